/* 1-bit dropout on float32 CPU tensors: the C kernels of slimgrad/ops/dropout.py (NOTE [Dropout
 * masks: drawn like eager, kept as bits] there; NOTE [CPU C kernels] in slimgrad/kernels/_cpu.py).
 * The mask itself is drawn by torch (eager's own bernoulli_ call); these kernels only pack it and
 * apply it, with eager's rounding: kept elements x * scale, dropped ones x * 0 (+-0, NaN for
 * inf/NaN x), scale = 1 / (1 - p) rounded as eager rounds it. Bits: element i is bit i % 8 (LSB
 * first) of byte i / 8, padding bits 0 (ops/_bits.py). */
#include <stdint.h>
#include <string.h>

#define BLOCK 65536 /* a multiple of 32 */

/* out = noise != 0 ? x * scale : x * 0, bits = [noise != 0]; out may alias noise or x. */
void dropout_fwd_f32(const float *noise, const float *x, float *out, uint8_t *bits, int64_t n,
                     float scale, int nt) {
    int64_t nb = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t b = 0; b < nb; b++) {
        int64_t a = b * BLOCK, e = a + BLOCK < n ? a + BLOCK : n;
        for (int64_t k = a; k < e; k += 32) {
            int64_t m = e - k < 32 ? e - k : 32;
            uint32_t word = 0;
            if (m == 32) { /* constant trip count: vectorizes */
                for (int j = 0; j < 32; j++) {
                    int keep = noise[k + j] != 0.0f;
                    word |= (uint32_t)keep << j;
                    out[k + j] = x[k + j] * (keep ? scale : 0.0f);
                }
            } else {
                for (int j = 0; j < m; j++) {
                    int keep = noise[k + j] != 0.0f;
                    word |= (uint32_t)keep << j;
                    out[k + j] = x[k + j] * (keep ? scale : 0.0f);
                }
            }
            memcpy(bits + (k >> 3), &word, (size_t)((m + 7) >> 3)); /* little-endian */
        }
    }
}

/* out = bit ? g * scale : g * 0 (eager's g * noise); out may alias g. */
void dropout_bwd_f32(const float *g, const uint8_t *bits, float *out, int64_t n, float scale,
                     int nt) {
    int64_t nb = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t b = 0; b < nb; b++) {
        int64_t a = b * BLOCK, e = a + BLOCK < n ? a + BLOCK : n;
        for (int64_t k = a; k < e; k += 32) {
            int64_t m = e - k < 32 ? e - k : 32;
            uint32_t word = 0;
            memcpy(&word, bits + (k >> 3), (size_t)((m + 7) >> 3));
            if (m == 32) {
                for (int j = 0; j < 32; j++)
                    out[k + j] = g[k + j] * (((word >> j) & 1) ? scale : 0.0f);
            } else {
                for (int j = 0; j < m; j++)
                    out[k + j] = g[k + j] * (((word >> j) & 1) ? scale : 0.0f);
            }
        }
    }
}
