/* Intel AMX's tile configuration (palette 1), shared by the kernels that use the tile unit, and the
 * widening of bfloat16 lanes to float32 both kernels do. */
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

#endif
