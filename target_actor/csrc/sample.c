/* The sampler's draw: one token from each row of unnormalised weights, by an exponential
 * race on the row's support with counter-based uniforms.
 *
 * Token i wins when w_i / E_i is largest, E_i ~ Exp(1) independent per token: it wins with
 * probability w_i / sum(w), the distribution itself (the race torch.multinomial runs).
 * E_i = -log(U_i), U_i from a hash of (the row's key, i): a token's uniform depends on the
 * key and its id only. The caller draws one key per row from the sequence's generator, so
 * a seeded sequence's stream advances by one draw per token whatever its batch or its
 * weights, and a token's chance is decided by its own weight alone: the same tokens alone
 * and in any batch. Only the support (w_i > 0) takes a uniform and a log, where
 * torch.multinomial draws an exponential for every token of the vocabulary.
 */
#include <stdlib.h>

#include "common.h"

/* SplitMix64's finaliser: a bijection of 64-bit words that mixes every input bit */
static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* w [n, V], keys [n] -> out [n]: each row's winner, or -1 where a row has no positive
 * weight */
void ls_race(const float *w, int64_t n, int64_t V, const uint64_t *keys, int64_t *out) {
    for (int64_t r = 0; r < n; r++) {
        const float *row = w + r * V;
        const uint64_t base = mix64(keys[r]);
        int64_t best = -1;
        double best_score = 0.0;
        for (int64_t i = 0; i < V; i++) {
            if (!(row[i] > 0.0f)) continue;
            /* U in (0, 1), never 0 or 1: the top 53 bits, centred */
            const uint64_t h = mix64(base + 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1));
            const double u = ((double)(h >> 11) + 0.5) * 0x1.0p-53;
            const double score = (double)row[i] / -log(u);
            if (best < 0 || score > best_score) {
                best = i;
                best_score = score;
            }
        }
        out[r] = best;
    }
}

/* softmax of each row of x [n, V] into out, each row alone in a fixed order (the max, the
 * exps, their sum in LANES partial sums, the division): the same bits in any batch.
 * -inf entries get 0; a row of -inf only gets NaN, as torch.softmax gives. */
void ls_softmax(const float *x, int64_t n, int64_t V, float *out) {
#pragma omp parallel for schedule(static) if (n > 1)
    for (int64_t r = 0; r < n; r++) {
        const float *row = x + r * V;
        float *o = out + r * V;
        float lane_max[LANES];
        for (int l = 0; l < LANES; l++) lane_max[l] = -INFINITY;
        int64_t i = 0;
        for (; i + LANES <= V; i += LANES)
            for (int l = 0; l < LANES; l++)
                lane_max[l] = row[i + l] > lane_max[l] ? row[i + l] : lane_max[l];
        for (; i < V; i++) {
            float *m = &lane_max[i % LANES];
            *m = row[i] > *m ? row[i] : *m;
        }
        float mx = -INFINITY;
        for (int l = 0; l < LANES; l++) mx = lane_max[l] > mx ? lane_max[l] : mx;
        for (i = 0; i < V; i++) {
            const float e = exp_neg(row[i] - mx);
            o[i] = row[i] == -INFINITY ? 0.0f : e;
        }
        float acc[LANES] = {0};
        for (i = 0; i + LANES <= V; i += LANES)
            for (int l = 0; l < LANES; l++) acc[l] += o[i + l];
        for (; i < V; i++) acc[i % LANES] += o[i];
        const float inv = 1.0f / fold(acc);
        for (int64_t j = 0; j < V; j++) o[j] *= inv;
    }
}

typedef struct {
    float p;
    int64_t i;
} Cand;

/* descending p, then ascending id: one order for ties, whatever the input order */
static int by_p_desc(const void *a, const void *b) {
    const Cand *x = a, *y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return x->i < y->i ? -1 : (x->i > y->i);
}

/* top-p of each row of probabilities p [n, V] (rows summing to 1) into out: the smallest
 * set of most likely tokens whose mass reaches top_p (the most likely token always),
 * renormalised; zero elsewhere. Only tokens within 2^-24 of the row's largest are sorted,
 * at most ``cap`` of them (``scratch`` holds cap entries of 16 bytes): when those do not
 * hold top_p of the mass, done[r] = 0 and the row is left to the caller. */
void ls_top_p(const float *p, int64_t n, int64_t V, float top_p, int64_t cap, void *scratch,
              float *out, uint8_t *done) {
    Cand *c = scratch;
    for (int64_t r = 0; r < n; r++) {
        const float *row = p + r * V;
        float *o = out + r * V;
        float mx = 0.0f;
        for (int64_t i = 0; i < V; i++) mx = row[i] > mx ? row[i] : mx;
        const float floor = mx * 0x1.0p-24f;
        int64_t m = 0;
        double mass = 0.0;
        for (int64_t i = 0; i < V && m <= cap; i++)
            if (row[i] >= floor && row[i] > 0.0f) {
                if (m < cap) c[m] = (Cand){row[i], i};
                m++;
                mass += row[i];
            }
        done[r] = m <= cap && mass >= (double)top_p;
        if (!done[r]) continue;
        qsort(c, (size_t)m, sizeof *c, by_p_desc);
        double before = 0.0, kept = 0.0;
        int64_t keep = 0;
        while (keep < m && (keep == 0 || before < (double)top_p)) {
            before += c[keep].p;
            kept += c[keep].p;
            keep++;
        }
        memset(o, 0, (size_t)V * sizeof *o);
        for (int64_t j = 0; j < keep; j++) o[c[j].i] = (float)(c[j].p / kept); /* 1 alone */
    }
}
