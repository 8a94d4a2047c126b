/* GroupNorm backward from the output on float32 CPU tensors: the C kernel of
 * slimgrad/ops/group_norm.py (_bwd_cpu; NOTE [CPU C kernels] in slimgrad/kernels/_cpu.py).
 * dy, y: (n, c, hw) contiguous, rows of hw values per (sample, channel); mean, rstd: (n, g); w, b:
 * (c) or NULL; idx: the k fallback channels, ascending (NOTE [GroupNorm's fallback channels]), and
 * xs their kept input, (n, k, hw).
 * Row sums in double (a product of two floats is exact in double; NOTE [GroupNorm dgamma in
 * float64]), in 8 lanes (element j in lane j % 8) added in lane order: s0 = sum(dy), s1 = sum(dy *
 * y) (fallback rows: dy * x), and the row's q = sum(dy * xhat): (s1 - s0 * beta) / gamma (fallback:
 * (s1 - s0 * mu) * rstd), the PyTorch path's formulas.
 * dgamma and dbeta: per channel, sum_n s0 and sum_n q in sample order; dx: per (sample, group),
 * g1 = sum(s0 * gamma) in channel order, g2 = sum(q * gamma) over the rebuilt channels in channel
 * order and then over the fallback ones (the PyTorch path's order: its fallback rows come in a pass
 * of their own); in a group with a non-finite gamma g2 = sum(s1 * gamma) (NOTE [GroupNorm with a
 * non-finite gamma]). c1 = g1 / m, c2 = g2 / m, the PyTorch path's per-channel coefficients in
 * double rounded once to float, and dx = (fma(bb, y, a * dy) + cc) on rebuilt channels, (a * dy +
 * cc) + x * bx on fallback ones, each step rounded as the PyTorch path's ops round (its addcmul_
 * is fused on x86 CPUs: fmaf; no other contraction). Where the row sums are kept between the
 * passes (the modes of group_norm_bwd_f32) changes how often dy and y are read, not the sums or
 * their order: the same bits in every mode and for any thread count (every unit writes only its
 * own outputs). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* *s0 = sum(d), *s1 = sum(d * o), in double */
static void row_sums(const float *d, const float *o, int64_t hw, double *s0, double *s1) {
    double a0[8] = {0}, a1[8] = {0};
    int64_t j = 0;
    for (; j + 8 <= hw; j += 8) {
        for (int l = 0; l < 8; l++) {
            double dv = (double)d[j + l];
            a0[l] += dv;
            a1[l] += dv * (double)o[j + l];
        }
    }
    for (int l = 0; j < hw; j++, l++) {
        double dv = (double)d[j];
        a0[l] += dv;
        a1[l] += dv * (double)o[j];
    }
    double t0 = 0.0, t1 = 0.0;
    for (int l = 0; l < 8; l++) {
        t0 += a0[l];
        t1 += a1[l];
    }
    *s0 = t0;
    *s1 = t1;
}

/* the column of channel ch in xs, or -1 (idx ascending) */
static int64_t fb_col(const int64_t *idx, int64_t k, int64_t ch) {
    int64_t lo = 0, hi = k;
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (idx[mid] < ch)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < k && idx[lo] == ch ? lo : -1;
}

typedef struct {
    const float *dy, *y, *mean, *rstd, *w, *b, *xs;
    const int64_t *idx;
    float *dx;
    double *st; /* the kept row sums (mode 1), or NULL: in the first 16 bytes of dx's rows */
    int64_t c, hw, g, cg, k;
} gn_args;

enum { COMPUTE, COMPUTE_KEEP, READ }; /* where a row's sums come from */

/* row (i, ch)'s (s0, s1): computed (and kept: COMPUTE_KEEP), or read where they were kept */
static void row_raw(const gn_args *P, int how, int64_t i, int64_t ch, int64_t kk, double *s0,
                    double *s1) {
    int64_t r = i * P->c + ch;
    double v[2];
    if (how == READ) {
        memcpy(v, P->st ? (const void *)(P->st + 2 * r) : (const void *)(P->dx + r * P->hw),
               sizeof v);
    } else {
        const float *o = kk >= 0 ? P->xs + (i * P->k + kk) * P->hw : P->y + r * P->hw;
        row_sums(P->dy + r * P->hw, o, P->hw, &v[0], &v[1]);
        if (how == COMPUTE_KEEP)
            memcpy(P->st ? (void *)(P->st + 2 * r) : (void *)(P->dx + r * P->hw), v, sizeof v);
    }
    *s0 = v[0];
    *s1 = v[1];
}

/* row (i, ch)'s sum(dy * xhat) from its raw sums */
static double row_q(const gn_args *P, int64_t i, int64_t ch, int64_t kk, double s0, double s1) {
    if (kk >= 0) {
        int64_t ng = i * P->g + ch / P->cg;
        return (s1 - s0 * (double)P->mean[ng]) * (double)P->rstd[ng];
    }
    if (P->b) s1 = s1 - s0 * (double)P->b[ch];
    if (P->w) s1 = s1 / (double)P->w[ch];
    return s1;
}

/* the (sample, group) pair u: g1 and g2 from its rows' sums (how: where they come from, kept for
 * later with COMPUTE_KEEP), then, with write_dx, its dx from the coefficients */
static void group(const gn_args *P, int64_t u, int how, int write_dx) {
    const float *w = P->w, *b = P->b;
    int64_t cg = P->cg, hw = P->hw, i = u / P->g, c0 = (u % P->g) * cg;
    int bad = 0, anyfb = 0;
    for (int64_t ch = c0; w && ch < c0 + cg; ch++)
        if (!isfinite(w[ch])) bad = 1;
    double g1 = 0.0, g2 = 0.0, s0, s1;
    for (int64_t ch = c0; ch < c0 + cg; ch++) {
        int64_t kk = P->k ? fb_col(P->idx, P->k, ch) : -1;
        row_raw(P, how, i, ch, kk, &s0, &s1);
        g1 += w ? s0 * (double)w[ch] : s0;
        if (kk >= 0) {
            anyfb = 1;
        } else {
            double q = row_q(P, i, ch, kk, s0, s1);
            g2 += w ? q * (double)w[ch] : q;
        }
    }
    for (int64_t ch = c0; anyfb && ch < c0 + cg; ch++) { /* the fallback rows, after */
        int64_t kk = fb_col(P->idx, P->k, ch);
        if (kk < 0) continue;
        row_raw(P, how == COMPUTE ? COMPUTE : READ, i, ch, kk, &s0, &s1);
        double v = bad ? s1 : row_q(P, i, ch, kk, s0, s1);
        g2 += w ? v * (double)w[ch] : v;
    }
    if (!write_dx) return;
    double m = (double)(cg * hw), rr = (double)P->rstd[u], mu = (double)P->mean[u];
    double c1 = g1 / m, c2 = g2 / m;
    if (bad) c2 = (c2 - c1 * mu) * rr;
    double c1r = c1 * rr, rc2 = c2 * rr;
    for (int64_t ch = c0; ch < c0 + cg; ch++) {
        int64_t kk = P->k ? fb_col(P->idx, P->k, ch) : -1;
        float a = (float)(w ? rr * (double)w[ch] : rr);
        const float *dyr = P->dy + (i * P->c + ch) * hw, *yr = P->y + (i * P->c + ch) * hw;
        float *dxr = P->dx + (i * P->c + ch) * hw;
        if (kk >= 0) { /* no y term: y may be inf here */
            const float *xr = P->xs + (i * P->k + kk) * hw;
            float cc = (float)((rc2 * mu) * rr - c1r);
            float bx = (float)(-(rc2 * rr));
            for (int64_t j = 0; j < hw; j++) {
                float t = a * dyr[j];
                t = t + cc;
                dxr[j] = t + xr[j] * bx;
            }
        } else {
            double uu = w ? rc2 / (double)w[ch] : rc2;
            float bb = (float)(-uu);
            float cc = (float)((b ? uu * (double)b[ch] : 0.0) - c1r);
            for (int64_t j = 0; j < hw; j++) {
                float t = a * dyr[j];
                t = fmaf(bb, yr[j], t);
                dxr[j] = t + cc;
            }
        }
    }
}

/* dgamma and dbeta per channel: sum_n q and sum_n s0 in sample order */
static void channel(const gn_args *P, int64_t n, int64_t ch, int how, float *dw, float *db) {
    int64_t kk = P->k ? fb_col(P->idx, P->k, ch) : -1;
    double s0 = 0.0, t = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double p0, p1;
        row_raw(P, how, i, ch, kk, &p0, &p1);
        s0 += p0;
        t += row_q(P, i, ch, kk, p0, p1);
    }
    if (db) db[ch] = (float)s0;
    if (dw) dw[ch] = (float)t;
}

/* mode 0: dgamma/dbeta per channel from the row sums, then per group the row sums again and dx
 * (three reads of dy and y; dx may alias dy; no buffer).
 * mode 1: per group the row sums, kept in st (2 doubles per row, the caller's buffer), and dx
 * right after (the group's dy and y still in cache); then dgamma/dbeta per channel from st (one
 * read; dx may alias dy).
 * mode 2: per group the row sums, kept in the first 16 bytes of each row of dx (hw >= 4; dx must
 * not alias dy); dgamma/dbeta per channel from there; then per group its sums from there and dx
 * (two reads; no buffer). All modes: the same sums in the same order, the same bits. */
void group_norm_bwd_f32(const float *dy, const float *y, const float *mean, const float *rstd,
                        const float *w, const float *b, const float *xs, const int64_t *idx,
                        float *dx, float *dw, float *db, double *st, int64_t n, int64_t c,
                        int64_t hw, int64_t g, int64_t k, int mode, int nt) {
    gn_args P = {dy, y, mean, rstd, w, b, xs, idx, dx, mode == 1 ? st : 0, c, hw, g, c / g, k};
    int par = !(dw || db) || !dx; /* one of the two passes only: no sums kept */
    if (!dx || (mode == 0 && (dw || db))) {
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t ch = 0; ch < c; ch++) channel(&P, n, ch, COMPUTE, dw, db);
    }
    if (!dx) return;
    int keep = !(mode == 0 || par);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t u = 0; u < n * g; u++)
        group(&P, u, keep ? COMPUTE_KEEP : COMPUTE, !keep || mode == 1);
    if (!keep) return;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t ch = 0; ch < c; ch++) channel(&P, n, ch, READ, dw, db);
    if (mode == 1) return;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t u = 0; u < n * g; u++) group(&P, u, READ, 1);
}
