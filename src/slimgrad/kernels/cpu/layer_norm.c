/* LayerNorm backward from the output on float32 CPU tensors: the C kernel of
 * slimgrad/ops/layer_norm.py (NOTE [CPU C kernels] in slimgrad/kernels/_cpu.py). Per row of d
 * elements, with xh = (y - b) / w rebuilt from the output (as the PyTorch path rebuilds it, float32,
 * no contraction) and g = dy * w:
 *   dx = rstd * ((g - mean(g)) - xh * mean(g * xh))      (row means accumulated in double)
 *   dw += dy * xh                                        (per-thread double partial sums)
 * Rows are read in full (statistics and dw) before dx is written, so dx may alias dy. No fallback
 * channel (ops/layer_norm.py runs its PyTorch path when there is one). w or b may be NULL. */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

void layer_norm_bwd_f32(const float *dy, const float *y, const float *rstd, const float *w,
                        const float *b, float *dx, double *dw_parts, int64_t n, int64_t d,
                        int need_dx, int need_dw, int nt) {
    if (need_dw) memset(dw_parts, 0, sizeof(double) * (size_t)d * (size_t)nt);
#pragma omp parallel num_threads(nt)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        double *dwp = need_dw ? dw_parts + (int64_t)tid * d : 0;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            const float *dyr = dy + i * d, *yr = y + i * d;
            /* 8 independent double lanes per sum (explicit, so it vectorizes without
             * reassociation), added up in a fixed order */
            double l1[8] = {0}, l2[8] = {0};
            int64_t j = 0;
            for (; j + 8 <= d; j += 8) {
                for (int k = 0; k < 8; k++) {
                    float xh = yr[j + k];
                    if (b) xh = xh - b[j + k];
                    if (w) xh = xh / w[j + k];
                    float g = w ? dyr[j + k] * w[j + k] : dyr[j + k];
                    l1[k] += (double)g;
                    l2[k] += (double)(g * xh);
                    if (need_dw) dwp[j + k] += (double)(dyr[j + k] * xh);
                }
            }
            for (; j < d; j++) {
                float xh = yr[j];
                if (b) xh = xh - b[j];
                if (w) xh = xh / w[j];
                float g = w ? dyr[j] * w[j] : dyr[j];
                l1[0] += (double)g;
                l2[0] += (double)(g * xh);
                if (need_dw) dwp[j] += (double)(dyr[j] * xh);
            }
            double s1 = 0.0, s2 = 0.0;
            for (int k = 0; k < 8; k++) {
                s1 += l1[k];
                s2 += l2[k];
            }
            if (!need_dx) continue;
            float c1 = (float)(s1 / (double)d), c2 = (float)(s2 / (double)d), r = rstd[i];
            float *dxr = dx + i * d;
            for (int64_t j = 0; j < d; j++) {
                float xh = yr[j];
                if (b) xh = xh - b[j];
                if (w) xh = xh / w[j];
                float g = w ? dyr[j] * w[j] : dyr[j];
                dxr[j] = ((g - c1) - xh * c2) * r;
            }
        }
    }
}
