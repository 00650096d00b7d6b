/* Decode and verify attention for every sequence of a forward in one call.
 *
 * Each query row attends to its own sequence's cached keys 0..pos (causal), one
 * row at a time, in a fixed order of operations that depends only on that row's
 * query and keys: a row's output is bit for bit the same whether it is a 1-row
 * decode step, one row of a verify block, or shares the call with any other
 * sequences. That is what makes speculative output equal plain output and keeps
 * one request's numbers independent of the batch it rides in.
 *
 * Cache layout (target_actor/kv_cache.py): one contiguous block per sequence,
 * [layers, 2, kv_heads, capacity, head_dim] fp32. New K/V rows are written into the
 * cache here before attending. Threads: OpenMP (the same libgomp torch loaded).
 */
#include <stdlib.h>

#include "common.h"

/* a dot product over d (a multiple of LANES): LANES independent partial sums, then a
 * fixed pairwise fold; the same order on every call */
static inline float dot(const float *a, const float *b, int d) {
    float acc[LANES] = {0};
    for (int i = 0; i < d; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    return fold(acc);
}

static inline float lane_sum(const float *x, int n) {
    float acc[LANES] = {0};
    int j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += x[j + l];
    for (int l = 0; j < n; j++, l++) acc[l] += x[j];
    return fold(acc);
}

/* One (query row, KV head): the `group` query heads that share this KV head. */
static void attend_row(const float *q, float *out, const float *keys, const float *values,
                       int64_t len, int group, int d, float scale, float *scores) {
    for (int g = 0; g < group; g++) {
        const float *qg = q + (int64_t)g * d;
        float *s = scores + (int64_t)g * len;
        float m = -INFINITY;
        for (int64_t j = 0; j < len; j++) {
            s[j] = dot(qg, keys + j * d, d) * scale;
            m = s[j] > m ? s[j] : m;
        }
        for (int64_t j = 0; j < len; j++) s[j] = exp_neg(s[j] - m);
        float inv = 1.0f / lane_sum(s, (int)len);
        float *o = out + (int64_t)g * d;
        for (int i = 0; i < d; i++) o[i] = 0.0f;
        for (int64_t j = 0; j < len; j++) {
            const float p = s[j], *v = values + j * d;
            for (int i = 0; i < d; i++) o[i] += p * v[i];
        }
        for (int i = 0; i < d; i++) o[i] *= inv;
    }
}

/* q [T, heads * d] (row stride q_stride), k/v new rows [T, kv_heads * d] (strides
 * k_stride / v_stride), out [T, heads * d] contiguous. Per sequence s: its cache base
 * (layer 0, K, head 0) base[s], capacity cap[s], first position start[s], new rows
 * nnew[s] beginning at row row0[s]. Returns 0, or -1 when d is not a multiple of LANES. */
int ls_attend(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
              const float *v, int64_t v_stride, float *out, int64_t nseq, const int64_t *base,
              const int64_t *cap, const int64_t *start, const int64_t *nnew, const int64_t *row0,
              int64_t layer, int heads, int kv_heads, int d, float scale) {
    if (d % LANES) return -1;
    const int group = heads / kv_heads;
    int64_t rows = 0, max_len = 0;
    for (int64_t s = 0; s < nseq; s++) {
        rows += nnew[s];
        if (start[s] + nnew[s] > max_len) max_len = start[s] + nnew[s];
    }
    /* store the new rows (every sequence, before any attends) */
    for (int64_t s = 0; s < nseq; s++) {
        float *kc = (float *)(intptr_t)base[s] + layer * 2 * kv_heads * cap[s] * d;
        float *vc = kc + (int64_t)kv_heads * cap[s] * d;
        for (int64_t i = 0; i < nnew[s]; i++)
            for (int h = 0; h < kv_heads; h++) {
                int64_t at = ((int64_t)h * cap[s] + start[s] + i) * d;
                memcpy(kc + at, k + (row0[s] + i) * k_stride + (int64_t)h * d, d * sizeof(float));
                memcpy(vc + at, v + (row0[s] + i) * v_stride + (int64_t)h * d, d * sizeof(float));
            }
    }
    const int64_t items = rows * kv_heads;
#pragma omp parallel if (items > 8)
    {
        float *scores = malloc(sizeof(float) * group * (max_len > 0 ? max_len : 1));
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            int64_t r = it / kv_heads, s = 0;
            const int h = (int)(it % kv_heads);
            while (r >= nnew[s]) r -= nnew[s++]; /* r: the row within sequence s */
            const int64_t row = row0[s] + r, len = start[s] + r + 1;
            const float *kc = (const float *)(intptr_t)base[s] + layer * 2 * kv_heads * cap[s] * d;
            const float *keys = kc + (int64_t)h * cap[s] * d;
            const float *values = keys + (int64_t)kv_heads * cap[s] * d;
            attend_row(q + row * q_stride + (int64_t)h * group * d,
                       out + row * (int64_t)heads * d + (int64_t)h * group * d, keys, values, len,
                       group, d, scale, scores);
        }
        free(scores);
    }
    return 0;
}
