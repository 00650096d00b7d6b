/* GEMMs for the few rows of a decode step, a verify block or a draft block:
 * y[M, N] = x[M, K] @ W[N, K]^T, x bf16, y fp32, W int8 (one scale per output channel)
 * or dense bf16.
 *
 * Why: for a handful of rows torch's int8 kernel and its bf16 matmul cost far more than
 * streaming their weights (the int8 LM head: 2.1 ms a 1-row step for 28 MB, and about
 * 0.7 ms more per extra row; a drafter's bf16 linears pay ~40 us a call whatever their
 * size). Here each channel's weights are widened once per pass into an L1 buffer of NB
 * channels and then used by every row, so an extra row costs only its dot products.
 *
 * Exactness: every output y[m, n] is one dot product over k in a fixed order (two
 * accumulators, even and odd steps of 32, then a fixed fold), whatever M, the row's place
 * in the batch or the thread that runs it: a row's result never depends on its batch.
 *
 * Paths, chosen at build time for the CPU (-march=native):
 * - AVX512-BF16: bf16 products with fp32 sums (vdpbf16ps). int8 is exact in bf16; the
 *   channel's scale multiplies the sum.
 * - elsewhere: fp32 widening and fp32 multiply-adds, vectorised by the compiler.
 */
#include <stdlib.h>

#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define LS_BF16_DOT 1
typedef uint16_t wtype; /* a widened weight: bf16 bits */
#else
#define LS_BF16_DOT 0
typedef float wtype;
#endif

#define NB 4      /* output channels widened and dotted together */
#define STEP 32   /* inputs per dot step; K must be a multiple */
#define MCHUNK 64 /* rows per pass over the weights (that chunk of x stays in L2) */

enum { INT8 = 0, BF16 = 1 };

static inline float bf16_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* channel n's weights -> buf [K] as the dot takes them (bf16 or fp32). Returns buf, or
 * the weights themselves when they already are in that form (dense bf16 on BF16). */
static const wtype *widen(int kind, const void *w, int64_t n, int64_t K, wtype *buf) {
    if (kind == BF16) {
        const uint16_t *row = (const uint16_t *)w + n * K;
#if LS_BF16_DOT
        (void)buf;
        return row;
#else
        for (int64_t j = 0; j < K; j++) buf[j] = bf16_f32(row[j]);
        return buf;
#endif
    }
    const int8_t *q = (const int8_t *)w + n * K;
#if LS_BF16_DOT
    for (int64_t j = 0; j < K; j += STEP) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(q + j));
        const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
        const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
        _mm512_storeu_si512((void *)(buf + j), (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
    }
#else
    for (int64_t j = 0; j < K; j++) buf[j] = (float)q[j];
#endif
    return buf;
}

/* y[c] = dot(x, w[c]) for the NB channels w[0..NB) */
#if LS_BF16_DOT
static inline void dot_channels(const uint16_t *x, const wtype *const *w, int64_t K, float *y) {
    __m512 acc[NB][2];
    for (int c = 0; c < NB; c++) acc[c][0] = acc[c][1] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 2 * STEP <= K; j += 2 * STEP) {
        const __m512bh x0 = (__m512bh)_mm512_loadu_si512((const void *)(x + j));
        const __m512bh x1 = (__m512bh)_mm512_loadu_si512((const void *)(x + j + STEP));
        for (int c = 0; c < NB; c++) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(w[c] + j));
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(w[c] + j + STEP));
            acc[c][0] = _mm512_dpbf16_ps(acc[c][0], w0, x0);
            acc[c][1] = _mm512_dpbf16_ps(acc[c][1], w1, x1);
        }
    }
    if (j < K) {
        const __m512bh x0 = (__m512bh)_mm512_loadu_si512((const void *)(x + j));
        for (int c = 0; c < NB; c++)
            acc[c][0] = _mm512_dpbf16_ps(
                acc[c][0], (__m512bh)_mm512_loadu_si512((const void *)(w[c] + j)), x0);
    }
    for (int c = 0; c < NB; c++) y[c] = _mm512_reduce_add_ps(_mm512_add_ps(acc[c][0], acc[c][1]));
}
#else
static inline void dot_channels(const float *x, const wtype *const *w, int64_t K, float *y) {
    for (int c = 0; c < NB; c++) {
        float acc[LANES] = {0};
        for (int64_t j = 0; j < K; j += LANES)
            for (int l = 0; l < LANES; l++) acc[l] += w[c][j + l] * x[j + l];
        y[c] = fold(acc);
    }
}
#endif

/* kind INT8: w int8 [N][K], scale [N] fp32; kind BF16: w bf16 [N][K], scale NULL.
 * Needs K % 32 == 0 and N % NB == 0 (the caller checks). Returns 0, or -1 when out of
 * memory. */
int ls_gemm(int kind, const uint16_t *x, int64_t M, int64_t K, const void *w, const float *scale,
            int64_t N, float *y) {
    int failed = 0;
#if !LS_BF16_DOT
    float *xf = malloc(sizeof(float) * (size_t)(MCHUNK * K));
    if (xf == NULL) return -1;
#endif
#pragma omp parallel
    {
        wtype *buf = aligned_alloc(64, ((sizeof(wtype) * (size_t)(NB * K) + 63) / 64) * 64);
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t m0 = 0; m0 < M; m0 += MCHUNK) {
            const int64_t rows = M - m0 < MCHUNK ? M - m0 : MCHUNK;
#if !LS_BF16_DOT
#pragma omp for schedule(static)
            for (int64_t i = 0; i < rows * K; i++) xf[i] = bf16_f32(x[m0 * K + i]);
#endif
#pragma omp for schedule(static)
            for (int64_t n0 = 0; n0 < N; n0 += NB) {
                if (buf == NULL) continue;
                const wtype *wc[NB];
                for (int c = 0; c < NB; c++) wc[c] = widen(kind, w, n0 + c, K, buf + c * K);
                for (int64_t r = 0; r < rows; r++) {
                    float out[NB];
#if LS_BF16_DOT
                    dot_channels(x + (m0 + r) * K, wc, K, out);
#else
                    dot_channels(xf + r * K, wc, K, out);
#endif
                    float *yr = y + (m0 + r) * N + n0;
                    for (int c = 0; c < NB; c++) yr[c] = scale ? out[c] * scale[n0 + c] : out[c];
                }
            }
        }
        free(buf);
    }
#if !LS_BF16_DOT
    free(xf);
#endif
    return failed ? -1 : 0;
}

/* 1 when this build multiplies by bf16 dot products, 0 when in fp32 */
int ls_gemm_bf16_dot(void) { return LS_BF16_DOT; }
