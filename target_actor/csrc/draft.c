/* The drafter's block pass in one call, and the Markov head's greedy draft.
 *
 * ls_draft_pass runs drafter_actor/network.py's DrafterLayer.forward for every layer
 * (pre-norm, q/k/v in one GEMM, RoPE, ls_draft_attend over context, summary and block,
 * o, post-norm, the SiLU MLP), then DrafterNetwork.logits on each block's MASK rows: the
 * kernels the Python path calls, from one C loop, so the ~15 torch ops a layer (and the
 * GIL they take) become one call a round. Its last bits may differ from the Python
 * path's (torch's SiLU and RoPE there); that only shapes the proposals, which carry the
 * distribution they were drawn from, so verification stays exact either way.
 *
 * ls_markov_greedy is markov.py's greedy branch of sample_block: for slot i, the previous
 * draft's W1 row through the int8 W2 (one GEMM for the batch), added to the slot's base
 * logits, then the argmax (the first of equal maxima, as torch's): the same kernel and
 * float steps as the Python loop, so the same drafts. */
#include <stdlib.h>

#include "layer.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

int ls_draft_attend(const float *q, const float *kb, const float *vb, const int64_t *ctx_k,
                    const int64_t *ctx_v, const uint8_t *ctx_mask, const float *g,
                    const int64_t *sum_m, const int64_t *sum_lam, float *out, int64_t n,
                    int64_t layer, int S, int heads, int kv_heads, int C, int R, int d,
                    float scale);

/* h [n * S, hidden]: each sequence's block embeddings (anchor first), the residual stream,
 * updated in place. cos / sin [n * S, hd]: the rows' RoPE. The context as ls_draft_attend
 * reads it (ctx_k ... sum_lam, C rows, R summary slots); g [layers, heads, R, hd] every
 * layer's summary keys. norm [hidden] and the LM head (Q8_0 tiles head_w, scales head_d,
 * vocab rows) give base [n, S - 1, vocab]: the logits of each MASK slot. Returns 0, or
 * the first kernel's error (-1: out of memory). */
int ls_draft_pass(const ls_layer *layers, int64_t nlayers, float *h, float eps, int64_t n,
                  int S, int64_t hidden, const float *cos, const float *sin, int heads,
                  int kv_heads, int hd, float scale, const int64_t *ctx_k, const int64_t *ctx_v,
                  const uint8_t *ctx_mask, int C, const float *g, const int64_t *sum_m,
                  const int64_t *sum_lam, int R, const float *norm, const uint8_t *head_w,
                  const uint16_t *head_d, int64_t vocab, int head_planes, float *base) {
    const int64_t T = n * S, nq = (int64_t)heads * hd, nkv = (int64_t)kv_heads * hd;
    const int64_t inter = layers[0].n[GATE_UP] / 2;
    const int64_t per_row = 2 * hidden + (nq + 2 * nkv) + 2 * nq + 4 * nkv + 3 * inter;
    float *buf = malloc(sizeof(float) * (size_t)(T * per_row));
    if (buf == NULL) return -1;
    float *x = buf, *y = x + T * hidden, *qkv = y + T * hidden, *q = qkv + T * (nq + 2 * nkv);
    float *k = q + T * nq, *v = k + T * nkv, *kb = v + T * nkv, *vb = kb + T * nkv;
    float *attn = vb + T * nkv, *gu = attn + T * nq, *act = gu + T * 2 * inter;
    int rc = 0;
    for (int64_t i = 0; i < nlayers && rc == 0; i++) {
        const ls_layer *L = layers + i;
        ls_add_rms_norm(h, i ? y : NULL, 0, L->input_norm, eps, x, 0, T, hidden);
        if ((rc = layer_gemm(L, QKV, x, T, qkv))) break;
        ls_qkv_rope(qkv, 0, L->n[QKV], NULL, L->q_norm, L->k_norm, eps, cos, sin, q, k, v, T,
                    heads, kv_heads, hd);
        /* the block's own keys and values as the attention reads them: [n, kv_heads, S, hd] */
        for (int64_t s = 0; s < n; s++)
            for (int j = 0; j < kv_heads; j++)
                for (int r = 0; r < S; r++) {
                    const int64_t from = ((s * S + r) * kv_heads + j) * hd;
                    const int64_t to = ((s * kv_heads + j) * S + r) * hd;
                    memcpy(kb + to, k + from, sizeof(float) * hd);
                    memcpy(vb + to, v + from, sizeof(float) * hd);
                }
        rc = ls_draft_attend(q, kb, vb, ctx_k, ctx_v, ctx_mask, g + i * heads * R * hd, sum_m,
                             sum_lam, attn, n, i, S, heads, kv_heads, C, R, hd, scale);
        if (rc) break;
        if ((rc = layer_gemm(L, O, attn, T, y))) break;
        ls_add_rms_norm(h, y, 0, L->post_norm, eps, x, 0, T, hidden);
        if ((rc = layer_gemm(L, GATE_UP, x, T, gu))) break;
        ls_silu_mul(gu, 0, act, 0, T, inter);
        if ((rc = layer_gemm(L, DOWN, act, T, y))) break;
    }
    if (rc == 0) { /* the final norm, then the LM head on the MASK rows only */
        ls_add_rms_norm(h, y, 0, norm, eps, x, 0, T, hidden);
        for (int64_t s = 0; s < n; s++)
            memmove(x + s * (S - 1) * hidden, x + (s * S + 1) * hidden,
                    sizeof(float) * (size_t)((S - 1) * hidden));
        rc = ls_gemm_w8(x, n * (S - 1), hidden, head_w, head_d, vocab, base, head_planes);
    }
    free(buf);
    return rc;
}

/* the first t with a[t] + b[t] largest (torch's argmax of a + b); a + b is left in b */
static int64_t argmax_sum(const float *a, float *b, int64_t n) {
    float best = -INFINITY;
    int64_t t = 0;
#if defined(__AVX512F__)
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (; t + 16 <= n; t += 16) {
        const __m512 v = _mm512_add_ps(_mm512_loadu_ps(a + t), _mm512_loadu_ps(b + t));
        _mm512_storeu_ps(b + t, v);
        m = _mm512_max_ps(m, v);
    }
    best = _mm512_reduce_max_ps(m);
#endif
    for (; t < n; t++) {
        b[t] += a[t];
        best = b[t] > best ? b[t] : best;
    }
    for (t = 0; t < n; t++)
        if (b[t] == best) return t;
    return 0; /* every sum NaN */
}

/* base [n, k, vocab] fp32; anchor [n]: each block's anchor as a W1 row (vocab: out of the
 * draft vocabulary); w1 [vocab + 1, rank] fp32; W2 as Q8_0 rows [vocab, rank] (tiles w2_w,
 * scales w2_d). tokens [n, k]: the drafts. Returns 0, or the GEMM's error. */
int ls_markov_greedy(const float *base, int64_t n, int k, int64_t vocab, const int64_t *anchor,
                     const float *w1, int64_t rank, const uint8_t *w2_w, const uint16_t *w2_d,
                     int planes, int64_t *tokens) {
    float *rows = malloc(sizeof(float) * (size_t)(n * (rank + vocab)));
    if (rows == NULL) return -1;
    float *bias = rows + n * rank;
    int rc = 0;
    for (int i = 0; i < k && rc == 0; i++) {
        for (int64_t s = 0; s < n; s++) {
            const int64_t prev = i ? tokens[s * k + i - 1] : anchor[s];
            memcpy(rows + s * rank, w1 + prev * rank, sizeof(float) * (size_t)rank);
        }
        if ((rc = ls_gemm_w8(rows, n, rank, w2_w, w2_d, vocab, bias, planes))) break;
        for (int64_t s = 0; s < n; s++)
            tokens[s * k + i] = argmax_sum(base + (s * k + i) * vocab, bias + s * vocab, vocab);
    }
    free(rows);
    return rc;
}

/* The round's context row of each sequence (its boundary state), as the drafter's context
 * K/V GEMM gives it: rows [n, layers, 2, kv_heads * hd] (every layer's K, then V). RoPE
 * on the keys at each sequence's position (cos / sin [n, hd]), then K and V go into the
 * sequence's context buffers (k_addr[i], v_addr[i]: [layers, kv_heads, C, hd] fp32) at
 * row `at`, right after the window ring, where ls_draft_attend reads them. */
void ls_draft_context_rows(const float *rows, const float *cos, const float *sin, int64_t n,
                           int layers, int kv_heads, int hd, const int64_t *k_addr,
                           const int64_t *v_addr, int C, int at) {
    const int64_t width = (int64_t)kv_heads * hd;
    for (int64_t i = 0; i < n; i++) {
        float *kb = (float *)(intptr_t)k_addr[i], *vb = (float *)(intptr_t)v_addr[i];
        const float *c = cos + i * hd, *s = sin + i * hd;
        for (int l = 0; l < layers; l++) {
            const float *k = rows + ((i * layers + l) * 2) * width, *v = k + width;
            for (int j = 0; j < kv_heads; j++) {
                const float *x = k + (int64_t)j * hd;
                float *ko = kb + (((int64_t)l * kv_heads + j) * C + at) * hd;
                float *vo = vb + (((int64_t)l * kv_heads + j) * C + at) * hd;
                rope_into(x, c, s, hd, ko);
                memcpy(vo, v + (int64_t)j * hd, sizeof(float) * (size_t)hd);
            }
        }
    }
}
