/* Decode-side attention over a KV store in place: every row of a pass in one call, each row over its own
 * slot's keys, with a reduction order fixed by the row's own keys alone.
 *
 * Why its own kernel: PyTorch's CPU SDPA takes one batch entry a call or pads rows to one key count; a
 * call a session cost ~90 µs for 3 key heads over ~500 keys in a served pass (2-vCPU AMD EPYC), 65% of an
 * 8-session decoding pass, and its rounding depends on the query rows and key count of the call. Here a
 * row reads exactly the keys it sees (no padding), wherever they sit, and nothing another row does
 * changes its arithmetic: the same bits alone, in a chain, as a tree's node, beside any sessions and on
 * any thread count.
 *
 * Per row r and key head h, for each of its `group` query heads q (the heads h·group .. h·group + group - 1):
 *   s_j = scale · Σ_d q_d k_jd          (the 16-lane partial sums of the D/16 chunks, then their lane sum)
 *   m = max_j s_j,  p_j = exp(s_j - m), l = Σ_j p_j   (j in order)
 *   out = (Σ_j p_j v_j) / l              (j in order, each lane of D on its own)
 * over j = 0 .. seen[r] - 1, the row's keys: columns 0 .. seen - 1 of its slot, or where `columns` is given
 * (a tree's node), columns[r][0 .. seen - 1]. exp is the vector polynomial below, not libm's.
 *
 * Rows of one slot that read its leading columns are attended together a key head at a time (attend_run):
 * their keys are read from memory once for all of them, and each row does exactly the arithmetic it does alone.
 *
 * Where the CPU has Intel AMX and the store is bfloat16 (amx), the scores and the value sums come from the
 * tile unit instead (tile_scores, tile_values): the same s_j and out to float32 rounding, up to 16 of a run's
 * queries a tile. Its order is fixed too, so a row's bits are still its own; they are not those of the
 * 16-lane sums above, so a machine keeps one of the two (store_attention.py).
 *
 * Prompt rows flagged by the caller take bfloat16 dot products instead where the store is bfloat16 and the tile
 * unit is not used (dots_run, below): a prompt row attends hundreds of keys, and that code keeps no lane sums.
 *
 * Layout: q and out [R, Hq, D] float32; keys and values [S, Hkv, capacity, D] float32, or bfloat16 where bf16
 * (widened to float32 as they are read: decoding reads every cached key and value a pass, and at long
 * contexts that memory traffic, not the arithmetic, sets a pass's attention time);
 * slots [R] int64, seen [R] int32, columns [R, width] int64 or NULL; D % 16 == 0.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tiles.h"

#define MAX_GROUP 16 /* query heads a key head */
#define MAX_RUN 8    /* rows of one slot an item attends, its keys read once for all */

typedef struct {  /* a thread's scratch for tile_scores and tile_values */
    uint16_t *parts, *gathered, *pparts, *pairs, *zeros;
    float *ctile, *sums;
} tile_scratch;

/* 16 lanes of a store at element `index`: float32 as they are, bfloat16 widened exactly (its bits are a
 * float32's upper half). */
static inline __attribute__((always_inline)) __m512 load16(const void *base, size_t index, int bf16) {
    if (bf16)
        return bfloat16_to_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index)));
    return _mm512_loadu_ps((const float *)base + index);
}

/* Lane j of the result is the lane sum of v[j], in _mm512_reduce_add_ps's order (lanes i + i+8, then
 * i + i+4, then i + i+2, then i + i+1), so a key's score has the bits of a score reduced alone: 16 keys'
 * sums in 15 shuffled adds instead of 16 reductions. Each add is lane-wise, so no key's lanes meet another's. */
static inline __m512 lane_sums16(const __m512 v[16]) {
    __m512 halves[8], quarters[4], pairs[2];
    for (int m = 0; m < 8; m++)  /* keys 2m, 2m+1: each 128-bit chunk c holds lanes c and c+2 (of 4) added */
        halves[m] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0x44), _mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0xEE));
    for (int n = 0; n < 4; n++)  /* chunk c: key 4n + c, its 4 lanes */
        quarters[n] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * n], halves[2 * n + 1], 0x88), _mm512_shuffle_f32x4(halves[2 * n], halves[2 * n + 1], 0xDD));
    for (int p = 0; p < 2; p++)  /* chunk c: keys 8p + c and 8p + 4 + c, 2 lanes each */
        pairs[p] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * p], quarters[2 * p + 1], 0x44), _mm512_shuffle_ps(quarters[2 * p], quarters[2 * p + 1], 0xEE));
    /* lane 4c + m: key c + 4m */
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88), _mm512_shuffle_ps(pairs[0], pairs[1], 0xDD));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, sums);
}

/* 16 keys' scores for one query qi: s_j = scale · Σ_d q_d k_jd, each key's 16-lane partial sums over the
 * D/16 chunks in order, then its lane sum (lane_sums16). chunks is a constant where inlined for D = 64. */
static inline __attribute__((always_inline)) void block_scores(const float *qi, const void *keys, const size_t key[16], int chunks,
                                                               int bf16, float scale, float *out) {
    __m512 sums[16];
    for (int m = 0; m < 16; m++) {
        __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(qi), load16(keys, key[m], bf16));
        for (int c = 1; c < chunks; c++)
            sum = _mm512_fmadd_ps(_mm512_loadu_ps(qi + 16 * c), load16(keys, key[m] + 16 * c, bf16), sum);
        sums[m] = sum;
    }
    _mm512_storeu_ps(out, _mm512_mul_ps(lane_sums16(sums), _mm512_set1_ps(scale)));
}

/* out[i] = (Σ_j p[i][j] v_j) / l_i for a row's `group` query heads over its `seen` keys, lane by lane of D,
 * j in order: each value read once for every query head. Inlined with constant group and chunks for the
 * shapes served most (the default target's 3 heads a key head of D = 64), so the sums stay in registers. */
static inline __attribute__((always_inline)) void value_sums(const float *p, int padded, const void *values, const int64_t *columns,
                                                             int seen, int group, int chunks, int bf16, const float *inverse, float *out) {
    __m512 acc[MAX_GROUP][8];  /* D <= 128 in registers' worth; larger D loops below */
    for (int base = 0; base < chunks; base += 8) {
        const int width = chunks - base < 8 ? chunks - base : 8;
        for (int i = 0; i < group; i++)
            for (int c = 0; c < width; c++) acc[i][c] = _mm512_setzero_ps();
        for (int j = 0; j < seen; j++) {
            const size_t v = (size_t)(columns ? columns[j] : j) * 16 * chunks + 16 * base;
            for (int c = 0; c < width; c++) {
                const __m512 vc = load16(values, v + 16 * c, bf16);
                for (int i = 0; i < group; i++)
                    acc[i][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[(size_t)i * padded + j]), vc, acc[i][c]);
            }
        }
        for (int i = 0; i < group; i++)
            for (int c = 0; c < width; c++)
                _mm512_storeu_ps(out + (size_t)i * 16 * chunks + 16 * (base + c), _mm512_mul_ps(acc[i][c], _mm512_set1_ps(inverse[i])));
    }
}

/* 32 float32 (low: 0..15, high: 16..31) as three bfloat16 vectors whose sum is exactly them: parts[0] the
 * values rounded, parts[1] the rounded residual, parts[2] the residual's residual (24 significant bits in
 * all; each residual is exact in float32). What the tile unit multiplies in place of a float32 vector. */
static inline void exact_parts(__m512 low, __m512 high, __m512i parts[3]) {
    for (int part = 0; part < 3; part++) {
        parts[part] = (__m512i)_mm512_cvtne2ps_pbh(high, low);  /* words 0..15 from low, 16..31 from high */
        low = _mm512_sub_ps(low, low_bfloat16_to_ps(parts[part]));
        high = _mm512_sub_ps(high, high_bfloat16_to_ps(parts[part]));
    }
}

/* Scores of a run's `queries` = n × group queries (query u: row u / group, head u % group) over a bfloat16
 * store's keys, by the tile unit: C[j][u] = Σ_d k_jd q_ud for 16 keys j and up to 16 queries u a tile.
 * Each query is split exactly into three bfloat16 parts (exact_parts), so every product with a bfloat16 key is exact and the score is the float32
 * score to float32 rounding, summed in the tile unit's fixed order. C[j][u] is a function of key j and
 * query u alone: whatever else shares the tile (other rows, padding, keys past a row's own) changes no bit.
 * Keys past the store's `capacity` columns, or a tree's compacted columns, are copied to `gathered` first.
 * A tile's columns past the block's queries are never read, so the scratch is never cleared.
 * parts: [D/32][3][16 pairs × 16 queries × 2] bfloat16 scratch; ctile: 16 × 16 float32 scratch. */
static void tile_scores(const float *q, size_t stride, const uint16_t *keys, const int64_t *columns, const int32_t *seen,
                        int n, int group, int D, int capacity, int most, int padded, float scale, float *scores,
                        uint16_t *parts, uint16_t *gathered, float *ctile) {
    const int chunks = D / 32, queries = n * group;
    const __m512i rows16 = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
    const __m512 scaled = _mm512_set1_ps(scale);
    for (int first = 0; first < queries; first += 16) {
        const int width = queries - first < 16 ? queries - first : 16;
        for (int u = 0; u < width; u++) {
            const int t = (first + u) / group, i = (first + u) % group;
            const float *qu = q + t * stride + (size_t)i * D;
            for (int c = 0; c < chunks; c++) {
                __m512i split[3];
                exact_parts(_mm512_loadu_ps(qu + 32 * c), _mm512_loadu_ps(qu + 32 * c + 16), split);
                for (int part = 0; part < 3; part++)  /* pair r (dims 2r, 2r + 1) is 32-bit lane r: to row r, column u */
                    _mm512_i32scatter_epi32((uint32_t *)parts + (size_t)(c * 3 + part) * 256 + u, rows16, split[part], 4);
            }
        }
        const int resident = chunks <= 2;  /* the parts stay in tiles 2..7 for every key block (D <= 64) */
        if (resident) {
            _tile_loadd(2, parts, 64);
            _tile_loadd(3, parts + 512, 64);
            _tile_loadd(4, parts + 1024, 64);
            if (chunks == 2) {
                _tile_loadd(5, parts + 1536, 64);
                _tile_loadd(6, parts + 2048, 64);
                _tile_loadd(7, parts + 2560, 64);
            }
        }
        const int last_row = (first + width - 1) / group;  /* the block's rows see the most keys last (a run's positions rise) */
        int sees = 0;
        for (int t = first / group; t <= last_row; t++) sees = seen[t] > sees ? seen[t] : sees;
        for (int ahead = 0; ahead < 32 * D && !columns; ahead += 32)  /* the first two blocks (tile loads stall on a miss) */
            _mm_prefetch((const char *)(keys + ahead), _MM_HINT_T0);
        for (int b = 0; b < padded && b < sees; b += 16) {
            const uint16_t *block = keys + (size_t)b * D;
            for (int line = 0; line < 16 * D && !columns && b + 32 < sees; line += 32)  /* two blocks ahead; a prefetch never faults */
                _mm_prefetch((const char *)(block + 32 * D + line), _MM_HINT_T0);
            if (columns || b + 16 > capacity) {
                for (int m = 0; m < 16; m++) {
                    const int j = b + m < most ? b + m : 0;
                    memcpy(gathered + (size_t)m * D, keys + (size_t)(columns ? columns[j] : j) * D, sizeof(uint16_t) * D);
                }
                block = gathered;
            }
            _tile_zero(0);
            if (resident) {
                _tile_loadd(1, block, D * sizeof(uint16_t));
                _tile_dpbf16ps(0, 1, 2);
                _tile_dpbf16ps(0, 1, 3);
                _tile_dpbf16ps(0, 1, 4);
                if (chunks == 2) {
                    _tile_loadd(1, block + 32, D * sizeof(uint16_t));
                    _tile_dpbf16ps(0, 1, 5);
                    _tile_dpbf16ps(0, 1, 6);
                    _tile_dpbf16ps(0, 1, 7);
                }
            }
            for (int c = 0; c < chunks && !resident; c++) {
                _tile_loadd(1, block + 32 * c, D * sizeof(uint16_t));
                _tile_loadd(2, parts + (size_t)(c * 3) * 512, 64);
                _tile_loadd(3, parts + (size_t)(c * 3 + 1) * 512, 64);
                _tile_loadd(4, parts + (size_t)(c * 3 + 2) * 512, 64);
                _tile_dpbf16ps(0, 1, 2);
                _tile_dpbf16ps(0, 1, 3);
                _tile_dpbf16ps(0, 1, 4);
            }
            _tile_stored(0, ctile, 64);
            for (int u = 0; u < width; u++) {
                const int t = (first + u) / group, i = (first + u) % group;
                if (seen[t] <= b) continue;
                const __m512 s = _mm512_i32gather_ps(_mm512_add_epi32(rows16, _mm512_set1_epi32(u)), ctile, 4);
                _mm512_storeu_ps(scores + ((size_t)t * group + i) * padded + b, _mm512_mul_ps(s, scaled));
            }
        }
    }
}

/* One value's 16 lanes of D from a pair of keys, interleaved as the tile unit's pairs: word 2k from the
 * first key's lane k, word 2k + 1 from the second's. */
static const uint16_t PAIR_WORDS[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

/* The tile accumulators 0..3 += the three parts (tiles 4..6) × the value pairs of d-block c (tile 7). */
#define VALUE_BLOCK(c)                                              \
    if (blocks > c) {                                               \
        _tile_loadd(7, pairs + (size_t)c * 512, 64);                \
        _tile_dpbf16ps(c, 4, 7);                                    \
        _tile_dpbf16ps(c, 5, 7);                                    \
        _tile_dpbf16ps(c, 6, 7);                                    \
    }
#define STORE_BLOCK(c) \
    if (blocks > c) _tile_stored(c, sums + (size_t)c * 256, 64);

/* out[u] = (Σ_j p_uj v_j) / l_u for a run's queries (at most 16: the tile path's runs) over a bfloat16
 * store's values, by the tile unit: 32 keys × 16 lanes of D an instruction chain. p (scores, after the
 * softmax) is split exactly into three bfloat16 parts as the queries are (exact_parts), so every product
 * is exact and each lane's sum runs in the tile unit's fixed order over the row's keys in order. A row
 * that sees fewer keys than its run adds p = 0 for the rest (zeros change no bit of a sum); keys past
 * the run's read a zero row. inverse: 1 / l_u; pparts: 3 × 16 × 32 bfloat16 scratch; pairs: 4 × 16 × 32
 * bfloat16; zeros: D bfloat16 zeros; sums: 4 × 16 × 16 float32. */
static void tile_values(const float *scores, int padded, const uint16_t *values, const int64_t *columns, const int32_t *seen,
                        int n, int group, int D, int most, const float *inverse, size_t stride, float *out,
                        uint16_t *pparts, uint16_t *pairs, const uint16_t *zeros, float *sums) {
    const int queries = n * group;
    const __m512i interleave = _mm512_loadu_si512(PAIR_WORDS);
    for (int dg = 0; dg < D; dg += 64) {
        const int blocks = (D - dg) / 16 < 4 ? (D - dg) / 16 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int kb = 0; kb < most; kb += 32) {
            for (int u = 0; u < queries; u++) {
                const int rounded = (seen[u / group] + 15) / 16 * 16;  /* the row's p: 0 past its keys, to `rounded` */
                const float *p = scores + (size_t)u * padded + kb;
                const __mmask16 first = kb < rounded ? 0xFFFF : 0, second = kb + 16 < rounded ? 0xFFFF : 0;
                __m512i split[3];
                exact_parts(_mm512_maskz_loadu_ps(first, p), _mm512_maskz_loadu_ps(second, p + 16), split);
                for (int part = 0; part < 3; part++)
                    _mm512_storeu_si512(pparts + (size_t)part * 512 + (size_t)u * 32, split[part]);
            }
            for (int pair = 0; pair < 16; pair++) {
                const int j = kb + 2 * pair;
                const uint16_t *v0 = j < most ? values + (size_t)(columns ? columns[j] : j) * D : zeros;
                const uint16_t *v1 = j + 1 < most ? values + (size_t)(columns ? columns[j + 1] : j + 1) * D : zeros;
                for (int c = 0; c < blocks; c++) {
                    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(v0 + dg + 16 * c))),
                                                            _mm256_loadu_si256((const __m256i *)(v1 + dg + 16 * c)), 1);
                    _mm512_storeu_si512(pairs + (size_t)c * 512 + (size_t)pair * 32, _mm512_permutexvar_epi16(interleave, both));
                }
            }
            _tile_loadd(4, pparts, 64);
            _tile_loadd(5, pparts + 512, 64);
            _tile_loadd(6, pparts + 1024, 64);
            VALUE_BLOCK(0)
            VALUE_BLOCK(1)
            VALUE_BLOCK(2)
            VALUE_BLOCK(3)
        }
        STORE_BLOCK(0)
        STORE_BLOCK(1)
        STORE_BLOCK(2)
        STORE_BLOCK(3)
        for (int u = 0; u < queries; u++)
            for (int c = 0; c < blocks; c++)
                _mm512_storeu_ps(out + (size_t)(u / group) * stride + (size_t)(u % group) * D + dg + 16 * c,
                                 _mm512_mul_ps(_mm512_load_ps(sums + (size_t)c * 256 + (size_t)u * 16), _mm512_set1_ps(inverse[u])));
    }
}

/* Tiles: C 0 (16 keys × 16 queries float32), A 1 (16 keys × 32 bfloat16), B 2..7 (16 pairs × 16 queries:
 * the three parts of two chunks of 32 dimensions, kept for every key block where D <= 64). */
static void configure_scores(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* One key head for `n` rows of one slot (a run): row t's `group` queries at q + t·stride, over its first
 * seen[t] keys → out + t·stride. The run's keys are read once a block of 16 for all its rows, and a row's
 * arithmetic is what it would be alone: its scores are per key, its softmax and its sum over values over
 * its own keys in order. columns: a tree's node's compacted columns (n == 1 only). scores: scratch of
 * n × group × (the run's most seen rounded up to 16) floats. tiles: the scores by the tile unit
 * (tile_scores, a bfloat16 store; its scratch in `scratch`), else by the 16-lane code below. */
static inline __attribute__((always_inline)) void attend_run(const float *q, size_t stride, const void *keys, const void *values,
                                                             const int64_t *columns, const int32_t *seen, int n, int group, int D,
                                                             int bf16, float scale, float *scores, float *out, int tiles,
                                                             int capacity, const tile_scratch *scratch) {
    const int chunks = D / 16;
    int most = 0;
    for (int t = 0; t < n; t++) most = seen[t] > most ? seen[t] : most;
    const int padded = (most + 15) / 16 * 16;
    if (tiles)
        tile_scores(q, stride, keys, columns, seen, n, group, D, capacity, most, padded, scale, scores,
                    scratch->parts, scratch->gathered, scratch->ctile);
    for (int b = 0; b < padded && !tiles; b += 16) {
        size_t key[16];  /* where each key starts; past the run's keys its first, read and then dropped (-inf) */
        for (int m = 0; m < 16; m++) {
            const int j = b + m < most ? b + m : 0;
            key[m] = (size_t)(columns ? columns[j] : j) * D;
        }
        for (int t = 0; t < n; t++) {
            if (seen[t] <= b) continue;
            for (int i = 0; i < group; i++) {
                const float *qi = q + t * stride + (size_t)i * D;
                float *s = scores + ((size_t)t * group + i) * padded + b;
                if (chunks == 4) block_scores(qi, keys, key, 4, bf16, scale, s);
                else block_scores(qi, keys, key, chunks, bf16, scale, s);
            }
        }
    }
    float inverses[16];  /* the tile path's queries (at most 16 a run) */
    for (int t = 0; t < n; t++) {
        const int rounded = (seen[t] + 15) / 16 * 16;
        float *inverse = tiles ? inverses + t * group : (float[MAX_GROUP]){0};
        for (int i = 0; i < group; i++) {
            float *s = scores + ((size_t)t * group + i) * padded;
            for (int j = seen[t]; j < rounded; j++) s[j] = -INFINITY;  /* the last block's tail: exp gives 0 */
            __m512 top = _mm512_set1_ps(-INFINITY);
            for (int j = 0; j < rounded; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
            const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
            __m512 total = _mm512_setzero_ps();
            for (int j = 0; j < rounded; j += 16) {
                const __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));
                _mm512_storeu_ps(s + j, p);
                total = _mm512_add_ps(total, p);
            }
            inverse[i] = 1.0f / _mm512_reduce_add_ps(total);
        }
        const float *p = scores + (size_t)t * group * padded;
        if (tiles) continue;
        if (group == 3 && chunks == 4) value_sums(p, padded, values, columns, seen[t], 3, 4, bf16, inverse, out + t * stride);
        else value_sums(p, padded, values, columns, seen[t], group, chunks, bf16, inverse, out + t * stride);
    }
    if (tiles)
        tile_values(scores, padded, values, columns, seen, n, group, D, most, inverses, stride, out,
                    scratch->pparts, scratch->pairs, scratch->zeros, scratch->sums);
}

/* Prompt rows by bfloat16 dot products (VDPBF16PS), where the CPU has AVX-512 BF16 and no AMX and the store is
 * bfloat16: a run of up to PROMPT_RUN prompt rows of one slot, its n × group queries 16 to a vector (lane l of
 * vector a: query 16a + l). Each query and each softmax weight is rounded to bfloat16 (the keys and values already
 * are), and every product is summed in float32:
 *   s_j = scale · Σ_p (q_{2p} k_{j,2p} + q_{2p+1} k_{j,2p+1})     p = 0 .. D/2 - 1 in order
 *   m = max_j s_j,  p_j = exp(s_j - m),  l = Σ_j p_j              j in order
 *   out_d = (Σ_i (p_{2i} v_{2i,d} + p_{2i+1} v_{2i+1,d})) / l        key pairs i from 0 in order
 * over the row's own keys j < seen: a key past them gets p = 0 and adds exactly nothing, and the pairs start at key
 * 0 whatever the run, so a row's bits are its own at any chunking, beside any rows and on any thread count. They are
 * not the 16-lane code's (which keeps the queries and weights in float32), so only prompt rows take them: a prompt
 * position is always a prompt row (CausalLM.prompt_end), and generated rows keep the 16-lane code.
 * Why: a prompt row attends hundreds of keys; the 16-lane code's per-key lane sums made attention 37% of a 1,000-token
 * prefill on a 2-vCPU AMD EPYC (Zen 4); a VDPBF16PS takes 32 products with no reduction across lanes. */
#define PROMPT_RUN 16 /* prompt rows of one slot an item attends by dot products */

typedef struct { /* a thread's scratch for dots_run, sized for the pass's widest row */
    uint32_t *qt, *pp, *vp; /* queries as bfloat16 pairs, the weights' pairs, the values' pairs */
    float *st;              /* scores and weights [keys][vectors × 16] */
} dots_scratch;

/* The dims' places among a key pair's words (unpacklo/hi_epi16 of two rows: each 128-bit lane's first 4 dims, then its last 4). */
static inline int pair_place(int d) {
    const int e = d % 32, lane = e / 8, r = e % 8;
    return d / 32 * 32 + (r < 4 ? 0 : 16) + 4 * lane + r % 4;
}

/* acc[a][m] = Σ_p qt[a][p] · key m's word p, for 4 keys and NV query vectors (constant where inlined). */
static inline __attribute__((always_inline)) void dots_scores4(const uint32_t *qt, const uint32_t *const key[4], int words, int NV,
                                                               float scale, float *st, size_t row) {
    __m512 acc[3][4];
    for (int a = 0; a < NV; a++)
        for (int m = 0; m < 4; m++) acc[a][m] = _mm512_setzero_ps();
    for (int p = 0; p < words; p++) {
        __m512bh qv[3];
        for (int a = 0; a < NV; a++) qv[a] = (__m512bh)_mm512_loadu_si512(qt + ((size_t)a * words + p) * 16);
        for (int m = 0; m < 4; m++) {
            const __m512bh kb = (__m512bh)_mm512_set1_epi32((int)key[m][p]);
            for (int a = 0; a < NV; a++) acc[a][m] = _mm512_dpbf16_ps(acc[a][m], kb, qv[a]);
        }
    }
    for (int m = 0; m < 4; m++)
        for (int a = 0; a < NV; a++) _mm512_storeu_ps(st + (size_t)m * row + 16 * a, _mm512_mul_ps(acc[a][m], _mm512_set1_ps(scale)));
}

/* acc[a][k] = Σ_i pp[i][a] · vp[i][dim k], for 8 dims and NV query vectors, then / l into ot[a][k][16]. */
static inline __attribute__((always_inline)) void dots_values8(const uint32_t *pp, const uint32_t *vp, const int place[8], int pairs,
                                                               int vectors, int D, int NV, const __m512 *inverse, float *ot) {
    __m512 acc[3][8];
    for (int a = 0; a < NV; a++)
        for (int k = 0; k < 8; k++) acc[a][k] = _mm512_setzero_ps();
    for (int i = 0; i < pairs; i++) {
        __m512bh w[3];
        for (int a = 0; a < NV; a++) w[a] = (__m512bh)_mm512_loadu_si512(pp + ((size_t)i * vectors + a) * 16);
        for (int k = 0; k < 8; k++) {
            const __m512bh vb = (__m512bh)_mm512_set1_epi32((int)vp[(size_t)i * D + place[k]]);
            for (int a = 0; a < NV; a++) acc[a][k] = _mm512_dpbf16_ps(acc[a][k], w[a], vb);
        }
    }
    for (int a = 0; a < NV; a++)
        for (int k = 0; k < 8; k++) _mm512_storeu_ps(ot + ((size_t)a * 8 + k) * 16, _mm512_mul_ps(acc[a][k], inverse[a]));
}

/* One key head for a run of n prompt rows (layout as attend_run's; a bfloat16 store; D % 32 == 0). */
static void dots_run(const float *q, size_t stride, const uint16_t *keys, const uint16_t *values, const int32_t *seen,
                     int n, int group, int D, float scale, float *out, const dots_scratch *w) {
    const int queries = n * group, vectors = (queries + 15) / 16, words = D / 2, row = 16 * vectors;
    int most = 0;
    for (int t = 0; t < n; t++) most = seen[t] > most ? seen[t] : most;
    const int blocks = (most + 3) / 4 * 4, pairs = (most + 1) / 2;
    memset(w->qt, 0, sizeof(uint32_t) * (size_t)vectors * words * 16);
    for (int u = 0; u < queries; u++) {  /* queries as bfloat16 pairs, transposed: qt[a][p][lane] */
        const float *qu = q + (size_t)(u / group) * stride + (size_t)(u % group) * D;
        uint32_t pair[16];
        for (int c = 0; c < D; c += 32) {
            _mm512_storeu_si512(pair, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(qu + c + 16), _mm512_loadu_ps(qu + c)));
            for (int p = 0; p < 16; p++) w->qt[((size_t)(u / 16) * words + c / 2 + p) * 16 + u % 16] = pair[p];
        }
    }
    for (int a0 = 0; a0 < vectors; a0 += 3) {
        const int NV = vectors - a0 < 3 ? vectors - a0 : 3;
        const uint32_t *qt = w->qt + (size_t)a0 * words * 16;
        for (int b = 0; b < blocks; b += 4) {
            const uint32_t *key[4];  /* past the run's keys its last, scored and then dropped (-inf) */
            for (int m = 0; m < 4; m++) key[m] = (const uint32_t *)(keys + (size_t)(b + m < most ? b + m : most - 1) * D);
            float *st = w->st + (size_t)b * row + 16 * a0;
            if (NV == 3) dots_scores4(qt, key, words, 3, scale, st, row);
            else if (NV == 2) dots_scores4(qt, key, words, 2, scale, st, row);
            else dots_scores4(qt, key, words, 1, scale, st, row);
        }
    }
    __m512 inverse[MAX_GROUP * PROMPT_RUN / 16];
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int a = 0; a < vectors; a++) {  /* each lane's softmax over its own keys, then the weights' pairs */
        int lanes[16];
        for (int l = 0; l < 16; l++) lanes[l] = 16 * a + l < queries ? seen[(16 * a + l) / group] : most;
        const __m512i own = _mm512_loadu_si512(lanes);
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int j = 0; j < most; j++) {
            float *s = w->st + (size_t)j * row + 16 * a;
            const __m512 kept = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), _mm512_cmpgt_epi32_mask(own, _mm512_set1_epi32(j)), _mm512_loadu_ps(s));
            _mm512_storeu_ps(s, kept);
            top = _mm512_max_ps(top, kept);
        }
        __m512 total = _mm512_setzero_ps();
        for (int j = 0; j < most; j++) {
            float *s = w->st + (size_t)j * row + 16 * a;
            const __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s), top));
            _mm512_storeu_ps(s, p);
            total = _mm512_add_ps(total, p);
        }
        inverse[a] = _mm512_div_ps(_mm512_set1_ps(1.0f), total);
        for (int i = 0; i < pairs; i++) {
            const __m512 first = _mm512_loadu_ps(w->st + (size_t)(2 * i) * row + 16 * a);
            const __m512 second = 2 * i + 1 < most ? _mm512_loadu_ps(w->st + (size_t)(2 * i + 1) * row + 16 * a) : _mm512_setzero_ps();
            _mm512_storeu_si512(w->pp + ((size_t)i * vectors + a) * 16,
                                _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(second, first)));
        }
    }
    for (int i = 0; i < pairs; i++)  /* the values as pairs of keys: word place(d) of pair i = (v_{2i,d}, v_{2i+1,d}) */
        for (int c = 0; c < D; c += 32) {
            const __m512i first = _mm512_loadu_si512(values + (size_t)(2 * i) * D + c);
            const __m512i second = 2 * i + 1 < most ? _mm512_loadu_si512(values + (size_t)(2 * i + 1) * D + c) : _mm512_setzero_si512();
            _mm512_storeu_si512(w->vp + (size_t)i * D + c, _mm512_unpacklo_epi16(first, second));
            _mm512_storeu_si512(w->vp + (size_t)i * D + c + 16, _mm512_unpackhi_epi16(first, second));
        }
    float ot[3 * 8 * 16];
    for (int a0 = 0; a0 < vectors; a0 += 3) {
        const int NV = vectors - a0 < 3 ? vectors - a0 : 3;
        for (int d0 = 0; d0 < D; d0 += 8) {
            int place[8];
            for (int k = 0; k < 8; k++) place[k] = pair_place(d0 + k);
            if (NV == 3) dots_values8(w->pp + 16 * a0, w->vp, place, pairs, vectors, D, 3, inverse + a0, ot);
            else if (NV == 2) dots_values8(w->pp + 16 * a0, w->vp, place, pairs, vectors, D, 2, inverse + a0, ot);
            else dots_values8(w->pp + 16 * a0, w->vp, place, pairs, vectors, D, 1, inverse + a0, ot);
            for (int a = 0; a < NV; a++)
                for (int l = 0; l < 16 && 16 * (a0 + a) + l < queries; l++) {
                    const int u = 16 * (a0 + a) + l;
                    float *o = out + (size_t)(u / group) * stride + (size_t)(u % group) * D + d0;
                    for (int k = 0; k < 8; k++) o[k] = ot[((size_t)a * 8 + k) * 16 + l];
                }
        }
    }
}

/* 16 float32 lanes as bfloat16, rounded as PyTorch's vectorized cast rounds them (to nearest even; a NaN
 * becomes 0xFFFF), denormals kept: a key the kernel writes has the bits `.to(torch.bfloat16)` gives it. */
static inline __m256i bfloat16_lanes(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0xFFFF));
    return _mm512_cvtepi32_epi16(rounded);
}

/* The pass's new keys and values k, v [R, Hkv, D] float32 into column writes[r] of slot slots[r], as the
 * store keeps them (bfloat16 rounded as above, or float32 as they are), before any row reads: a chain's
 * rows see the keys written beside them. */
static void write_rows(const float *k, const float *v, const int64_t *slots, const int64_t *writes, void *keys, void *values,
                       int R, int kv_heads, int capacity, int D, int bf16) {
#pragma omp for schedule(static)
    for (int item = 0; item < R * kv_heads; item++) {
        const int r = item / kv_heads, h = item % kv_heads;
        const size_t at = (((size_t)slots[r] * kv_heads + h) * capacity + (size_t)writes[r]) * D, from = (size_t)item * D;
        for (int d = 0; d < D; d += 16) {
            if (bf16) {
                _mm256_storeu_si256((__m256i *)((uint16_t *)keys + at + d), bfloat16_lanes(_mm512_loadu_ps(k + from + d)));
                _mm256_storeu_si256((__m256i *)((uint16_t *)values + at + d), bfloat16_lanes(_mm512_loadu_ps(v + from + d)));
            } else {
                _mm512_storeu_ps((float *)keys + at + d, _mm512_loadu_ps(k + from + d));
                _mm512_storeu_ps((float *)values + at + d, _mm512_loadu_ps(v + from + d));
            }
        }
    }
}

/* Every row's attention (layout above) over a store of `store_slots` slots; 0 on success, -1 where a shape
 * is outside what it serves or a row would read or write outside the store (nothing is written then).
 * With new_keys and new_values (not NULL), the rows' own keys and values are written first (write_rows, at `writes`). Consecutive
 * rows of one slot that read its leading columns (a chain's, a prompt chunk's) share an item, so their
 * keys come from memory once; runs are cut so the threads still get about four items each. `prompt` (R flags, or
 * NULL): rows that are prompt positions, which take bfloat16 dot products (dots_run) where the store is bfloat16
 * and the tile unit is not used; the caller passes it only where the CPU has AVX-512 BF16. */
int specd_attend_rows(const float *q, void *keys, void *values, const int64_t *slots, const int32_t *seen,
                      const int64_t *columns, int columns_width, float *out, int R, int heads, int kv_heads, int store_slots,
                      int capacity, int D, float scale, int bf16, int threads, int amx,
                      const float *new_keys, const float *new_values, const int64_t *writes, const uint8_t *prompt) {
    const int group = heads / kv_heads;
    const int tiles = amx && bf16 && D % 32 == 0;
    const int dots = prompt && bf16 && !tiles && !columns && D % 32 == 0;  /* prompt rows by dot products (dots_run) */
    if (D % 16 || group > MAX_GROUP || heads % kv_heads) return -1;
    int most = 1;
    for (int r = 0; r < R; r++) {
        if (slots[r] < 0 || slots[r] >= store_slots || seen[r] < 1 || seen[r] > (columns ? columns_width : capacity)) return -1;
        for (int j = 0; columns && j < seen[r]; j++)
            if (columns[(size_t)r * columns_width + j] < 0 || columns[(size_t)r * columns_width + j] >= capacity) return -1;
        if (seen[r] > most) most = seen[r];
        if (new_keys && (writes[r] < 0 || writes[r] >= capacity)) return -1;
    }
    int longest = (R * kv_heads + 4 * threads - 1) / (4 * threads);  /* rows a run: enough items to share out */
    longest = columns ? 1 : longest < 1 ? 1 : longest > MAX_RUN ? MAX_RUN : longest;
    if (tiles && longest * group > 16) longest = 16 / group;  /* a run's queries fill one tile */
    int prompted = 0;  /* prompt rows by dot products: runs of them as long as the threads still get items */
    for (int r = 0; dots && r < R; r++) prompted += prompt[r] != 0;
    int longest_prompt = (prompted * kv_heads + 4 * threads - 1) / (4 * threads);
    longest_prompt = longest_prompt < 1 ? 1 : longest_prompt > PROMPT_RUN ? PROMPT_RUN : longest_prompt;
    int *starts = malloc(sizeof(int) * (R + 1)), runs = 0;
    if (!starts) return -1;
    for (int r = 0; r < R; runs++) {
        starts[runs] = r;
        const int first = r++, by_dots = prompted && prompt[first], limit = by_dots ? longest_prompt : longest;
        while (r < R && r - first < limit && slots[r] == slots[first] && (prompted && prompt[r]) == by_dots) r++;
    }
    starts[runs] = R;
    const size_t scratch = (size_t)longest * group * ((most + 15) / 16 * 16);
    int short_of_memory = 0;
    const size_t vectors = ((size_t)longest_prompt * group + 15) / 16, keys_up = (most + 3) / 4 * 4, pairs = (most + 1) / 2;
#pragma omp parallel num_threads(threads)
    {
        if (new_keys)  /* its loop ends in a barrier: every row's keys are in before any row reads */
            write_rows(new_keys, new_values, slots, writes, keys, values, R, kv_heads, capacity, D, bf16);
        float *scores = aligned_alloc(64, (scratch * sizeof(float) + 63) / 64 * 64);
        dots_scratch mine = {0};
        if (prompted) {  /* a thread whose scratch is not there attends nothing and the call fails */
            mine.qt = malloc(sizeof(uint32_t) * vectors * 16 * (size_t)D / 2);
            mine.pp = malloc(sizeof(uint32_t) * pairs * vectors * 16);
            mine.vp = malloc(sizeof(uint32_t) * pairs * (size_t)D);
            mine.st = malloc(sizeof(float) * keys_up * vectors * 16);
        }
        tile_scratch own = {0};
        char *block = NULL;
        if (tiles) {  /* one block a thread: parts, pparts, pairs, gathered, zeros (bfloat16), then ctile, sums */
            configure_scores();
            const size_t parts = (size_t)D / 32 * 3 * 512, words = parts + 3 * 512 + 4 * 512 + 16 * (size_t)D + (size_t)D;
            block = aligned_alloc(64, (words * sizeof(uint16_t) + 5 * 256 * sizeof(float) + 63) / 64 * 64 + 64);
            own.parts = (uint16_t *)block;
            own.pparts = own.parts + parts;
            own.pairs = own.pparts + 3 * 512;
            own.gathered = own.pairs + 4 * 512;
            own.zeros = own.gathered + 16 * (size_t)D;
            memset(own.zeros, 0, sizeof(uint16_t) * D);
            own.ctile = (float *)(block + (words * sizeof(uint16_t) + 63) / 64 * 64);
            own.sums = own.ctile + 256;
        }
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < runs * kv_heads; item++) {
            if (prompted && !(mine.qt && mine.pp && mine.vp && mine.st)) {
                short_of_memory = 1;
                continue;
            }
            const int run = item / kv_heads, h = item % kv_heads, r = starts[run];
            const size_t head = ((size_t)slots[r] * kv_heads + h) * capacity * D;
            const char *k = (const char *)keys + head * (bf16 ? 2 : 4), *v = (const char *)values + head * (bf16 ? 2 : 4);
            const float *qr = q + ((size_t)r * heads + (size_t)h * group) * D;
            const int64_t *cr = columns ? columns + (size_t)r * columns_width : NULL;
            float *o = out + ((size_t)r * heads + (size_t)h * group) * D;
            if (prompted && prompt[r]) dots_run(qr, (size_t)heads * D, (const uint16_t *)k, (const uint16_t *)v, seen + r, starts[run + 1] - r, group, D, scale, o, &mine);
            else if (bf16) attend_run(qr, (size_t)heads * D, k, v, cr, seen + r, starts[run + 1] - r, group, D, 1, scale, scores, o, tiles, capacity, &own);
            else attend_run(qr, (size_t)heads * D, k, v, cr, seen + r, starts[run + 1] - r, group, D, 0, scale, scores, o, 0, capacity, &own);
        }
        free(scores);
        free(mine.qt);
        free(mine.pp);
        free(mine.vp);
        free(mine.st);
        if (tiles) {
            free(block);
            _tile_release();
        }
    }
    free(starts);
    return short_of_memory ? -1 : 0;
}
