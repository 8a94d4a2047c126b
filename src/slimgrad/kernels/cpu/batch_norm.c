/* BatchNorm backward from the output on float32 CPU tensors (slimgrad/ops/batch_norm.py's
 * _bwd_from_output; NOTE [CPU C kernels] in slimgrad/kernels/_cpu.py). For b and dy viewed as
 * (N, C, S), contiguous:
 *   sums[0][c] = sum b,  sums[1][c] = sum dy,  sums[2][c] = sum dy * b
 * every product and sum in double (8 lanes, element j of a run in lane j % 8, the lanes added in
 * order at the end; the 8 lanes live in two 4-lane vectors, which gcc keeps in registers where an
 * 8-lane double vector spilled to the stack: the same association, 3.5-6x faster at 1 thread),
 * so mean(b) and dgamma = sum dy (b - mean) / gamma come from exact products (the PyTorch path
 * rounds each dy * (b - mean) to float before its float64 sum) and the mean costs no pass of its
 * own. bn_bwd_from_output_f32 then computes, for the same channel while its data is in cache, the
 * float64 coefficients of NOTE [dx from the output] rounded once to float (C from the rounded S
 * and K) and
 *   dx = fma(dy, S, fma(b, K, C))    (float, one rounding each: torch.addcmul's bits, twice)
 * plus dgamma and dbeta (sum dy, rounded once): the whole backward in two passes over b and dy,
 * as eager's kernel. dx may be dy's own buffer (a channel's dx is written after its sums are read,
 * and depends on that channel's dy and b only). Channels are split over threads; each channel is summed by one thread in a
 * fixed order, so the results have the same bits for any thread count. */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float vf4 __attribute__((vector_size(16)));
typedef double vd4 __attribute__((vector_size(32)));

static void channel_sums(const float *b, const float *dy, int64_t n, int64_t c, int64_t s,
                         int64_t ch, double *out) {
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
    out[0] = tb;
    out[1] = td;
    out[2] = tdb;
}

void bn_channel_sums_f32(const float *b, const float *dy, int64_t n, int64_t c, int64_t s,
                         double *sums, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t ch = 0; ch < c; ch++) {
        double t[3];
        channel_sums(b, dy, n, c, s, ch, t);
        sums[ch] = t[0];
        sums[c + ch] = t[1];
        sums[2 * c + ch] = t[2];
    }
}

/* gamma NULL: no affine (gamma = 1). dx, gw, gb: NULL when not wanted. */
void bn_bwd_from_output_f32(const float *b, const float *dy, int64_t n, int64_t c, int64_t s,
                            const float *gamma, const float *invstd, float *dx, float *gw,
                            float *gb, int nt) {
    const double cnt = (double)(n * s);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t ch = 0; ch < c; ch++) {
        double t[3];
        channel_sums(b, dy, n, c, s, ch, t);
        const float meanf = (float)(t[0] / cnt);
        const double mean = meanf, sdy = t[1];
        const double dot = t[2] - mean * sdy;
        const double g = gamma ? (double)gamma[ch] : 1.0;
        if (gw) gw[ch] = (float)(dot / g);
        if (gb) gb[ch] = (float)sdy;
        if (!dx) continue;
        const double s64 = g * (double)invstd[ch];
        const double k = dot / (g * g) / cnt;
        const float kf = (float)(-k * s64);
        const float sf = (float)s64;
        /* C from the rounded S and K and the float64 sums, so that S sum dy + K sum b + n C
         * cancels exactly but for C's own rounding (NOTE [dx from the output]) */
        const float cf = (float)(-((double)sf * sdy + (double)kf * t[0]) / cnt);
        for (int64_t i = 0; i < n; i++) {
            const int64_t o = (i * c + ch) * s;
            const float *br = b + o, *dr = dy + o;
            float *xr = dx + o;
            if (xr == dr) { /* dx over dy (the caller owns dy's buffer): two streams */
                for (int64_t j = 0; j < s; j++) xr[j] = fmaf(xr[j], sf, fmaf(br[j], kf, cf));
            } else {
                for (int64_t j = 0; j < s; j++) xr[j] = fmaf(dr[j], sf, fmaf(br[j], kf, cf));
            }
        }
    }
}
