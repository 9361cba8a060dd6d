// Linear layers, y[M, N] = x[M, K] @ w[N, K]^T, with the weights in the three forms
// the CPU backend repacks every checkpoint format into (engine/backends/cpu/weights.py):
//
//   u4:    blocks of 32 weights, w = d * q + m with q a nibble: codes [N, K / 2] (in
//          GROUP_LAYOUT, below), d and m float32 [N, K / 32].
//   u8:    the same with q a byte: codes [N, K].
//   float: float32, bfloat16, float16 or FP8 e4m3 values times a scale per group of
//          columns, multiplied in float32 as the numpy reference does.
//
// u4 and u8 multiply integers: the activations are first quantized to int16 in blocks
// of 32, each with its scale sx = max|x| / 32767, so that a block's 32 products are
// integer multiply-adds (VNNI's vpdpwssd, or vpmaddwd) and
//     sum_k w[k] x[k] = sum_blocks sx (d dot(q, xq) + m sum(xq)),
// accumulated in float32. int16 keeps a product within about 1e-5 of float32's (int8,
// llama.cpp's choice, errs by a logit on small models, enough to flip greedy choices).
// Rows of w are shared out among the threads; each row is read once for all of x's rows.
#include <omp.h>

#include "common.h"

#define TILE 8  // rows of x a weight row meets while it is in registers
// GROUP_LAYOUT: a row's blocks go by groups of 8 (those left over, in order, after the
// last group). In a group, one vector of 16 int16 holds weights j and j + 1 of each
// of the 8 blocks, so that a multiply-add of pairs (dot_i16) sums each block in its
// own 32-bit lane: 16 of them make the group's 8 block sums with no shuffling.
#define GROUP 8
// Whether a product is worth more threads: below this many multiply-adds, waking them
// costs more than it saves.
#define PARALLEL_MACS (1 << 16)

int threads = 1;

void set_threads(int n) { threads = n; }

// xq[r, :], sx[r, :] and xs[r, :] (= sx * sum(xq) per block) from x[r, :k] (columns
// perm[c] where perm is given: act-order checkpoints), zero-padded to kp columns; xq in
// GROUP_LAYOUT, as the weights are.
void quantize_rows(const float *x, int ldx, int m, int k, int kp, const int32_t *perm, int16_t *xq, float *sx,
                   float *xs) {
    const int nb = kp / BLOCK, grouped = nb / GROUP * GROUP;
#pragma omp parallel for schedule(static) num_threads(threads) if ((size_t)m * k > PARALLEL_MACS / 16)
    for (int r = 0; r < m; r++) {
        const float *row = x + (size_t)r * ldx;
        for (int b = 0; b < nb; b++) {
            float v[BLOCK], amax = 0.0f;
            for (int j = 0; j < BLOCK; j++) {
                int c = b * BLOCK + j;
                v[j] = c < k ? row[perm ? perm[c] : c] : 0.0f;
                amax = fmaxf(amax, fabsf(v[j]));
            }
            float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
            int sum = 0;
            int16_t *q = xq + (size_t)r * kp;
            for (int j = 0; j < BLOCK; j++) {
                int16_t value = (int16_t)lrintf(v[j] * inv);
                // a group's vector j / 2 holds weights j and j + 1 of its 8 blocks, in turn
                int at = b < grouped ? (b - b % GROUP) * BLOCK + j / 2 * 16 + b % GROUP * 2 + j % 2 : b * BLOCK + j;
                q[at] = value;
                sum += value;
            }
            sx[(size_t)r * nb + b] = amax / 32767.0f;
            xs[(size_t)r * nb + b] = amax / 32767.0f * (float)sum;
        }
    }
}

// Rows a thread takes at a time: about 8 turns a thread, so that where the OS takes a
// core away (the server's other threads, another process) the others finish its rows.
static inline int chunk_rows(int n) {
    int chunk = n / (8 * threads);
    return chunk < 4 ? 4 : chunk;
}

// sum_b m[b] * xs[b]: the offsets of blocks that are not in a group
static inline float offsets(const float *m, const float *xs, int nb) {
    float sum = 0.0f;
    for (int b = 0; b < nb; b++) sum += m[b] * xs[b];
    return sum;
}

// acc + the block's 32 products: w0 and w1 its weights 0-15 and 16-31 as int16
static inline __m256 block_dot(__m256 acc, __m256i w0, __m256i w1, const int16_t *x, float d_sx) {
    __m256i p = dot_i16(_mm256_setzero_si256(), w0, _mm256_loadu_si256((const __m256i *)x));
    p = dot_i16(p, w1, _mm256_loadu_si256((const __m256i *)(x + 16)));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d_sx), acc);
}

// acc + a group's products for 8 blocks at once (w: its 16 vectors of weights, x the
// row's 16): lane i of the int32 sums is block i's dot product, scaled by d[i] sx[i];
// accm gathers the groups' offsets m[i] xs[i].
static inline __attribute__((always_inline)) void group_dot(__m256 *acc, __m256 *accm, const __m256i *w,
                                                            const int16_t *x, __m256 d, __m256 m, const float *sx,
                                                            const float *xs) {
    __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();  // (two chains)
    for (int j = 0; j < 16; j += 2) {
        p0 = dot_i16(p0, w[j], _mm256_loadu_si256((const __m256i *)(x + 16 * j)));
        p1 = dot_i16(p1, w[j + 1], _mm256_loadu_si256((const __m256i *)(x + 16 * j + 16)));
    }
    __m256 scale = _mm256_mul_ps(d, _mm256_loadu_ps(sx));
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)), scale, *acc);
    *accm = _mm256_fmadd_ps(m, _mm256_loadu_ps(xs), *accm);
}

// One weight row of u4 against `rows` (<= TILE) quantized rows of x. A group's 128
// bytes widen, 16 at a time, to two vectors of 16-bit weights: the low nibbles and
// the high ones (GROUP_LAYOUT). The blocks after the last group come in pairs of 32
// bytes, byte j holding the pair's first block's weight j in its low nibble and the
// second's in its high one.
static inline __attribute__((always_inline)) void u4_row(const int rows, float *y, int ldy, const int16_t *xq,
                                                         const float *sx, const float *xs, int kp, const uint8_t *wq,
                                                         const float *wd, const float *wm) {
    const int nb = kp / BLOCK, grouped = nb / GROUP * GROUP;
    const __m256i nibble = _mm256_set1_epi16(0x0F);
    __m256 acc[TILE], accm[TILE];
    for (int r = 0; r < rows; r++) acc[r] = accm[r] = _mm256_setzero_ps();
    for (int b = 0; b < grouped; b += GROUP) {
        __m256i w[16];
        for (int c = 0; c < 8; c++) {
            __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wq + b * BLOCK / 2 + 16 * c)));
            w[c] = _mm256_and_si256(v, nibble);
            w[c + 8] = _mm256_srli_epi16(v, 4);
        }
        const __m256 d = _mm256_loadu_ps(wd + b), m = _mm256_loadu_ps(wm + b);
        for (int r = 0; r < rows; r++)
            group_dot(&acc[r], &accm[r], w, xq + (size_t)r * kp + b * BLOCK, d, m, sx + (size_t)r * nb + b,
                      xs + (size_t)r * nb + b);
    }
    for (int b = grouped; b < nb; b += 2) {
        __m256i lo16 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wq + b * BLOCK / 2)));
        __m256i hi16 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wq + b * BLOCK / 2 + 16)));
        __m256i a0 = _mm256_and_si256(lo16, nibble), b0 = _mm256_srli_epi16(lo16, 4);
        __m256i a1 = _mm256_and_si256(hi16, nibble), b1 = _mm256_srli_epi16(hi16, 4);
        for (int r = 0; r < rows; r++) {
            const int16_t *x = xq + (size_t)r * kp + b * BLOCK;
            const float *s = sx + (size_t)r * nb + b;
            acc[r] = block_dot(acc[r], a0, a1, x, wd[b] * s[0]);
            acc[r] = block_dot(acc[r], b0, b1, x + BLOCK, wd[b + 1] * s[1]);
        }
    }
    for (int r = 0; r < rows; r++)
        y[(size_t)r * ldy] = hsum(_mm256_add_ps(acc[r], accm[r])) +
                             offsets(wm + grouped, xs + (size_t)r * nb + grouped, nb - grouped);
}

// One weight row of u8 against `rows` (<= TILE) quantized rows of x: groups of 256
// bytes in GROUP_LAYOUT, then the other blocks' 32 bytes in order.
static inline __attribute__((always_inline)) void u8_row(const int rows, float *y, int ldy, const int16_t *xq,
                                                         const float *sx, const float *xs, int kp, const uint8_t *wq,
                                                         const float *wd, const float *wm) {
    const int nb = kp / BLOCK, grouped = nb / GROUP * GROUP;
    __m256 acc[TILE], accm[TILE];
    for (int r = 0; r < rows; r++) acc[r] = accm[r] = _mm256_setzero_ps();
    for (int b = 0; b < grouped; b += GROUP) {
        __m256i w[16];
        for (int j = 0; j < 16; j++)
            w[j] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wq + b * BLOCK + 16 * j)));
        const __m256 d = _mm256_loadu_ps(wd + b), m = _mm256_loadu_ps(wm + b);
        for (int r = 0; r < rows; r++)
            group_dot(&acc[r], &accm[r], w, xq + (size_t)r * kp + b * BLOCK, d, m, sx + (size_t)r * nb + b,
                      xs + (size_t)r * nb + b);
    }
    for (int b = grouped; b < nb; b++) {
        __m256i w0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wq + b * BLOCK)));
        __m256i w1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wq + b * BLOCK + 16)));
        for (int r = 0; r < rows; r++)
            acc[r] = block_dot(acc[r], w0, w1, xq + (size_t)r * kp + b * BLOCK, wd[b] * sx[(size_t)r * nb + b]);
    }
    for (int r = 0; r < rows; r++)
        y[(size_t)r * ldy] = hsum(_mm256_add_ps(acc[r], accm[r])) +
                             offsets(wm + grouped, xs + (size_t)r * nb + grouped, nb - grouped);
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

// y[M, N] (row stride ldy) = the quantized x [M, kp] times w^T, w in u4 (bits 4) or u8 (bits 8).
void linear_q(float *y, int ldy, const int16_t *xq, const float *sx, const float *xs, int m, int kp,
              const uint8_t *codes, const float *d, const float *mins, int n, int bits) {
    const int nb = kp / BLOCK;
    const size_t row_bytes = (size_t)kp * bits / 8;
#pragma omp parallel for schedule(dynamic, chunk_rows(n)) num_threads(threads) if ((size_t)m * n * kp > PARALLEL_MACS)
    for (int o = 0; o < n; o++) {
        const uint8_t *wq = codes + o * row_bytes;
        const float *wd = d + (size_t)o * nb, *wm = mins + (size_t)o * nb;
        for (int r = 0; r < m; r += TILE) {
            const int rows = m - r < TILE ? m - r : TILE;
            float *yr = y + (size_t)r * ldy + o;
            const int16_t *xr = xq + (size_t)r * kp;
            const float *sr = sx + (size_t)r * nb, *xsr = xs + (size_t)r * nb;
            if (bits == 4) {
                FOR_TILE(u4_row, rows, yr, ldy, xr, sr, xsr, kp, wq, wd, wm)
            } else {
                FOR_TILE(u8_row, rows, yr, ldy, xr, sr, xsr, kp, wq, wd, wm)
            }
        }
    }
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

#define FLOAT_ROWS(rows, kind) \
    float_row(rows, kind, yr, ldy, xr, ldx, k, w, (size_t)o * k, scale ? scale + (size_t)o * groups : 0, group)
#define FLOAT_TILE(kind)                               \
    switch (rows) {                                    \
        case 1: FLOAT_ROWS(1, kind); break;            \
        case 2: FLOAT_ROWS(2, kind); break;            \
        case 3: FLOAT_ROWS(3, kind); break;            \
        default: FLOAT_ROWS(4, kind); break;           \
    }

// y[M, N] = x[M, K] @ (w[N, K] * scale[N, K / group])^T; K a multiple of 8 and of `group`
// (scale may be null: all ones).
void linear_float(float *y, int ldy, const float *x, int ldx, int m, int k, const void *w, int kind,
                  const float *scale, int group, int n) {
    const int groups = (k + group - 1) / group;
#pragma omp parallel for schedule(dynamic, chunk_rows(n)) num_threads(threads) if ((size_t)m * n * k > PARALLEL_MACS)
    for (int o = 0; o < n; o++) {
        for (int r = 0; r < m; r += 4) {
            const int rows = m - r < 4 ? m - r : 4;
            float *yr = y + (size_t)r * ldy + o;
            const float *xr = x + (size_t)r * ldx;
            switch (kind) {
                case F32: FLOAT_TILE(F32) break;
                case BF16: FLOAT_TILE(BF16) break;
                case F16: FLOAT_TILE(F16) break;
                default: FLOAT_TILE(E4M3) break;
            }
        }
    }
}
