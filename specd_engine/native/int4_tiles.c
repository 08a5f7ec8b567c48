/* y = x · Wᵀ for 4-bit weights in groups of 32 inputs, a weight tile unpacked once for every row of x:
 * on Intel AMX (bfloat16 tiles), or on AVX-512 BF16 where the CPU has no AMX (AMD Zen 4 and later).
 *
 * Why its own kernel: PyTorch's CPU int4 kernel computes each row of x on its own (~1.3 ms a row
 * for the default target's products on a 2-vCPU Xeon), so a pass over 8 sessions pays 8 rows' work.
 * Here a weight tile is unpacked once and multiplied by every row at once (in the tile unit, or by
 * VDPBF16PS with the row's input pair broadcast), and each row's arithmetic is the same whatever rows
 * share the call: a row's bits are its own.
 *
 * The math, per output n and row m, with groups g of 32 inputs k:
 *   y[m, n] = Σ_g scale[n, g] · C[m, n, g] + (zero[n, g] - 136 · scale[n, g]) · S[m, g]
 *   C[m, n, g] = Σ_{k∈g} x[m, k] · (128 + q[n, k]),   S[m, g] = Σ_{k∈g} x[m, k]
 * since the weight is (q - 8) · scale + zero. 128 + q (q in 0..15) is a bfloat16 whose bits are
 * 0x4300 | q, so a weight unpacks with a shift and one logic operation, no conversion. C runs in
 * bfloat16 pairs (products of a bfloat16 and an 8-bit integer are exact in float32), the rest in
 * float32 in group order; the result is rounded to bfloat16. The two instruction sets may round C's
 * sums differently: a machine's bits are its own kernel's, the same at any row count.
 *
 * Weight layout (specd_engine/int4_tiles.py, pack): for each block of 16 outputs and group of 32
 * inputs, 256 bytes, four chunks of 32 little-endian 16-bit words; nibble j (bits 4j..4j+3) of word e
 * in chunk c is element e of tile row 4c + j, and element e of tile row r is output e / 2 at input
 * 2r + e % 2 (the tile unit's pairs, and VDPBF16PS's: 32-bit lane o of row r is output o's pair).
 * scale and zero: bfloat16 [N/16][K/32][16].
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "tiles.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TILE_ROWS 16
#define STACK_ROWS 64 /* rows whose sums and accumulators live on the stack */
#define PROMPT_PANEL_BYTES (512 << 10) /* dequantized prompt weights a thread keeps at once: well inside a core's L2 */
#define PREFETCH_TILES 16 /* weight tiles read ahead: 12% off a one-row pass of the default target's products (2-vCPU Xeon) */

/* Ask the kernel for the tile state (once a process); 1 when granted. */
int specd_amx_init(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

static inline __m512 bf16x16_to_ps(const uint16_t *p) {
    return bfloat16_to_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* Tiles: A 0 and 3 (rows × 32 bfloat16), B 1 and 4 (16 pairs × 16 outputs), C 2 and 5 (rows × 16 float32):
 * two groups in flight. */
static void configure(int rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 6; t++) {
        cfg.rows[t] = t % 3 == 1 ? 16 : rows;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* Tile rows 4c .. 4c + 3 of a group, bfloat16 (128 + q), from chunk c's 64 packed bytes: nibble j of each word. */
static inline void unpack_chunk(const uint8_t *chunk, __m512i rows[4]) {
    const __m512i low = _mm512_set1_epi16(15), bias = _mm512_set1_epi16(0x4300);
    const __m512i w = _mm512_loadu_si512(chunk);
    /* (w & 15) | 0x4300: ternary logic 0xEA is (a & b) | c */
    rows[0] = _mm512_ternarylogic_epi32(w, low, bias, 0xEA);
    rows[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 4), low, bias, 0xEA);
    rows[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 8), low, bias, 0xEA);
    rows[3] = _mm512_or_si512(_mm512_srli_epi16(w, 12), bias);
}

/* One group's weight tile [16 pairs][32] bfloat16 (128 + q) from its 256 packed bytes. */
static inline void unpack_tile(const uint8_t *packed, uint16_t *tile) {
    for (int c = 0; c < 4; c++) {
        __m512i rows[4];
        unpack_chunk(packed + 64 * c, rows);
        for (int j = 0; j < 4; j++) _mm512_store_si512(tile + 128 * c + 32 * j, rows[j]);
    }
}

static inline void add_group(float *acc, const float *c_tile, const float *sums, int first, int count, int groups, int g,
                             __m512 s, __m512 z) {
    for (int r = 0; r < count; r++) {
        const int m = first + r;
        __m512 a = _mm512_load_ps(acc + 16 * m);
        a = _mm512_fmadd_ps(s, _mm512_load_ps(c_tile + 16 * r), a);
        a = _mm512_fmadd_ps(z, _mm512_set1_ps(sums[(size_t)m * groups + g]), a);
        _mm512_store_ps(acc + 16 * m, a);
    }
}

/* A partial last block of rows [first, first + rest) zero-padded to a whole tile (free it), or NULL. */
static uint16_t *last_rows(const uint16_t *x, int first, int rest, int K) {
    if (!rest) return NULL;
    uint16_t *rows = aligned_alloc(64, (size_t)TILE_ROWS * K * 2);
    memset(rows, 0, (size_t)TILE_ROWS * K * 2);
    memcpy(rows, x + (size_t)first * K, (size_t)rest * K * 2);
    return rows;
}

/* A buffer of at least `bytes` that a caller keeps for its next calls (*buffer and *held its own per-thread
 * statics): grown, in whole pages, only when a call needs more than it holds. */
static void *kept_buffer(void **buffer, size_t *held, size_t bytes) {
    if (bytes > *held) {
        free(*buffer);
        *held = (bytes + 4095) / 4096 * 4096;
        *buffer = aligned_alloc(64, *held);
    }
    return *buffer;
}

/* The rows as bfloat16: x itself, or float32 rows rounded to nearest even (as torch's cast) into a buffer
 * this thread keeps for its next calls. */
static const uint16_t *bfloat16_rows(const void *x, int floats, int M, int K) {
    static __thread void *kept = NULL;
    static __thread size_t held = 0;
    if (!floats) return x;
    const size_t count = (size_t)M * K;
    uint16_t *buffer = kept_buffer(&kept, &held, count * 2);
    const float *rows = x;
    for (size_t i = 0; i < count; i += 16)  /* K % 32 == 0 */
        _mm256_store_si256((__m256i *)(buffer + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(rows + i)));
    return buffer;
}

/* 16 outputs rounded to bfloat16, stored as bfloat16 or as the float32 they are exactly. */
static inline void store_rounded(void *out, size_t at, int floats, __m512 values) {
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(values);
    if (floats)
        _mm512_storeu_ps((float *)out + at, bfloat16_to_ps(rounded));
    else
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), rounded);
}

/* S[m, g] = Σ_{k∈g} x[m, k] in float32 [M, K/32]: in `here` where it fits (`room` floats), else allocated. */
static float *group_sums(const uint16_t *x, int M, int K, float *here, size_t room) {
    const int groups = K / 32;
    float *sums = (size_t)M * groups <= room ? here : aligned_alloc(64, (sizeof(float) * (size_t)M * groups + 63) / 64 * 64);
    for (int m = 0; m < M; m++)
        for (int g = 0; g < groups; g++) {
            const uint16_t *p = x + (size_t)m * K + g * 32;
            sums[(size_t)m * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(bf16x16_to_ps(p), bf16x16_to_ps(p + 16)));
        }
    return sums;
}

/* x [M, K] (row stride K) and out [M, N], float32 where `floats`, else bfloat16; K % 32 == 0, N % 16 == 0.
 * Float32 rows are rounded to bfloat16 first, and the outputs are rounded to bfloat16 either way: a
 * caller's casts around the product are done here, in one pass over the rows. */
void specd_int4_mm(const void *x_in, const uint8_t *nibbles, const uint16_t *scale, const uint16_t *zero,
                   void *out, int M, int K, int N, int threads, int floats) {
    const uint16_t *x = bfloat16_rows(x_in, floats, M, K);
    const int groups = K / 32, blocks = N / 16;
    const int tile_rows = M < TILE_ROWS ? M : TILE_ROWS;
    const int full = M / tile_rows, rest = M - full * tile_rows;  /* row blocks of tile_rows, and a last partial one */
    float sums_here[STACK_ROWS * 48] __attribute__((aligned(64)));
    float *sums = group_sums(x, M, K, sums_here, sizeof sums_here / sizeof(float));

#pragma omp parallel num_threads(threads)
    {
        configure(tile_rows);
        uint16_t b_tiles[2][TILE_ROWS * 32] __attribute__((aligned(64)));
        float c_tiles[2][TILE_ROWS * 16] __attribute__((aligned(64)));
        float acc_here[STACK_ROWS * 16] __attribute__((aligned(64)));
        float *acc = M <= STACK_ROWS ? acc_here : aligned_alloc(64, sizeof(float) * 16 * (size_t)M);
        uint16_t *a_rest = last_rows(x, full * tile_rows, rest, K);
#pragma omp for schedule(static)
        for (int block = 0; block < blocks; block++) {
            memset(acc, 0, sizeof(float) * 16 * (size_t)M);
            for (int g = 0; g < groups; g += 2) {  /* two groups at once: the second's tiles run while the first's drain */
                const int pair = g + 1 < groups;  /* an odd last group runs alone */
                const size_t tile = (size_t)block * groups + g;
                for (int line = 0; line < 8; line++)  /* two tiles' bytes, PREFETCH_TILES ahead (past the end is harmless) */
                    _mm_prefetch((const char *)(nibbles + (tile + PREFETCH_TILES) * 256 + 64 * line), _MM_HINT_T0);
                unpack_tile(nibbles + tile * 256, b_tiles[0]);
                _tile_loadd(1, b_tiles[0], 64);
                const __m512 bias = _mm512_set1_ps(-136.0f);
                const __m512 s0 = bf16x16_to_ps(scale + tile * 16);
                const __m512 z0 = _mm512_fmadd_ps(bias, s0, bf16x16_to_ps(zero + tile * 16));
                __m512 s1 = s0, z1 = z0;
                if (pair) {
                    unpack_tile(nibbles + (tile + 1) * 256, b_tiles[1]);
                    _tile_loadd(4, b_tiles[1], 64);
                    s1 = bf16x16_to_ps(scale + (tile + 1) * 16);
                    z1 = _mm512_fmadd_ps(bias, s1, bf16x16_to_ps(zero + (tile + 1) * 16));
                }
                for (int row_block = 0; row_block < full + (rest > 0); row_block++) {
                    const int first = row_block * tile_rows;
                    const int count = row_block < full ? tile_rows : rest;
                    const uint16_t *a = row_block < full ? x + (size_t)first * K : a_rest;
                    _tile_loadd(0, a + g * 32, K * 2);
                    _tile_zero(2);
                    _tile_dpbf16ps(2, 0, 1);
                    if (pair) {
                        _tile_loadd(3, a + g * 32 + 32, K * 2);
                        _tile_zero(5);
                        _tile_dpbf16ps(5, 3, 4);
                    }
                    _tile_stored(2, c_tiles[0], 64);
                    add_group(acc, c_tiles[0], sums, first, count, groups, g, s0, z0);
                    if (pair) {
                        _tile_stored(5, c_tiles[1], 64);
                        add_group(acc, c_tiles[1], sums, first, count, groups, g + 1, s1, z1);
                    }
                }
            }
            for (int m = 0; m < M; m++)
                store_rounded(out, (size_t)m * N + block * 16, floats, _mm512_load_ps(acc + 16 * m));
        }
        if (acc != acc_here) free(acc);
        free(a_rest);
        _tile_release();
    }
    if (sums != sums_here) free(sums);
}


/* ---- Prompt rows: a block's weights dequantized once, every row through them, all of K in the tile unit ---- */

/* One group's weight tile [16 pairs][32] as bfloat16((q − 8) · scale + zero): Int4Linear.dequantized()'s
 * weight ((q − 8) · scale is exact in float32, so the one rounding before bfloat16's is the add's, as
 * there). s and z: the group's 16 scales and zeros, each in both lanes of its output's pair, for outputs
 * 0..7 (lo) and 8..15 (hi). */
static inline void dequantize_tile(const uint8_t *packed, __m512 s_lo, __m512 s_hi, __m512 z_lo, __m512 z_hi, uint16_t *tile) {
    const __m512 bias = _mm512_set1_ps(136.0f);  /* (128 + q) − 136 = q − 8 */
    for (int c = 0; c < 4; c++) {
        __m512i rows[4];
        unpack_chunk(packed + 64 * c, rows);
        for (int j = 0; j < 4; j++) {
            const __m512 lo = _mm512_sub_ps(low_bfloat16_to_ps(rows[j]), bias), hi = _mm512_sub_ps(high_bfloat16_to_ps(rows[j]), bias);
            _mm512_store_si512(tile + 128 * c + 32 * j, (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, s_hi, z_hi), _mm512_fmadd_ps(lo, s_lo, z_lo)));
        }
    }
}

/* Every group's weight tile of one block of 16 outputs, dequantized (dequantize_tile) into tiles [groups][512]. */
static void dequantize_block(const uint8_t *nibbles, const uint16_t *scale, const uint16_t *zero, int groups, uint16_t *tiles) {
    const __m512i low_pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i high_pairs = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    for (int g = 0; g < groups; g++) {
        const __m512 s = bf16x16_to_ps(scale + (size_t)g * 16), z = bf16x16_to_ps(zero + (size_t)g * 16);
        dequantize_tile(nibbles + (size_t)g * 256, _mm512_permutexvar_ps(low_pairs, s), _mm512_permutexvar_ps(high_pairs, s),
                        _mm512_permutexvar_ps(low_pairs, z), _mm512_permutexvar_ps(high_pairs, z), tiles + (size_t)g * TILE_ROWS * 32);
    }
}

/* Tiles: C 0..3 (row block i, output block j at 2i + j), A 4 and 5, B 6 and 7; 16 rows each. */
static void configure_prompt(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = TILE_ROWS;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* One C tile's 16 rows × 16 outputs (float32, in `c`) rounded into out's rows [first, first + count). */
static inline void store_tile(const float *c, void *out, int first, int count, int N, int block, int floats) {
    for (int r = 0; r < count; r++) store_rounded(out, (size_t)(first + r) * N + block * 16, floats, _mm512_load_ps(c + 16 * r));
}

/* y = x · Wᵀ for prompt rows, with W the 4-bit weight dequantized to bfloat16 (Int4Linear.dequantized()).
 * Why: specd_int4_mm applies each group's scale to each row's sum of that group (a tile store and two
 * adds a row and group), which is most of a prompt chunk's cost; here each thread dequantizes a panel of
 * its output blocks once (PROMPT_PANEL_BYTES) and every pair of row blocks goes through it, 2 × 2 tiles
 * at a time, all of K summed in the tile unit. The rows are first laid out by tiles, so a tile loads
 * contiguous lines. Same arguments, layout and rounding as specd_int4_mm; a row's bits are its own at any
 * row count (each output sums its own row's products over K in one order), but they are not
 * specd_int4_mm's: the weight is rounded to bfloat16 first. */
void specd_int4_prompt_mm(const void *x_in, const uint8_t *nibbles, const uint16_t *scale, const uint16_t *zero,
                          void *out, int M, int K, int N, int threads, int floats) {
    const int groups = K / 32, blocks = N / 16;
    const int row_blocks = (M + TILE_ROWS - 1) / TILE_ROWS;
    /* the rows by tiles, [row block][group][16 rows][32] bfloat16, the last block's missing rows zero: a tile loads contiguous lines */
    uint16_t *a = aligned_alloc(64, (size_t)row_blocks * groups * TILE_ROWS * 32 * 2);
    const size_t a_block = (size_t)groups * TILE_ROWS * 32;  /* words a row block */
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int rb = 0; rb < row_blocks; rb++)  /* float32 rows rounded as bfloat16_rows rounds them; ends in a barrier */
            for (int r = 0; r < TILE_ROWS; r++) {
                const int m = rb * TILE_ROWS + r;
                for (int g = 0; g < groups; g++) {
                    __m512i row = _mm512_setzero_si512();
                    if (m < M && floats) {
                        const float *from = (const float *)x_in + (size_t)m * K + g * 32;
                        row = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(from + 16), _mm512_loadu_ps(from));
                    } else if (m < M) {
                        row = _mm512_loadu_si512((const uint16_t *)x_in + (size_t)m * K + g * 32);
                    }
                    _mm512_store_si512(a + rb * a_block + ((size_t)g * TILE_ROWS + r) * 32, row);
                }
            }
        configure_prompt();
        /* this thread's output blocks, in panels whose dequantized tiles stay in L2 while every row pair passes */
        const int team = omp_get_num_threads(), me = omp_get_thread_num();
        const int pairs = (blocks + 1) / 2, begin = 2 * (pairs * me / team), end = 2 * (pairs * (me + 1) / team);
        int panel = (int)(PROMPT_PANEL_BYTES / ((size_t)groups * TILE_ROWS * 32 * 2)) & ~1;
        if (panel < 2) panel = 2;
        uint16_t *w = aligned_alloc(64, (size_t)panel * groups * TILE_ROWS * 32 * 2);
        float c[4][TILE_ROWS * 16] __attribute__((aligned(64)));
        const size_t w_block = (size_t)groups * TILE_ROWS * 32;  /* words a block */
        for (int from = begin; from < end && from < blocks; from += panel) {
            int to = from + panel < end ? from + panel : end;
            if (to > blocks) to = blocks;  /* an odd last block: its pair's second is none */
            for (int block = from; block < to; block++) {
                const size_t tile = (size_t)block * groups;
                dequantize_block(nibbles + tile * 256, scale + tile * 16, zero + tile * 16, groups, w + (block - from) * w_block);
            }
            for (int rb = 0; rb < row_blocks; rb += 2) {
                const int two = rb + 1 < row_blocks;
                const uint16_t *a0 = a + rb * a_block, *a1 = a0 + a_block;
                const int first = rb * TILE_ROWS;
                const int count0 = M - first < TILE_ROWS ? M - first : TILE_ROWS;
                const int count1 = M - first - TILE_ROWS < TILE_ROWS ? M - first - TILE_ROWS : TILE_ROWS;
                for (int block = from; block < to; block += 2) {
                    const int both = block + 1 < to;
                    const uint16_t *w0 = w + (block - from) * w_block, *w1 = w0 + w_block;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int g = 0; g < groups; g++) {
                        _tile_loadd(4, a0 + (size_t)g * 512, 64);
                        _tile_loadd(6, w0 + (size_t)g * 512, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        if (both) {
                            _tile_loadd(7, w1 + (size_t)g * 512, 64);
                            _tile_dpbf16ps(1, 4, 7);
                        }
                        if (two) {
                            _tile_loadd(5, a1 + (size_t)g * 512, 64);
                            _tile_dpbf16ps(2, 5, 6);
                            if (both) _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                    _tile_stored(0, c[0], 64);
                    store_tile(c[0], out, first, count0, N, block, floats);
                    if (both) {
                        _tile_stored(1, c[1], 64);
                        store_tile(c[1], out, first, count0, N, block + 1, floats);
                    }
                    if (two) {
                        _tile_stored(2, c[2], 64);
                        store_tile(c[2], out, first + TILE_ROWS, count1, N, block, floats);
                        if (both) {
                            _tile_stored(3, c[3], 64);
                            store_tile(c[3], out, first + TILE_ROWS, count1, N, block + 1, floats);
                        }
                    }
                }
            }
        }
        free(w);
        _tile_release();
    }
    free(a);
}


/* One 8-bit weight row (32 int8 in pair order) as 32 bfloat16: exact, an 8-bit integer is a bfloat16. */
static inline __m512bh row8(const int8_t *packed) {
    const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)packed)));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(packed + 16))));
    return _mm512_cvtne2ps_pbh(high, low);
}

/* One weight tile [16 pairs][32] bfloat16 from 8-bit weights already in the tile unit's pair order
 * (512 bytes). */
static inline void unpack_tile8(const int8_t *packed, uint16_t *tile) {
    for (int r = 0; r < 16; r++) _mm512_store_si512(tile + 32 * r, (__m512i)row8(packed + 32 * r));
}

/* y = x · Wᵀ for 8-bit weights with one float32 scale an output (the LM head): y[m, n] = scale[n] ·
 * Σ_k x[m, k] · q[n, k], the sum in the tile unit over all of K (even and odd input tiles in two
 * accumulators, added at the end), rounded to bfloat16 (x and out as specd_int4_mm's). Weight layout: for each block of 16 outputs
 * and tile of 32 inputs, 512 bytes: byte 32r + e is output e / 2 at input 2r + e % 2. A row's bits are
 * its own at any row count, as specd_int4_mm's. */
void specd_int8_mm(const void *x_in, const int8_t *weights, const float *scale, void *out, int M, int K, int N, int threads,
                   int floats) {
    const uint16_t *x = bfloat16_rows(x_in, floats, M, K);
    const int tiles_in = K / 32, blocks = N / 16;
    const int tile_rows = M < TILE_ROWS ? M : TILE_ROWS;
    const int full = M / tile_rows, rest = M - full * tile_rows;
#pragma omp parallel num_threads(threads)
    {
        configure(tile_rows);
        uint16_t b_tiles[2][TILE_ROWS * 32] __attribute__((aligned(64)));
        float c_tiles[2][TILE_ROWS * 16] __attribute__((aligned(64)));
        uint16_t *a_rest = last_rows(x, full * tile_rows, rest, K);
#pragma omp for schedule(static)
        for (int block = 0; block < blocks; block++) {
            const __m512 s = _mm512_loadu_ps(scale + 16 * block);
            for (int row_block = 0; row_block < full + (rest > 0); row_block++) {
                const int first = row_block * tile_rows;
                const int count = row_block < full ? tile_rows : rest;
                const uint16_t *a = row_block < full ? x + (size_t)first * K : a_rest;
                _tile_zero(2);
                _tile_zero(5);
                for (int t = 0; t < tiles_in; t += 2) {
                    const int8_t *packed = weights + ((size_t)block * tiles_in + t) * 512;
                    for (int line = 0; line < 16; line++)  /* two tiles' bytes, PREFETCH_TILES / 2 pairs ahead */
                        _mm_prefetch((const char *)(packed + PREFETCH_TILES * 512 + 64 * line), _MM_HINT_T0);
                    unpack_tile8(packed, b_tiles[0]);
                    _tile_loadd(1, b_tiles[0], 64);
                    _tile_loadd(0, a + t * 32, K * 2);
                    _tile_dpbf16ps(2, 0, 1);
                    if (t + 1 < tiles_in) {
                        unpack_tile8(packed + 512, b_tiles[1]);
                        _tile_loadd(4, b_tiles[1], 64);
                        _tile_loadd(3, a + t * 32 + 32, K * 2);
                        _tile_dpbf16ps(5, 3, 4);
                    }
                }
                _tile_stored(2, c_tiles[0], 64);
                _tile_stored(5, c_tiles[1], 64);
                for (int r = 0; r < count; r++) {
                    const __m512 sum = _mm512_add_ps(_mm512_load_ps(c_tiles[0] + 16 * r), _mm512_load_ps(c_tiles[1] + 16 * r));
                    store_rounded(out, (size_t)(first + r) * N + block * 16, floats, _mm512_mul_ps(s, sum));
                }
            }
        }
        free(a_rest);
        _tile_release();
    }
}


/* ---- AVX-512 BF16: the same products where the CPU has no tile unit ------------------------------------ */

#define VECTOR_ROWS 8 /* rows a weight row is applied to while in a register: 8 sums + 8 accumulators + weights fit 32 registers */

/* Input pair r of a group (x[2r], x[2r + 1] as one 32-bit word) in all 16 lanes. */
static inline __m512bh pair_of(const uint16_t *group, int r) {
    int32_t word;
    memcpy(&word, group + 2 * r, sizeof word);
    return (__m512bh)_mm512_set1_epi32(word);
}

/* Rows [0, R) of x (row stride K) through one block of 16 outputs: acc[m] += Σ_g scale·C + (zero − 136·scale)·S.
 * Inlined for each constant R, so a row's instructions are the same whatever R it shares. */
static inline __attribute__((always_inline)) void vector_rows(const uint16_t *x, int K, const uint8_t *tiles, const uint16_t *scale,
                                                            const uint16_t *zero, const float *sums, int groups, int R, __m512 *acc) {
    for (int g = 0; g < groups; g++) {
        const uint8_t *packed = tiles + (size_t)g * 256;
        _mm_prefetch((const char *)(packed + PREFETCH_TILES * 256), _MM_HINT_T0);
        _mm_prefetch((const char *)(packed + PREFETCH_TILES * 256 + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(packed + PREFETCH_TILES * 256 + 128), _MM_HINT_T0);
        _mm_prefetch((const char *)(packed + PREFETCH_TILES * 256 + 192), _MM_HINT_T0);
        __m512 c[VECTOR_ROWS];
        for (int m = 0; m < R; m++) c[m] = _mm512_setzero_ps();
        for (int chunk = 0; chunk < 4; chunk++) {
            __m512i rows[4];
            unpack_chunk(packed + 64 * chunk, rows);
            for (int j = 0; j < 4; j++)
                for (int m = 0; m < R; m++)
                    c[m] = _mm512_dpbf16_ps(c[m], (__m512bh)rows[j], pair_of(x + (size_t)m * K + g * 32, 4 * chunk + j));
        }
        const __m512 s = bf16x16_to_ps(scale + (size_t)g * 16);
        const __m512 z = _mm512_fmadd_ps(_mm512_set1_ps(-136.0f), s, bf16x16_to_ps(zero + (size_t)g * 16));
        for (int m = 0; m < R; m++) {
            acc[m] = _mm512_fmadd_ps(s, c[m], acc[m]);
            acc[m] = _mm512_fmadd_ps(z, _mm512_set1_ps(sums[(size_t)m * groups + g]), acc[m]);
        }
    }
}

/* specd_int4_mm's product (same arguments, layout and rounding) on AVX-512 BF16: each block of 16 outputs
 * takes the rows VECTOR_ROWS at a time, its weight tiles unpacked once for each (from L1 after the first). */
void specd_int4_mm_avx512(const void *x_in, const uint8_t *nibbles, const uint16_t *scale, const uint16_t *zero,
                          void *out, int M, int K, int N, int threads, int floats) {
    const uint16_t *x = bfloat16_rows(x_in, floats, M, K);
    const int groups = K / 32, blocks = N / 16;
    float sums_here[STACK_ROWS * 48] __attribute__((aligned(64)));
    float *sums = group_sums(x, M, K, sums_here, sizeof sums_here / sizeof(float));
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int block = 0; block < blocks; block++) {
        const size_t tile = (size_t)block * groups;
        for (int first = 0; first < M; first += VECTOR_ROWS) {
            const int R = M - first < VECTOR_ROWS ? M - first : VECTOR_ROWS;
            const uint16_t *rows = x + (size_t)first * K;
            const float *row_sums = sums + (size_t)first * groups;
            __m512 acc[VECTOR_ROWS];
            for (int m = 0; m < R; m++) acc[m] = _mm512_setzero_ps();
            switch (R) {  /* one inlined body a row count: registers, no loop over a variable count */
#define ROWS_CASE(n) case n: vector_rows(rows, K, nibbles + tile * 256, scale + tile * 16, zero + tile * 16, row_sums, groups, n, acc); break;
                ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
#undef ROWS_CASE
            }
            for (int m = 0; m < R; m++)
                store_rounded(out, (size_t)(first + m) * N + block * 16, floats, acc[m]);
        }
    }
    if (sums != sums_here) free(sums);
}

/* Rows [0, R) of x through one block of 16 outputs of 8-bit weights: even and odd input tiles sum in two
 * accumulators a row, added at the end, as the tile unit's two. Inlined for each constant R, as vector_rows. */
static inline __attribute__((always_inline)) void vector_rows8(const uint16_t *x, int K, const int8_t *tiles, int tiles_in,
                                                             __m512 s, int R, void *out, size_t at, int N, int floats) {
    __m512 even[VECTOR_ROWS], odd[VECTOR_ROWS];
    for (int m = 0; m < R; m++) even[m] = odd[m] = _mm512_setzero_ps();
    for (int t = 0; t < tiles_in; t++) {
        const int8_t *packed = tiles + (size_t)t * 512;
        for (int line = 0; line < 8; line++)
            _mm_prefetch((const char *)(packed + PREFETCH_TILES * 512 + 64 * line), _MM_HINT_T0);
        for (int r = 0; r < 16; r++) {
            const __m512bh w = row8(packed + 32 * r);
            for (int m = 0; m < R; m++) {
                if (t % 2)
                    odd[m] = _mm512_dpbf16_ps(odd[m], w, pair_of(x + (size_t)m * K + t * 32, r));
                else
                    even[m] = _mm512_dpbf16_ps(even[m], w, pair_of(x + (size_t)m * K + t * 32, r));
            }
        }
    }
    for (int m = 0; m < R; m++)
        store_rounded(out, at + (size_t)m * N, floats, _mm512_mul_ps(s, _mm512_add_ps(even[m], odd[m])));
}

/* specd_int8_mm's product (same arguments, layout and rounding) on AVX-512 BF16. */
void specd_int8_mm_avx512(const void *x_in, const int8_t *weights, const float *scale, void *out, int M, int K, int N,
                          int threads, int floats) {
    const uint16_t *x = bfloat16_rows(x_in, floats, M, K);
    const int tiles_in = K / 32, blocks = N / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int block = 0; block < blocks; block++) {
        const __m512 s = _mm512_loadu_ps(scale + 16 * block);
        const int8_t *tiles = weights + (size_t)block * tiles_in * 512;
        for (int first = 0; first < M; first += VECTOR_ROWS) {
            const int R = M - first < VECTOR_ROWS ? M - first : VECTOR_ROWS;
            const uint16_t *rows = x + (size_t)first * K;
            const size_t at = (size_t)first * N + block * 16;
            switch (R) {
#define ROWS_CASE(n) case n: vector_rows8(rows, K, tiles, tiles_in, s, n, out, at, N, floats); break;
                ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
#undef ROWS_CASE
            }
        }
    }
}

/* ---- AVX-512 VNNI: the 4-bit products with 8-bit inputs ------------------------------------------------- */

/* Why: VPDPBUSD multiplies 64 bytes by 64 bytes into 16 sums of 4 products in one instruction, twice the
 * products of VDPBF16PS, and a 4-bit weight needs one logic operation to become a byte. Where the products
 * are compute-bound (many rows: batched decoding, prompts) they take half the instructions; at one row
 * the unpacking is a third of the bfloat16 kernel's.
 *
 * The math, per output n and row m, with groups g of 32 inputs k: each row's group is quantized to bytes
 * xq = round(x / d), d = max|x| / 127 (0 where the group is zero), so x ≈ d · xq, and
 *   y[m, n] = Σ_g d[m, g] · (scale[n, g] · C[m, n, g] + (zero[n, g] − 8 · scale[n, g]) · S[m, g])
 *   C[m, n, g] = Σ_{k∈g} xq[m, k] · q[n, k],   S[m, g] = Σ_{k∈g} xq[m, k]
 * C and S are exact integers; the rest is float32 in group order; the result is rounded to bfloat16.
 * It is the arithmetic llama.cpp does for these weights (a 4-bit block times an 8-bit block of the input).
 * A row's bytes, scales and sums are its own, so its bits are too, at any row and thread count.
 *
 * The weight layout is the tiles' (above): the 32-bit word of output o in chunk c holds its inputs
 * 8c + {0, 2, 4, 6} in its low half and 8c + {1, 3, 5, 7} in its high half, a nibble each, so the low
 * nibbles of its bytes are inputs {0, 4, 1, 5} and the high ones {2, 6, 3, 7}: the input bytes are stored
 * in that order (INPUT_ORDER) and each pair of words is broadcast against them. */

/* Each 8 inputs' bytes in the order the weight words' nibbles hold them. */
static const int8_t INPUT_ORDER[16] = {0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15};

/* Row m of x (float32 rounded to bfloat16, or bfloat16 where !floats) → its bytes xq [K] (INPUT_ORDER), and per
 * group its d and S. */
static void quantize_row(const void *x, int floats, int m, int K, int8_t *xq, float *d, float *s) {
    const __m128i order = _mm_loadu_si128((const __m128i *)INPUT_ORDER);
    for (int g = 0; g < K / 32; g++) {
        __m512 v[2];
        for (int h = 0; h < 2; h++) {
            const size_t at = (size_t)m * K + g * 32 + 16 * h;
            /* float32 rows as their bfloat16 cast, as the other kernels take them: a row's bits are the same either way */
            v[h] = floats ? bfloat16_to_ps((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps((const float *)x + at)))
                          : bf16x16_to_ps((const uint16_t *)x + at);
        }
        const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        const float step = largest / 127.0f, inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
        __m512i sum = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            const __m512i levels = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(inverse)));  /* to nearest even */
            sum = _mm512_add_epi32(sum, levels);
            _mm_storeu_si128((__m128i *)(xq + g * 32 + 16 * h), _mm_shuffle_epi8(_mm512_cvtsepi32_epi8(levels), order));
        }
        d[g] = step;
        s[g] = (float)_mm512_reduce_add_epi32(sum);
    }
}

/* Rows [0, R) of the bytes xq (row stride K) through one block of 16 outputs: acc[m] += Σ_g d · (scale·C + (zero − 8·scale)·S).
 * Inlined for each constant R, as vector_rows. */
static inline __attribute__((always_inline)) void vnni_rows(const int8_t *xq, int K, const uint8_t *tiles, const uint16_t *scale,
                                                          const uint16_t *zero, const float *d, const float *s, int groups, int R,
                                                          __m512 *acc) {
    const __m512i low = _mm512_set1_epi8(15);
    for (int g = 0; g < groups; g++) {
        const uint8_t *packed = tiles + (size_t)g * 256;
        for (int line = 0; line < 4; line++) _mm_prefetch((const char *)(packed + PREFETCH_TILES * 256 + 64 * line), _MM_HINT_T0);
        __m512i c[VECTOR_ROWS];
        for (int m = 0; m < R; m++) c[m] = _mm512_setzero_si512();
        for (int chunk = 0; chunk < 4; chunk++) {
            const __m512i w = _mm512_loadu_si512(packed + 64 * chunk);
            const __m512i even = _mm512_and_si512(w, low), odd = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
            for (int m = 0; m < R; m++) {
                const int8_t *bytes = xq + (size_t)m * K + g * 32 + 8 * chunk;
                int32_t first, second;
                memcpy(&first, bytes, 4);
                memcpy(&second, bytes + 4, 4);
                c[m] = _mm512_dpbusd_epi32(c[m], even, _mm512_set1_epi32(first));
                c[m] = _mm512_dpbusd_epi32(c[m], odd, _mm512_set1_epi32(second));
            }
        }
        const __m512 sc = bf16x16_to_ps(scale + (size_t)g * 16);
        const __m512 z = _mm512_fmadd_ps(_mm512_set1_ps(-8.0f), sc, bf16x16_to_ps(zero + (size_t)g * 16));
        for (int m = 0; m < R; m++) {
            __m512 part = _mm512_mul_ps(sc, _mm512_cvtepi32_ps(c[m]));
            part = _mm512_fmadd_ps(z, _mm512_set1_ps(s[(size_t)m * groups + g]), part);
            acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(d[(size_t)m * groups + g]), part, acc[m]);
        }
    }
}

/* specd_int4_mm's product (same arguments and layout; the output rounded to bfloat16) with 8-bit inputs on
 * AVX-512 VNNI: the rows quantized once (bytes, steps and sums in a buffer this thread keeps), then each
 * block of 16 outputs takes them VECTOR_ROWS at a time. */
void specd_int4_mm_vnni(const void *x, const uint8_t *nibbles, const uint16_t *scale, const uint16_t *zero,
                        void *out, int M, int K, int N, int threads, int floats) {
    static __thread void *kept = NULL;
    static __thread size_t held = 0;
    const int groups = K / 32, blocks = N / 16;
    const size_t bytes = (size_t)M * K;
    int8_t *buffer = kept_buffer(&kept, &held, bytes + 2 * sizeof(float) * (size_t)M * groups + 64), *xq = buffer;
    float *d = (float *)(buffer + (bytes + 63) / 64 * 64), *s = d + (size_t)M * groups;
#pragma omp parallel for num_threads(threads) schedule(static) if (M >= STACK_ROWS)
    for (int m = 0; m < M; m++) quantize_row(x, floats, m, K, xq + (size_t)m * K, d + (size_t)m * groups, s + (size_t)m * groups);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int block = 0; block < blocks; block++) {
        const size_t tile = (size_t)block * groups;
        for (int first = 0; first < M; first += VECTOR_ROWS) {
            const int R = M - first < VECTOR_ROWS ? M - first : VECTOR_ROWS;
            const int8_t *rows = xq + (size_t)first * K;
            const float *row_d = d + (size_t)first * groups, *row_s = s + (size_t)first * groups;
            __m512 acc[VECTOR_ROWS];
            for (int m = 0; m < R; m++) acc[m] = _mm512_setzero_ps();
            switch (R) {
#define ROWS_CASE(n) case n: vnni_rows(rows, K, nibbles + tile * 256, scale + tile * 16, zero + tile * 16, row_d, row_s, groups, n, acc); break;
                ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
#undef ROWS_CASE
            }
            for (int m = 0; m < R; m++)
                store_rounded(out, (size_t)(first + m) * N + block * 16, floats, acc[m]);
        }
    }
}
