/* LayerNorm backward from the output on float32 CPU tensors: the C kernel of
 * slimgrad/ops/layer_norm.py (NOTE [CPU C kernels] in slimgrad/kernels/_cpu.py). Per row of d
 * elements, with xh = (y - b) / w rebuilt from the output (as the PyTorch path rebuilds it, float32,
 * no contraction) and g = dy * w:
 *   dx = rstd * ((g - mean(g)) - xh * mean(g * xh))
 *   dw = sum_rows(dy * xh), db = sum_rows(dy)
 * Precision, chosen by seed sweeps against float64 (ops/layer_norm.py, _bwd_cpu): the row sums
 * mean(g), mean(g * xh) in float, 16 lanes (element j in lane j % 16; eager's own kernel sums rows
 * in float lanes too), the lanes added in double; dw in double (float sums failed the error rule
 * by too thin a margin: 0.97 of the bound) over the exact double products dy * xh (the float
 * products' rounding put the round-17 zero-weight case's dgamma outside the rule: 2.066e-06
 * against 1.952e-06 at 2 threads, now 1.589e-06 as the PyTorch path's, whose products are
 * float64 too: tests/ops/test_layer_norm_c_dgamma.py); db in float within a row block (eager
 * sums all rows in float), the blocks in double.
 * Rows are cut into blocks of rows_per_block rows, a number the caller derives from n alone: each
 * block sums its rows into its own slice of the parts buffers, and the blocks' sums are then added
 * in block order, so dw and db have the same bits for any thread count (dx is per row anyway).
 * One sweep per row builds xh into the thread's scratch row (d floats, cache resident) and reads
 * dy for the row sums, dw and db; a second writes dx. Every read of a row of dy comes before its dx
 * is written, so dx may alias dy.
 * Without scratch (scratch NULL: no buffer beyond the outputs, where the buffers above would cost
 * more than eager's backward allocates, ops/layer_norm.py _bwd_cpu) the same sums come in another
 * loop order: dw and db by tiles of TJ columns, each tile's block sums and their total in local
 * arrays (the same additions in the same order: the same bits), before any dx is written; then
 * the row sums and dx per row, with xh kept in dx's own row (dx not dy) or rebuilt again from y
 * (dx aliases dy; the same float operations: the same bits). No fallback channel (ops/layer_norm.py runs its PyTorch path when
 * there is one). w or b may be NULL. The GNU C vector type (gcc >= 9, clang) makes the lanes
 * explicit: element-wise float/double arithmetic, the same bits on every instruction set. */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef float vf8 __attribute__((vector_size(32)));
typedef double vd8 __attribute__((vector_size(64)));

static inline vf8 ld(const float *p) {
    vf8 v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void st(float *p, vf8 v) { memcpy(p, &v, sizeof v); }
static inline void acc_d(double *p, vf8 u, vf8 v) { /* p[0..8) += (double)u * (double)v */
    vd8 a;
    memcpy(&a, p, sizeof a);
    a += __builtin_convertvector(u, vd8) * __builtin_convertvector(v, vd8); /* exact product */
    memcpy(p, &a, sizeof a);
}

/* One row: xs = xh; fb += dy (fb may be NULL); pw += (double)dy * (double)xh (pw may be NULL); with
 * sums: *s1 = sum(g), *s2 = sum(g * xh). */
static void row_pass(const float *dyr, const float *yr, const float *w, const float *b, float *xs,
                     float *fb, double *pw, int64_t d, int sums, double *s1, double *s2) {
    vf8 a1 = {0}, b1 = {0}, a2 = {0}, b2 = {0}; /* lanes 0-7 and 8-15 */
    int64_t j = 0;
    for (; j + 16 <= d; j += 16) {
        vf8 x0 = ld(yr + j), x1 = ld(yr + j + 8), d0 = ld(dyr + j), d1 = ld(dyr + j + 8);
        if (b) {
            x0 = x0 - ld(b + j);
            x1 = x1 - ld(b + j + 8);
        }
        if (w) {
            x0 = x0 / ld(w + j);
            x1 = x1 / ld(w + j + 8);
        }
        if (xs) {
            st(xs + j, x0);
            st(xs + j + 8, x1);
        }
        if (fb) {
            st(fb + j, ld(fb + j) + d0);
            st(fb + j + 8, ld(fb + j + 8) + d1);
        }
        if (pw) {
            acc_d(pw + j, d0, x0);
            acc_d(pw + j + 8, d1, x1);
        }
        if (sums) {
            vf8 g0 = w ? d0 * ld(w + j) : d0, g1 = w ? d1 * ld(w + j + 8) : d1;
            a1 += g0;
            b1 += g1;
            a2 += g0 * x0;
            b2 += g1 * x1;
        }
    }
    float l1[16], l2[16];
    memcpy(l1, &a1, sizeof a1);
    memcpy(l1 + 8, &b1, sizeof b1);
    memcpy(l2, &a2, sizeof a2);
    memcpy(l2 + 8, &b2, sizeof b2);
    for (int k = 0; j < d; j++, k++) { /* the tail: element j in lane j % 16 = k */
        float x = yr[j];
        if (b) x = x - b[j];
        if (w) x = x / w[j];
        if (xs) xs[j] = x;
        if (fb) fb[j] += dyr[j];
        if (pw) pw[j] += (double)dyr[j] * (double)x;
        float g = w ? dyr[j] * w[j] : dyr[j];
        l1[k] += g;
        l2[k] += g * x;
    }
    double t1 = 0.0, t2 = 0.0;
    for (int k = 0; k < 16; k++) {
        t1 += (double)l1[k];
        t2 += (double)l2[k];
    }
    *s1 = t1;
    *s2 = t2;
}

/* dx for one row from its sums c1, c2: xh read from xs, or rebuilt from y where xs is NULL. */
static void row_dx(const float *dyr, const float *yr, const float *w, const float *b,
                   const float *xs, float *dxr, int64_t d, float c1, float c2, float r) {
    if (xs) {
        if (w) {
            for (int64_t j = 0; j < d; j++) dxr[j] = ((dyr[j] * w[j] - c1) - xs[j] * c2) * r;
        } else {
            for (int64_t j = 0; j < d; j++) dxr[j] = ((dyr[j] - c1) - xs[j] * c2) * r;
        }
        return;
    }
    for (int64_t j = 0; j < d; j++) {
        float x = yr[j];
        if (b) x = x - b[j];
        if (w) x = x / w[j];
        float g = w ? dyr[j] * w[j] : dyr[j];
        dxr[j] = ((g - c1) - x * c2) * r;
    }
}

#define TJ 64

/* dw, db without parts buffers: per tile of TJ columns, each row block's sums (pw in double, fb
 * in float, as the row passes keep them) and the blocks' total in block order, in local arrays. */
static void col_sums(const float *dy, const float *y, const float *w, const float *b, float *dw,
                     float *db, int64_t n, int64_t d, int64_t rows_per_block, int need_dw,
                     int need_db, int nt) {
    int64_t nblk = rows_per_block > 0 ? (n + rows_per_block - 1) / rows_per_block : 0;
    int64_t ntile = (d + TJ - 1) / TJ;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < ntile; t++) {
        int64_t j0 = t * TJ, m = d - j0 < TJ ? d - j0 : TJ;
        double sw[TJ], sb[TJ], pw[TJ];
        float fb[TJ];
        for (int64_t k = 0; k < m; k++) sw[k] = sb[k] = 0.0;
        for (int64_t kb = 0; kb < nblk; kb++) {
            for (int64_t k = 0; k < m; k++) {
                pw[k] = 0.0;
                fb[k] = 0.0f;
            }
            int64_t i1 = (kb + 1) * rows_per_block < n ? (kb + 1) * rows_per_block : n;
            for (int64_t i = kb * rows_per_block; i < i1; i++) {
                const float *dyr = dy + i * d + j0, *yr = y + i * d + j0;
                for (int64_t k = 0; k < m; k++) {
                    float x = yr[k];
                    if (b) x = x - b[j0 + k];
                    if (w) x = x / w[j0 + k];
                    pw[k] += (double)dyr[k] * (double)x;
                    fb[k] += dyr[k];
                }
            }
            for (int64_t k = 0; k < m; k++) {
                sw[k] += pw[k];
                sb[k] += (double)fb[k];
            }
        }
        for (int64_t k = 0; k < m; k++) {
            if (need_dw) dw[j0 + k] = (float)sw[k];
            if (need_db) db[j0 + k] = (float)sb[k];
        }
    }
}

/* scratch: nt * 2 * d floats, or NULL (no scratch, no parts: the column order above); dw_parts, db_parts: ceil(n / rows_per_block) * d doubles each
 * (NULL when not needed); dw, db: d floats. */
void layer_norm_bwd_f32(const float *dy, const float *y, const float *rstd, const float *w,
                        const float *b, float *dx, float *dw, float *db, float *scratch,
                        double *dw_parts, double *db_parts, int64_t n, int64_t d,
                        int64_t rows_per_block, int need_dx, int need_dw, int need_db, int nt) {
    int64_t nblk = rows_per_block > 0 ? (n + rows_per_block - 1) / rows_per_block : 0;
    if (!scratch) {
        if (need_dw || need_db)
            col_sums(dy, y, w, b, dw, db, n, d, rows_per_block, need_dw, need_db, nt);
        if (!need_dx) return;
        int own = dx != dy; /* xh kept in dx's own row, else rebuilt */
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t i = 0; i < n; i++) {
            const float *dyr = dy + i * d, *yr = y + i * d;
            float *dxr = dx + i * d;
            double s1 = 0.0, s2 = 0.0;
            row_pass(dyr, yr, w, b, own ? dxr : 0, 0, 0, d, 1, &s1, &s2);
            float c1 = (float)(s1 / (double)d), c2 = (float)(s2 / (double)d);
            row_dx(dyr, yr, w, b, own ? dxr : 0, dxr, d, c1, c2, rstd[i]);
        }
        return;
    }
#pragma omp parallel num_threads(nt)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float *xs = scratch + (int64_t)tid * 2 * d, *fb = need_db ? xs + d : 0;
#pragma omp for schedule(static)
        for (int64_t kb = 0; kb < nblk; kb++) {
            double *pw = need_dw ? dw_parts + kb * d : 0;
            if (pw) memset(pw, 0, sizeof(double) * (size_t)d);
            if (fb) memset(fb, 0, sizeof(float) * (size_t)d);
            int64_t i1 = (kb + 1) * rows_per_block < n ? (kb + 1) * rows_per_block : n;
            for (int64_t i = kb * rows_per_block; i < i1; i++) {
                const float *dyr = dy + i * d;
                double s1 = 0.0, s2 = 0.0;
                row_pass(dyr, y + i * d, w, b, xs, fb, pw, d, need_dx, &s1, &s2);
                if (!need_dx) continue;
                /* after every read of the row of dy: dx may alias it */
                float c1 = (float)(s1 / (double)d), c2 = (float)(s2 / (double)d), r = rstd[i];
                row_dx(dyr, 0, w, 0, xs, dx + i * d, d, c1, c2, r);
            }
            if (fb)
                for (int64_t j = 0; j < d; j++) db_parts[kb * d + j] = (double)fb[j];
        }
        /* the blocks' sums in block order, split by columns (after the loop's implicit barrier) */
        if (need_dw || need_db) {
#pragma omp for schedule(static)
            for (int64_t j = 0; j < d; j++) {
                double sw = 0.0, sb = 0.0;
                for (int64_t kb = 0; kb < nblk; kb++) {
                    if (need_dw) sw += dw_parts[kb * d + j];
                    if (need_db) sb += db_parts[kb * d + j];
                }
                if (need_dw) dw[j] = (float)sw;
                if (need_db) db[j] = (float)sb;
            }
        }
    }
}

/* layer_norm_bwd_f32 with its 18 arguments packed as int64 (pointers as addresses, 0 for NULL) in
 * one array: a ctypes call converts each argument it is given, so one pointer instead of 18 is
 * most of the call's host cost at small sizes (NOTE [One argument per C call] in
 * ops/layer_norm.py). The same kernel, the same bits. */
void layer_norm_bwd_f32_packed(const int64_t *a) {
    layer_norm_bwd_f32((const float *)(intptr_t)a[0], (const float *)(intptr_t)a[1],
                       (const float *)(intptr_t)a[2], (const float *)(intptr_t)a[3],
                       (const float *)(intptr_t)a[4], (float *)(intptr_t)a[5],
                       (float *)(intptr_t)a[6], (float *)(intptr_t)a[7], (float *)(intptr_t)a[8],
                       (double *)(intptr_t)a[9], (double *)(intptr_t)a[10], a[11], a[12], a[13],
                       (int)a[14], (int)a[15], (int)a[16], (int)a[17]);
}
