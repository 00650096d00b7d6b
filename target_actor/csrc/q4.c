/* The integer GEMMs: y[M, N] = x[M, K] @ W[N, K]^T, x fp32 quantised to int8 per block of
 * 32 inputs, W int4 (GGUF Q4_1 blocks: the int4 form's layers) or int8 (one scale per
 * channel: its LM head).
 *
 * Q4 W: blocks of 32 inputs, w = d * q + m with q in 0..15 and d, m fp16 per (channel, block),
 * as a GGUF file stores them (so a Q4_1 file's weights are multiplied exactly).
 * x: each row quantised per block of 32 (as llama.cpp's Q8 does): x ~= dx * qx with qx
 * int8 and dx = max|x| / 127, and sx = dx * sum(qx) (llama.cpp's Q8_1). Then
 *
 *     y[r, n] = sum over blocks b of  d[n, b] * dx[r, b] * I[r, n, b]  +  m[n, b] * sx[r, b]
 *
 * where I = sum of q * qx over the block is an exact int32: the product of the Q4_1
 * weights and the quantised x. (An exact sx would weigh x's rounding by d * q alone, which
 * is all of one sign, instead of by w: three times the error.)
 *
 * Why: a verify block (k + 1 rows) and a batch of decode rows multiply by the same weights.
 * With fp32 multiply-adds after widening (torch's int4 kernel) each extra row costs as much
 * arithmetic as the first costs streaming, so 8 rows cost ~2.5x one row. Integer dot products
 * (AVX512-VNNI vpdpbusd: 64 multiply-adds an instruction, 4x an fp32 FMA) over weights
 * widened once per block and shared by up to 8 rows in registers bring an extra row close
 * to free at few rows, and cut prefill's arithmetic by ~4x.
 *
 * Exactness: I is exact; the float steps per (row, channel, block) are fixed (convert,
 * d * dx, fma, fma) and blocks are summed in order, so y[r, n] depends on row r's inputs only:
 * never on M, the row's place in the batch, the thread, or the code path (the portable path
 * below does the same integer sums and the same float steps, bit for bit).
 *
 * Packed weights (``pack`` in linear.py): for each 16 channels n0.. and each 8 inputs
 * k0..k0+7, 64 bytes; byte 4c + t holds q[n0 + c, k0 + t] in its low nibble and
 * q[n0 + c, k0 + 4 + t] in its high one. d and m: fp16 bits, [N/16][K/32][16].
 */
#include <stdlib.h>

#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define LS_Q4_VNNI 1
#else
#define LS_Q4_VNNI 0
#endif

#define QB 32      /* inputs per quantisation block */
#define CH 16      /* channels per packed tile */
#define RB 8       /* rows sharing one pass over a tile's weights */
#define MCHUNK 128 /* rows per sweep over all tiles (their int8 inputs stay in L2) */

/* row r of x [K] -> qx [K] int8, dx [K/QB], sx [K/QB], and qsum [K/QB] = sum(qx) */
static void quantize_row(const float *x, int64_t K, int8_t *qx, float *dx, float *sx,
                         int32_t *qsum) {
    for (int64_t b = 0; b < K / QB; b++) {
        const float *xb = x + b * QB;
        float amax = 0.0f;
        for (int j = 0; j < QB; j++) {
            const float a = fabsf(xb[j]);
            amax = a > amax ? a : amax;
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int j = 0; j < QB; j++) {
            qx[b * QB + j] = (int8_t)lrintf(xb[j] * inv);
            sum += qx[b * QB + j];
        }
        dx[b] = amax / 127.0f;
        sx[b] = dx[b] * (float)sum;
        qsum[b] = sum;
    }
}

/* Row inputs of one sweep, quantised: qx [rows][K], and per (row, block) dx, sx, qsum */
typedef struct {
    const int8_t *qx;
    const float *dx, *sx;
    const int32_t *qsum;
    int64_t K, nb;
} Rows;

/* One tile's weights: Q4 (nibbles, fp16 d and m per block) or W8 (int8 + 128, one fp32
 * scale per channel). */
enum { Q4 = 0, W8 = 1 };
typedef struct {
    int kind;
    const uint8_t *w;
    const uint16_t *d, *m; /* Q4 */
    const float *scale;    /* W8 */
} Tile;

#if LS_Q4_VNNI
static inline __m512 load_half(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* R rows (a compile-time constant once inlined) against one tile of 16 channels */
static inline __attribute__((always_inline)) void tile_rows(const int R, const int kind,
                                                            const Tile *t, const Rows *x, float *y,
                                                            int64_t ldy) {
    const int64_t nb = x->nb, K = x->K;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[RB];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i isum[RB];
        for (int r = 0; r < R; r++) isum[r] = _mm512_setzero_si512();
        /* 8 dot steps of 4 inputs for each of the 16 channels */
        for (int o = 0; o < QB / 8; o++) {
            __m512i w0, w1;
            if (kind == Q4) {
                const __m512i v = _mm512_loadu_si512((const void *)(t->w + (b * 4 + o) * 64));
                w0 = _mm512_and_si512(v, low);
                w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            } else {
                w0 = _mm512_loadu_si512((const void *)(t->w + (b * 8 + 2 * o) * 64));
                w1 = _mm512_loadu_si512((const void *)(t->w + (b * 8 + 2 * o + 1) * 64));
            }
            for (int r = 0; r < R; r++) {
                const int8_t *xr = x->qx + r * K + b * QB + o * 8;
                int32_t x0, x1;
                memcpy(&x0, xr, 4);
                memcpy(&x1, xr + 4, 4);
                isum[r] = _mm512_dpbusd_epi32(isum[r], w0, _mm512_set1_epi32(x0));
                isum[r] = _mm512_dpbusd_epi32(isum[r], w1, _mm512_set1_epi32(x1));
            }
        }
        if (kind == Q4) {
            const __m512 dv = load_half(t->d + b * CH), mv = load_half(t->m + b * CH);
            for (int r = 0; r < R; r++) {
                const __m512 s = _mm512_mul_ps(dv, _mm512_set1_ps(x->dx[r * nb + b]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), s, acc[r]);
                acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(x->sx[r * nb + b]), acc[r]);
            }
        } else {
            for (int r = 0; r < R; r++) {
                const __m512i bias = _mm512_set1_epi32(128 * x->qsum[r * nb + b]);
                const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(isum[r], bias));
                acc[r] = _mm512_fmadd_ps(dot, _mm512_set1_ps(x->dx[r * nb + b]), acc[r]);
            }
        }
    }
    if (kind == W8) {
        const __m512 sv = _mm512_loadu_ps(t->scale);
        for (int r = 0; r < R; r++) acc[r] = _mm512_mul_ps(acc[r], sv);
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

static void tile(int rows, const Tile *t, const Rows *x, float *y, int64_t ldy) {
#define ROWS(R, KIND) \
    case R: tile_rows(R, KIND, t, x, y, ldy); break;
    if (t->kind == Q4) {
        switch (rows) {
            ROWS(1, Q4) ROWS(2, Q4) ROWS(3, Q4) ROWS(4, Q4)
            ROWS(5, Q4) ROWS(6, Q4) ROWS(7, Q4) ROWS(8, Q4)
        }
    } else {
        switch (rows) {
            ROWS(1, W8) ROWS(2, W8) ROWS(3, W8) ROWS(4, W8)
            ROWS(5, W8) ROWS(6, W8) ROWS(7, W8) ROWS(8, W8)
        }
    }
#undef ROWS
}
#else
/* fp16 bits -> fp32, exactly */
static inline float half_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, f = h & 1023;
    float v;
    if (e == 0) {
        v = ldexpf((float)f, -24); /* subnormal (or zero) */
    } else if (e == 31) {
        v = f ? NAN : INFINITY;
    } else {
        const uint32_t u = ((e + 112) << 23) | (f << 13);
        memcpy(&v, &u, sizeof v);
    }
    return sign ? -v : v;
}

/* weight (channel c, input j of block b's step o: j < 4 the first half) as unsigned */
static inline int32_t weight_at(const Tile *t, int64_t b, int o, int c, int j) {
    if (t->kind == Q4) {
        const uint8_t v = t->w[(b * 4 + o) * 64 + 4 * c + (j & 3)];
        return j < 4 ? (v & 15) : (v >> 4);
    }
    return t->w[(b * 8 + 2 * o + (j >> 2)) * 64 + 4 * c + (j & 3)];
}

/* the same integer sums and float steps, one row at a time */
static void tile(int rows, const Tile *t, const Rows *x, float *y, int64_t ldy) {
    const int64_t nb = x->nb, K = x->K;
    for (int r = 0; r < rows; r++) {
        float acc[CH] = {0};
        for (int64_t b = 0; b < nb; b++) {
            int32_t isum[CH] = {0};
            for (int o = 0; o < QB / 8; o++) {
                const int8_t *xr = x->qx + r * K + b * QB + o * 8;
                for (int c = 0; c < CH; c++)
                    for (int j = 0; j < 8; j++) isum[c] += weight_at(t, b, o, c, j) * xr[j];
            }
            const float dxb = x->dx[r * nb + b], sxb = x->sx[r * nb + b];
            for (int c = 0; c < CH; c++) {
                if (t->kind == Q4) {
                    acc[c] = fmaf((float)isum[c], half_f32(t->d[b * CH + c]) * dxb, acc[c]);
                    acc[c] = fmaf(half_f32(t->m[b * CH + c]), sxb, acc[c]);
                } else {
                    const float dot = (float)(isum[c] - 128 * x->qsum[r * nb + b]);
                    acc[c] = fmaf(dot, dxb, acc[c]);
                }
            }
        }
        for (int c = 0; c < CH; c++) y[r * ldy + c] = t->kind == W8 ? acc[c] * t->scale[c] : acc[c];
    }
}
#endif

/* The driver of both kinds: x [M, K] fp32 -> y [M, N] fp32. */
static int gemm(int kind, const float *x, int64_t M, int64_t K, const uint8_t *w,
                const uint16_t *d, const uint16_t *m, const float *scale, int64_t N, float *y) {
    const int64_t nb = K / QB, rows_max = M < MCHUNK ? M : MCHUNK;
    int8_t *qx = malloc((size_t)(rows_max * K));
    float *dsx = malloc(sizeof(float) * (size_t)(2 * rows_max * nb));
    int32_t *qsum = malloc(sizeof(int32_t) * (size_t)(rows_max * nb));
    if (qx == NULL || dsx == NULL || qsum == NULL) {
        free(qx);
        free(dsx);
        free(qsum);
        return -1;
    }
    float *dx = dsx, *sx = dsx + rows_max * nb;
    const int64_t tile_bytes = kind == Q4 ? K / 2 * CH : K * CH;
    for (int64_t m0 = 0; m0 < M; m0 += MCHUNK) {
        const int64_t rows = M - m0 < MCHUNK ? M - m0 : MCHUNK;
#pragma omp parallel
        {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++)
                quantize_row(x + (m0 + r) * K, K, qx + r * K, dx + r * nb, sx + r * nb,
                             qsum + r * nb);
#pragma omp for schedule(static)
            for (int64_t n = 0; n < N / CH; n++) {
                const Tile t = {kind, w + n * tile_bytes, d ? d + n * nb * CH : NULL,
                                m ? m + n * nb * CH : NULL, scale ? scale + n * CH : NULL};
                for (int64_t r0 = 0; r0 < rows; r0 += RB) {
                    const Rows xs = {qx + r0 * K, dx + r0 * nb, sx + r0 * nb, qsum + r0 * nb, K, nb};
                    const int count = rows - r0 < RB ? (int)(rows - r0) : RB;
                    tile(count, &t, &xs, y + (m0 + r0) * N + n * CH, N);
                }
            }
        }
    }
    free(qx);
    free(dsx);
    free(qsum);
    return 0;
}

/* Q4_1 weights (tiles above), d and m fp16 [N/16][K/32][16]. Needs K % 32 == 0 and
 * N % 16 == 0 (the caller checks). Returns 0, or -1 when out of memory. */
int ls_gemm_q4(const float *x, int64_t M, int64_t K, const uint8_t *wq, const uint16_t *d,
               const uint16_t *m, int64_t N, float *y) {
    return gemm(Q4, x, M, K, wq, d, m, NULL, N, y);
}

/* int8 weights with one scale per channel (w = scale * q), as tiles of 16 channels x 4
 * inputs: byte 4c + t of step j = q[n0 + c, 4j + t] + 128; scale fp32 [N]. */
int ls_gemm_w8(const float *x, int64_t M, int64_t K, const uint8_t *wq, const float *scale,
               int64_t N, float *y) {
    return gemm(W8, x, M, K, wq, NULL, NULL, scale, N, y);
}

/* 1 when this build multiplies by VNNI integer dot products, 0 on the portable path */
int ls_gemm_q4_vnni(void) { return LS_Q4_VNNI; }
