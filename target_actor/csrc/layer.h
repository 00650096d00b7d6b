/* A decoder layer's weights as the one-call passes read them (decoder.c for the target,
 * draft.c for the drafter), and the row kernels those passes call. */
#ifndef LONGSPARK_LAYER_H
#define LONGSPARK_LAYER_H

#include "common.h"

void ls_add_rms_norm(float *h, const void *y, int y_bf16, const float *w, float eps, void *out,
                     int out_bf16, int64_t rows, int64_t n);
void ls_qkv_rope(const void *qkv, int qkv_bf16, int64_t stride, const float *bias,
                 const float *qn, const float *kn, float eps, const float *cos, const float *sin,
                 float *q, float *k, float *v, int64_t rows, int heads, int kv_heads, int d);
void ls_silu_mul(const void *gu, int gu_bf16, void *out, int out_bf16, int64_t rows, int64_t n);
int ls_gemm_q4(const float *x, int64_t M, int64_t K, const uint8_t *wq, const uint16_t *d,
               const uint16_t *m, int64_t N, float *y, int planes);
int ls_gemm_w8(const float *x, int64_t M, int64_t K, const uint8_t *wq, const uint16_t *d,
               int64_t N, float *y, int planes);

enum { QKV, O, GATE_UP, DOWN };
enum { KIND_Q4 = 0, KIND_W8 = 1 };

/* One layer's weights (target_actor/native_decoder.py fills these): the norms, and per
 * GEMM (qkv, o, gate_up, down) its kind, tiles, scales d (and m for Q4_1), [n, k] and
 * activation planes. */
typedef struct {
    const float *input_norm, *post_norm, *q_norm, *k_norm;
    const uint8_t *w[4];
    const uint16_t *d[4], *m[4];
    int64_t n[4], k[4], kind[4], planes[4];
} ls_layer;

static inline int layer_gemm(const ls_layer *L, int g, const float *x, int64_t rows, float *y) {
    if (L->kind[g] == KIND_Q4)
        return ls_gemm_q4(x, rows, L->k[g], L->w[g], L->d[g], L->m[g], L->n[g], y,
                          (int)L->planes[g]);
    return ls_gemm_w8(x, rows, L->k[g], L->w[g], L->d[g], L->n[g], y, (int)L->planes[g]);
}

#endif
