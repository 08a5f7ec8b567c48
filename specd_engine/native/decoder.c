/* A flat pass's decoder layers in one call: every layer of an int4 Llama-shaped model over the pass's
 * rows, with no interpreter and no tensor framework between its products.
 *
 * Why: around its products and attention, a layer of the lean pass is ~30 framework operators (two
 * RMSNorms of five, the rotation, casts, SiLU, the residual adds) and the Python that calls them. On a
 * 2-vCPU Xeon they were a third of a pass: 4.6 of 13.9 ms for one row, 10.1 of 31.3 ms for 8 sessions × 4
 * rows. Here they are loops over rows between direct calls of specd's kernels, the CPU's counterpart of a
 * replayed CUDA graph: the host does almost nothing per layer.
 *
 * Per layer, over rows x [R, C] float32 (the residual stream, updated in place):
 *   h = x / sqrt(mean(x²) + eps) · input_norm       a row's sum of squares in 16 lanes, then their sum
 *   qkv = h · Wqkvᵀ                                   int4 (specd_int4_mm), rounded to bfloat16
 *   q, k = x·cos + roll(x, D/2)·signed sin            each head of the row at the row's position; v as it is
 *   a = attention(q over its slot's keys)             specd_attend_rows, which first writes the rows' k and v
 *   x += a · Woᵀ
 *   h = x / sqrt(mean(x²) + eps) · post_norm
 *   g, u = h · Wgate_upᵀ
 *   x += (silu(g) · u) · Wdownᵀ                       silu(g) = g · σ(g), σ from exp of -|g|
 * Every loop computes a row alone in a fixed order, and the products and attention keep a row's bits its own,
 * so a row's bits do not depend on what shares its pass or on the thread count. Prompt rows take the prompt
 * tiles in every product where the model asks for them (prompt_products), as the framework's pass does, and
 * bfloat16 dot products in attention where the caller asks (prompt_attention: attention.c's dots_run).
 *
 * Layout: x [R, C]; cos and sin [R, D] (sin with its first half negated); the store's keys and values
 * [S, Hkv, capacity, D]; slots, seen, columns and writes as specd_attend_rows takes them; captured
 * [R, captures, C]: x after each layer named in capture (1-based). C % 32 == 0, intermediate % 32 == 0.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tiles.h"

#define PARALLEL_ROWS 32 /* rows from which the loops between products share the threads (below, the fork costs more) */

int specd_attend_rows(const float *q, void *keys, void *values, const int64_t *slots, const int32_t *seen,
                      const int64_t *columns, int columns_width, float *out, int R, int heads, int kv_heads, int store_slots,
                      int capacity, int D, float scale, int bf16, int threads, int amx,
                      const float *new_keys, const float *new_values, const int64_t *writes, const uint8_t *prompt);

typedef struct {
    const float *input_norm, *post_norm; /* [C] */
    specd_int4 qkv, o, gate_up, down;    /* [(Hq + 2 Hkv) D, C], [C, Hq D], [2 I, C], [C, I] */
    void *keys, *values;                 /* this layer's store */
} specd_layer;

typedef struct {
    int layers, hidden, heads, kv_heads, head_dim, intermediate, store_slots, capacity, bf16_store;
    float eps, scaling;
    const specd_layer *layer; /* [layers] */
} specd_decoder;

typedef struct { /* which rows a product sends to which kernel */
    int rows, prompt;                         /* R, and how many are prompt rows (0: every row by int4) */
    const int32_t *prompt_rows, *other_rows;  /* ascending; NULL where a set is the run [first, first + count) */
    int prompt_first, other_first;
    int4_kernel mm, prompt_mm;
    float *gather_in, *gather_out;            /* a scattered set's rows, gathered */
    int threads;
} row_plan;

/* out rows (stride N) = in rows (stride K) · Wᵀ for one set of rows through `kernel`. */
static void product_part(int4_kernel kernel, const specd_int4 *w, const float *in, int K, float *out, int N,
                         const int32_t *rows, int first, int count, const row_plan *plan) {
    if (!count) return;
    if (!rows) {
        kernel(in + (size_t)first * K, w->nibbles, w->scale, w->zero, out + (size_t)first * N, count, K, N, plan->threads, 1);
        return;
    }
    for (int i = 0; i < count; i++) memcpy(plan->gather_in + (size_t)i * K, in + (size_t)rows[i] * K, sizeof(float) * K);
    kernel(plan->gather_in, w->nibbles, w->scale, w->zero, plan->gather_out, count, K, N, plan->threads, 1);
    for (int i = 0; i < count; i++) memcpy(out + (size_t)rows[i] * N, plan->gather_out + (size_t)i * N, sizeof(float) * N);
}

/* out [R, N] = in [R, K] · Wᵀ, rounded to bfloat16 (as float32): prompt rows by the prompt kernel, the rest by int4. */
static void product(const row_plan *plan, const specd_int4 *w, const float *in, int K, float *out, int N) {
    if (!plan->prompt) {
        plan->mm(in, w->nibbles, w->scale, w->zero, out, plan->rows, K, N, plan->threads, 1);
        return;
    }
    product_part(plan->prompt_mm, w, in, K, out, N, plan->prompt_rows, plan->prompt_first, plan->prompt, plan);
    product_part(plan->mm, w, in, K, out, N, plan->other_rows, plan->other_first, plan->rows - plan->prompt, plan);
}

/* h = x / sqrt(mean(x²) + eps) · weight, row by row (LlamaRMSNorm in float32). */
static void rms_rows(const float *x, const float *weight, float *h, int R, int C, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (R >= PARALLEL_ROWS)
    for (int r = 0; r < R; r++) {
        const float *row = x + (size_t)r * C;
        __m512 squares = _mm512_setzero_ps();
        for (int c = 0; c < C; c += 16) {
            const __m512 v = _mm512_loadu_ps(row + c);
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        const __m512 inverse = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / C + eps));
        for (int c = 0; c < C; c += 16)
            _mm512_storeu_ps(h + (size_t)r * C + c, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(row + c), inverse), _mm512_loadu_ps(weight + c)));
    }
}

/* q [R, Hq, D] and k [R, Hkv, D] rotated from qkv [R, (Hq + 2 Hkv) D] at each row's position, v [R, Hkv, D] copied. */
static void rotate_rows(const float *qkv, const float *cos, const float *sin, float *q, float *k, float *v,
                        int R, int heads, int kv_heads, int D, int threads) {
    const int width = (heads + 2 * kv_heads) * D, half = D / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (R >= PARALLEL_ROWS)
    for (int r = 0; r < R; r++) {
        const float *c = cos + (size_t)r * D, *s = sin + (size_t)r * D;
        for (int j = 0; j < heads + kv_heads; j++) {
            const float *from = qkv + (size_t)r * width + (size_t)j * D;
            float *to = j < heads ? q + ((size_t)r * heads + j) * D : k + ((size_t)r * kv_heads + j - heads) * D;
            for (int d = 0; d < D; d++) to[d] = from[d] * c[d] + from[(d + half) % D] * s[d];
        }
        memcpy(v + (size_t)r * kv_heads * D, qkv + (size_t)r * width + (size_t)(heads + kv_heads) * D, sizeof(float) * kv_heads * D);
    }
}

/* act [R, I] = silu(g) · u for gu [R, 2 I] = (g, u). */
static void silu_rows(const float *gu, float *act, int R, int I, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (R >= PARALLEL_ROWS)
    for (int r = 0; r < R; r++) {
        const float *g = gu + (size_t)r * 2 * I, *u = g + I;
        for (int i = 0; i < I; i += 16)
            _mm512_storeu_ps(act + (size_t)r * I + i, _mm512_mul_ps(silu16(_mm512_loadu_ps(g + i)), _mm512_loadu_ps(u + i)));
    }
}

static inline int larger(int a, int b) { return a > b ? a : b; }

static void add_rows(float *x, const float *y, size_t count) {
    for (size_t i = 0; i < count; i++) x[i] += y[i];
}

/* 0, or -1 where attention refused the rows (a slot, width or column out of the store's range) or memory ran out. */
int specd_decoder_pass(const specd_decoder *m, float *x, int R, const float *cos, const float *sin,
                       const int64_t *slots, const int32_t *seen, const int64_t *columns, int columns_width, const int64_t *writes,
                       const int32_t *prompt_rows, int prompt_count, int prompt_products, int prompt_attention, int isa,
                       int amx_attention, const int32_t *capture, int captures, float *captured, int threads) {
    const int C = m->hidden, H = m->heads, Hkv = m->kv_heads, D = m->head_dim, I = m->intermediate;
    const int width = (H + 2 * Hkv) * D;
    const int widest_in = larger(C, larger(I, H * D)), widest_out = larger(width, larger(2 * I, C));  /* a product's K and N */
    const size_t floats = (size_t)R * (2 * C + width + 2 * H * D + 2 * Hkv * D + 3 * I + widest_in + widest_out);
    float *scratch = aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);
    const int products_prompt = prompt_products ? prompt_count : 0;  /* prompt rows the prompt tiles multiply */
    int32_t *others = products_prompt ? malloc(sizeof(int32_t) * (R - products_prompt + 1)) : NULL;
    uint8_t *attending = prompt_attention && prompt_count ? calloc(R, 1) : NULL;  /* prompt rows by dot products */
    if (!scratch || (products_prompt && !others) || (prompt_attention && prompt_count && !attending)) {
        free(scratch);
        free(others);
        free(attending);
        return -1;
    }
    for (int p = 0; attending && p < prompt_count; p++) attending[prompt_rows[p]] = 1;
    float *h = scratch, *qkv = h + (size_t)R * C, *q = qkv + (size_t)R * width, *k = q + (size_t)R * H * D;
    float *v = k + (size_t)R * Hkv * D, *attended = v + (size_t)R * Hkv * D, *out = attended + (size_t)R * H * D;
    float *gu = out + (size_t)R * C, *act = gu + (size_t)R * 2 * I, *gather_in = act + (size_t)R * I;
    row_plan plan = {R, products_prompt, prompt_rows, NULL, 0, 0, int4_kernel_for(isa), specd_int4_prompt_mm,
                     gather_in, gather_in + (size_t)R * widest_in, threads};
    if (products_prompt) {  /* each set as a run of consecutive rows where it is one (no gather), else its rows */
        int count = 0;
        for (int r = 0, p = 0; r < R; r++) {
            if (p < prompt_count && prompt_rows[p] == r) p++;
            else others[count++] = r;
        }
        if (prompt_rows[prompt_count - 1] - prompt_rows[0] + 1 == prompt_count) plan.prompt_first = prompt_rows[0], plan.prompt_rows = NULL;
        if (count && others[count - 1] - others[0] + 1 == count) plan.other_first = others[0];
        else plan.other_rows = others;
    }
    int failed = 0;
    for (int l = 0; l < m->layers && !failed; l++) {
        const specd_layer *layer = m->layer + l;
        rms_rows(x, layer->input_norm, h, R, C, m->eps, threads);
        product(&plan, &layer->qkv, h, C, qkv, width);
        rotate_rows(qkv, cos, sin, q, k, v, R, H, Hkv, D, threads);
        failed = specd_attend_rows(q, layer->keys, layer->values, slots, seen, columns, columns_width, attended, R, H, Hkv,
                                   m->store_slots, m->capacity, D, m->scaling, m->bf16_store, threads, amx_attention, k, v, writes, attending);
        product(&plan, &layer->o, attended, H * D, out, C);
        add_rows(x, out, (size_t)R * C);
        rms_rows(x, layer->post_norm, h, R, C, m->eps, threads);
        product(&plan, &layer->gate_up, h, C, gu, 2 * I);
        silu_rows(gu, act, R, I, threads);
        product(&plan, &layer->down, act, I, out, C);
        add_rows(x, out, (size_t)R * C);
        for (int c = 0; c < captures; c++)
            if (capture[c] == l + 1)
                for (int r = 0; r < R; r++) memcpy(captured + ((size_t)r * captures + c) * C, x + (size_t)r * C, sizeof(float) * C);
    }
    free(scratch);
    free(others);
    free(attending);
    return failed ? -1 : 0;
}
