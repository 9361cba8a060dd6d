// The rest of a decoder layer in float32, as the numpy reference computes it
// (engine/backends/numpy_backend.py names each function's counterpart).
#include <stdlib.h>

#include "common.h"

// e^x for each lane: 2^n * e^r with n = round(x / ln 2) and |r| <= ln(2) / 2, e^r by
// its Taylor polynomial to degree 7 (relative error below 2e-7, as expf's).
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts, for an exact r
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// rms_norm: out[r] = weight * x[r] / sqrt(mean(x[r]^2) + eps), after x[r] += delta[r]
// where delta is given (the residual stream's add, fused); d a multiple of 8
void rms_norm(float *out, float *x, const float *delta, const float *weight, int rows, int d, float eps) {
    for (int r = 0; r < rows; r++) {
        float *xr = x + (size_t)r * d;
        __m256 ss = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            if (delta) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(delta + (size_t)r * d + i));
                _mm256_storeu_ps(xr + i, v);
            }
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum(ss) / d + eps));
        for (int i = 0; i < d; i += 8)
            _mm256_storeu_ps(out + (size_t)r * d + i,
                             _mm256_mul_ps(_mm256_loadu_ps(weight + i), _mm256_mul_ps(_mm256_loadu_ps(xr + i), inv)));
    }
}

// y += x, n floats
void add_to(float *y, const float *x, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_loadu_ps(x + i)));
    for (; i < n; i++) y[i] += x[i];
}

// silu_and_mul: out[r, i] = silu(gate) * up for gate_up[r] = [gate | up], `inter` each
// (a multiple of 8)
void silu_and_mul(float *out, const float *gate_up, int rows, int inter) {
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (size_t)r * 2 * inter, *u = g + inter;
        for (int i = 0; i < inter; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(out + (size_t)r * inter + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
    }
}

// apply_rope in place on `heads` heads of dim d at x (row stride ldx), "rotate half":
// the pair (x[i], x[i + d/2]) turns by the angle whose cos and sin are given per row.
static void rope_heads(float *x, int ldx, int rows, int heads, int d, const float *cos, const float *sin) {
    const int half = d / 2;
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++) {
            float *v = x + (size_t)r * ldx + h * d;
            const float *c = cos + (size_t)r * half, *s = sin + (size_t)r * half;
            for (int i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i] + a * s[i];
            }
        }
}

// The values of the e4m3 codes 0x00..0x7E (the non-negative finite ones), ascending.
static float e4m3_values[0x7F];

__attribute__((constructor)) static void fill_e4m3_values(void) {
    for (int code = 0; code < 0x7F; code++) {
        const int e = code >> 3, m = code & 7;
        e4m3_values[code] = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf((float)m, -9);
    }
}

// The e4m3 code nearest to x, saturating at +-448, a tie to the smaller magnitude (as
// the numpy backend's f32_to_e4m3 rounds; its test holds them equal)
static uint8_t e4m3_of(float x) {
    const float a = fminf(fabsf(x), 448.0f);
    int lo = 0, hi = 0x7E;  // the last value <= a is in lo..hi
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (e4m3_values[mid] <= a) lo = mid;
        else hi = mid - 1;
    }
    if (lo < 0x7E && e4m3_values[lo + 1] - a < a - e4m3_values[lo]) lo++;
    return (uint8_t)(lo | (x < 0 ? 0x80 : 0));
}

// 8 e4m3 codes as float32: each code's bits moved into a float's (sign; exponent and
// mantissa 20 places up, into the top of the float's), times 2^120 for the exponents'
// biases (7 against 127). Subnormal codes come out as subnormal floats and scale exactly.
static inline __m256 e4m3x8(const uint8_t *p) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
    const __m256i rest = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x7F)), 20);
    return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(sign, rest)), _mm256_set1_ps(0x1p120f));
}

// rope_and_cache: rotate the query and key heads of qkv [rows, (heads + 2 kv_heads) d]
// in place, then copy each row's K and V to its cache slot ([slots, kv_heads, d] caches
// of float32, or where fp8 of e4m3 codes of K * k_inv and V * v_inv: the reciprocals of
// the layer's scales, engine/quantization/kv_cache.py).
void rope_and_cache(float *qkv, int rows, int heads, int kv_heads, int d, const float *cos, const float *sin,
                    const int64_t *slots, void *k_cache, void *v_cache, int fp8, float k_inv, float v_inv) {
    const int ld = (heads + 2 * kv_heads) * d, kv = kv_heads * d;
    rope_heads(qkv, ld, rows, heads + kv_heads, d, cos, sin);
    for (int r = 0; r < rows; r++) {
        const float *k = qkv + (size_t)r * ld + heads * d;
        if (fp8) {
            uint8_t *kc = (uint8_t *)k_cache + slots[r] * kv, *vc = (uint8_t *)v_cache + slots[r] * kv;
            for (int i = 0; i < kv; i++) {
                kc[i] = e4m3_of(k[i] * k_inv);
                vc[i] = e4m3_of(k[kv + i] * v_inv);
            }
        } else {
            memcpy((float *)k_cache + slots[r] * kv, k, kv * sizeof(float));
            memcpy((float *)v_cache + slots[r] * kv, k + kv, kv * sizeof(float));
        }
    }
}

// the largest of x[0..n)
static float max_of(const float *x, int n) {
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 8 <= n; j += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(x + j));
    float top = hmax(top8);
    for (; j < n; j++) top = x[j] > top ? x[j] : top;
    return top;
}

// scores[j] = e^(scores[j] - top) for j < n; returns their sum
static float softmax_numerators(float *scores, int n, float top) {
    __m256 sum = _mm256_setzero_ps();
    const __m256 t = _mm256_set1_ps(top);
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), t));
        _mm256_storeu_ps(scores + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    float total = hsum(sum);
    for (; j < n; j++) total += scores[j] = expf(scores[j] - top);
    return total;
}

struct attention_args {
    float *out;
    const float *qkv;
    const void *k_cache, *v_cache;  // float32, or e4m3 codes (fp8)
    int heads, kv_heads, d, fp8;
    const int *q_row, *n, *start;
    const int64_t *slots, *slot_at;
    float scale, v_scale;
};

// Scores of a thread's tasks: grown as contexts need, kept between calls.
static _Thread_local float *scores;
static _Thread_local size_t capacity;

#define QUERY_TILE 8  // query rows (of a sequence and a kv head) that share each pass over its keys and values
#define AHEAD 8       // positions whose key and value are fetched while the scores of an earlier one are computed
#ifdef __AVX512VL__
#define YMM_REGISTERS 32  // (AVX-512 adds ymm16-31)
#else
#define YMM_REGISTERS 16
#endif

// 8 cached values (of K or V) from element `at` of a layer's cache.
static inline __attribute__((always_inline)) __m256 cached8(const void *cache, size_t at, const int fp8) {
    return fp8 ? e4m3x8((const uint8_t *)cache + at) : _mm256_loadu_ps((const float *)cache + at);
}

// The cache lines of n cached values from element `at`.
static inline __attribute__((always_inline)) void prefetch(const void *cache, size_t at, int n, const int fp8) {
    const char *p = (const char *)cache + at * (fp8 ? 1 : sizeof(float));
    for (int i = 0; i < n * (fp8 ? 1 : (int)sizeof(float)); i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

// The sums of each of the 8 vectors at p (8 floats apart) as one vector: a transpose by
// horizontal adds, about as many instructions for 8 sums as summing one alone takes.
static inline __m256 sums_of_8(const float *p) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_load_ps(p), _mm256_load_ps(p + 8));
    const __m256 t1 = _mm256_hadd_ps(_mm256_load_ps(p + 16), _mm256_load_ps(p + 24));
    const __m256 t2 = _mm256_hadd_ps(_mm256_load_ps(p + 32), _mm256_load_ps(p + 40));
    const __m256 t3 = _mm256_hadd_ps(_mm256_load_ps(p + 48), _mm256_load_ps(p + 56));
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // vectors 0-3's and 4-7's half sums
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// out[r] = inv[r] * sum_v scores[r * stride + v] * V[v] for a tile's tn rows, V the kv
// head's values (from element `head` of each cache row) at positions 0..last-1 of slots
// sl: each position's values read once for all the rows, `width` groups of 8 of them at
// a time (tn and width constants, so that the sums stay in registers).
static inline __attribute__((always_inline)) void weighted_values(const int tn, const int width, const int fp8,
                                                                  const struct attention_args *a, const int64_t *sl,
                                                                  int last, size_t head, const float *inv,
                                                                  float *const *out, size_t stride) {
    const int kv = a->kv_heads * a->d;
    for (int i0 = 0; i0 < a->d; i0 += 8 * width) {
        __m256 o[QUERY_TILE][4];
        for (int r = 0; r < tn; r++)
            for (int c = 0; c < width; c++) o[r][c] = _mm256_setzero_ps();
        for (int v = 0; v < last; v++) {
            __m256 values[4];
            for (int c = 0; c < width; c++) values[c] = cached8(a->v_cache, sl[v] * kv + head + i0 + 8 * c, fp8);
            for (int r = 0; r < tn; r++) {
                const __m256 p = _mm256_set1_ps(scores[r * stride + v]);
                for (int c = 0; c < width; c++) o[r][c] = _mm256_fmadd_ps(p, values[c], o[r][c]);
            }
        }
        for (int r = 0; r < tn; r++)
            for (int c = 0; c < width; c++)
                _mm256_storeu_ps(out[r] + i0 + 8 * c, _mm256_mul_ps(o[r][c], _mm256_set1_ps(inv[r])));
    }
}

// Query rows i0..i0+tn-1 of kv head g of sequence s (tn a constant, so that the tile's
// sums stay in registers; fp8 too, the cache's format, so that each copy reads one),
// row i being token i / group's query head g * group + i %
// group: the query heads that read the same keys and values, and the sequence's tokens,
// go together, so that each key and value is read once for the tile. The scores of the
// tile's rows are kept meanwhile (those past a row's own position zeroed).
static inline __attribute__((always_inline)) void query_tile(const int tn, const int fp8, const struct attention_args *a,
                                                             int s, int g, int i0, size_t stride) {
    const int d = a->d, ld = (a->heads + 2 * a->kv_heads) * a->d, kv = a->kv_heads * d;
    const int group = a->heads / a->kv_heads, start = a->start[s], last = start + (i0 + tn - 1) / group + 1;
    const int64_t *sl = a->slots + a->slot_at[s];
    const size_t head = (size_t)g * d;  // the kv head's first element in a cache row
    const float *q[QUERY_TILE];
    float *out[QUERY_TILE];
    int visible[QUERY_TILE];  // causal: positions 0..the row's own
    for (int r = 0; r < tn; r++) {
        const int t = (i0 + r) / group, h = g * group + (i0 + r) % group;
        q[r] = a->qkv + (size_t)(a->q_row[s] + t) * ld + h * d;
        out[r] = a->out + (size_t)(a->q_row[s] + t) * a->heads * d + h * d;
        visible[r] = start + t + 1;
    }
    // Scores: a row's products with a key summed to 8 lanes and kept; every 8 keys,
    // summed across the lanes 8 keys at once.
    float partial[QUERY_TILE][8][8] __attribute__((aligned(32)));
    for (int j = 0; j < last; j++) {
        const size_t k = sl[j] * kv + head;
        if (j + AHEAD < last) {  // (the rows are where the block table puts them: no prefetcher sees them coming)
            prefetch(a->k_cache, sl[j + AHEAD] * kv + head, d, fp8);
            prefetch(a->v_cache, sl[j + AHEAD] * kv + head, d, fp8);
        }
        __m256 acc[QUERY_TILE], acc2[QUERY_TILE];  // (two chains of adds a row)
        for (int r = 0; r < tn; r++) acc[r] = acc2[r] = _mm256_setzero_ps();
        int i = 0;
        for (; i + 16 <= d; i += 16) {
            const __m256 ki = cached8(a->k_cache, k + i, fp8), ki2 = cached8(a->k_cache, k + i + 8, fp8);
            for (int r = 0; r < tn; r++) {
                acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + i), ki, acc[r]);
                acc2[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + i + 8), ki2, acc2[r]);
            }
        }
        if (i < d) {
            const __m256 ki = cached8(a->k_cache, k + i, fp8);
            for (int r = 0; r < tn; r++) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + i), ki, acc[r]);
        }
        for (int r = 0; r < tn; r++) _mm256_store_ps(partial[r][j % 8], _mm256_add_ps(acc[r], acc2[r]));
        if (j % 8 == 7 || j == last - 1) {
            const int j0 = j / 8 * 8;
            for (int r = 0; r < tn; r++) {
                float sums[8];  // (a last group of fewer keys: its other lanes zeroed)
                for (int p = j % 8 + 1; p < 8; p++) _mm256_store_ps(partial[r][p], _mm256_setzero_ps());
                _mm256_storeu_ps(sums, _mm256_mul_ps(sums_of_8(partial[r][0]), _mm256_set1_ps(a->scale)));
                memcpy(scores + r * stride + j0, sums, (j - j0 + 1) * sizeof(float));
            }
        }
    }
    float inv[QUERY_TILE];
    for (int r = 0; r < tn; r++) {
        float *row = scores + r * stride;
        inv[r] = a->v_scale / softmax_numerators(row, visible[r], max_of(row, visible[r]));
        for (int j = visible[r]; j < last; j++) row[j] = 0.0f;
    }
    // (as many groups of 8 values at once as the rows' sums leave registers for)
    if (d % 32 == 0 && tn * 4 + 5 <= YMM_REGISTERS) weighted_values(tn, 4, fp8, a, sl, last, head, inv, out, stride);
    else if (d % 16 == 0 && tn * 2 + 3 <= YMM_REGISTERS) weighted_values(tn, 2, fp8, a, sl, last, head, inv, out, stride);
    else weighted_values(tn, 1, fp8, a, sl, last, head, inv, out, stride);
}

// Tasks [begin, end) of attention: task t is sequence t / kv_heads's kv head t %
// kv_heads, its query rows (tokens times the kv head's query heads) by tiles of QUERY_TILE.
// (a tile of tn rows, its cache's format a constant of each copy)
#define TILE(tn) (a->fp8 ? query_tile(tn, 1, a, s, g, i0, stride) : query_tile(tn, 0, a, s, g, i0, stride))
static void attention_tasks(void *ctx, int begin, int end) {
    const struct attention_args *a = ctx;
    for (int task = begin; task < end; task++) {
        const int s = task / a->kv_heads, g = task % a->kv_heads, rows = a->n[s] * (a->heads / a->kv_heads);
        const size_t stride = (size_t)a->start[s] + a->n[s];  // a query row's scores
        if (QUERY_TILE * stride > capacity) {
            free(scores);
            capacity = QUERY_TILE * stride;
            scores = malloc(sizeof(float) * capacity);
        }
        for (int i0 = 0; i0 < rows; i0 += QUERY_TILE) {
            switch (rows - i0 < QUERY_TILE ? rows - i0 : QUERY_TILE) {
                case 1: TILE(1); break;
                case 2: TILE(2); break;
                case 3: TILE(3); break;
                case 4: TILE(4); break;
                case 5: TILE(5); break;
                case 6: TILE(6); break;
                case 7: TILE(7); break;
                default: TILE(QUERY_TILE); break;
            }
        }
    }
}

// paged_attention of every sequence of a step. Sequence s has n[s] query rows from row
// q_row[s] of qkv (its positions start[s]..), and the cache slots of its positions
// 0..start[s]+n[s]-1 at slots + slot_at[s]. out [rows, heads * d]. The caches hold
// float32, or e4m3 codes (fp8: widened as they are read; `scale`, the softmax's, carries
// the keys' cache scale and v_scale multiplies the output: engine/quantization/kv_cache.py).
// The work is shared out by (sequence, kv head): each task reads its keys and values once
// for all the queries that attend to them.
void attention(float *out, const float *qkv, int heads, int kv_heads, int d, int num_seqs, const int *q_row,
               const int *n, const int *start, const int64_t *slots, const int64_t *slot_at, const void *k_cache,
               const void *v_cache, float scale, int fp8, float v_scale) {
    struct attention_args a = {out,   qkv, k_cache, v_cache, heads, kv_heads, d, fp8, q_row, n, start, slots, slot_at,
                               scale, v_scale};
    size_t work = 0;  // multiply-adds, as many again for the values
    for (int s = 0; s < num_seqs; s++) work += (size_t)n[s] * (start[s] + n[s]) * heads * d;
    const int tasks = num_seqs * kv_heads;
    parallel_for(tasks, work > (1 << 16) ? 1 : tasks, attention_tasks, &a);
}
