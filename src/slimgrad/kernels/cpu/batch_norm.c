/* BatchNorm backward from the output on float32 CPU tensors: the per-channel sums of
 * slimgrad/ops/batch_norm.py's _bwd_from_output in one pass (NOTE [CPU C kernels] in
 * slimgrad/kernels/_cpu.py). For b and dy viewed as (N, C, S), contiguous:
 *   sums[0][c] = sum b,  sums[1][c] = sum dy,  sums[2][c] = sum dy * b
 * every product and sum in double (8 lanes, element j of a run in lane j % 8, the lanes added in
 * order at the end), so mean(b) and dgamma = sum dy (b - mean) / gamma come from exact products
 * (the PyTorch path rounds each dy * (b - mean) to float before its float64 sum) and the mean
 * costs no pass of its own. Channels are split over threads; each channel is summed by one thread
 * in a fixed order, so the results have the same bits for any thread count. */
#include <stdint.h>
#include <string.h>

typedef float vf8 __attribute__((vector_size(32)));
typedef double vd8 __attribute__((vector_size(64)));

void bn_channel_sums_f32(const float *b, const float *dy, int64_t n, int64_t c, int64_t s,
                         double *sums, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t ch = 0; ch < c; ch++) {
        vd8 sb = {0}, sd = {0}, sdb = {0};
        double tb = 0.0, td = 0.0, tdb = 0.0;
        for (int64_t i = 0; i < n; i++) {
            const float *br = b + (i * c + ch) * s, *dr = dy + (i * c + ch) * s;
            int64_t j = 0;
            for (; j + 8 <= s; j += 8) {
                vf8 x, g;
                memcpy(&x, br + j, sizeof x);
                memcpy(&g, dr + j, sizeof g);
                vd8 xd = __builtin_convertvector(x, vd8), gd = __builtin_convertvector(g, vd8);
                sb += xd;
                sd += gd;
                sdb += gd * xd;
            }
            for (; j < s; j++) {
                double x = br[j], g = dr[j];
                tb += x;
                td += g;
                tdb += g * x;
            }
        }
        double lb[8], ld[8], ldb[8];
        memcpy(lb, &sb, sizeof lb);
        memcpy(ld, &sd, sizeof ld);
        memcpy(ldb, &sdb, sizeof ldb);
        for (int k = 0; k < 8; k++) {
            tb += lb[k];
            td += ld[k];
            tdb += ldb[k];
        }
        sums[ch] = tb;
        sums[c + ch] = td;
        sums[2 * c + ch] = tdb;
    }
}
