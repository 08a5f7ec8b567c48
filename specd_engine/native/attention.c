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
 * Layout: q and out [R, Hq, D] float32; keys and values [S, Hkv, capacity, D] float32 (the store's);
 * slots [R] int64, seen [R] int32, columns [R, width] int64 or NULL; D % 16 == 0.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_GROUP 16 /* query heads a key head */

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

/* One row's key head: its `group` queries q [group][D] over `seen` keys → out [group][D]. scores: scratch of
 * group × (seen rounded up to 16) floats. */
static void attend_head(const float *q, const float *keys, const float *values, const int64_t *columns, int seen, int group,
                        int D, float scale, float *scores, float *out) {
    const int chunks = D / 16, padded = (seen + 15) / 16 * 16;
    /* s_j for every query head: the key read once for all of them */
    for (int j = 0; j < seen; j++) {
        const float *k = keys + (size_t)(columns ? columns[j] : j) * D;
        for (int i = 0; i < group; i++) {
            const float *qi = q + (size_t)i * D;
            __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(qi), _mm512_loadu_ps(k));
            for (int c = 1; c < chunks; c++)
                sum = _mm512_fmadd_ps(_mm512_loadu_ps(qi + 16 * c), _mm512_loadu_ps(k + 16 * c), sum);
            scores[(size_t)i * padded + j] = _mm512_reduce_add_ps(sum) * scale;
        }
    }
    float inverse[MAX_GROUP];
    for (int i = 0; i < group; i++) {
        float *s = scores + (size_t)i * padded;
        for (int j = seen; j < padded; j++) s[j] = -INFINITY;  /* the last block's tail: exp gives 0 */
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int j = 0; j < padded; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
        __m512 total = _mm512_setzero_ps();
        for (int j = 0; j < padded; j += 16) {
            const __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));
            _mm512_storeu_ps(s + j, p);
            total = _mm512_add_ps(total, p);
        }
        inverse[i] = 1.0f / _mm512_reduce_add_ps(total);
    }
    /* Σ_j p_j v_j, lane by lane of D: the value read once for every query head */
    __m512 acc[MAX_GROUP][8];  /* D <= 128 in registers' worth; larger D loops below */
    for (int base = 0; base < chunks; base += 8) {
        const int width = chunks - base < 8 ? chunks - base : 8;
        for (int i = 0; i < group; i++)
            for (int c = 0; c < width; c++) acc[i][c] = _mm512_setzero_ps();
        for (int j = 0; j < seen; j++) {
            const float *v = values + (size_t)(columns ? columns[j] : j) * D + 16 * base;
            for (int c = 0; c < width; c++) {
                const __m512 vc = _mm512_loadu_ps(v + 16 * c);
                for (int i = 0; i < group; i++)
                    acc[i][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[(size_t)i * padded + j]), vc, acc[i][c]);
            }
        }
        for (int i = 0; i < group; i++)
            for (int c = 0; c < width; c++)
                _mm512_storeu_ps(out + (size_t)i * D + 16 * (base + c), _mm512_mul_ps(acc[i][c], _mm512_set1_ps(inverse[i])));
    }
}

/* Every row's attention (layout above) over a store of `store_slots` slots; 0 on success, -1 where a shape
 * is outside what it serves or a row would read outside the store (nothing is written then). */
int specd_attend_rows(const float *q, const float *keys, const float *values, const int64_t *slots, const int32_t *seen,
                      const int64_t *columns, int columns_width, float *out, int R, int heads, int kv_heads, int store_slots,
                      int capacity, int D, float scale, int threads) {
    const int group = heads / kv_heads;
    if (D % 16 || group > MAX_GROUP || heads % kv_heads) return -1;
    int most = 1;
    for (int r = 0; r < R; r++) {
        if (slots[r] < 0 || slots[r] >= store_slots || seen[r] < 1 || seen[r] > (columns ? columns_width : capacity)) return -1;
        for (int j = 0; columns && j < seen[r]; j++)
            if (columns[(size_t)r * columns_width + j] < 0 || columns[(size_t)r * columns_width + j] >= capacity) return -1;
        if (seen[r] > most) most = seen[r];
    }
    const size_t scratch = (size_t)group * ((most + 15) / 16 * 16);
#pragma omp parallel num_threads(threads)
    {
        float *scores = aligned_alloc(64, (scratch * sizeof(float) + 63) / 64 * 64);
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < R * kv_heads; item++) {
            const int r = item / kv_heads, h = item % kv_heads;
            const size_t head = ((size_t)slots[r] * kv_heads + h) * capacity * D;
            attend_head(q + ((size_t)r * heads + (size_t)h * group) * D, keys + head, values + head,
                        columns ? columns + (size_t)r * columns_width : NULL, seen[r], group, D, scale, scores,
                        out + ((size_t)r * heads + (size_t)h * group) * D);
        }
        free(scores);
    }
    return 0;
}
