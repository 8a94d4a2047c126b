/* BatchNorm backward from the output on float32 CPU tensors: the per-channel sums of
 * slimgrad/ops/batch_norm.py's _bwd_from_output in one pass (NOTE [CPU C kernels] in
 * slimgrad/kernels/_cpu.py). For b and dy viewed as (N, C, S), contiguous:
 *   sums[0][c] = sum b,  sums[1][c] = sum dy,  sums[2][c] = sum dy * b
 * every product and sum in double (8 lanes, element j of a run in lane j % 8, the lanes added in
 * order at the end; the 8 lanes live in two 4-lane vectors, which gcc keeps in registers where an
 * 8-lane double vector spilled to the stack: the same association, 3.5-6x faster at 1 thread),
 * so mean(b) and dgamma = sum dy (b - mean) / gamma come from exact products (the PyTorch path rounds each dy * (b - mean) to float before its float64 sum) and the mean
 * costs no pass of its own. Channels are split over threads; each channel is summed by one thread
 * in a fixed order, so the results have the same bits for any thread count. */
#include <stdint.h>
#include <string.h>

typedef float vf4 __attribute__((vector_size(16)));
typedef double vd4 __attribute__((vector_size(32)));

void bn_channel_sums_f32(const float *b, const float *dy, int64_t n, int64_t c, int64_t s,
                         double *sums, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t ch = 0; ch < c; ch++) {
        /* lanes 0-3 and 4-7 of the 8-lane sums as two 4-lane registers: the same association */
        vd4 sb0 = {0}, sb1 = {0}, sd0 = {0}, sd1 = {0}, sdb0 = {0}, sdb1 = {0};
        double tb = 0.0, td = 0.0, tdb = 0.0;
        for (int64_t i = 0; i < n; i++) {
            const float *br = b + (i * c + ch) * s, *dr = dy + (i * c + ch) * s;
            int64_t j = 0;
            for (; j + 8 <= s; j += 8) {
                vf4 x0, x1, g0, g1;
                memcpy(&x0, br + j, sizeof x0);
                memcpy(&x1, br + j + 4, sizeof x1);
                memcpy(&g0, dr + j, sizeof g0);
                memcpy(&g1, dr + j + 4, sizeof g1);
                vd4 xd0 = __builtin_convertvector(x0, vd4), xd1 = __builtin_convertvector(x1, vd4);
                vd4 gd0 = __builtin_convertvector(g0, vd4), gd1 = __builtin_convertvector(g1, vd4);
                sb0 += xd0;
                sb1 += xd1;
                sd0 += gd0;
                sd1 += gd1;
                sdb0 += gd0 * xd0;
                sdb1 += gd1 * xd1;
            }
            for (; j < s; j++) {
                double x = br[j], g = dr[j];
                tb += x;
                td += g;
                tdb += g * x;
            }
        }
        for (int k = 0; k < 4; k++) {
            tb += sb0[k];
            td += sd0[k];
            tdb += sdb0[k];
        }
        for (int k = 0; k < 4; k++) {
            tb += sb1[k];
            td += sd1[k];
            tdb += sdb1[k];
        }
        sums[ch] = tb;
        sums[c + ch] = td;
        sums[2 * c + ch] = tdb;
    }
}
