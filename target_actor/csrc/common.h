/* What the kernels share: the vector width of their fixed-order sums, an exp, RoPE. */
#ifndef LONGSPARK_COMMON_H
#define LONGSPARK_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* partial sums per reduction: element j always lands in lane j % LANES, and lanes fold
 * pairwise in a fixed order, so a sum's rounding depends on its inputs only */
#define LANES 16

/* exp(x) for x <= 0 (scores minus their max, -|g| in SiLU): Cody-Waite range
 * reduction and a degree-6 polynomial, ~1 ulp, branch-free so loops over it vectorise;
 * below -87 it returns ~1e-38 rather than 0. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

/* rotate-half RoPE of one head of d values: out[j] = x[j] cos[j] -+ x[j +- d/2] sin[j]
 * (out must not alias x) */
static inline void rope_into(const float *x, const float *cos, const float *sin, int d,
                             float *out) {
    const int half = d / 2;
    for (int j = 0; j < half; j++) out[j] = x[j] * cos[j] - x[j + half] * sin[j];
    for (int j = half; j < d; j++) out[j] = x[j] * cos[j] + x[j - half] * sin[j];
}

static inline float fold(float *acc) {
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

#endif
