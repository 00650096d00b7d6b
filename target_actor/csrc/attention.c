/* Decode and verify attention for every sequence of a forward in one call.
 *
 * Each query row attends to its own sequence's cached keys 0..pos (causal), in chunks of
 * keys at fixed positions (KC below), in a fixed order of operations that depends only on
 * that row's query and keys: a row's output is bit for bit the same whether it is a 1-row
 * decode step, one row of a verify block, or shares the call with any other sequences.
 * That is what makes speculative output equal plain output and keeps one request's
 * numbers independent of the batch it rides in.
 *
 * Cache layout (target_actor/kv_cache.py): one contiguous block per sequence,
 * [layers, 2, kv_heads, capacity, head_dim], fp32 or bf16 (half the bytes to read at high
 * load and long context; rows rounded to nearest even as torch rounds them, and widened
 * exactly on reading, so the arithmetic is the same fp32 either way). New K/V rows are
 * written into the cache here before attending. Threads: OpenMP (the same libgomp torch
 * loaded).
 */
#include <omp.h>
#include <stdlib.h>

#include "common.h"

/* bytes ahead of the keys and values being read that the first row of a chunk prefetches
 * (past the 4 KB page the hardware prefetcher stops at) */
#define PF_AHEAD 2048

/* a dot product over d (a multiple of LANES): LANES independent partial sums by fused
 * multiply-adds, then a fixed pairwise fold; the same order on every call */
static inline float dot(const float *a, const float *b, int d) {
    float acc[LANES] = {0};
    for (int i = 0; i < d; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = fmaf(a[i + l], b[i + l], acc[l]);
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

/* fp32 -> bf16 bits, rounded to nearest even (NaN kept a NaN) */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float from_bf16(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* a cache row's d values, fp32 or bf16 bits (bf), widened into out */
static inline void widen_row(const void *row, int bf, int d, float *out) {
    if (!bf) {
        memcpy(out, row, sizeof(float) * (size_t)d);
        return;
    }
    for (int i = 0; i < d; i++) out[i] = from_bf16(((const uint16_t *)row)[i]);
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 cache values from element i of row base (fp32, or bf16 bits widened exactly) */
static inline __m512 load16(const void *base, int64_t i, int bf) {
    if (!bf) return _mm512_loadu_ps((const float *)base + i);
    const __m256i b = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

/* fold() of 16 vectors at once: out[j] = fold(v[j]), by the same pairwise adds (lane l
 * with l + 8, then + 4, + 2, + 1) arranged as a transpose, so each score is bit for bit
 * what dot() gives, whichever of the 16 places it takes. */
static inline __m512 fold16(const __m512 *v) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++) /* l += l + 8: two vectors' halves side by side */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* l += l + 4: block b of x[i] is vector 4i + b */
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* l += l + 2 within each 128-bit block */
        y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
    /* l += l + 1; lane 4b + t now holds vector 4t + b */
    const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88),
                                   _mm512_shuffle_ps(y[0], y[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, z);
}

/* the 16 scores of keys k[0], k[d], ..., k[15 d] (fp32, or bf16 bits when bf) */
static inline __attribute__((always_inline)) __m512 scores16(const float *q, const void *k,
                                                             int bf, int d) {
    __m512 v[16];
#pragma GCC unroll 16
    for (int t = 0; t < 16; t++) v[t] = _mm512_setzero_ps();
    for (int i = 0; i < d; i += 16) {
        const __m512 qi = _mm512_loadu_ps(q + i);
#pragma GCC unroll 16
        for (int t = 0; t < 16; t++)
            v[t] = _mm512_fmadd_ps(qi, load16(k, (int64_t)t * d + i, bf), v[t]);
    }
    return fold16(v);
}

/* s[j] = dot(q, keys[j]) * scale for j < len, 16 keys at a time; a short last group is
 * widened next to zeros (pad: 16 * d floats) */
static void scores_of(const float *q, const void *keys, int bf, int64_t len, int d,
                      float scale, float *s, float *pad, int pf) {
    const __m512 sc = _mm512_set1_ps(scale);
    const size_t esize = bf ? 2 : 4;
    int64_t j0 = 0;
    for (; j0 + 16 <= len; j0 += 16) {
        const void *k = (const char *)keys + (size_t)(j0 * d) * esize;
        if (pf)
            for (size_t l = 0; l < 16 * (size_t)d * esize; l += 64)
                _mm_prefetch((const char *)k + PF_AHEAD + l, _MM_HINT_T0);
        __m512 dots; /* the common head sizes with d known: the keys at fixed offsets */
        if (d == 64)
            dots = bf ? scores16(q, k, 1, 64) : scores16(q, k, 0, 64);
        else if (d == 128)
            dots = bf ? scores16(q, k, 1, 128) : scores16(q, k, 0, 128);
        else
            dots = bf ? scores16(q, k, 1, d) : scores16(q, k, 0, d);
        _mm512_storeu_ps(s + j0, _mm512_mul_ps(dots, sc));
    }
    const int n = (int)(len - j0);
    if (n > 0) {
        for (int t = 0; t < n; t++)
            widen_row((const char *)keys + (size_t)((j0 + t) * d) * esize, bf, d, pad + t * d);
        memset(pad + n * d, 0, sizeof(float) * (size_t)((16 - n) * d));
        const __m512 dots = _mm512_mul_ps(scores16(q, pad, 0, d), sc);
        _mm512_mask_storeu_ps(s + j0, (__mmask16)((1u << n) - 1), dots);
    }
}

/* o = sum_j p[j] * values[j] (in order of j), times inv; four vectors of o at a time */
static void weigh_values(const float *p, const void *values, int bf, int64_t len, int d,
                         float inv, float *o) {
    int i0 = 0;
    for (; i0 + 64 <= d; i0 += 64) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t j = 0; j < len; j++) {
            const __m512 pj = _mm512_set1_ps(p[j]);
            const int64_t at = j * d + i0;
            a0 = _mm512_fmadd_ps(pj, load16(values, at, bf), a0);
            a1 = _mm512_fmadd_ps(pj, load16(values, at + 16, bf), a1);
            a2 = _mm512_fmadd_ps(pj, load16(values, at + 32, bf), a2);
            a3 = _mm512_fmadd_ps(pj, load16(values, at + 48, bf), a3);
        }
        const __m512 sc = _mm512_set1_ps(inv);
        _mm512_storeu_ps(o + i0, _mm512_mul_ps(a0, sc));
        _mm512_storeu_ps(o + i0 + 16, _mm512_mul_ps(a1, sc));
        _mm512_storeu_ps(o + i0 + 32, _mm512_mul_ps(a2, sc));
        _mm512_storeu_ps(o + i0 + 48, _mm512_mul_ps(a3, sc));
    }
    for (; i0 < d; i0 += 16) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t j = 0; j < len; j++)
            a = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), load16(values, j * d + i0, bf), a);
        _mm512_storeu_ps(o + i0, _mm512_mul_ps(a, _mm512_set1_ps(inv)));
    }
}
/* weigh_values for G (<= 4) query heads over the same values: p holds G rows of weights
 * (stride ps), head g's output goes to o + g * os times inv[g]. Each value vector is
 * loaded once for all the heads and 4 G sums are in flight, where one head alone waits on
 * its 4 multiply-add chains; every output element is still summed in the order j. */
static inline __attribute__((always_inline)) void weigh_n(const int G, const float *p, int64_t ps,
                                                          const void *values, int bf, int64_t len,
                                                          int d, const float *inv, float *o,
                                                          int64_t os, int pf) {
    int i0 = 0;
    for (; i0 + 64 <= d; i0 += 64) {
        __m512 a[4][4];
        for (int g = 0; g < G; g++)
            for (int t = 0; t < 4; t++) a[g][t] = _mm512_setzero_ps();
        for (int64_t j = 0; j < len; j++) {
            const int64_t at = j * d + i0;
            if (pf) {
                _mm_prefetch((const char *)values + at * (bf ? 2 : 4) + PF_AHEAD, _MM_HINT_T0);
                if (!bf) _mm_prefetch((const char *)values + at * 4 + PF_AHEAD + 128, _MM_HINT_T0);
            }
            const __m512 v0 = load16(values, at, bf), v1 = load16(values, at + 16, bf);
            const __m512 v2 = load16(values, at + 32, bf), v3 = load16(values, at + 48, bf);
            for (int g = 0; g < G; g++) {
                const __m512 pj = _mm512_set1_ps(p[g * ps + j]);
                a[g][0] = _mm512_fmadd_ps(pj, v0, a[g][0]);
                a[g][1] = _mm512_fmadd_ps(pj, v1, a[g][1]);
                a[g][2] = _mm512_fmadd_ps(pj, v2, a[g][2]);
                a[g][3] = _mm512_fmadd_ps(pj, v3, a[g][3]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int t = 0; t < 4; t++)
                _mm512_storeu_ps(o + g * os + i0 + 16 * t,
                                 _mm512_mul_ps(a[g][t], _mm512_set1_ps(inv[g])));
    }
    for (; i0 < d; i0 += 16) {
        __m512 a[4];
        for (int g = 0; g < G; g++) a[g] = _mm512_setzero_ps();
        for (int64_t j = 0; j < len; j++) {
            const __m512 v0 = load16(values, j * d + i0, bf);
            for (int g = 0; g < G; g++)
                a[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * ps + j]), v0, a[g]);
        }
        for (int g = 0; g < G; g++)
            _mm512_storeu_ps(o + g * os + i0, _mm512_mul_ps(a[g], _mm512_set1_ps(inv[g])));
    }
}

static void weigh_values_heads(int G, const float *p, int64_t ps, const void *values, int bf,
                               int64_t len, int d, const float *inv, float *o, int64_t os,
                               int pf) {
    for (int g = 0; g < G; g += 4, pf = 0) {
        const float *pg = p + g * ps;
        float *og = o + g * os;
        switch (G - g < 4 ? G - g : 4) {
        case 1: weigh_n(1, pg, ps, values, bf, len, d, inv + g, og, os, pf); break;
        case 2: weigh_n(2, pg, ps, values, bf, len, d, inv + g, og, os, pf); break;
        case 3: weigh_n(3, pg, ps, values, bf, len, d, inv + g, og, os, pf); break;
        default: weigh_n(4, pg, ps, values, bf, len, d, inv + g, og, os, pf); break;
        }
    }
}

/* the largest of s[0..n) (scores: never NaN), 16 at a time */
static inline float max_of(const float *s, int64_t n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
    float top = _mm512_reduce_max_ps(m);
    for (; j < n; j++) top = s[j] > top ? s[j] : top;
    return top;
}
#else
static void scores_of(const float *q, const void *keys, int bf, int64_t len, int d,
                      float scale, float *s, float *pad, int pf) {
    (void)pf;
    const size_t esize = bf ? 2 : 4;
    for (int64_t j = 0; j < len; j++) { /* pad: one widened key at a time */
        widen_row((const char *)keys + (size_t)(j * d) * esize, bf, d, pad);
        s[j] = dot(q, pad, d) * scale;
    }
}

static void weigh_values(const float *p, const void *values, int bf, int64_t len, int d,
                         float inv, float *o) {
    const size_t esize = bf ? 2 : 4;
    float v[d];
    for (int i = 0; i < d; i++) o[i] = 0.0f;
    for (int64_t j = 0; j < len; j++) {
        widen_row((const char *)values + (size_t)(j * d) * esize, bf, d, v);
        for (int i = 0; i < d; i++) o[i] = fmaf(p[j], v[i], o[i]);
    }
    for (int i = 0; i < d; i++) o[i] *= inv;
}
static void weigh_values_heads(int G, const float *p, int64_t ps, const void *values, int bf,
                               int64_t len, int d, const float *inv, float *o, int64_t os,
                               int pf) {
    (void)pf;
    for (int g = 0; g < G; g++) weigh_values(p + g * ps, values, bf, len, d, inv[g], o + g * os);
}

static inline float max_of(const float *s, int64_t n) {
    float top = -INFINITY;
    for (int64_t j = 0; j < n; j++) top = s[j] > top ? s[j] : top;
    return top;
}
#endif

/* Keys per chunk. A row attends to its keys in chunks at fixed positions (0..KC-1, KC..),
 * each chunk's softmax taken alone and the chunks merged in order afterwards (the
 * flash-decoding split), so the arithmetic of a row depends on its length only. Why
 * chunks: a verify block's rows and a KV head's query heads all read the same keys; an
 * item of work is one (sequence, KV head, chunk), whose rows and heads take its keys one
 * after another while they sit in L2, so a long cache streams from memory once a forward
 * instead of once a row and head; and a single long sequence still splits over the cores. */
#define KC 128

/* One row's softmax over one chunk of n keys, for G query heads of one KV head (queries
 * q + g * d). With ``whole`` the chunk is the row's only one and head g's output, at
 * out + g * os, is the attention itself (weights over their sum); otherwise it is the
 * unnormalised sum of weights times values, and m[g * ms], l[g * ms] the chunk's max score
 * and weight sum, for merge_chunks. s: G * KC scores. The two paths above compute the
 * same bits. */
static void attend_chunk(int G, const float *q, float *out, int64_t os, const void *keys,
                         const void *values, int bf, int64_t n, int d, float scale, int whole,
                         float *m, float *l, int64_t ms, float *s, float *pad, int pf) {
    float inv[G];
    for (int g = 0; g < G; g++) {
        float *sg = s + g * KC;
        scores_of(q + g * d, keys, bf, n, d, scale, sg, pad, pf && g == 0);
        const float top = max_of(sg, n);
        for (int64_t j = 0; j < n; j++) sg[j] = exp_neg(sg[j] - top);
        const float sum = lane_sum(sg, (int)n);
        inv[g] = whole ? 1.0f / sum : 1.0f; /* times 1: exact */
        if (!whole) {
            m[g * ms] = top;
            l[g * ms] = sum;
        }
    }
    weigh_values_heads(G, s, KC, values, bf, n, d, inv, out, os, pf);
}

/* A row's nch chunk results (o: nch x d, m, l) merged in chunk order into out */
static void merge_chunks(const float *o, const float *m, const float *l, int64_t nch, int d,
                         float *out) {
    float top = -INFINITY, sum = 0.0f;
    for (int64_t c = 0; c < nch; c++) top = m[c] > top ? m[c] : top;
    for (int i = 0; i < d; i++) out[i] = 0.0f;
    for (int64_t c = 0; c < nch; c++) {
        const float w = exp_neg(m[c] - top);
        sum = fmaf(l[c], w, sum);
        for (int i = 0; i < d; i++) out[i] = fmaf(o[c * d + i], w, out[i]);
    }
    const float inv = 1.0f / sum;
    for (int i = 0; i < d; i++) out[i] *= inv;
}

static inline int64_t chunks_of(int64_t len) { return (len + KC - 1) / KC; }

/* q [T, heads * d] (row stride q_stride), k/v new rows [T, kv_heads * d] (strides
 * k_stride / v_stride), out [T, heads * d] contiguous. Per sequence s: its cache base
 * (layer 0, K, head 0) base[s], capacity cap[s], first position start[s], new rows
 * nnew[s] beginning at row row0[s]; kv_bf16: the cache holds bf16. Returns 0, -1 when
 * d is not a multiple of LANES, -2 when out of memory. */
int ls_attend(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
              const float *v, int64_t v_stride, float *out, int64_t nseq, const int64_t *base,
              const int64_t *cap, const int64_t *start, const int64_t *nnew, const int64_t *row0,
              int64_t layer, int heads, int kv_heads, int d, float scale, int kv_bf16) {
    if (d % LANES) return -1;
    const int group = heads / kv_heads, bf = kv_bf16 != 0;
    const size_t esize = bf ? 2 : 4;
    /* store the new rows (every sequence, before any attends); element offsets below */
    for (int64_t s = 0; s < nseq; s++) {
        const int64_t kc = layer * 2 * kv_heads * cap[s] * d, vc = kc + kv_heads * cap[s] * d;
        char *cache = (char *)(intptr_t)base[s];
        for (int64_t i = 0; i < nnew[s]; i++)
            for (int h = 0; h < kv_heads; h++) {
                const int64_t at = ((int64_t)h * cap[s] + start[s] + i) * d;
                const float *kr = k + (row0[s] + i) * k_stride + (int64_t)h * d;
                const float *vr = v + (row0[s] + i) * v_stride + (int64_t)h * d;
                if (!bf) {
                    memcpy(cache + (kc + at) * 4, kr, d * sizeof(float));
                    memcpy(cache + (vc + at) * 4, vr, d * sizeof(float));
                    continue;
                }
                uint16_t *kb = (uint16_t *)(cache + (kc + at) * 2);
                uint16_t *vb = (uint16_t *)(cache + (vc + at) * 2);
                for (int j = 0; j < d; j++) {
                    kb[j] = to_bf16(kr[j]);
                    vb[j] = to_bf16(vr[j]);
                }
            }
    }
    /* items: (sequence, KV head, chunk), numbered sequence by sequence (first[s]); the
     * chunk results of rows with more than one chunk go to part (rows' slots from slot[s]) */
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(2 * nseq + 2));
    if (first == NULL) return -2;
    int64_t *slot = first + nseq + 1, rows = 0, merged = 0, work = 0;
    first[0] = slot[0] = 0;
    for (int64_t s = 0; s < nseq; s++) {
        const int64_t nch = chunks_of(start[s] + nnew[s]);
        first[s + 1] = first[s] + kv_heads * nch;
        slot[s + 1] = slot[s] + (nch > 1 ? nnew[s] * heads * nch : 0);
        rows += nnew[s];
        merged += nch > 1 ? nnew[s] : 0;
        work += nnew[s] * (start[s] + nnew[s]);
    }
    float *part = NULL;
    if (slot[nseq] > 0 && (part = malloc(sizeof(float) * (size_t)(slot[nseq] * (d + 2)))) == NULL) {
        free(first);
        return -2;
    }
    float *part_m = part ? part + slot[nseq] * d : NULL, *part_l = part_m ? part_m + slot[nseq] : NULL;
    /* few items (a decode step at low load, short caches) go one per query head as well,
     * so both cores share the step; the order of operations per row and head is the same */
    const int split = first[nseq] < 4 * omp_get_max_threads() ? group : 1;
    const int64_t items = first[nseq] * split;
#pragma omp parallel if (items > 8 || work * heads > 1024)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * KC + 16 * d));
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t unit = it / split;
            int64_t s = 0;
            while (unit >= first[s + 1]) s++;
            const int64_t nch = chunks_of(start[s] + nnew[s]);
            const int h = (int)((unit - first[s]) / nch);
            const int64_t c = (unit - first[s]) % nch;
            const int64_t kc = layer * 2 * kv_heads * cap[s] * d + (int64_t)h * cap[s] * d;
            const char *cache = (const char *)(intptr_t)base[s];
            const void *keys = cache + (kc + c * KC * d) * esize;
            const void *values = cache + (kc + (int64_t)kv_heads * cap[s] * d + c * KC * d) * esize;
            const int g0 = split > 1 ? (int)(it % split) : 0, G = split > 1 ? 1 : group;
            const int64_t hq = (int64_t)h * group + g0;
            int pf = 1; /* the first row streams the chunk from memory: it prefetches ahead */
            for (int64_t r = 0; r < nnew[s]; r++) {
                const int64_t len = start[s] + r + 1, n = len - c * KC < KC ? len - c * KC : KC;
                if (n <= 0) continue; /* this chunk is past the row's keys */
                const int64_t row = row0[s] + r, at = slot[s] + (r * heads + hq) * nch + c;
                const float *qr = q + row * q_stride + hq * d;
                if (chunks_of(len) == 1)
                    attend_chunk(G, qr, out + (row * heads + hq) * d, d, keys, values, bf, n, d,
                                 scale, 1, NULL, NULL, 0, scores, scores + G * KC, pf);
                else
                    attend_chunk(G, qr, part + at * d, nch * d, keys, values, bf, n, d, scale, 0,
                                 part_m + at, part_l + at, nch, scores, scores + G * KC, pf);
                pf = 0; /* the chunk is in cache for the rows after the first */
            }
        }
        /* rows over more than one chunk: merge their chunks, in order */
#pragma omp for schedule(static)
        for (int64_t it = 0; it < (merged ? rows * heads : 0); it++) {
            int64_t r = it / heads, s = 0;
            const int64_t hq = it % heads;
            while (r >= nnew[s]) r -= nnew[s++]; /* r: the row within sequence s */
            const int64_t nch = chunks_of(start[s] + nnew[s]), len = start[s] + r + 1;
            const int64_t at = slot[s] + (r * heads + hq) * nch;
            if (chunks_of(len) > 1)
                merge_chunks(part + at * d, part_m + at, part_l + at, chunks_of(len), d,
                             out + (row0[s] + r) * (int64_t)heads * d + hq * d);
        }
        free(scores);
    }
    free(part);
    free(first);
    return 0;
}

/* The drafter's attention (drafter_actor/network.py, DrafterLayer): every row of a
 * sequence's block attends, without a causal mask, to three key sets at once under one
 * softmax:
 *
 *   its context rows   (window ring, boundary, carry: keys K_c, values V_c, a row mask)
 *   the block's rows   (keys K_b, values V_b: all present)
 *   the summary slots  (keys G, the layer's learned queries, shared; values M; a slot is
 *                       empty where its lambda is -inf)
 *
 * so a layer is one call instead of ~25 torch ops, and each sequence's buffers are read
 * where they live (by address) instead of being stacked into a batch tensor every round.
 *
 * q [n, S, heads, d] (post-RoPE) and out [n, S, heads, d] contiguous; kb, vb [n, kv_heads,
 * S, d] contiguous; ctx_mask [n, C] (bytes, 0 = absent); g [heads, R, d]. Per sequence i:
 * ctx_k[i], ctx_v[i] the addresses of its context buffers [layers, kv_heads, C, d], sum_m[i]
 * of its summary values [layers, heads, R, d] and sum_lam[i] of its lambdas [layers, heads,
 * R], all fp32; layer picks the slice. Query head hq reads KV head hq / (heads / kv_heads).
 * Scores are dot * scale. Absent rows weigh exactly 0 (their values must be finite).
 * Returns 0, or -1 when d is not a multiple of LANES. */
int ls_draft_attend(const float *q, const float *kb, const float *vb, const int64_t *ctx_k,
                    const int64_t *ctx_v, const uint8_t *ctx_mask, const float *g,
                    const int64_t *sum_m, const int64_t *sum_lam, float *out, int64_t n,
                    int64_t layer, int S, int heads, int kv_heads, int C, int R, int d,
                    float scale) {
    if (d % LANES) return -1;
    const int group = heads / kv_heads;
    const int64_t len = (int64_t)C + S + R, items = n * heads;
#pragma omp parallel if (items > 8)
    {
        float *s = malloc(sizeof(float) * (size_t)(len + 16 * d + d));
        float *pad = s + len, *part = pad + 16 * d;
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            const int64_t i = it / heads;
            const int hq = (int)(it % heads), j = hq / group;
            const float *kc = (const float *)(intptr_t)ctx_k[i] + ((layer * kv_heads + j) * C) * d;
            const float *vc = (const float *)(intptr_t)ctx_v[i] + ((layer * kv_heads + j) * C) * d;
            const float *kbl = kb + ((i * kv_heads + j) * S) * d;
            const float *vbl = vb + ((i * kv_heads + j) * S) * d;
            const float *ks = g + (int64_t)hq * R * d;
            const float *vs = (const float *)(intptr_t)sum_m[i] + ((layer * heads + hq) * R) * d;
            const float *lam = (const float *)(intptr_t)sum_lam[i] + (layer * heads + hq) * R;
            const uint8_t *keep = ctx_mask + i * C;
            for (int r = 0; r < S; r++) {
                const float *qr = q + ((i * S + r) * heads + hq) * d;
                float *o = out + ((i * S + r) * heads + hq) * d;
                scores_of(qr, kc, 0, C, d, scale, s, pad, 0);
                scores_of(qr, kbl, 0, S, d, scale, s + C, pad, 0);
                scores_of(qr, ks, 0, R, d, scale, s + C + S, pad, 0);
                for (int c = 0; c < C; c++)
                    if (!keep[c]) s[c] = -INFINITY;
                for (int t = 0; t < R; t++)
                    if (lam[t] == -INFINITY) s[C + S + t] = -INFINITY;
                float m = -INFINITY;
                for (int64_t t = 0; t < len; t++) m = s[t] > m ? s[t] : m;
                for (int64_t t = 0; t < len; t++) s[t] = s[t] == -INFINITY ? 0.0f : exp_neg(s[t] - m);
                const float inv = 1.0f / lane_sum(s, (int)len);
                weigh_values(s, vc, 0, C, d, inv, o);
                weigh_values(s + C, vbl, 0, S, d, inv, part);
                for (int t = 0; t < d; t++) o[t] += part[t];
                weigh_values(s + C + S, vs, 0, R, d, inv, part);
                for (int t = 0; t < d; t++) o[t] += part[t];
            }
        }
        free(s);
    }
    return 0;
}
