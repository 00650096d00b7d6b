/* Row-wise steps of a decoder layer, each fused into one pass per row: the residual
 * add and RMSNorm, the QKV bias / q-k norm / RoPE split, and SiLU(gate) * up.
 *
 * Every row is computed alone, in a fixed order of operations, so a row's result is
 * the same in any batch. Activations are fp32 or bf16 (the quantized GEMMs' input and
 * output); bf16 is rounded to nearest even, as torch rounds.
 */
#include <stdlib.h>

#include "common.h"

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float load(const void *p, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int bf16, int64_t i, float x) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(x);
    else
        ((float *)p)[i] = x;
}

static inline float sum_squares(const float *x, int64_t n) {
    float acc[LANES] = {0};
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += x[j + l] * x[j + l];
    for (int l = 0; j < n; j++, l++) acc[l] += x[j] * x[j];
    return fold(acc);
}

/* h [T, n] fp32 += y (when y is not NULL); out = rms_norm(h) * w, fp32 or bf16 */
void ls_add_rms_norm(float *h, const void *y, int y_bf16, const float *w, float eps, void *out,
                     int out_bf16, int64_t rows, int64_t n) {
#pragma omp parallel for if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        float *x = h + r * n;
        if (y)
            for (int64_t i = 0; i < n; i++) x[i] += load(y, y_bf16, r * n + i);
        const float inv = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
        for (int64_t i = 0; i < n; i++) store(out, out_bf16, r * n + i, x[i] * inv * w[i]);
    }
}

/* RoPE of one head in place (rope_into through tmp) */
static inline void rope(float *x, const float *cos, const float *sin, int d, float *tmp) {
    rope_into(x, cos, sin, d, tmp);
    memcpy(x, tmp, sizeof(float) * d);
}

static inline void head_norm(float *x, const float *w, float eps, int d) {
    const float inv = 1.0f / sqrtf(sum_squares(x, d) / (float)d + eps);
    for (int j = 0; j < d; j++) x[j] = x[j] * inv * w[j];
}

/* qkv [T, (heads + 2 kv_heads) * d] (fp32 or bf16, row stride `stride`) -> q [T, heads, d],
 * k, v [T, kv_heads, d] fp32: + bias, per-head RMSNorm of q and k (when qn / kn are
 * given), RoPE on q and k with this row's cos / sin [T, d] */
void ls_qkv_rope(const void *qkv, int qkv_bf16, int64_t stride, const float *bias,
                 const float *qn, const float *kn, float eps, const float *cos, const float *sin,
                 float *q, float *k, float *v, int64_t rows, int heads, int kv_heads, int d) {
    const int64_t nq = (int64_t)heads * d, nk = (int64_t)kv_heads * d;
#pragma omp parallel for if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        float tmp[1024];
        float *dst[3] = {q + r * nq, k + r * nk, v + r * nk};
        const int64_t width[3] = {nq, nk, nk};
        int64_t col = 0;
        for (int part = 0; part < 3; part++)
            for (int64_t i = 0; i < width[part]; i++, col++) {
                float x = load(qkv, qkv_bf16, r * stride + col);
                dst[part][i] = bias ? x + bias[col] : x;
            }
        const float *c = cos + r * d, *s = sin + r * d;
        for (int hh = 0; hh < heads + kv_heads; hh++) {
            float *x = hh < heads ? dst[0] + (int64_t)hh * d : dst[1] + (int64_t)(hh - heads) * d;
            if (qn) head_norm(x, hh < heads ? qn : kn, eps, d);
            rope(x, c, s, d, tmp);
        }
    }
}

/* gate_up [T, 2n] -> out [T, n] = silu(gate) * up */
void ls_silu_mul(const void *gu, int gu_bf16, void *out, int out_bf16, int64_t rows, int64_t n) {
#pragma omp parallel if (rows >= 16)
    {
        float *restrict g = malloc(sizeof(float) * 2 * n), *restrict u = g + n;
#pragma omp for
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t i = 0; i < n; i++) g[i] = load(gu, gu_bf16, r * 2 * n + i);
            for (int64_t i = 0; i < n; i++) u[i] = load(gu, gu_bf16, r * 2 * n + n + i);
            for (int64_t i = 0; i < n; i++) {
                /* silu(g) = g / (1 + exp(-g)), with exp taken of -|g| only */
                const float e = exp_neg(g[i] < 0.0f ? g[i] : -g[i]);
                g[i] = (g[i] < 0.0f ? g[i] * e : g[i]) / (1.0f + e) * u[i];
            }
            for (int64_t i = 0; i < n; i++) store(out, out_bf16, r * n + i, g[i]);
        }
        free(g);
    }
}
