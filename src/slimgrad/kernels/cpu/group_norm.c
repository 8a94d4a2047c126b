/* GroupNorm backward from the output on float32 CPU tensors: the C kernel of
 * slimgrad/ops/group_norm.py (_bwd_cpu; NOTE [CPU C kernels] in slimgrad/kernels/_cpu.py).
 * dy, y: (n, c, hw) contiguous, rows of hw values per (sample, channel); mean, rstd: (n, g); w, b:
 * (c) or NULL; idx: the k fallback channels, ascending (NOTE [GroupNorm's fallback channels]), and
 * xs their kept input, (n, k, hw).
 * Row sums in double (a product of two floats is exact in double; NOTE [GroupNorm dgamma in
 * float64]), in 8 lanes (element j in lane j % 8) added in lane order: p0 = sum(dy), p1 = sum(dy *
 * y) (fallback rows: dy * x), and the row's sum(dy * xhat): q = (p1 - p0 * beta) / gamma (fallback:
 * (p1 - p0 * mu) * rstd), the PyTorch path's formulas.
 * dgamma and dbeta: per channel, sum_n p0 and sum_n q in sample order; dx: per (sample, group),
 * c1 = sum(p0 * gamma) / m, c2 = sum(q * gamma) / m, the PyTorch path's per-channel coefficients
 * in double rounded once to float, and dx = (fma(bb, y, a * dy) + cc) (+ x * bx on fallback
 * channels), each step rounded as the PyTorch path's ops round (its addcmul_ is fused on x86
 * CPUs: fmaf; no other contraction). Where the row sums are kept between the two (the modes of
 * group_norm_bwd_f32) changes how often dy and y are read, not the sums or their order: the same
 * bits in every mode and for any thread count (every unit writes only its own outputs). */
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

/* row (i, ch): *p0 = sum(dy), *q = sum(dy * xhat) */
static void row_q(const float *dy, const float *y, const float *mean, const float *rstd,
                  const float *w, const float *b, const float *xs, int64_t c, int64_t hw,
                  int64_t cg, int64_t g, int64_t k, int64_t i, int64_t ch, int64_t kk, double *p0,
                  double *q) {
    const float *dyr = dy + (i * c + ch) * hw;
    double s0, s1;
    if (kk >= 0) {
        row_sums(dyr, xs + (i * k + kk) * hw, hw, &s0, &s1);
        int64_t ng = i * g + ch / cg;
        s1 = (s1 - s0 * (double)mean[ng]) * (double)rstd[ng];
    } else {
        row_sums(dyr, y + (i * c + ch) * hw, hw, &s0, &s1);
        if (b) s1 = s1 - s0 * (double)b[ch];
        if (w) s1 = s1 / (double)w[ch];
    }
    *p0 = s0;
    *q = s1;
}

/* the (sample, group) pair u's dx from its c1 * rstd and c2 * rstd */
static void group_dx(const float *dy, const float *y, const float *mean, const float *rstd,
                     const float *w, const float *b, const float *xs, const int64_t *idx, float *dx,
                     int64_t c, int64_t hw, int64_t g, int64_t k, int64_t u, double c1r,
                     double rc2) {
    int64_t cg = c / g, i = u / g, c0 = (u % g) * cg;
    double rr = (double)rstd[u];
    for (int64_t ch = c0; ch < c0 + cg; ch++) {
        int64_t kk = k ? fb_col(idx, k, ch) : -1;
        double uu = kk >= 0 ? 0.0 : (w ? rc2 / (double)w[ch] : rc2);
        float a = (float)(w ? rr * (double)w[ch] : rr);
        float bb = (float)(-uu);
        double cd = b ? uu * (double)b[ch] : 0.0;
        if (kk >= 0) cd = (rc2 * (double)mean[u]) * rr;
        float cc = (float)(cd - c1r);
        const float *dyr = dy + (i * c + ch) * hw, *yr = y + (i * c + ch) * hw;
        float *dxr = dx + (i * c + ch) * hw;
        if (kk >= 0) {
            const float *xr = xs + (i * k + kk) * hw;
            float bx = (float)(-(rc2 * rr));
            for (int64_t j = 0; j < hw; j++) {
                float t = a * dyr[j];
                t = fmaf(bb, yr[j], t);
                t = t + cc;
                dxr[j] = t + xr[j] * bx;
            }
        } else {
            for (int64_t j = 0; j < hw; j++) {
                float t = a * dyr[j];
                t = fmaf(bb, yr[j], t);
                dxr[j] = t + cc;
            }
        }
    }
}

/* row r's (p0, q), kept in a double pair: st (the stash) or the first 16 bytes of dx's row r */
static void put(double *st, float *dx, int64_t hw, int64_t r, double p0, double q) {
    double v[2] = {p0, q};
    if (st)
        memcpy(st + 2 * r, v, sizeof v);
    else
        memcpy(dx + r * hw, v, sizeof v);
}
static void get(const double *st, const float *dx, int64_t hw, int64_t r, double *p0, double *q) {
    double v[2];
    if (st)
        memcpy(v, st + 2 * r, sizeof v);
    else
        memcpy(v, dx + r * hw, sizeof v);
    *p0 = v[0];
    *q = v[1];
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
    int64_t cg = c / g;
    double m = (double)(cg * hw);
    int par = !(dw || db) || !dx; /* one of the two passes only: no sums kept */
    if (!dx || (mode == 0 && (dw || db))) {
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t ch = 0; ch < c; ch++) {
            int64_t kk = k ? fb_col(idx, k, ch) : -1;
            double s0 = 0.0, t = 0.0;
            for (int64_t i = 0; i < n; i++) {
                double p0, q;
                row_q(dy, y, mean, rstd, w, b, xs, c, hw, cg, g, k, i, ch, kk, &p0, &q);
                s0 += p0;
                t += q;
            }
            if (db) db[ch] = (float)s0;
            if (dw) dw[ch] = (float)t;
        }
    }
    if (!dx) return;
    if (mode == 0 || par) {
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t u = 0; u < n * g; u++) {
            int64_t i = u / g, c0 = (u % g) * cg;
            double g1 = 0.0, g2 = 0.0;
            for (int64_t ch = c0; ch < c0 + cg; ch++) {
                int64_t kk = k ? fb_col(idx, k, ch) : -1;
                double p0, q;
                row_q(dy, y, mean, rstd, w, b, xs, c, hw, cg, g, k, i, ch, kk, &p0, &q);
                if (w) {
                    p0 = p0 * (double)w[ch];
                    q = q * (double)w[ch];
                }
                g1 += p0;
                g2 += q;
            }
            double rr = (double)rstd[u];
            group_dx(dy, y, mean, rstd, w, b, xs, idx, dx, c, hw, g, k, u, (g1 / m) * rr,
                     (g2 / m) * rr);
        }
        return;
    }
    double *sp = mode == 1 ? st : 0;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t u = 0; u < n * g; u++) {
        int64_t i = u / g, c0 = (u % g) * cg;
        double g1 = 0.0, g2 = 0.0;
        for (int64_t ch = c0; ch < c0 + cg; ch++) {
            int64_t kk = k ? fb_col(idx, k, ch) : -1;
            double p0, q;
            row_q(dy, y, mean, rstd, w, b, xs, c, hw, cg, g, k, i, ch, kk, &p0, &q);
            put(sp, dx, hw, i * c + ch, p0, q);
            if (w) {
                p0 = p0 * (double)w[ch];
                q = q * (double)w[ch];
            }
            g1 += p0;
            g2 += q;
        }
        if (mode == 1) {
            double rr = (double)rstd[u];
            group_dx(dy, y, mean, rstd, w, b, xs, idx, dx, c, hw, g, k, u, (g1 / m) * rr,
                     (g2 / m) * rr);
        }
    }
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t ch = 0; ch < c; ch++) {
        double s0 = 0.0, t = 0.0;
        for (int64_t i = 0; i < n; i++) {
            double p0, q;
            get(sp, dx, hw, i * c + ch, &p0, &q);
            s0 += p0;
            t += q;
        }
        if (db) db[ch] = (float)s0;
        if (dw) dw[ch] = (float)t;
    }
    if (mode == 1) return;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t u = 0; u < n * g; u++) {
        int64_t i = u / g, c0 = (u % g) * cg;
        double g1 = 0.0, g2 = 0.0;
        for (int64_t ch = c0; ch < c0 + cg; ch++) {
            double p0, q;
            get(0, dx, hw, i * c + ch, &p0, &q);
            if (w) {
                p0 = p0 * (double)w[ch];
                q = q * (double)w[ch];
            }
            g1 += p0;
            g2 += q;
        }
        double rr = (double)rstd[u];
        group_dx(dy, y, mean, rstd, w, b, xs, idx, dx, c, hw, g, k, u, (g1 / m) * rr,
                 (g2 / m) * rr);
    }
}
