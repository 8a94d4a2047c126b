/* Exact-mode fixed-point stream of slimgrad/ops/reversible.py (NOTE [Exact-mode integer stream]
 * there; NOTE [CPU C kernels] in slimgrad/kernels/_cpu.py): one pass per step where the PyTorch
 * path takes four to six (scale, round, max, convert, add) and two temporaries.
 *
 * A stream half is `rows` runs of `len` contiguous integers, `stride` elements apart (a narrow view
 * of the whole stream along the split dimension); h, F's float32 output, is contiguous (rows * len).
 * Grid units are rintf(h * scale): scale is a power of two, so the product is exact and rintf
 * rounds half to even, as torch.round does; the conversion of that integer-valued float to the
 * stream's integer type is exact (the caller has checked the range with rev_absmax_units_f32). */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* max |rintf(h * scale)| over n elements; NaN if any is NaN (inf propagates). Taken on the bit
 * patterns: for non-negative floats their order as unsigned integers is the float order, and every
 * NaN pattern lies above +inf's (an integer max vectorizes; a NaN-aware float max does not). */
double rev_absmax_units_f32(const float *h, int64_t n, float scale, int nt) {
    uint32_t m = 0;
#pragma omp parallel for num_threads(nt) schedule(static) reduction(max : m)
    for (int64_t i = 0; i < n; i++) {
        float q = fabsf(rintf(h[i] * scale));
        uint32_t b;
        memcpy(&b, &q, sizeof b);
        m = b > m ? b : m;
    }
    if (m > 0x7f800000u) return (double)NAN;
    float f;
    memcpy(&f, &m, sizeof f);
    return (double)f;
}

#define CHUNK 65536 /* elements per parallel work item: each item's inner loop vectorizes */

/* for every (row, chunk) work item: j runs over [a, e) of row r */
#define FOR_RUNS(rows, len, nt, BODY)                                                             \
    do {                                                                                          \
        int64_t nc_ = ((len) + CHUNK - 1) / CHUNK;                                                \
        _Pragma("omp parallel for num_threads(nt) schedule(static)")                              \
        for (int64_t w = 0; w < (rows) * nc_; w++) {                                              \
            int64_t r = w / nc_, a = (w % nc_) * CHUNK;                                           \
            int64_t e = a + CHUNK < (len) ? a + CHUNK : (len);                                    \
            BODY                                                                                  \
        }                                                                                         \
    } while (0)

#define STREAM_KERNELS(T, NAME)                                                                   \
    /* u += units(h) */                                                                           \
    void rev_add_units_##NAME(T *u, int64_t rows, int64_t len, int64_t stride, const float *h,   \
                              float scale, int nt) {                                              \
        FOR_RUNS(rows, len, nt, {                                                                 \
            T *ur = u + r * stride;                                                               \
            const float *hr = h + r * len;                                                        \
            for (int64_t j = a; j < e; j++) ur[j] += (T)rintf(hr[j] * scale);                     \
        });                                                                                       \
    }                                                                                             \
    /* out = y - units(h); out may be y itself (out_stride == stride) */                          \
    void rev_sub_units_##NAME(const T *y, T *out, int64_t rows, int64_t len, int64_t stride,      \
                              int64_t out_stride, const float *h, float scale, int nt) {          \
        FOR_RUNS(rows, len, nt, {                                                                 \
            const T *yr = y + r * stride;                                                         \
            T *orow = out + r * out_stride;                                                       \
            const float *hr = h + r * len;                                                        \
            for (int64_t j = a; j < e; j++) orow[j] = yr[j] - (T)rintf(hr[j] * scale);            \
        });                                                                                       \
    }                                                                                             \
    /* out = (float)u * inv_scale (the value rounded once to float32; the scaling is exact) */    \
    void rev_image_##NAME(const T *u, int64_t rows, int64_t len, int64_t stride, float *out,     \
                          float inv_scale, int nt) {                                              \
        FOR_RUNS(rows, len, nt, {                                                                 \
            const T *ur = u + r * stride;                                                         \
            float *orow = out + r * len;                                                          \
            for (int64_t j = a; j < e; j++) orow[j] = (float)ur[j] * inv_scale;                   \
        });                                                                                       \
    }

STREAM_KERNELS(int32_t, i32)
STREAM_KERNELS(int64_t, i64)
