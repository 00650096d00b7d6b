/* The decoder's layers in one call, for forwards whose every row attends in ls_attend
 * (decode rows and verify blocks) and whose GEMMs are the integer ones of q4.c.
 *
 * It runs the kernels target_actor/model.py calls one by one from Python, in the same
 * order on the same buffers, so its output is the same bits; what it saves is the ~10
 * Python calls a layer (and, in a process that also streams, the GIL they take). */
#include <stdlib.h>

#include "layer.h"

int ls_attend(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
              const float *v, int64_t v_stride, float *out, int64_t nseq, const int64_t *base,
              const int64_t *cap, const int64_t *start, const int64_t *nnew, const int64_t *row0,
              int64_t layer, int heads, int kv_heads, int d, float scale, int kv_bf16);

/* h [T, hidden] fp32, the residual stream before layer 0, updated in place; on return y
 * [T, hidden] holds the last layer's output, still to be added to h (as the Python loop
 * leaves it). Scratch: x [T, hidden], qkv [T, (heads + 2 kv_heads) hd], q / attn
 * [T, heads hd], k / v [T, kv_heads hd], gu [T, 2 inter], act [T, inter]. Attention as
 * ls_attend's arguments. Taps: for layer i with tap_h[i] set, tap_h[i] = h + y (its
 * output hidden state) and tap_k[i] / tap_v[i] its new K / V rows. Returns 0, or the
 * first kernel's error. */
int ls_decoder(const ls_layer *layers, int64_t nlayers, float *h, float eps, int64_t T,
               int64_t hidden, const float *cos, const float *sin, int heads, int kv_heads,
               int hd, float scale, int64_t nseq, const int64_t *base, const int64_t *cap,
               const int64_t *start, const int64_t *nnew, const int64_t *row0, int kv_bf16,
               float *x, float *qkv, float *q, float *k, float *v, float *attn, float *gu,
               float *act, float *y, float **tap_h, float **tap_k, float **tap_v) {
    const int64_t nq = (int64_t)heads * hd, nkv = (int64_t)kv_heads * hd;
    int rc;
    for (int64_t i = 0; i < nlayers; i++) {
        const ls_layer *L = layers + i;
        ls_add_rms_norm(h, i ? y : NULL, 0, L->input_norm, eps, x, 0, T, hidden);
        if ((rc = layer_gemm(L, QKV, x, T, qkv))) return rc;
        ls_qkv_rope(qkv, 0, L->n[QKV], NULL, L->q_norm, L->k_norm, eps, cos, sin, q, k, v, T,
                    heads, kv_heads, hd);
        rc = ls_attend(q, nq, k, nkv, v, nkv, attn, nseq, base, cap, start, nnew, row0, i, heads,
                       kv_heads, hd, scale, kv_bf16);
        if (rc) return rc;
        if ((rc = layer_gemm(L, O, attn, T, y))) return rc;
        ls_add_rms_norm(h, y, 0, L->post_norm, eps, x, 0, T, hidden);
        if ((rc = layer_gemm(L, GATE_UP, x, T, gu))) return rc;
        ls_silu_mul(gu, 0, act, 0, T, L->n[GATE_UP] / 2);
        if ((rc = layer_gemm(L, DOWN, act, T, y))) return rc;
        if (tap_h && tap_h[i]) {
            for (int64_t j = 0; j < T * hidden; j++) tap_h[i][j] = h[j] + y[j];
            memcpy(tap_k[i], k, sizeof(float) * T * nkv);
            memcpy(tap_v[i], v, sizeof(float) * T * nkv);
        }
    }
    return 0;
}
