/* Smooth activations with one minimum x* (SiLU, GELU erf/tanh, Mish) that keep their output y, a
 * packed branch bit [x >= x*] per element and a sparse table of "hard" elements: the C kernels of
 * slimgrad/ops/_output_act.py (smooth_fwd, smooth_grad), float32 only. NOTE [Gradient from the
 * output] there; NOTE [CPU C kernels] in slimgrad/kernels/_cpu.py. Every buffer is allocated by the
 * caller (torch); arithmetic is float32 in the order the PyTorch path uses, float64 for the zone. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 65536 /* = ops._output_act.CHUNK: the hard elements are ordered per block */

enum { ACT_SILU = 0, ACT_GELU_ERF = 1, ACT_GELU_TANH = 2, ACT_MISH = 3 };

/* the float64 forms of ops/silu.py, gelu.py, mish.py (spec.f), same operation order */
static double f64(double x, int act) {
    switch (act) {
    case ACT_SILU:
        return x * (1.0 / (1.0 + exp(-x)));
    case ACT_GELU_ERF:
        return x * 0.5 * erfc(-x * 0.70710678118654757);
    case ACT_GELU_TANH: {
        double u2 = (2.0 * 0.79788456080286541) * (x + 0.044715 * (x * x * x));
        return x * (1.0 / (1.0 + exp(-u2)));
    }
    default: { /* mish: softplus (beta 1, threshold 20) */
        double sp = x > 20.0 ? x : log1p(exp(x));
        return x * tanh(sp);
    }
    }
}

/* Pass 1: branch bits, y correctly rounded within the zone, and per block the number of hard
 * elements: cnt[2b] those with |x - x*| < window or non-finite x, cnt[2b + 1] tail-only ones. */
void smooth_fwd_f32(const float *x, float *y, uint8_t *bits, int64_t *cnt, int64_t n, int act,
                    float xstar, float zone, float window, int has_tail, float tail, int nt) {
    int64_t nb = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t b = 0; b < nb; b++) {
        int64_t a = b * BLOCK, e = a + BLOCK < n ? a + BLOCK : n;
        int64_t cw = 0, ct = 0;
        for (int64_t k = a; k < e; k += 8) {
            int64_t m = e - k < 8 ? e - k : 8;
            unsigned byte = 0;
            for (int64_t j = 0; j < m; j++) {
                float xv = x[k + j];
                float d = xv - xstar;
                byte |= (unsigned)(d >= 0.0f) << j;
                float t = fabsf(d);
                if (t < zone) y[k + j] = (float)f64((double)xv, act);
                int w = (t < window) | !(t < INFINITY);
                cw += w;
                ct += (!w) & has_tail & (xv < tail);
            }
            bits[k >> 3] = (uint8_t)byte;
        }
        cnt[2 * b] = cw;
        cnt[2 * b + 1] = ct;
    }
}

/* Pass 2: the hard elements' flat index and x, block b's at off[b]: its window / non-finite hits,
 * then its tail hits, each ascending (the PyTorch path's order for finite inputs). */
#define COLLECT(IDX_T, NAME)                                                                       \
    void NAME(const float *x, const int64_t *cnt, const int64_t *off, IDX_T *idx, float *xs,      \
              int64_t n, float xstar, float window, int has_tail, float tail, int nt) {           \
        int64_t nb = (n + BLOCK - 1) / BLOCK;                                                      \
        _Pragma("omp parallel for num_threads(nt) schedule(static)")                              \
        for (int64_t b = 0; b < nb; b++) {                                                         \
            if (cnt[2 * b] + cnt[2 * b + 1] == 0) continue;                                        \
            int64_t a = b * BLOCK, e = a + BLOCK < n ? a + BLOCK : n, o = off[b];                  \
            for (int64_t k = a; k < e; k++) {                                                      \
                float t = fabsf(x[k] - xstar);                                                     \
                if ((t < window) | !(t < INFINITY)) {                                              \
                    idx[o] = (IDX_T)k;                                                             \
                    xs[o++] = x[k];                                                                \
                }                                                                                  \
            }                                                                                      \
            if (!cnt[2 * b + 1]) continue;                                                         \
            for (int64_t k = a; k < e; k++) {                                                      \
                float t = fabsf(x[k] - xstar);                                                     \
                if (!((t < window) | !(t < INFINITY)) & has_tail & (x[k] < tail)) {                \
                    idx[o] = (IDX_T)k;                                                             \
                    xs[o++] = x[k];                                                                \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }
COLLECT(int32_t, smooth_collect_i32)
COLLECT(int64_t, smooth_collect_i64)

/* f'(x) from y and the branch bit, as ops._output_act._Inverse.df: the table is
 * [right (nt_) | pad | left (nt_) | pad]; right: pos = s sc_r, left: pos = nt_ + 1 + s sc_l,
 * s = sqrt(clamp((y - y_hi) - y_lo, 0, s2max)); f' = lerp(tab[i], tab[i + 1], pos - i) with
 * i = floor(pos) (NaN: 0). out = g * f' (out may be g: elementwise). */
void smooth_bwd_f32(const float *g, const float *y, const uint8_t *bits, const float *tab,
                    float *out, int64_t n, int64_t tn, float y_hi, float y_lo, float s2max,
                    float sc_r, float sc_l, int fma, int nt) {
    const float off_l = (float)(tn + 1);
    const int64_t imax = 2 * tn;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t b = 0; b < (n + BLOCK - 1) / BLOCK; b++) {
        int64_t a = b * BLOCK, e = a + BLOCK < n ? a + BLOCK : n;
        for (int64_t k = a; k < e; k++) {
            int right = (bits[k >> 3] >> (k & 7)) & 1;
            float s = (y[k] - y_hi) - y_lo;
            s = s < 0.0f ? 0.0f : s; /* NaN stays NaN, as torch.clamp */
            s = s > s2max ? s2max : s;
            s = sqrtf(s);
            /* torch's addcmul_ (as built) rounds pos0 + s * scale once: fma */
            float pos = fmaf(s, right ? sc_r : sc_l, right ? 0.0f : off_l);
            int64_t i = pos >= 0.0f ? (int64_t)pos : 0;
            i = i > imax ? imax : i;
            float w = pos - (float)i;
            float lo = tab[i], hi = tab[i + 1];
            float df;
            if (fma) /* torch's vectorized lerp: fmadd(coeff, hi - lo, base) */
                df = w < 0.5f ? fmaf(w, hi - lo, lo) : fmaf(w - 1.0f, hi - lo, hi);
            else
                df = w < 0.5f ? lo + w * (hi - lo) : hi - (hi - lo) * (1.0f - w);
            out[k] = g[k] * df;
        }
    }
}
