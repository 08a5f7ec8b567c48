/* Intel AMX's tile configuration (palette 1), shared by the kernels that use the tile unit. */
#ifndef SPECD_TILES_H
#define SPECD_TILES_H
#include <stdint.h>

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

#endif
