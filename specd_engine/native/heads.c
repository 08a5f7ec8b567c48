/* The Medusa heads' proposals in one call: every head's residual blocks, its product over the heads'
 * vocabulary and its best candidates, head after head, with no interpreter or tensor framework between.
 *
 * Why: a proposal is small products (a row or a few through 4-6 blocks of 576 × 1152-2304 weights, then
 * 8192 × 576 a head) joined by ~40 framework operators a head (the embedding gather, the cat, the bias,
 * SiLU, top-k, the float32 rescoring, logsumexp). On a 2-vCPU Xeon a served proposal of the default heads
 * took 2.27 ms beside a 6.4 ms pass, a quarter of the framework's time being the operators between the
 * products; one head alone 1.19 ms. Here those steps are loops over a row's values between direct calls
 * of specd's products: the blocks in 8 bits as the framework serves them (4 bits lost a point of held-out
 * position-1 hits), each head's product in 4-bit groups (40% fewer bytes than 8 bits: that product is
 * most of a proposal's bytes), its best columns rescored in float32.
 *
 * Head h (0-based) over rows x [N, H] (the target's final hidden state at each row), as MedusaHeads.ranked:
 *   u = [x ; e(t_0) ; … ; e(t_r)]          r = h when chained (t_j: the row's next token, then the earlier
 *                                           heads' best), else r = 0; e: the target's input embedding
 *   x ← x + silu(u · W0ᵀ + b0), then x ← x + silu(x · Wlᵀ + bl) for each further block (W: 8 bits a weight)
 *   s = x · Pᵀ                              P: the target's LM-head rows of the heads' vocabulary, int4
 *   the `rescored` best columns by s, rescored exactly (x · P32ᵀ, float32); the best `candidates` of those,
 *   each with exp(exact − logsumexp(s with those columns' exact scores)) as its confidence
 * A row's values are its own: every loop reads one row, and the products keep a row's bits its own at
 * any row count. Proposals are drafts the verify judges, so their rounding (4-bit weights, this exp)
 * costs at most acceptance, never exactness.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tiles.h"

typedef struct {
    const int8_t *weight; /* [H, in] in 8 bits (int4_tiles.pack8) */
    const float *scale;   /* [H] */
    const float *bias;    /* [H] */
    int in;            /* H · (1 + tokens the block reads): H for every block after a head's first */
} specd_heads_block;

typedef struct {
    int heads, layers, hidden, draft_vocab, chained, rescored;
    const specd_heads_block *block; /* [heads · layers], head after head */
    specd_int4 product;             /* the heads' LM-head rows [V', H] */
    const float *rows;              /* the same rows in float32 [V', H]: the candidates' exact scores */
    const float *embedding;         /* the target's input embedding [V, H] */
    const int64_t *vocab_ids;       /* [V']: the target id of each column */
} specd_heads;

/* Columns a row's candidates are chosen among: the `rescored` best, at least `candidates`, at most the vocabulary. */
static int rescored_count(const specd_heads *m, int candidates) {
    const int wanted = m->rescored > candidates ? m->rescored : candidates;
    return wanted < m->draft_vocab ? wanted : m->draft_vocab;
}

/* x [H] += silu(y + bias) */
static void residual_silu(float *x, const float *y, const float *bias, int H) {
    for (int i = 0; i < H; i += 16) {
        const __m512 g = _mm512_add_ps(_mm512_loadu_ps(y + i), _mm512_loadu_ps(bias + i));
        _mm512_storeu_ps(x + i, _mm512_add_ps(_mm512_loadu_ps(x + i), silu16(g)));
    }
}

/* log Σ exp over s [V] (V % 16 == 0) with the columns of exact [R] taking their exact scores: the 4-bit
 * scores' rounding would otherwise move the normalizer of a peaked row by its best column's error
 * (confidences off by a median 21% against float32's on 131 rows of three texts, 3.4% with this; the
 * framework's 8-bit path 6.4%). */
static float normalizer_of(const float *s, int V, const int *columns, const float *exact, int R) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int v = 0; v < V; v += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + v));
    float max = _mm512_reduce_max_ps(top);
    for (int j = 0; j < R; j++) max = exact[j] > max ? exact[j] : max;
    __m512 sum = _mm512_setzero_ps();
    const __m512 shift = _mm512_set1_ps(max);
    for (int v = 0; v < V; v += 16) sum = _mm512_add_ps(sum, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + v), shift)));
    float total = _mm512_reduce_add_ps(sum);
    for (int j = 0; j < R; j++) total += expf(exact[j] - max) - expf(s[columns[j]] - max);
    return max + logf(total);
}

/* best [count]: the columns of s [V] with the largest scores, best first (the lower column first on a tie). */
static void top_columns(const float *s, int V, int count, int *best) {
    float kept[count];
    int n = 0;
    for (int v = 0; v < V; v++) {
        if (n == count && s[v] <= kept[n - 1]) continue;
        int at = n < count ? n++ : count - 1;
        while (at > 0 && kept[at - 1] < s[v]) {
            kept[at] = kept[at - 1];
            best[at] = best[at - 1];
            at--;
        }
        kept[at] = s[v];
        best[at] = v;
    }
}

static float dot(const float *a, const float *b, int H) {
    __m512 sum = _mm512_setzero_ps();
    for (int i = 0; i < H; i += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), sum);
    return _mm512_reduce_add_ps(sum);
}

/* Each row's candidates of one head: tokens and confidences [candidates] from its scores s [V'] and x [H]. */
static void candidates_of(const specd_heads *m, const float *s, const float *x, int candidates, int *columns,
                          int64_t *tokens, float *probs) {
    const int R = rescored_count(m, candidates);
    float exact[R];
    top_columns(s, m->draft_vocab, R, columns);
    for (int j = 0; j < R; j++) exact[j] = dot(m->rows + (size_t)columns[j] * m->hidden, x, m->hidden);
    const float normalizer = normalizer_of(s, m->draft_vocab, columns, exact, R);
    for (int c = 0; c < candidates; c++) { /* selection by exact score, the earlier (better reduced) one on a tie */
        int pick = c;
        for (int j = c + 1; j < R; j++)
            if (exact[j] > exact[pick]) pick = j;
        const float score = exact[pick];
        const int column = columns[pick];
        memmove(exact + c + 1, exact + c, sizeof(float) * (pick - c));
        memmove(columns + c + 1, columns + c, sizeof(int) * (pick - c));
        exact[c] = score;
        columns[c] = column;
        tokens[c] = m->vocab_ids[column];
        probs[c] = expf(score - normalizer);
    }
}

/* The first `depth` heads' proposals for rows features [N, H] whose next tokens are next_tokens [N]: tokens
 * and probs [N, depth, candidates]. 0, or -1 when memory ran out or candidates exceed the vocabulary. */
int specd_heads_propose(const specd_heads *m, const float *features, const int64_t *next_tokens, int N, int depth,
                        int candidates, int isa, int threads, int64_t *tokens, float *probs) {
    const int H = m->hidden, V = m->draft_vocab;
    if (N <= 0 || depth <= 0 || candidates <= 0 || candidates > V) return N < 0 || depth < 0 || candidates > V ? -1 : 0;
    const int R = rescored_count(m, candidates);
    const int4_kernel mm = int4_kernel_for(isa);
    const int8_kernel mm8 = int8_kernel_for(isa);
    int widest = H;
    for (int b = 0; b < m->heads * m->layers; b++) widest = m->block[b].in > widest ? m->block[b].in : widest;
    float *x = malloc(sizeof(float) * N * H), *u = malloc(sizeof(float) * N * widest), *y = malloc(sizeof(float) * N * H);
    float *s = malloc(sizeof(float) * N * V);
    int64_t *chain = malloc(sizeof(int64_t) * N * (m->heads + 1)); /* [N, 1 + heads]: the tokens after each row */
    int *columns = malloc(sizeof(int) * R);
    const int failed = !x || !u || !y || !s || !chain || !columns;
    if (!failed) {
        for (int n = 0; n < N; n++) chain[n * (m->heads + 1)] = next_tokens[n];
        for (int h = 0; h < depth; h++) {
            memcpy(x, features, sizeof(float) * N * H); /* every head starts from the row's hidden state */
            for (int l = 0; l < m->layers; l++) {
                const specd_heads_block *b = m->block + h * m->layers + l;
                const float *in = x;
                if (l == 0 && b->in > H) { /* [x ; e(t_0) ; …] */
                    for (int n = 0; n < N; n++) {
                        float *row = u + (size_t)n * b->in;
                        memcpy(row, x + (size_t)n * H, sizeof(float) * H);
                        for (int t = 1; t * H < b->in; t++)
                            memcpy(row + t * H, m->embedding + (size_t)chain[n * (m->heads + 1) + t - 1] * H, sizeof(float) * H);
                    }
                    in = u;
                }
                mm8(in, b->weight, b->scale, y, N, b->in, H, threads, 1);
                for (int n = 0; n < N; n++) residual_silu(x + (size_t)n * H, y + (size_t)n * H, b->bias, H);
            }
            mm(x, m->product.nibbles, m->product.scale, m->product.zero, s, N, H, V, threads, 1);
            for (int n = 0; n < N; n++) {
                const size_t at = ((size_t)n * depth + h) * candidates;
                candidates_of(m, s + (size_t)n * V, x + (size_t)n * H, candidates, columns, tokens + at, probs + at);
                chain[n * (m->heads + 1) + h + 1] = tokens[at];
            }
        }
    }
    free(x);
    free(u);
    free(y);
    free(s);
    free(chain);
    free(columns);
    return failed ? -1 : 0;
}
