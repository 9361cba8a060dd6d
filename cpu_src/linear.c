// Linear layers, y[M, N] = x[M, K] @ w[N, K]^T, with the weights in the three forms
// the CPU backend repacks every checkpoint format into (engine/backends/cpu/weights.py):
//
//   u4:    blocks of 32 weights, w = d * q + m with q a nibble: codes [N, K / 2] (in
//          GROUP_LAYOUT, below), and each block's d and m (struct scales).
//   u8:    the same with q a byte: codes [N, K].
//   float: float32, bfloat16, float16 or FP8 e4m3 values times a scale per group of
//          columns, multiplied in float32 as the numpy reference does.
//
// u4 and u8 multiply integers: the activations are first quantized in blocks of 32, each
// with its scale sx = max|x| / L, so that a block's 32 products are integer
// multiply-adds and
//     sum_k w[k] x[k] = sum_blocks sx (d dot(q, xq) + m sum(xq)),
// accumulated in float32. Two precisions (`act`, the bytes an activation takes):
//   int16 (act 2, L = 32767, the default): vpdpwssd; a product within about 1e-5 of
//     float32's.
//   int8 (act 1, L = 127): llama.cpp's; vpdpbusd does twice vpdpwssd's multiply-adds an
//     instruction (products of 8 rows 1.3-1.5x as fast). It moves SmolLM2's logits by
//     ~4e-2 (relative L2), its perplexity not at all, turning near ties as llama.cpp does.
// Rows of w are shared out among the threads (pool.c); each is read once for all of x's rows.
//
// PANEL_LAYOUT: a matrix of more than PANEL columns is stored as panels of PANEL columns
// (the last one what is left), each panel [N, its columns] with its scales [N, its
// blocks], one after the other. A thread multiplies its rows panel by panel, so that
// the activations a panel meets (PANEL of them a row) stay in L1 while the weights stream
// past: a whole row of 8,192 columns (16 KB of int16) is evicted by them, and reading
// it from L2 slowed such products by a fifth.
#include "common.h"

#define TILE 8  // rows of x a weight row meets while it is in registers
// GROUP_LAYOUT: a row's blocks go by groups of 8, and those left over after the last
// group by pairs (rows have an even number of blocks: the repacking pads them). In a
// group of g blocks, with E = 4 / act activations to a 32-bit lane (a multiply-add of
// adjacent int16 sums 2 products into a lane, one of bytes 4), weights j to j + E - 1 of
// block i are elements E g (j / E) + E i on, so that one multiply-add sums each block in
// its own lanes with no shuffling: lane l holds block l % g's products. The activations
// are laid out alike, so that a group's or a pair's block sums, their scales and offsets
// are all lane by lane, and only a row's end sums across lanes.
#define GROUP 8
#define PAIR 2  // blocks of a pair
#define PANEL 2048  // columns (a multiple of GROUP blocks; PANEL_LAYOUT)
// Weight bytes read ahead of the group being multiplied (into L1: the rows come from
// memory, and the hardware's prefetcher alone keeps too few of them in flight).
#define AHEAD 1024
// Whether a product is worth more threads: below this many multiply-adds, waking them
// costs more than it saves.
#define PARALLEL_MACS (1 << 16)

// xq, sx and xs (= sx * sum(xq) per block) of one row x[:k] (columns perm[c] where
// perm is given: act-order checkpoints), zero-padded to kp columns; xq int8 (act 1) or
// int16 (act 2) in GROUP_LAYOUT, as the weights are.
static inline __attribute__((always_inline)) void quantize_row(const float *x, int k, int kp, const int32_t *perm,
                                                               const int act, void *xq, float *sx, float *xs) {
    const int nb = kp / BLOCK, grouped = nb / GROUP * GROUP, lane = 4 / act;
    const float levels = act == 1 ? 127.0f : 32767.0f;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < nb; b++) {
        float v[BLOCK];
        for (int j = 0; j < BLOCK; j++) {
            const int c = b * BLOCK + j;
            v[j] = c < k ? x[perm ? perm[c] : c] : 0.0f;
        }
        __m256 amax = _mm256_setzero_ps();
        for (int j = 0; j < BLOCK; j += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)));
        const float top = hmax(amax);
        const __m256 inv = _mm256_set1_ps(top > 0.0f ? levels / top : 0.0f);
        int32_t q[BLOCK];
        __m256i sum = _mm256_setzero_si256();
        for (int j = 0; j < BLOCK; j += 8) {  // (to nearest, ties to even, as lrintf)
            const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + j), inv));
            _mm256_storeu_si256((__m256i *)(q + j), r);
            sum = _mm256_add_epi32(sum, r);
        }
        const int g = b < grouped ? GROUP : PAIR;  // (the blocks of b's group or pair)
        const size_t first = (size_t)(b - b % g) * BLOCK;
        for (int j = 0; j < BLOCK; j++) {
            const size_t at = first + j / lane * lane * g + b % g * lane + j % lane;
            if (act == 1) ((int8_t *)xq)[at] = (int8_t)q[j]; else ((int16_t *)xq)[at] = (int16_t)q[j];
        }
        sx[b] = top / levels;
        xs[b] = top / levels * (float)hsum(_mm256_cvtepi32_ps(sum));
    }
}

// The fewest rows a thread takes at a time (pool.c: more while much is left): small,
// so that where the OS takes a core away (the server's other threads, another
// process) the others finish its rows, and the threads finish together; all of them
// where the product is too small to be worth waking other threads.
static inline int chunk_rows(int n, size_t macs) {
    if (macs < PARALLEL_MACS) return n;
    int chunk = n / (32 * threads);
    return chunk < 4 ? 4 : chunk;
}

static inline void prefetch(const uint8_t *p, int bytes) {
    for (int i = 0; i < bytes; i += 64) _mm_prefetch((const char *)(p + i), _MM_HINT_T0);
}

// A matrix's block scales: d and m in float32 or (half) float16, [N, blocks] each; or,
// where m is null, m = -d z with z a byte a block (zero-point formats, so that d can
// stay the checkpoint's float16), or, where z is null too, one zero point for every
// block (GGUF's Q4_0 and Q8_0: no bytes to read for it). Indexed by row * blocks + block.
struct scales {
    const void *d, *m;
    const uint8_t *z;
    int half, zero;
};

// Eight of a matrix's scales from p[i] on: a group's (`pair` 0), or a pair's two,
// repeated as lanes 0, 1, 0, 1, ... (`pair` 1), as a group's or pair's lanes are.
static inline __m256 scales_at(const void *p, size_t i, int half, const int pair) {
    if (pair && half) {
        int32_t two;  // (both float16)
        memcpy(&two, (const uint16_t *)p + i, sizeof(two));
        return _mm256_cvtph_ps(_mm_set1_epi32(two));
    }
    if (pair) return _mm256_castpd_ps(_mm256_broadcast_sd((const double *)((const float *)p + i)));
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
                : _mm256_loadu_ps((const float *)p + i);
}

static inline __m256 floats_at(const float *p, const int pair) { return scales_at(p, 0, 0, pair); }

// The offsets m of a group's or pair's blocks, lane by lane as scales_at: a pair's in
// lanes 0 and 1 alone (the others repeat them), so that each block's is added once.
static inline __m256 offsets_at(const struct scales *s, size_t i, __m256 d, const int pair) {
    __m256 m;
    if (s->m) {
        m = scales_at(s->m, i, s->half, pair);
    } else {
        __m256 z = _mm256_set1_ps((float)s->zero);
        if (s->z && pair) {
            uint16_t two;  // (both zero points)
            memcpy(&two, s->z + i, sizeof(two));
            z = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set1_epi16((short)two)));
        } else if (s->z) {
            z = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(s->z + i))));
        }
        m = _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), d), z);
    }
    return pair ? _mm256_blend_ps(_mm256_setzero_ps(), m, 0x03) : m;
}

// A group's or a pair's weights, widened to the activations' width (`act` bytes: u4
// nibbles to bytes or int16, u8 bytes to int16 where act is 2), in `n` registers of
// `wvec`, register i meeting the activations at byte REG * i of theirs. With AVX-512
// VNNI a register is a zmm; elsewhere a ymm. u4 codes: byte t of a group's (or a pair's)
// holds its element t in the low nibble and element t + 128 (a pair: t + 32) in the high
// one.
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
typedef __m512i wvec;
#define REG 64
static inline __m512i load_reg(const void *p) { return _mm512_loadu_si512(p); }
static inline void unpack_u4_words(wvec *w, const uint8_t *q, const int n) {
    const __m512i nibble = _mm512_set1_epi16(0x0F);
    for (int c = 0; c < n / 2; c++) {
        __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * c)));
        w[c] = _mm512_and_si512(v, nibble);
        w[c + n / 2] = _mm512_srli_epi16(v, 4);
    }
}
static inline void unpack_u8_words(wvec *w, const uint8_t *q, const int n) {
    for (int i = 0; i < n; i++) w[i] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * i)));
}
static inline void unpack_u4_bytes(wvec *w, const uint8_t *q, const int n) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    if (n == 1) {  // (a pair: 32 bytes, its first 32 elements low and the rest high)
        const __m256i v = _mm256_loadu_si256((const __m256i *)q), low = _mm256_set1_epi8(0x0F);
        w[0] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, low)),
                                  _mm256_and_si256(_mm256_srli_epi16(v, 4), low), 1);
        return;
    }
    for (int c = 0; c < n / 2; c++) {
        const __m512i v = _mm512_loadu_si512(q + REG * c);
        w[c] = _mm512_and_si512(v, nibble);
        w[c + n / 2] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    }
}
// acc + the 32-bit lane sums of multiply-adds of adjacent int16 (act 2) or bytes (act 1)
static inline __m512i dot_reg(__m512i acc, __m512i w, __m512i x, const int act, const int bits) {
    (void)bits;
    return act == 1 ? _mm512_dpbusd_epi32(acc, w, x) : _mm512_dpwssd_epi32(acc, w, x);
}
// a zmm's lanes l and l + 8 (the same block's) added
static inline __m256i fold_lanes(__m512i s) {
    return _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
}
#define ZERO_REG _mm512_setzero_si512
#define ADD_REG _mm512_add_epi32
#else
typedef __m256i wvec;
#define REG 32
static inline __m256i load_reg(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void unpack_u4_words(wvec *w, const uint8_t *q, const int n) {
    const __m256i nibble = _mm256_set1_epi16(0x0F);
    for (int c = 0; c < n / 2; c++) {
        __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(q + 16 * c)));
        w[c] = _mm256_and_si256(v, nibble);
        w[c + n / 2] = _mm256_srli_epi16(v, 4);
    }
}
static inline void unpack_u8_words(wvec *w, const uint8_t *q, const int n) {
    for (int j = 0; j < n; j++) w[j] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(q + 16 * j)));
}
static inline void unpack_u4_bytes(wvec *w, const uint8_t *q, const int n) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < n / 2; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + REG * c));
        w[c] = _mm256_and_si256(v, nibble);
        w[c + n / 2] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    }
}
static inline __m256i dot_reg(__m256i acc, __m256i w, __m256i x, const int act, const int bits) {
    return act == 1 ? dot_u8_i8(acc, w, x, bits) : dot_i16(acc, w, x);
}
static inline __m256i fold_lanes(__m256i s) { return s; }
#define ZERO_REG _mm256_setzero_si256
#define ADD_REG _mm256_add_epi32
#endif
static inline void unpack_u8_bytes(wvec *w, const uint8_t *q, const int n) {
    for (int i = 0; i < n; i++) w[i] = load_reg(q + REG * i);
}

// The lane sums of n registers of weights against x (in GROUP_LAYOUT), 8 lanes.
static inline __attribute__((always_inline)) __m256i lane_sums(const wvec *w, const int n, const char *x,
                                                               const int act, const int bits) {
    if (act == 1) {  // (one chain: rows overlap theirs, and for a group's 4 zmm 4 chains' adds cost more)
        wvec p = ZERO_REG();
        for (int i = 0; i < n; i++) p = dot_reg(p, w[i], load_reg(x + REG * i), act, bits);
        return fold_lanes(p);
    }
    wvec p[4] = {ZERO_REG(), ZERO_REG(), ZERO_REG(), ZERO_REG()};  // (four chains of adds)
    for (int i = 0; i < n; i++) p[i % 4] = dot_reg(p[i % 4], w[i], load_reg(x + REG * i), act, bits);
    return fold_lanes(ADD_REG(ADD_REG(p[0], p[1]), ADD_REG(p[2], p[3])));
}

// acc[r] + the products of a group of 8 blocks (pair 0) or of a pair (pair 1) of one
// weight row (codes q, scales from sc's `at`) with rows r of x from its block b on:
// lane by lane, scaled by d sx and offset by m xs there.
static inline __attribute__((always_inline)) void blocks_dot(const int rows, const int bits, const int act,
                                                             const int pair, __m256 *acc, const uint8_t *q,
                                                             const struct scales *sc, size_t at, const char *xq,
                                                             const float *sx, const float *xs, int kp, int nb, int b) {
    const int n = (pair ? PAIR : GROUP) * BLOCK * act / REG;
    wvec w[GROUP * BLOCK * 2 / REG];  // (room for a group of int16)
    prefetch(q + AHEAD, (pair ? PAIR : GROUP) * BLOCK * bits / 8);
    if (act == 1 && bits == 4) unpack_u4_bytes(w, q, n);
    else if (act == 1) unpack_u8_bytes(w, q, n);
    else if (bits == 4) unpack_u4_words(w, q, n);
    else unpack_u8_words(w, q, n);
    const __m256 d = scales_at(sc->d, at, sc->half, pair), m = offsets_at(sc, at, d, pair);
    #pragma GCC unroll 8  // (each row's accumulator a register of its own)
    for (int r = 0; r < rows; r++) {
        const size_t i = (size_t)r * nb + b;
        const __m256 sums = _mm256_cvtepi32_ps(lane_sums(w, n, xq + ((size_t)r * kp + b * BLOCK) * act, act, bits));
        acc[r] = _mm256_fmadd_ps(sums, _mm256_mul_ps(d, floats_at(sx + i, pair)), acc[r]);
        acc[r] = _mm256_fmadd_ps(m, floats_at(xs + i, pair), acc[r]);
    }
}

// One weight row of u4 or u8 (`bits`) against the columns of a panel: y[r * ldy] (+)=
// w . x[r] for `rows` (<= TILE) quantized rows of x (`act` bytes each), x[r] at xq + r *
// kp (sx and xs at r * nb), the panel `pk` columns, added to y where `add`. One
// accumulator a row of x (with 8 rows, two would not fit in the registers), its lanes
// summed at the end.
static inline __attribute__((always_inline)) void quantized_row(const int rows, const int bits, const int act,
                                                                float *y, int ldy, int add, const char *xq,
                                                                const float *sx, const float *xs, int kp, int nb,
                                                                int pk, const uint8_t *wq, const struct scales *sc,
                                                                size_t row) {
    const int pb = pk / BLOCK, grouped = pb / GROUP * GROUP;
    __m256 acc[TILE];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    int b = 0;
    for (; b < grouped; b += GROUP)
        blocks_dot(rows, bits, act, 0, acc, wq + b * BLOCK * bits / 8, sc, row + b, xq, sx, xs, kp, nb, b);
    for (; b < pb; b += PAIR)
        blocks_dot(rows, bits, act, 1, acc, wq + b * BLOCK * bits / 8, sc, row + b, xq, sx, xs, kp, nb, b);
    for (int r = 0; r < rows; r++) y[(size_t)r * ldy] = (add ? y[(size_t)r * ldy] : 0.0f) + hsum(acc[r]);
}

// The row kernels above with `rows` a constant, so that their accumulators stay in registers.
#define FOR_TILE(KERNEL, rows, ...)                     \
    switch (rows) {                                     \
        case 1: KERNEL(1, __VA_ARGS__); break;          \
        case 2: KERNEL(2, __VA_ARGS__); break;          \
        case 3: KERNEL(3, __VA_ARGS__); break;          \
        case 4: KERNEL(4, __VA_ARGS__); break;          \
        case 5: KERNEL(5, __VA_ARGS__); break;          \
        case 6: KERNEL(6, __VA_ARGS__); break;          \
        case 7: KERNEL(7, __VA_ARGS__); break;          \
        default: KERNEL(TILE, __VA_ARGS__); break;      \
    }

struct linear_q_args {
    float *y;
    int ldy, m, kp, n, bits, act;
    const char *xq;
    const float *sx, *xs;
    const uint8_t *codes;
    struct scales scales;
};

// Panel p's scales: those of the blocks from i = N * (its first column / BLOCK) on.
static inline struct scales panel_scales(const struct scales *s, size_t i) {
    const size_t size = s->half ? 2 : 4;
    return (struct scales){(const char *)s->d + i * size, s->m ? (const char *)s->m + i * size : NULL,
                           s->z ? s->z + i : NULL, s->half, s->zero};
}

// Output columns [begin, end) of linear_q.
static void linear_q_rows(void *ctx, int begin, int end) {
    const struct linear_q_args *a = ctx;
    const int nb = a->kp / BLOCK, ldy = a->ldy, kp = a->kp;
    // (a tile of x's rows against every weight row of the chunk, a panel at a time: the
    // tile's panel stays in L1 while the chunk's rows come from L2 or memory)
    for (int r = 0; r < a->m; r += TILE) {
        const int rows = a->m - r < TILE ? a->m - r : TILE;
        for (int c0 = 0; c0 < kp; c0 += PANEL) {
            const int pk = kp - c0 < PANEL ? kp - c0 : PANEL, add = c0 > 0;
            const size_t panel_bytes = (size_t)pk * a->bits / 8;
            const uint8_t *codes = a->codes + (size_t)a->n * c0 * a->bits / 8;
            const struct scales sc = panel_scales(&a->scales, (size_t)a->n * (c0 / BLOCK));
            const char *xr = a->xq + ((size_t)r * kp + c0) * a->act;
            const float *sr = a->sx + (size_t)r * nb + c0 / BLOCK, *xsr = a->xs + (size_t)r * nb + c0 / BLOCK;
            for (int o = begin; o < end; o++) {
                const uint8_t *wq = codes + o * panel_bytes;
                const size_t row = (size_t)o * (pk / BLOCK);
                float *yr = a->y + (size_t)r * ldy + o;
                if (a->bits == 4 && a->act == 1) {
                    FOR_TILE(quantized_row, rows, 4, 1, yr, ldy, add, xr, sr, xsr, kp, nb, pk, wq, &sc, row)
                } else if (a->bits == 4) {
                    FOR_TILE(quantized_row, rows, 4, 2, yr, ldy, add, xr, sr, xsr, kp, nb, pk, wq, &sc, row)
                } else if (a->act == 1) {
                    FOR_TILE(quantized_row, rows, 8, 1, yr, ldy, add, xr, sr, xsr, kp, nb, pk, wq, &sc, row)
                } else {
                    FOR_TILE(quantized_row, rows, 8, 2, yr, ldy, add, xr, sr, xsr, kp, nb, pk, wq, &sc, row)
                }
            }
        }
    }
}

// y[M, N] (row stride ldy) = x[M, k] (row stride ldx) @ w^T, w in u4 (bits 4) or u8
// (bits 8) over kp columns in PANEL_LAYOUT with its block scales (struct scales: d, m or
// z or zero, half), laid out for activations of `act` bytes: x quantized first into xq
// [M, kp] of them, sx and xs [M, kp / 32].
void linear_q(float *y, int ldy, const float *x, int ldx, int m, int k, const int32_t *perm, void *xq, float *sx,
              float *xs, int kp, const uint8_t *codes, const void *d, const void *mins, const uint8_t *zeros, int zero,
              int half, int n, int bits, int act) {
    const int nb = kp / BLOCK;
    for (int r = 0; r < m; r++) {
        const float *row = x + (size_t)r * ldx;
        char *out = (char *)xq + (size_t)r * kp * act;
        if (act == 1) quantize_row(row, k, kp, perm, 1, out, sx + (size_t)r * nb, xs + (size_t)r * nb);
        else quantize_row(row, k, kp, perm, 2, out, sx + (size_t)r * nb, xs + (size_t)r * nb);
    }
    struct linear_q_args a = {y, ldy, m, kp, n, bits, act, xq, sx, xs, codes, {d, mins, zeros, half, zero}};
    parallel_for(n, chunk_rows(n, (size_t)m * n * kp), linear_q_rows, &a);
}

// -- float weights ---------------------------------------------------------------------

enum { F32 = 0, BF16 = 1, F16 = 2, E4M3 = 3 };

// Eight weights as float32. An e4m3 byte moved into a float16's bits (sign, then the
// exponent and mantissa shifted up by 7) is its value / 256, subnormals included: the
// backend folds the 256 into the scales.
static inline __attribute__((always_inline)) __m256 load8(const void *w, size_t i, const int kind) {
    switch (kind) {
        case F32: return _mm256_loadu_ps((const float *)w + i);
        case BF16: {
            __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
            return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
        }
        case F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
        default: {
            __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)((const uint8_t *)w + i)));
            __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                     _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
            return _mm256_cvtph_ps(h);
        }
    }
}

// One weight row against `rows` (<= 4) rows of x: sum over groups of scale[g] * (w . x)
static inline __attribute__((always_inline)) void float_row(const int rows, const int kind, float *y, int ldy,
                                                            const float *x, int ldx, int k, const void *w, size_t wi,
                                                            const float *scale, int group) {
    __m256 acc[4];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int g0 = 0, g = 0; g0 < k; g0 += group, g++) {
        const int g1 = g0 + group < k ? g0 + group : k;
        __m256 part[4];
        for (int r = 0; r < rows; r++) part[r] = _mm256_setzero_ps();
        for (int i = g0; i < g1; i += 8) {
            __m256 v = load8(w, wi + i, kind);
            for (int r = 0; r < rows; r++) part[r] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + (size_t)r * ldx + i), part[r]);
        }
        const __m256 s = _mm256_set1_ps(scale ? scale[g] : 1.0f);
        for (int r = 0; r < rows; r++) acc[r] = _mm256_fmadd_ps(part[r], s, acc[r]);
    }
    for (int r = 0; r < rows; r++) y[(size_t)r * ldy] = hsum(acc[r]);
}

struct linear_float_args {
    float *y;
    int ldy, ldx, m, k, kind, group;
    const float *x, *scale;
    const void *w;
};

#define FLOAT_ROWS(rows, kind) \
    float_row(rows, kind, yr, a->ldy, xr, a->ldx, k, a->w, (size_t)o * k, a->scale ? a->scale + (size_t)o * groups : 0, a->group)
#define FLOAT_TILE(kind)                               \
    switch (rows) {                                    \
        case 1: FLOAT_ROWS(1, kind); break;            \
        case 2: FLOAT_ROWS(2, kind); break;            \
        case 3: FLOAT_ROWS(3, kind); break;            \
        default: FLOAT_ROWS(4, kind); break;           \
    }

// Output columns [begin, end) of linear_float.
static void linear_float_rows(void *ctx, int begin, int end) {
    const struct linear_float_args *a = ctx;
    const int k = a->k, groups = (k + a->group - 1) / a->group;
    for (int o = begin; o < end; o++) {
        for (int r = 0; r < a->m; r += 4) {
            const int rows = a->m - r < 4 ? a->m - r : 4;
            float *yr = a->y + (size_t)r * a->ldy + o;
            const float *xr = a->x + (size_t)r * a->ldx;
            switch (a->kind) {
                case F32: FLOAT_TILE(F32) break;
                case BF16: FLOAT_TILE(BF16) break;
                case F16: FLOAT_TILE(F16) break;
                default: FLOAT_TILE(E4M3) break;
            }
        }
    }
}

// y[M, N] = x[M, K] @ (w[N, K] * scale[N, K / group])^T; K and `group` multiples of 8
// (scale may be null: all ones).
void linear_float(float *y, int ldy, const float *x, int ldx, int m, int k, const void *w, int kind,
                  const float *scale, int group, int n) {
    struct linear_float_args a = {y, ldy, ldx, m, k, kind, group, x, scale, w};
    parallel_for(n, chunk_rows(n, (size_t)m * n * k), linear_float_rows, &a);
}

// linear_q and linear_float with their arguments in one array, in order (pointers and
// ints alike as int64): a step makes the same call every layer, so the caller packs
// them once rather than converting 20 arguments at each call.
void linear_q_packed(const int64_t *a) {
    linear_q((float *)a[0], (int)a[1], (const float *)a[2], (int)a[3], (int)a[4], (int)a[5], (const int32_t *)a[6],
             (void *)a[7], (float *)a[8], (float *)a[9], (int)a[10], (const uint8_t *)a[11], (const void *)a[12],
             (const void *)a[13], (const uint8_t *)a[14], (int)a[15], (int)a[16], (int)a[17], (int)a[18], (int)a[19]);
}

void linear_float_packed(const int64_t *a) {
    linear_float((float *)a[0], (int)a[1], (const float *)a[2], (int)a[3], (int)a[4], (int)a[5], (const void *)a[6],
                 (int)a[7], (const float *)a[8], (int)a[9], (int)a[10]);
}
