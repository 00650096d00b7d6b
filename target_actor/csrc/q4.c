/* The integer GEMMs of the quantized forms: y[M, N] = x[M, K] @ W[N, K]^T, x fp32, y fp32,
 * W in GGUF blocks of 32 inputs, each with an fp16 scale d as the file stores it:
 *
 *   Q4 (Q4_1, the int4 form's layers):  w = d * q + m,  q in 0..15, m fp16 too
 *   W8 (Q8_0, its LM head / embedding): w = d * q,      q in -127..127
 *
 * so a GGUF's weights are multiplied exactly, not re-quantised.
 *
 * x: each row, per block of 32 inputs, as two int8 planes: x ~= dx * (q1 + q2 / 256) with
 * dx = max|x| / 127, q1 = round(x / dx) and q2 = round((x / dx - q1) * 256). The second
 * plane brings x's relative error from ~7e-3 (int8 alone, llama.cpp's Q8_1) to ~3e-5 of
 * the block's largest value, below bf16's 1.5e-3: what reaches the logits is the weights'.
 *
 * Per (row r, channel n, block b), with the exact int32 sums I1 = sum q * q1, I2 = sum q * q2:
 *
 *   Q4: y += (d * dx) * float(256 I1 + I2) / 256... as fma(float(256 I1 + I2), d * dx / 256)
 *       then y += m * sx,  sx = dx / 256 * (256 sum q1 + sum q2)   (|256 I1 + I2| < 2^24)
 *   W8: y += fma(float(I1), d * dx) then fma(float(I2), d * dx / 256)
 *
 * Why: a verify block (k + 1 rows) and a batch of decode rows multiply by the same weights.
 * torch's int4 kernel widens them to fp32 and spends an FMA per 16 multiply-adds; AVX512-VNNI
 * (vpdpbusd) does 64 byte products an instruction, on weights widened once per block and
 * shared by up to 8 rows held in registers: extra rows cost about half as much, and prefill
 * about a third.
 *
 * One plane (``planes`` = 1): x ~= dx * q1, llama.cpp's Q8 activations, at half the integer
 * work: the second plane is zero and its dot products are skipped, so one plane computes
 * what two planes would with q2 = 0, bit for bit. For the drafter (its numbers only shape
 * its proposals, which carry the distribution they were drawn from) and the target's
 * opt-in ``-q8`` forms (llama.cpp's arithmetic on the GGUF's blocks).
 *
 * Exactness: the integer sums are exact and the float steps per (row, channel, block) are
 * fixed and taken in block order, so y[r, n] depends on row r's inputs only: never on M, the
 * row's place in the batch, the thread, or the code path (the portable path below does the
 * same integer sums and float steps, bit for bit).
 *
 * Packed weights (pack_q4 / pack_w8 in linear.py), per tile of 16 channels:
 *   Q4: per 8 inputs k0.., 64 bytes; byte 4c + t = q[c, k0 + t] | q[c, k0 + 4 + t] << 4;
 *   W8: per 4 inputs k0.., 64 bytes; byte 4c + t = q[c, k0 + t] + 128 (unsigned);
 *   d (and m): fp16 bits, [N/16][K/32][16].
 */
#define _GNU_SOURCE /* syscall(): asking Linux for the AMX tile state */
#include <stdlib.h>

#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define LS_Q4_VNNI 1
#else
#define LS_Q4_VNNI 0
#endif

/* AMX (Intel since Sapphire Rapids): a tile instruction takes up to 16 rows of a block's
 * 32 int8 inputs against its 16 channels' weights at once. The integer sums are the same
 * exact ones VNNI takes, and the float steps after them are the same (see tile_amx), so
 * the path changes the speed, never a bit. Linux hands a process the tile state only on
 * request (ls_gemm_amx). */
#if LS_Q4_VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
#define LS_Q4_AMX 1
#else
#define LS_Q4_AMX 0
#endif
#define AMX_ROWS 16 /* rows of an A tile: a pass's rows times its planes */
#define AMX_MIN 8 /* fewer rows than this take the VNNI passes (faster there) */

static int amx_on = 0; /* the tiles were granted and not switched off (ls_gemm_amx) */

#define QB 32      /* inputs per block */
#define CH 16      /* channels per packed tile */
#define RB 8       /* rows sharing one pass over a tile's weights, at most */
#define RB2 6      /* ... with two planes (registers: 3 a row, where one plane takes 2) */
/* weight bytes prefetched ahead of the ones being read (about the next 16-channel tile):
 * a decode step streams every weight once, and the hardware prefetcher alone left the
 * 1-row GEMMs waiting on memory (5.3 -> 3.5 ms for SmolLM2's GEMMs on an Intel Xeon) */
#define PF_AHEAD 4096
#define MCHUNK 120 /* rows per sweep over all tiles (their int8 planes stay in L2) */

enum { Q4 = 0, W8 = 1 };

/* A sweep's rows, quantised: planes q1, q2; per (row, block) dx, sx and the plane sums
 * s1, s2. The planes are [rows][K] each, or for AMX (pass > 0) stacked a pass at a time:
 * a pass's ``pass`` rows of q1, then the same rows of q2, so one tile load takes both. */
typedef struct {
    int8_t *q1, *q2; /* row 0's planes */
    float *dx, *dx256, *sx; /* dx256 = dx / 256, exactly */
    int32_t *s1, *s2;
    int64_t K, nb, pass;
} Rows;

/* where row r's planes start, from q1 and q2 */
static inline int64_t row_at(const Rows *xs, int64_t r) {
    return xs->pass ? ((r / xs->pass) * 2 * xs->pass + r % xs->pass) * xs->K : r * xs->K;
}

/* One tile of 16 channels */
typedef struct {
    const uint8_t *w;
    const uint16_t *d, *m; /* m: Q4 only */
} Tile;

static void quantize_row(const float *x, const Rows *xs, int64_t r, int planes) {
    const int64_t K = xs->K, nb = xs->nb;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QB;
        int8_t *q1 = xs->q1 + row_at(xs, r) + b * QB, *q2 = xs->q2 + row_at(xs, r) + b * QB;
        float amax = 0.0f;
        for (int j = 0; j < QB; j++) {
            const float a = fabsf(xb[j]);
            amax = a > amax ? a : amax;
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t s1 = 0, s2 = 0;
        for (int j = 0; j < QB; j++) {
            const float u = xb[j] * inv, hi = rintf(u);
            float lo = rintf((u - hi) * 256.0f);
            lo = lo > 127.0f ? 127.0f : lo; /* (u - hi) is at most 1/2: 128 at worst */
            lo = planes == 2 ? lo : 0.0f;
            q1[j] = (int8_t)hi;
            q2[j] = (int8_t)lo;
            s1 += q1[j];
            s2 += q2[j];
        }
        const float dx = amax / 127.0f;
        xs->dx[r * nb + b] = dx;
        xs->dx256[r * nb + b] = dx * (1.0f / 256.0f);
        xs->sx[r * nb + b] = dx * (1.0f / 256.0f) * (float)(256 * s1 + s2);
        xs->s1[r * nb + b] = s1;
        xs->s2[r * nb + b] = s2;
    }
}

#if LS_Q4_VNNI
static inline __m512 load_half(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* One block's exact int32 sums i1 (and i2: plane 2) of one row, for 16 channels with
 * scales dv (and mins mv: Q4), into the row's accumulator: the float steps every integer
 * path takes, in this order, so each computes the same bits. at: the (row, block) index. */
static inline __attribute__((always_inline)) __m512 block_step(const int kind, const int P,
                                                               __m512i i1, __m512i i2, __m512 dv,
                                                               __m512 mv, const Rows *x,
                                                               int64_t at, __m512 acc) {
    if (kind == Q4) {
        /* (d dx / 256) float(256 I1 + I2); with one plane I2 = 0 and, the factors being
         * powers of two (|256 I1| < 2^24), (d dx) float(I1) is the same float */
        if (P == 2) {
            const __m512i whole = _mm512_add_epi32(_mm512_slli_epi32(i1, 8), i2);
            const __m512 s = _mm512_mul_ps(dv, _mm512_set1_ps(x->dx256[at]));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(whole), s, acc);
        } else {
            const __m512 s = _mm512_mul_ps(dv, _mm512_set1_ps(x->dx[at]));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), s, acc);
        }
        return _mm512_fmadd_ps(mv, _mm512_set1_ps(x->sx[at]), acc);
    }
    /* the weights came +128: take 128 * sum(plane) */
    const __m512i d1 = _mm512_sub_epi32(i1, _mm512_set1_epi32(128 * x->s1[at]));
    const __m512 s = _mm512_mul_ps(dv, _mm512_set1_ps(x->dx[at]));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), s, acc);
    if (P == 2) {
        const __m512i d2 = _mm512_sub_epi32(i2, _mm512_set1_epi32(128 * x->s2[at]));
        const __m512 s2 = _mm512_mul_ps(dv, _mm512_set1_ps(x->dx256[at]));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d2), s2, acc);
    }
    return acc;
}

/* R rows (a compile-time constant once inlined) against one tile of 16 channels */
static inline __attribute__((always_inline)) void tile_rows(const int R, const int kind,
                                                            const int P, const Tile *t,
                                                            const Rows *x,
                                                            int64_t r0, float *y, int64_t ldy) {
    const int64_t nb = x->nb, K = x->K;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[RB];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i i1[RB], i2[RB];
        for (int r = 0; r < R; r++) i1[r] = i2[r] = _mm512_setzero_si512();
        for (int o = 0; o < QB / 8; o++) { /* 8 inputs of each of the 16 channels */
            __m512i w0, w1;
            if (kind == Q4) {
                const __m512i v = _mm512_loadu_si512((const void *)(t->w + (b * 4 + o) * 64));
                _mm_prefetch((const char *)(t->w + (b * 4 + o) * 64 + PF_AHEAD), _MM_HINT_T0);
                w0 = _mm512_and_si512(v, low);
                w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            } else {
                w0 = _mm512_loadu_si512((const void *)(t->w + (b * 8 + 2 * o) * 64));
                _mm_prefetch((const char *)(t->w + (b * 8 + 2 * o) * 64 + PF_AHEAD), _MM_HINT_T0);
                _mm_prefetch((const char *)(t->w + (b * 8 + 2 * o) * 64 + 64 + PF_AHEAD), _MM_HINT_T0);
                w1 = _mm512_loadu_si512((const void *)(t->w + (b * 8 + 2 * o + 1) * 64));
            }
            for (int r = 0; r < R; r++) {
                const int64_t at = (r0 + r) * K + b * QB + o * 8;
                i1[r] = _mm512_dpbusd_epi32(i1[r], w0, bcast4(x->q1 + at));
                i1[r] = _mm512_dpbusd_epi32(i1[r], w1, bcast4(x->q1 + at + 4));
                if (P == 2) { /* with one plane q2 is zero: these would add nothing */
                    i2[r] = _mm512_dpbusd_epi32(i2[r], w0, bcast4(x->q2 + at));
                    i2[r] = _mm512_dpbusd_epi32(i2[r], w1, bcast4(x->q2 + at + 4));
                }
            }
        }
        const __m512 dv = load_half(t->d + b * CH);
        const __m512 mv = kind == Q4 ? load_half(t->m + b * CH) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++)
            acc[r] = block_step(kind, P, i1[r], i2[r], dv, mv, x, (r0 + r) * nb + b, acc[r]);
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

static void tile(int kind, int planes, int rows, const Tile *t, const Rows *x, int64_t r0,
                 float *y, int64_t ldy) {
#define ROWS(R, KIND, P) \
    case R: tile_rows(R, KIND, P, t, x, r0, y, ldy); break;
#define ALL(KIND, P) \
    switch (rows) { ROWS(1, KIND, P) ROWS(2, KIND, P) ROWS(3, KIND, P) ROWS(4, KIND, P) ROWS(5, KIND, P) ROWS(6, KIND, P) }
#define ALL8(KIND) \
    switch (rows) { ROWS(1, KIND, 1) ROWS(2, KIND, 1) ROWS(3, KIND, 1) ROWS(4, KIND, 1) ROWS(5, KIND, 1) ROWS(6, KIND, 1) ROWS(7, KIND, 1) ROWS(8, KIND, 1) }
    if (kind == Q4 && planes == 2) {
        ALL(Q4, 2)
    } else if (kind == Q4) {
        ALL8(Q4)
    } else if (planes == 2) {
        ALL(W8, 2)
    } else {
        ALL8(W8)
    }
#undef ALL8
#undef ALL
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

/* the stored (unsigned) weight of channel c at input j of block b's 8-input step o */
static inline int32_t weight_at(int kind, const Tile *t, int64_t b, int o, int c, int j) {
    if (kind == Q4) {
        const uint8_t v = t->w[(b * 4 + o) * 64 + 4 * c + (j & 3)];
        return j < 4 ? (v & 15) : (v >> 4);
    }
    return t->w[(b * 8 + 2 * o + (j >> 2)) * 64 + 4 * c + (j & 3)];
}

/* the same integer sums and float steps, one row at a time */
static void tile(int kind, int planes, int rows, const Tile *t, const Rows *x, int64_t r0,
                 float *y, int64_t ldy) {
    const int64_t nb = x->nb, K = x->K;
    for (int r = 0; r < rows; r++) {
        float acc[CH] = {0};
        for (int64_t b = 0; b < nb; b++) {
            int32_t i1[CH] = {0}, i2[CH] = {0};
            for (int o = 0; o < QB / 8; o++) {
                const int64_t at = (r0 + r) * K + b * QB + o * 8;
                for (int c = 0; c < CH; c++)
                    for (int j = 0; j < 8; j++) {
                        const int32_t w = weight_at(kind, t, b, o, c, j);
                        i1[c] += w * x->q1[at + j];
                        i2[c] += w * x->q2[at + j];
                    }
            }
            const int64_t at = (r0 + r) * nb + b;
            for (int c = 0; c < CH; c++) {
                const float dxd = half_f32(t->d[b * CH + c]) * x->dx[at];
                if (kind == Q4) {
                    acc[c] = fmaf((float)(i1[c] * 256 + i2[c]), dxd * (1.0f / 256.0f), acc[c]);
                    acc[c] = fmaf(half_f32(t->m[b * CH + c]), x->sx[at], acc[c]);
                } else {
                    acc[c] = fmaf((float)(i1[c] - 128 * x->s1[at]), dxd, acc[c]);
                    if (planes == 2)
                        acc[c] = fmaf((float)(i2[c] - 128 * x->s2[at]), dxd * (1.0f / 256.0f),
                                      acc[c]);
                }
            }
        }
        for (int c = 0; c < CH; c++) y[r * ldy + c] = acc[c];
    }
}
#endif

#if LS_Q4_AMX
/* the tile registers' shapes (LDTILECFG's 64 bytes) */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Two sets of three tiles, for even and odd blocks, so one block's sums are taken while
 * the next one's are stored: A holds a block's 32 inputs of each row (a pass's q1 rows,
 * then with two planes its q2 rows), B its 16 channels' weights (4 inputs a row of 64
 * bytes: the packed W8 layout, and Q4's once its nibbles are split), C the int32 sums
 * [A's rows][16]. (Numbers: the intrinsics spell them into the instruction.) */
#define TA0 0
#define TB0 1
#define TC0 2
#define TA1 3
#define TB1 4
#define TC1 5

static void amx_config(int a_rows) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int s = 0; s < 2; s++) {
        c.rows[3 * s] = c.rows[3 * s + 2] = (uint8_t)a_rows;
        c.colsb[3 * s] = QB;
        c.rows[3 * s + 1] = QB / 4;
        c.colsb[3 * s + 1] = c.colsb[3 * s + 2] = 64;
    }
    _tile_loadconfig(&c);
}

/* block b's Q4 weights as B rows: the nibbles of each 8 inputs split (low: inputs 0-3,
 * high: 4-7) into wq's 8 rows of 64 bytes, the packed W8 layout */
static inline void amx_unpack(const Tile *t, int64_t b, uint8_t *wq) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int o = 0; o < QB / 8; o++) {
        const __m512i v = _mm512_loadu_si512((const void *)(t->w + (b * 4 + o) * 64));
        _mm_prefetch((const char *)(t->w + (b * 4 + o) * 64 + PF_AHEAD), _MM_HINT_T0);
        _mm512_store_si512((void *)(wq + 2 * o * 64), _mm512_and_si512(v, low));
        _mm512_store_si512((void *)(wq + (2 * o + 1) * 64),
                           _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    }
}

/* the integer sums of a block, B (its weights) times A (its inputs), into c [A's rows][16],
 * on tile set ``set`` */
static inline void amx_block(int set, const uint8_t *w, const int8_t *a, int64_t K, int32_t *c) {
    if (set == 0) {
        _tile_loadd(TB0, w, 64);
        _tile_loadd(TA0, a, K);
        _tile_zero(TC0);
        _tile_dpbsud(TC0, TA0, TB0);
        _tile_stored(TC0, c, 64);
    } else {
        _tile_loadd(TB1, w, 64);
        _tile_loadd(TA1, a, K);
        _tile_zero(TC1);
        _tile_dpbsud(TC1, TA1, TB1);
        _tile_stored(TC1, c, 64);
    }
}

#define AMX_CHUNK 16 /* blocks whose weights and sums are staged at once (24 KB, in L1) */

/* rows (<= x->pass) of the pass at row r0 against one tile of 16 channels, AMX_CHUNK
 * blocks at a time: the tiles take the blocks' integer sums (signed inputs times unsigned
 * weights, exact in int32: the sums tile_rows takes), then per row the same float steps in
 * the same order. Tile loads and stores wait for the memory they touch, so the staging
 * (weights split, sums kept) is done a chunk ahead of its readers rather than block by
 * block. A reads the pass's whole ``pass`` rows: those past ``rows`` are left over from an
 * earlier pass, and their sums are dropped. */
static void tile_amx(const int kind, const int P, int rows, const Tile *t, const Rows *x,
                     int64_t r0, float *y, int64_t ldy) {
    const int64_t nb = x->nb, K = x->K, pass = x->pass;
    const int8_t *a = x->q1 + row_at(x, r0);
    uint8_t wq[AMX_CHUNK][QB / 4 * 64] __attribute__((aligned(64)));
    int32_t sums[AMX_CHUNK][AMX_ROWS * CH] __attribute__((aligned(64)));
    __m512 acc[AMX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += AMX_CHUNK) {
        const int n = nb - b0 < AMX_CHUNK ? (int)(nb - b0) : AMX_CHUNK;
        if (kind == Q4)
            for (int j = 0; j < n; j++) amx_unpack(t, b0 + j, wq[j]);
        for (int j = 0; j < n; j++) {
            const uint8_t *w = kind == Q4 ? wq[j] : t->w + (b0 + j) * QB / 4 * 64;
            if (kind == W8)
                for (int l = 0; l < QB / 4; l++)
                    _mm_prefetch((const char *)(w + l * 64 + PF_AHEAD), _MM_HINT_T0);
            amx_block(j % 2, w, a + (b0 + j) * QB, K, sums[j]);
        }
        for (int j = 0; j < n; j++) {
            const int64_t b = b0 + j;
            const int32_t *c = sums[j];
            const __m512 dv = load_half(t->d + b * CH);
            const __m512 mv = kind == Q4 ? load_half(t->m + b * CH) : _mm512_setzero_ps();
            for (int r = 0; r < rows; r++) {
                const __m512i i1 = _mm512_load_si512((const void *)(c + r * CH));
                const __m512i i2 = P == 2 ? _mm512_load_si512((const void *)(c + (pass + r) * CH))
                                          : _mm512_setzero_si512();
                acc[r] = block_step(kind, P, i1, i2, dv, mv, x, (r0 + r) * nb + b, acc[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

static void amx_tile(int kind, int planes, int rows, const Tile *t, const Rows *x, int64_t r0,
                     float *y, int64_t ldy) {
    if (kind == Q4 && planes == 2) {
        tile_amx(Q4, 2, rows, t, x, r0, y, ldy);
    } else if (kind == Q4) {
        tile_amx(Q4, 1, rows, t, x, r0, y, ldy);
    } else if (planes == 2) {
        tile_amx(W8, 2, rows, t, x, r0, y, ldy);
    } else {
        tile_amx(W8, 1, rows, t, x, r0, y, ldy);
    }
}
#endif

/* Ask for the AMX tiles (want = 1) or stop using them (0); returns whether the GEMMs now
 * take them: 0 on a CPU or kernel without them, or a build for another CPU. */
int ls_gemm_amx(int want) {
#if LS_Q4_AMX
    if (want && !amx_on) {
        enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
        amx_on = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    } else if (!want) {
        amx_on = 0;
    }
    return amx_on;
#else
    (void)want;
    return 0;
#endif
}

/* The driver of both kinds: x [M, K] fp32 -> y [M, N] fp32. Needs K % 32 == 0 and
 * N % 16 == 0 (the caller checks). Returns 0, or -1 when out of memory. */
static int gemm(int kind, int planes, const float *x, int64_t M, int64_t K, const uint8_t *w,
                const uint16_t *d, const uint16_t *m, int64_t N, float *y) {
    const int64_t nb = K / QB, rows_max = M < MCHUNK ? M : MCHUNK;
    /* AMX passes: the A tile's 16 rows hold a pass's rows of both planes */
    const int64_t amx_rows = AMX_ROWS / planes;
    const int64_t pass = amx_on && M >= AMX_MIN ? (rows_max < amx_rows ? rows_max : amx_rows) : 0;
    const int64_t rows_buf = pass ? (rows_max + pass - 1) / pass * pass : rows_max;
    int8_t *buf = calloc((size_t)(2 * rows_buf * K), 1);
    float *scales = malloc(sizeof(float) * (size_t)(3 * rows_max * nb));
    int32_t *sums = malloc(sizeof(int32_t) * (size_t)(2 * rows_max * nb));
    if (buf == NULL || scales == NULL || sums == NULL) {
        free(buf);
        free(scales);
        free(sums);
        return -1;
    }
    const Rows xs = {buf,  buf + (pass ? pass * K : rows_buf * K), scales, scales + rows_max * nb,
                     scales + 2 * rows_max * nb, sums, sums + rows_max * nb, K, nb, pass};
    const int64_t tile_bytes = kind == Q4 ? K / 2 * CH : K * CH;
    for (int64_t m0 = 0; m0 < M; m0 += MCHUNK) {
        const int64_t rows = M - m0 < MCHUNK ? M - m0 : MCHUNK;
#pragma omp parallel
        {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) quantize_row(x + (m0 + r) * K, &xs, r, planes);
#if LS_Q4_AMX
            if (pass) amx_config((int)(planes * pass));
#endif
#pragma omp for schedule(static)
            for (int64_t n = 0; n < N / CH; n++) {
                const Tile t = {w + n * tile_bytes, d + n * nb * CH, m ? m + n * nb * CH : NULL};
#if LS_Q4_AMX
                if (pass) {
                    for (int64_t r0 = 0; r0 < rows; r0 += pass) {
                        const int count = rows - r0 < pass ? (int)(rows - r0) : (int)pass;
                        amx_tile(kind, planes, count, &t, &xs, r0, y + (m0 + r0) * N + n * CH,
                                 N);
                    }
                    continue;
                }
#endif
                /* passes of as even a size as the registers allow: 8 rows at two planes
                 * as 4 + 4, not 6 + 2, whose short pass widens the weights again for little */
                const int64_t most = planes == 2 ? RB2 : RB, passes = (rows + most - 1) / most;
                for (int64_t p = 0, r0 = 0; p < passes; p++) {
                    const int64_t count = (rows - r0) / (passes - p);
                    tile(kind, planes, (int)count, &t, &xs, r0, y + (m0 + r0) * N + n * CH, N);
                    r0 += count;
                }
            }
#if LS_Q4_AMX
            if (pass) _tile_release();
#endif
        }
    }
    free(buf);
    free(scales);
    free(sums);
    return 0;
}

/* Q4_1 weights: tiles, d and m; planes as for ls_gemm_w8 */
int ls_gemm_q4(const float *x, int64_t M, int64_t K, const uint8_t *wq, const uint16_t *d,
               const uint16_t *m, int64_t N, float *y, int planes) {
    return gemm(Q4, planes == 1 ? 1 : 2, x, M, K, wq, d, m, N, y);
}

/* Q8_0 weights: tiles, d; planes: 2 (x to ~3e-5) or 1 (x to ~7e-3, half the work) */
int ls_gemm_w8(const float *x, int64_t M, int64_t K, const uint8_t *wq, const uint16_t *d,
               int64_t N, float *y, int planes) {
    return gemm(W8, planes == 1 ? 1 : 2, x, M, K, wq, d, NULL, N, y);
}

/* 1 when this build multiplies by VNNI integer dot products, 0 on the portable path */
int ls_gemm_q4_vnni(void) { return LS_Q4_VNNI; }
