/* What specd's kernels share: Intel AMX's tile configuration (palette 1), the widening of bfloat16 lanes
 * to float32, the vector exp of attention's softmax and of SiLU, and the int4 and int8 products' entry points (for
 * the native decoder's and the Medusa heads' calls). */
#ifndef SPECD_TILES_H
#define SPECD_TILES_H
#include <immintrin.h>
#include <stdint.h>

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* 16 bfloat16 as the float32 they are exactly (a bfloat16's bits are a float32's upper half). */
static inline __attribute__((always_inline)) __m512 bfloat16_to_ps(__m256i words) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16));
}

/* The low (words 0..15) and high (16..31) halves of 32 bfloat16 as float32. */
static inline __attribute__((always_inline)) __m512 low_bfloat16_to_ps(__m512i words) {
    return bfloat16_to_ps(_mm512_castsi512_si256(words));
}
static inline __attribute__((always_inline)) __m512 high_bfloat16_to_ps(__m512i words) {
    return bfloat16_to_ps(_mm512_extracti64x4_epi64(words, 1));
}

/* exp(x) for x <= 0 (scores less their max), 16 at a time: 2^k · P(f) with x = k·ln2 + f, |f| <= ln2/2;
 * a degree-6 polynomial (Cephes' expf coefficients), within 2 ulp; below -87 it is 0. */
static inline __m512 exp_nonpositive(__m512 x) {
    const __m512 low = _mm512_set1_ps(-87.0f);
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, low, _CMP_LT_OQ);
    x = _mm512_max_ps(x, low);
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    f = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), f);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.0f)));
    const __m512 scaled = _mm512_scalef_ps(p, k);
    return _mm512_mask_mov_ps(scaled, tiny, _mm512_setzero_ps());
}

/* silu(g) = g · σ(g), 16 at a time: σ(g) = 1 / (1 + e) for g ≥ 0 and e / (1 + e) below, e = exp(-|g|). */
static inline __m512 silu16(__m512 gate) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 e = exp_nonpositive(_mm512_min_ps(gate, _mm512_sub_ps(_mm512_setzero_ps(), gate)));
    const __mmask16 negative = _mm512_cmp_ps_mask(gate, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_mul_ps(gate, _mm512_div_ps(_mm512_mask_mov_ps(one, negative, e), _mm512_add_ps(one, e)));
}

typedef struct { /* a product's packed weight (int4_tiles.pack) */
    const uint8_t *nibbles;
    const uint16_t *scale, *zero;
} specd_int4;

/* out [M, N] = x [M, K] · Wᵀ (int4_tiles.c): (x, nibbles, scale, zero, out, M, K, N, threads, floats) */
typedef void (*int4_kernel)(const void *, const uint8_t *, const uint16_t *, const uint16_t *, void *, int, int, int, int, int);
void specd_int4_mm(const void *, const uint8_t *, const uint16_t *, const uint16_t *, void *, int, int, int, int, int);
void specd_int4_mm_avx512(const void *, const uint8_t *, const uint16_t *, const uint16_t *, void *, int, int, int, int, int);
void specd_int4_prompt_mm(const void *, const uint8_t *, const uint16_t *, const uint16_t *, void *, int, int, int, int, int);
void specd_int4_mm_vnni(const void *, const uint8_t *, const uint16_t *, const uint16_t *, void *, int, int, int, int, int);

/* out [M, N] = x [M, K] · Wᵀ for 8-bit weights (int4_tiles.c): (x, weights, scale, out, M, K, N, threads, floats) */
typedef void (*int8_kernel)(const void *, const int8_t *, const float *, void *, int, int, int, int, int);
void specd_int8_mm(const void *, const int8_t *, const float *, void *, int, int, int, int, int);
void specd_int8_mm_avx512(const void *, const int8_t *, const float *, void *, int, int, int, int, int);

/* The products of an instruction set's code (int4_tiles.CODES): 0 AMX, 1 AVX-512 BF16, 2 AVX-512 VNNI (its
 * 8-bit weights as AVX-512 BF16's). */
static inline int4_kernel int4_kernel_for(int isa) {
    return isa == 2 ? specd_int4_mm_vnni : isa == 1 ? specd_int4_mm_avx512 : specd_int4_mm;
}
static inline int8_kernel int8_kernel_for(int isa) {
    return isa ? specd_int8_mm_avx512 : specd_int8_mm;
}

#endif
