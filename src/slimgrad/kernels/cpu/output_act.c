/* Smooth activations with one minimum x* (SiLU, GELU erf/tanh, Mish) that keep their output y, a
 * packed branch bit [x >= x*] per element and a sparse table of "hard" elements: the C kernels of
 * slimgrad/ops/_output_act.py (smooth_fwd, smooth_grad), float32 only. NOTE [Gradient from the
 * output] there; NOTE [CPU C kernels] in slimgrad/kernels/_cpu.py. Every buffer is allocated by the
 * caller (torch); arithmetic is float32 in the order the PyTorch path uses. y is eager's own output
 * (computed by torch before these kernels run). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define BLOCK 65536 /* = ops._output_act.CHUNK: the hard elements are ordered per block */

/* Masks of 32 consecutive elements x[0..m) (m <= 32; bit j = element j): the branch bit
 * [x - x* >= 0], "window" hits (|x - x*| < window or non-finite x) and tail-only hits (x < tail,
 * not a window hit). For m == 32 the loop has a constant trip count and vectorizes. */
static inline void masks32(const float *restrict x, int64_t m, float xstar, float window,
                           int has_tail, float tail, uint32_t *right, uint32_t *wm, uint32_t *tm) {
    uint32_t r = 0, w = 0, tl = 0;
    if (m == 32) {
        for (int j = 0; j < 32; j++) {
            float d = x[j] - xstar, t = fabsf(d);
            uint32_t hw = (uint32_t)((t < window) | !(t < INFINITY));
            r |= (uint32_t)(d >= 0.0f) << j;
            w |= hw << j;
            tl |= ((uint32_t)(has_tail & (x[j] < tail)) & (hw ^ 1)) << j;
        }
    } else {
        for (int j = 0; j < m; j++) {
            float d = x[j] - xstar, t = fabsf(d);
            uint32_t hw = (uint32_t)((t < window) | !(t < INFINITY));
            r |= (uint32_t)(d >= 0.0f) << j;
            w |= hw << j;
            tl |= ((uint32_t)(has_tail & (x[j] < tail)) & (hw ^ 1)) << j;
        }
    }
    *right = r, *wm = w, *tm = tl;
}

/* Pass 1: branch bits and per block the number of hard elements: cnt[2b] window hits
 * (|x - x*| < window, or non-finite x), cnt[2b + 1] tail-only hits; flags[w] (one byte per 32
 * elements): bit 0 = word w has window hits, bit 1 = tail-only hits. */
void smooth_fwd_f32(const float *x, uint8_t *bits, int64_t *cnt, uint8_t *flags, int64_t n,
                    float xstar, float window, int has_tail, float tail, int nt) {
    int64_t nb = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t b = 0; b < nb; b++) {
        int64_t a = b * BLOCK, e = a + BLOCK < n ? a + BLOCK : n;
        int64_t cw = 0, ct = 0;
        for (int64_t k = a; k < e; k += 32) {
            int64_t m = e - k < 32 ? e - k : 32;
            uint32_t r, w, tl;
            masks32(x + k, m, xstar, window, has_tail, tail, &r, &w, &tl);
            memcpy(bits + (k >> 3), &r, (size_t)((m + 7) >> 3)); /* little-endian: LSB first */
            cw += __builtin_popcount(w);
            ct += __builtin_popcount(tl);
            flags[k >> 5] = (uint8_t)((w != 0) | ((tl != 0) << 1)); /* for pass 2 */
        }
        cnt[2 * b] = cw;
        cnt[2 * b + 1] = ct;
    }
}

/* Pass 1 as smooth_fwd_f32, then block b's offset off[b] into the hard-element table (a prefix
 * sum over the blocks, in block order) and the number of hard elements, returned: what the
 * caller needs to allocate the table and run pass 2, in one call. */
int64_t smooth_fwd_off_f32(const float *x, uint8_t *bits, int64_t *cnt, uint8_t *flags,
                           int64_t *off, int64_t n, float xstar, float window, int has_tail,
                           float tail, int nt) {
    int64_t nb = (n + BLOCK - 1) / BLOCK, total = 0;
    smooth_fwd_f32(x, bits, cnt, flags, n, xstar, window, has_tail, tail, nt);
    for (int64_t b = 0; b < nb; b++) {
        off[b] = total;
        total += cnt[2 * b] + cnt[2 * b + 1];
    }
    return total;
}

/* Pass 2: the hard elements' flat index and x, block b's at off[b]: its window hits, then its
 * tail-only hits, each ascending (the PyTorch path's order for finite inputs); only the words
 * pass 1 flagged are read again. */
#define COLLECT(IDX_T, NAME)                                                                       \
    void NAME(const float *x, const int64_t *cnt, const uint8_t *flags, const int64_t *off,       \
              IDX_T *idx, float *xs, int64_t n, float xstar, float window, int has_tail,          \
              float tail, int nt) {                                                                \
        int64_t nb = (n + BLOCK - 1) / BLOCK;                                                      \
        _Pragma("omp parallel for num_threads(nt) schedule(static)")                              \
        for (int64_t b = 0; b < nb; b++) {                                                         \
            if (cnt[2 * b] + cnt[2 * b + 1] == 0) continue;                                        \
            int64_t a = b * BLOCK, e = a + BLOCK < n ? a + BLOCK : n, o = off[b];                  \
            for (int pass = 0; pass < 2; pass++) {                                                 \
                if (!cnt[2 * b + pass]) continue;                                                  \
                for (int64_t k = a; k < e; k += 32) {                                              \
                    if (!((flags[k >> 5] >> pass) & 1)) continue; /* no such hit in the word */   \
                    int64_t m = e - k < 32 ? e - k : 32;                                           \
                    uint32_t r, w, tl;                                                             \
                    masks32(x + k, m, xstar, window, has_tail, tail, &r, &w, &tl);                \
                    uint32_t h = pass ? tl : w;                                                    \
                    while (h) {                                                                    \
                        int j = __builtin_ctz(h);                                                \
                        idx[o] = (IDX_T)(k + j);                                                   \
                        xs[o++] = x[k + j];                                                        \
                        h &= h - 1;                                                                \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }
COLLECT(int32_t, smooth_collect_i32)
COLLECT(int64_t, smooth_collect_i64)

/* f'(x) from y and the branch bit, as ops._output_act._Inverse.df: the table is
 * [right (tn) | pad | left (tn) | pad]; right: pos = s sc_r, left: pos = tn + 1 + s sc_l,
 * s = sqrt(clamp((y - y_hi) - y_lo, 0, s2max)); f' = lerp(tab[i], tab[i + 1], pos - i) with
 * i = floor(pos) (NaN: 0). torch's addcmul_ and vectorized lerp round as fused multiply-adds on
 * its builds, hence fmaf. out = g * f' (out may be g: elementwise). Branch-free: vectorizes. */
#define SUB 256 /* elements per inner step: positions first (vectorized), then the lookups */

void smooth_bwd_f32(const float *g, const float *restrict y, const uint8_t *restrict bits,
                    const float *restrict tab, float *out, int64_t n, int64_t tn, float y_hi,
                    float y_lo, float s2max, float sc_r, float sc_l, int nt) {
    const float off_l = (float)(tn + 1);
    const int32_t imax = (int32_t)(2 * tn);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t a = 0; a < n; a += SUB) {
        int64_t m = n - a < SUB ? n - a : SUB;
        float posv[SUB];
        int32_t iv[SUB];
        for (int64_t w0 = 0; w0 < m; w0 += 64) { /* 64 bits at a time: the loop vectorizes */
            int64_t mw = m - w0 < 64 ? m - w0 : 64;
            uint64_t word = 0;
            memcpy(&word, bits + ((a + w0) >> 3), (size_t)((mw + 7) >> 3));
            for (int64_t jj = 0; jj < mw; jj++) {
                int64_t j = w0 + jj, k = a + j;
                int right = (int)((word >> jj) & 1);
                float s = (y[k] - y_hi) - y_lo;
                s = s < 0.0f ? 0.0f : s; /* NaN stays NaN, as torch.clamp */
                s = s > s2max ? s2max : s;
                s = sqrtf(s);
                float pos = fmaf(s, right ? sc_r : sc_l, right ? 0.0f : off_l);
                int32_t i = pos >= 0.0f ? (int32_t)pos : 0; /* pos < 2^31: s^2 <= s2max */
                i = i > imax ? imax : i;
                posv[j] = pos - (float)i;
                iv[j] = i;
            }
        }
        int64_t j = 0;
#if defined(__AVX512F__)
        /* the lookups as vector gathers (the compiler does not vectorize them; scalar lookups
         * measured 5-10x slower than the whole eager backward) */
        for (; j + 16 <= m; j += 16) {
            __m512i i = _mm512_loadu_si512((const void *)(iv + j));
            __m512 w = _mm512_loadu_ps(posv + j);
            __m512 lo = _mm512_i32gather_ps(i, tab, 4), hi = _mm512_i32gather_ps(i, tab + 1, 4);
            __m512 d = _mm512_sub_ps(hi, lo);
            __mmask16 small = _mm512_cmp_ps_mask(w, _mm512_set1_ps(0.5f), _CMP_LT_OQ);
            __m512 c = _mm512_mask_blend_ps(small, _mm512_sub_ps(w, _mm512_set1_ps(1.0f)), w);
            __m512 base = _mm512_mask_blend_ps(small, hi, lo);
            __m512 df = _mm512_fmadd_ps(c, d, base);
            _mm512_storeu_ps(out + a + j, _mm512_mul_ps(_mm512_loadu_ps(g + a + j), df));
        }
#elif defined(__AVX2__) && defined(__FMA__)
        for (; j + 8 <= m; j += 8) {
            __m256i i = _mm256_loadu_si256((const __m256i *)(iv + j));
            __m256 w = _mm256_loadu_ps(posv + j);
            __m256 lo = _mm256_i32gather_ps(tab, i, 4), hi = _mm256_i32gather_ps(tab + 1, i, 4);
            __m256 d = _mm256_sub_ps(hi, lo);
            __m256 small = _mm256_cmp_ps(w, _mm256_set1_ps(0.5f), _CMP_LT_OQ);
            __m256 c = _mm256_blendv_ps(_mm256_sub_ps(w, _mm256_set1_ps(1.0f)), w, small);
            __m256 base = _mm256_blendv_ps(hi, lo, small);
            __m256 df = _mm256_fmadd_ps(c, d, base);
            _mm256_storeu_ps(out + a + j, _mm256_mul_ps(_mm256_loadu_ps(g + a + j), df));
        }
#endif
        for (; j < m; j++) {
            float w = posv[j], lo = tab[iv[j]], hi = tab[iv[j] + 1], d = hi - lo;
            float df = w < 0.5f ? fmaf(w, d, lo) : fmaf(w - 1.0f, d, hi);
            out[a + j] = g[a + j] * df;
        }
    }
}
