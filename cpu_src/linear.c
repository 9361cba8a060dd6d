// Linear layers, y[M, N] = x[M, K] @ w[N, K]^T, with the weights in the three forms
// the CPU backend repacks every checkpoint format into (engine/backends/cpu/weights.py):
//
//   u4:    blocks of 32 weights, w = d * q + m with q a nibble: codes [N, K / 2] (in
//          TILE_LAYOUT, below), and each block's d and m (struct scales).
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
//     instruction. It moves SmolLM2's logits by ~4e-2 (relative L2), its perplexity not
//     at all, turning near ties as llama.cpp does.
//
// TILE_LAYOUT: the weight rows go by tiles of 16 (the last padded with zero rows), a row
// to a 32-bit lane of a zmm (a ymm holds half a tile), so that a multiply-add with one
// activation broadcast to every lane advances 16 rows at once, and a block's sums, its
// scales and offsets are all lane by lane: nothing is summed across lanes. A tile's
// block is E = 4 / act weights a lane times 32 / E slots: slot c holds weights E c to
// E c + E - 1 of each row, lane l's at bytes E l on. u8 codes hold slot c at byte 16 E c;
// u4 codes pair slot c (low nibble) with slot c + 16 / E (high), at byte 16 E c. A
// tile's blocks follow one another, and its block scales (d, m, z) are [tile, block, 16].
//
// PANEL_LAYOUT: a matrix of more than PANEL columns is stored as panels of PANEL columns
// (the last one what is left), each in TILE_LAYOUT with its scales, one after the other.
// A thread multiplies its tiles panel by panel, so that the activations a panel meets
// (PANEL of them a row) stay in L1 while the weights stream past.
//
// Tiles of w are shared out among the threads (pool.c); each is read once for up to
// X_ROWS rows of x.
//
// AMX: where the CPU has Intel's tile unit (AMX-INT8) and the OS lets the process use
// it, products of many rows multiply a block on it, 16 rows of x at a time: a tile's
// block of codes, laid out for it (TILE_LAYOUT with int8's 4 codes a lane is already
// its B operand), against x's block as A, int16 activations as two multiplies of their
// high and low bytes. The int32 sums are those of vpdpbusd and vpdpwssd, scaled to
// float32 by the same instructions, so the outputs are bit for bit the same.
#define _DEFAULT_SOURCE  // (syscall, for AMX's permission)
#include "common.h"

#define TILE_ROWS 16  // weight rows of a tile (TILE_LAYOUT)
#define PANEL 2048  // columns (a multiple of BLOCK; PANEL_LAYOUT)
// Weight bytes read ahead of the block being multiplied (into L1: the rows come from
// memory, and the hardware's prefetcher alone keeps too few of them in flight).
#define AHEAD 2048
// Whether a product is worth more threads: below this many multiply-adds, waking them
// costs more than it saves.
#define PARALLEL_MACS (1 << 16)

// xq, sx and xs (= sx * sum(xq) per block) of one row x[:k] (columns perm[c] where
// perm is given: act-order checkpoints), zero-padded to kp columns; xq int8 (act 1) or
// int16 (act 2), or, where `planes` (for the tile unit, which multiplies bytes), int16
// as two planes of kp bytes: the high bytes (signed), then the low ones (unsigned).
static inline __attribute__((always_inline)) void quantize_row(const float *x, int k, int kp, const int32_t *perm,
                                                               const int act, const int planes, void *xq, float *sx,
                                                               float *xs) {
    const float levels = act == 1 ? 127.0f : 32767.0f;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < kp / BLOCK; b++) {
        float v[BLOCK];
        for (int j = 0; j < BLOCK; j++) {
            const int c = b * BLOCK + j;
            v[j] = c < k ? x[perm ? perm[c] : c] : 0.0f;
        }
        __m256 amax = _mm256_setzero_ps();
        for (int j = 0; j < BLOCK; j += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)));
        const float top = hmax(amax);
        const __m256 inv = _mm256_set1_ps(top > 0.0f ? levels / top : 0.0f);
        __m256i sum = _mm256_setzero_si256();
        for (int j = 0; j < BLOCK; j += 8) {  // (to nearest, ties to even, as lrintf)
            const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + j), inv));
            sum = _mm256_add_epi32(sum, r);
            const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
            if (act == 1) {
                _mm_storel_epi64((__m128i *)((int8_t *)xq + b * BLOCK + j), _mm_packs_epi16(words, words));
            } else if (planes) {
                const __m128i high = _mm_srai_epi16(words, 8), low = _mm_and_si128(words, _mm_set1_epi16(0xFF));
                _mm_storel_epi64((__m128i *)((int8_t *)xq + b * BLOCK + j), _mm_packs_epi16(high, high));
                _mm_storel_epi64((__m128i *)((uint8_t *)xq + kp + b * BLOCK + j), _mm_packus_epi16(low, low));
            } else {
                _mm_storeu_si128((__m128i *)((int16_t *)xq + b * BLOCK + j), words);
            }
        }
        sx[b] = top / levels;
        xs[b] = top / levels * (float)hsum(_mm256_cvtepi32_ps(sum));
    }
}

// The fewest of a product's `units` (tiles, rows) a thread takes at a time (pool.c:
// more while much is left): few, at least `least`, so that where the OS takes a core
// away (the server's other threads, another process) the others finish its units, and
// the threads finish together; all of them where the product is too small to be worth
// waking other threads.
static inline int chunk_size(int units, size_t macs, int least) {
    if (macs < PARALLEL_MACS) return units;
    const int chunk = units / (32 * threads);
    return chunk < least ? least : chunk;
}

static inline void prefetch(const uint8_t *p, int bytes) {
    for (int i = 0; i < bytes; i += 64) _mm_prefetch((const char *)(p + i), _MM_HINT_T0);
}

// A matrix's block scales: d and m in float32 or (half) float16; or, where m is null,
// m = -d z with z a byte a block (zero-point formats, so that d can stay the
// checkpoint's float16), or, where z is null too, one zero point for every block
// (GGUF's Q4_0 and Q8_0: no bytes to read for it). [tile, block, 16] each (TILE_LAYOUT).
struct scales {
    const void *d, *m;
    const uint8_t *z;
    int half, zero;
};

// The registers of a tile's lanes: with AVX-512 a zmm holds the whole tile; elsewhere a
// ymm holds half of it, and a tile is multiplied a half at a time. ivec holds the
// integer codes and sums, fvec the float32 sums; LANES of them a register.
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
typedef __m512i ivec;
typedef __m512 fvec;
#define LANES 16
#define X_ROWS 8  // rows of x a tile's block meets while it is in registers
static inline ivec bytes_at(const uint8_t *p, const int act) {  // a slot's codes: 64 bytes, or 32 widened to int16
    return act == 1 ? _mm512_loadu_si512(p) : _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
}
static inline ivec low_nibbles(ivec v, const int act) {
    return _mm512_and_si512(v, act == 1 ? _mm512_set1_epi8(0x0F) : _mm512_set1_epi16(0x0F));
}
static inline ivec high_nibbles(ivec v, const int act) { return low_nibbles(_mm512_srli_epi16(v, 4), act); }
// acc + the lane sums of multiply-adds of adjacent int16 (act 2) or bytes (act 1) of w
// and of the 32 bits at x, broadcast
static inline ivec dot_lanes(ivec acc, ivec w, const void *x, const int act, const int bits) {
    int32_t b;
    memcpy(&b, x, sizeof(b));
    (void)bits;
    return act == 1 ? _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(b)) : _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32(b));
}
static inline fvec scales_at(const void *p, size_t i, int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)))
                : _mm512_loadu_ps((const float *)p + i);
}
static inline fvec zeros_at(const uint8_t *z) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)z))); }
// y[0, count) (+)= v's first `count` lanes
static inline void store_lanes(float *y, fvec v, int count, int add) {
    const __mmask16 mask = count >= LANES ? 0xFFFF : (__mmask16)((1u << count) - 1);
    if (add) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, y));
    _mm512_mask_storeu_ps(y, mask, v);
}
#define F(op) _mm512_##op
#define ZERO_I _mm512_setzero_si512
#else
typedef __m256i ivec;
typedef __m256 fvec;
#define LANES 8
#define X_ROWS 4  // (16 ymm registers: a block's 8 and 4 rows' sums)
static inline ivec bytes_at(const uint8_t *p, const int act) {
    return act == 1 ? _mm256_loadu_si256((const __m256i *)p) : _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
}
static inline ivec low_nibbles(ivec v, const int act) {
    return _mm256_and_si256(v, act == 1 ? _mm256_set1_epi8(0x0F) : _mm256_set1_epi16(0x0F));
}
static inline ivec high_nibbles(ivec v, const int act) { return low_nibbles(_mm256_srli_epi16(v, 4), act); }
static inline ivec dot_lanes(ivec acc, ivec w, const void *x, const int act, const int bits) {
    int32_t b;
    memcpy(&b, x, sizeof(b));
    return act == 1 ? dot_u8_i8(acc, w, _mm256_set1_epi32(b), bits) : dot_i16(acc, w, _mm256_set1_epi32(b));
}
static inline fvec scales_at(const void *p, size_t i, int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
                : _mm256_loadu_ps((const float *)p + i);
}
static inline fvec zeros_at(const uint8_t *z) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)z))); }
static inline void store_lanes(float *y, fvec v, int count, int add) {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    if (add) v = _mm256_add_ps(v, _mm256_maskload_ps(y, mask));
    _mm256_maskstore_ps(y, mask, v);
}
#define F(op) _mm256_##op
#define ZERO_I _mm256_setzero_si256
#endif

// The offsets m of a block's lanes from i on.
static inline fvec offsets_at(const struct scales *s, size_t i, fvec d) {
    if (s->m) return scales_at(s->m, i, s->half);
    const fvec z = s->z ? zeros_at(s->z + i) : F(set1_ps)((float)s->zero);
    return F(mul_ps)(F(sub_ps)(F(setzero_ps)(), d), z);
}

// acc + a block's int32 sums of lanes scaled to float32: d sx sums + m xs (xs = sx
// sum(xq)). The one scaling of both the vector and the tile unit's products.
static inline fvec scaled_sums(fvec acc, ivec sums, fvec d, fvec m, float sx, float xs) {
    acc = F(fmadd_ps)(F(cvtepi32_ps)(sums), F(mul_ps)(d, F(set1_ps)(sx)), acc);
    return F(fmadd_ps)(m, F(set1_ps)(xs), acc);
}

// acc[r] + the products of LANES rows of a tile of u4 or u8 (`bits`) codes q with rows
// r < `rows` of x, over a panel's pb blocks: its scales from sc's `at` on, x[r] at xq
// + r * kp (`act` bytes each; sx and xs at r * nb). `half`: which half of a tile's lanes
// (a ymm's), 0 for a zmm.
static inline __attribute__((always_inline)) void tile_dot(const int rows, const int bits, const int act, fvec *acc,
                                                           const uint8_t *q, const struct scales *sc, size_t at,
                                                           const char *xq, const float *sx, const float *xs, int kp,
                                                           int nb, int pb, int half) {
    const int lane = 4 / act, slots = BLOCK / lane, block_bytes = TILE_ROWS * BLOCK * bits / 8;
    for (int b = 0; b < pb; b++) {
        const uint8_t *qb = q + (size_t)b * block_bytes + half * LANES * lane;
        if (half == 0) prefetch(qb + AHEAD, block_bytes);
        ivec w[BLOCK / 2];  // (a block's slots: 16 at most)
        if (bits == 4) {
            for (int c = 0; c < slots / 2; c++) {
                const ivec v = bytes_at(qb + TILE_ROWS * lane * c, act);
                w[c] = low_nibbles(v, act);
                w[c + slots / 2] = high_nibbles(v, act);
            }
        } else {
            for (int c = 0; c < slots; c++) w[c] = bytes_at(qb + TILE_ROWS * lane * c, act);
        }
        const size_t i = at + (size_t)b * TILE_ROWS + half * LANES;
        const fvec d = scales_at(sc->d, i, sc->half), m = offsets_at(sc, i, d);
        #pragma GCC unroll 8  // (each row's accumulator a register of its own)
        for (int r = 0; r < rows; r++) {
            const char *x = xq + ((size_t)r * kp + b * BLOCK) * act;
            ivec s[2] = {ZERO_I(), ZERO_I()};  // (two chains of multiply-adds)
            for (int c = 0; c < slots; c++) s[c % 2] = dot_lanes(s[c % 2], w[c], x + 4 * c, act, bits);
            const size_t at_r = (size_t)r * nb + b;
            acc[r] = scaled_sums(acc[r], F(add_epi32)(s[0], s[1]), d, m, sx[at_r], xs[at_r]);
        }
    }
}

// One tile of u4 or u8 against the columns of a panel: y[r * ldy + l] (+)= w[l] . x[r]
// for its first `count` lanes l and `rows` (<= X_ROWS) quantized rows of x, added to y
// where `add`.
static inline __attribute__((always_inline)) void tile_rows(const int rows, const int bits, const int act, float *y,
                                                            int ldy, int count, int add, const char *xq,
                                                            const float *sx, const float *xs, int kp, int nb, int pb,
                                                            const uint8_t *q, const struct scales *sc, size_t at) {
    for (int half = 0; half < TILE_ROWS / LANES && half * LANES < count; half++) {
        fvec acc[X_ROWS];
        for (int r = 0; r < rows; r++) acc[r] = F(setzero_ps)();
        tile_dot(rows, bits, act, acc, q, sc, at, xq, sx, xs, kp, nb, pb, half);
        for (int r = 0; r < rows; r++) store_lanes(y + (size_t)r * ldy + half * LANES, acc[r], count - half * LANES, add);
    }
}

// tile_rows with `rows` a constant, so that their accumulators stay in registers.
#if X_ROWS == 8
#define FOR_ROWS(KERNEL, rows, ...)                     \
    switch (rows) {                                     \
        case 1: KERNEL(1, __VA_ARGS__); break;          \
        case 2: KERNEL(2, __VA_ARGS__); break;          \
        case 3: KERNEL(3, __VA_ARGS__); break;          \
        case 4: KERNEL(4, __VA_ARGS__); break;          \
        case 5: KERNEL(5, __VA_ARGS__); break;          \
        case 6: KERNEL(6, __VA_ARGS__); break;          \
        case 7: KERNEL(7, __VA_ARGS__); break;          \
        default: KERNEL(8, __VA_ARGS__); break;         \
    }
#else
#define FOR_ROWS(KERNEL, rows, ...)                     \
    switch (rows) {                                     \
        case 1: KERNEL(1, __VA_ARGS__); break;          \
        case 2: KERNEL(2, __VA_ARGS__); break;          \
        case 3: KERNEL(3, __VA_ARGS__); break;          \
        default: KERNEL(4, __VA_ARGS__); break;         \
    }
#endif

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && LANES == 16
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16  // rows of x a tile multiply takes (a tile's 16 rows)
// The rows from which a product is faster on the tile unit than on the vector units
// (measured on a Xeon's two cores, bench/HISTORY.md): 8, or 16 where its codes cost more
// to lay out for it than the tile unit saves at 8 (u4 with int8 activations: widened;
// u8 with int16: interleaved). int16 activations take two tile multiplies a block (their
// high and low bytes) where vpdpwssd takes twice vpdpbusd's instructions.
#define AMX_LEAST_ROWS(bits, act) ((act) == 1 ? ((bits) == 8 ? 8 : 16) : ((bits) == 4 ? 8 : 16))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx;  // whether products use the tile unit (use_amx)
static _Thread_local int amx_rows;  // the rows of x this thread's tiles are configured for

// Asks the OS for the tile registers' state (Linux grants it per process) and says
// whether products will use them: `on` where the OS allowed it.
int use_amx(int on) {
    amx = on && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx;
}

// Tiles 0 and 3: int32 sums C [rows, 16]; 1 and 4: x's block A [rows, 32 bytes]; 2 and
// 5: the codes B [8, 64 bytes]. int8 activations use them as two sets (a block's sums
// are scaled while the next block's multiply runs), int16 as one: a block's high and
// low bytes of x (1 and 4) against its codes (2), into 0 and 3.
static void configure_tiles(int rows) {
    if (amx_rows == rows) return;
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t bytes[16];
        uint8_t rows[16];
    } config = {.palette = 1};
    for (int set = 0; set < 6; set += 3) {
        config.rows[set] = config.rows[set + 1] = (uint8_t)rows, config.bytes[set] = 64, config.bytes[set + 1] = BLOCK;
        config.rows[set + 2] = BLOCK / 4, config.bytes[set + 2] = 64;
    }
    _tile_loadconfig(&config);
    amx_rows = rows;
}

// Leaves the tiles unused: a thread switched out while its tiles are in use has their
// 8 KB saved and restored.
static void release_tiles(void) {
    _tile_release();
    amx_rows = 0;
}

// The sums of x's rows with a block's codes into sums, on tiles c (the sums), a (x)
// and b (the codes): numbers, as the instructions take them.
#define TILE_BLOCK(c, a, b, codes, x, ldx, sums) \
    do {                                         \
        _tile_loadd(b, codes, 64);               \
        _tile_loadd(a, x, ldx);                  \
        _tile_zero(c);                           \
        _tile_dpbsud(c, a, b);                   \
        _tile_stored(c, sums, 64);               \
    } while (0)

// The same for int16 x as its planes: its high bytes (signed) at x, its low bytes
// (unsigned) at x + low, into high and low sums: x's sums are 256 high + low.
#define TILE_BLOCK_INT16(codes, x, low, ldx, sums)  \
    do {                                            \
        _tile_loadd(2, codes, 64);                  \
        _tile_loadd(1, x, ldx);                     \
        _tile_loadd(4, (x) + (low), ldx);           \
        _tile_zero(0);                              \
        _tile_zero(3);                              \
        _tile_dpbsud(0, 1, 2);                      \
        _tile_dpbuud(3, 4, 2);                      \
        _tile_stored(0, sums[0], 64);               \
        _tile_stored(3, sums[1], 64);               \
    } while (0)

// A tile's panel of pb blocks of codes (TILE_LAYOUT for `act`) as the tile unit reads
// them: a byte a code, slot c of 4 codes a lane as B's row c. u4 codes are widened;
// int16's layout (2 codes a lane a slot) has each pair of slots interleaved by 16-bit
// lanes. (All of a panel first: a block prepared just before its multiply would wait for
// its stores.)
static void tile_codes(uint8_t *out, const uint8_t *q, int pb, int bits, int act) {
    const int block_bytes = TILE_ROWS * BLOCK * bits / 8;
    // (two slots of 16 lanes of 2 bytes, one after the other, to 16 lanes of 4 bytes)
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int b = 0; b < pb; b++) {
        const uint8_t *qb = q + (size_t)b * block_bytes;
        uint8_t *ob = out + (size_t)b * TILE_ROWS * BLOCK;
        prefetch(qb + AHEAD, block_bytes);
        for (int c = 0; c < block_bytes / 64; c++) {
            const ivec v = bytes_at(qb + 64 * c, 1);
            if (bits == 8) {  // (int16's only: int8's u8 codes are read as they lie)
                _mm512_store_si512(ob + 64 * c, _mm512_permutexvar_epi16(pairs, v));
            } else if (act == 1) {  // slot c in the low nibbles, slot c + 4 in the high
                _mm512_store_si512(ob + 64 * c, low_nibbles(v, 1));
                _mm512_store_si512(ob + 64 * (c + 4), high_nibbles(v, 1));
            } else {  // slots 2c and 2c + 1 in the low nibbles, 2c + 8 and 2c + 9 in the high
                _mm512_store_si512(ob + 64 * c, _mm512_permutexvar_epi16(pairs, low_nibbles(v, 1)));
                _mm512_store_si512(ob + 64 * (c + 4), _mm512_permutexvar_epi16(pairs, high_nibbles(v, 1)));
            }
        }
    }
}

// tile_rows on the tile unit: `rows` (<= AMX_ROWS) rows of x (int8, or int16 as two
// planes `low` bytes apart), ldx bytes apart, against a tile's panel of pb blocks of
// codes as tile_codes lays them out. A block's int32 sums, the same as vpdpbusd's or
// vpdpwssd's, are scaled lane by lane as tile_dot does.
static inline __attribute__((always_inline)) void amx_tile_rows(const int act, int rows, float *y, int ldy, int count,
                                                                int add, const char *xq, int ldx, int low,
                                                                const float *sx, const float *xs, int nb, int pb,
                                                                const uint8_t *codes, const struct scales *sc,
                                                                size_t at, int prefetching) {
    const int block_bytes = TILE_ROWS * BLOCK;
    int32_t sums[2][AMX_ROWS * LANES] __attribute__((aligned(64)));
    fvec acc[AMX_ROWS];
    #pragma GCC unroll 16
    for (int r = 0; r < AMX_ROWS; r++) acc[r] = F(setzero_ps)();
    if (act == 1) TILE_BLOCK(0, 1, 2, codes, xq, ldx, sums[0]);
    for (int b = 0; b < pb; b++) {
        if (act == 2) {
            TILE_BLOCK_INT16(codes + (size_t)b * block_bytes, xq + b * BLOCK, low, ldx, sums);
        } else if (b + 1 < pb) {
            const uint8_t *next = codes + (size_t)(b + 1) * block_bytes;
            if (prefetching) prefetch(next + AHEAD, block_bytes);
            if (b % 2 == 0) TILE_BLOCK(3, 4, 5, next, xq + (b + 1) * BLOCK, ldx, sums[1]);
            else TILE_BLOCK(0, 1, 2, next, xq + (b + 1) * BLOCK, ldx, sums[0]);
        }
        const size_t i = at + (size_t)b * TILE_ROWS;
        const fvec d = scales_at(sc->d, i, sc->half), m = offsets_at(sc, i, d);
        #pragma GCC unroll 16
        for (int r = 0; r < AMX_ROWS; r++) {
            if (r >= rows) break;
            const ivec s = act == 1 ? _mm512_load_si512(sums[b % 2] + r * LANES)
                                    : _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums[0] + r * LANES), 8),
                                                       _mm512_load_si512(sums[1] + r * LANES));
            acc[r] = scaled_sums(acc[r], s, d, m, sx[(size_t)r * nb + b], xs[(size_t)r * nb + b]);
        }
    }
    #pragma GCC unroll 16
    for (int r = 0; r < AMX_ROWS; r++)
        if (r < rows) store_lanes(y + (size_t)r * ldy, acc[r], count, add);
}
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#define AMX_ROWS X_ROWS
#define AMX_LEAST_ROWS(bits, act) 1
static const int amx = 0;
int use_amx(int on) {
    (void)on;
    return 0;
}
#endif

struct linear_q_args {
    float *y;
    int ldy, m, kp, n, bits, act, tiled;  // tiled: on the tile unit (x quantized for it)
    const char *xq;
    const float *sx, *xs;
    const uint8_t *codes;
    struct scales scales;
};

// Panel p's scales: those of the blocks from i = (rows, padded) * (its first column / BLOCK) on.
static inline struct scales panel_scales(const struct scales *s, size_t i) {
    const size_t size = s->half ? 2 : 4;
    return (struct scales){(const char *)s->d + i * size, s->m ? (const char *)s->m + i * size : NULL,
                           s->z ? s->z + i : NULL, s->half, s->zero};
}

#if HAVE_AMX
// Tiles [begin, end) of linear_q on the tile unit: a tile's panel against every row
// of x, AMX_ROWS at a time (its codes laid out for the tile unit once for all of them).
static void amx_tiles(const struct linear_q_args *a, int begin, int end) {
    static _Thread_local uint8_t laid_out[PANEL / BLOCK * TILE_ROWS * BLOCK] __attribute__((aligned(64)));
    const int nb = a->kp / BLOCK, kp = a->kp, padded = (a->n + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
    const int act = a->act, as_they_lie = a->bits == 8 && act == 1;
    for (int t = begin; t < end; t++) {
        for (int c0 = 0; c0 < kp; c0 += PANEL) {
            const int pk = kp - c0 < PANEL ? kp - c0 : PANEL, pb = pk / BLOCK;
            const uint8_t *q = a->codes + (size_t)padded * c0 * a->bits / 8 + (size_t)t * TILE_ROWS * pk * a->bits / 8;
            const struct scales sc = panel_scales(&a->scales, (size_t)padded * (c0 / BLOCK));
            if (!as_they_lie) tile_codes(laid_out, q, pb, a->bits, act);
            for (int r = 0; r < a->m; r += AMX_ROWS) {
                const int rows = a->m - r < AMX_ROWS ? a->m - r : AMX_ROWS;
                float *y = a->y + (size_t)r * a->ldy + t * TILE_ROWS;
                const char *x = a->xq + ((size_t)r * kp) * act + c0;  // (int16: its high bytes' plane)
                const float *sx = a->sx + (size_t)r * nb + c0 / BLOCK, *xs = a->xs + (size_t)r * nb + c0 / BLOCK;
                const uint8_t *codes = as_they_lie ? q : laid_out;
                configure_tiles(rows);
                if (act == 1)
                    amx_tile_rows(1, rows, y, a->ldy, a->n - t * TILE_ROWS, c0 > 0, x, kp, 0, sx, xs, nb, pb, codes,
                                  &sc, (size_t)t * pb * TILE_ROWS, as_they_lie && r == 0);
                else
                    amx_tile_rows(2, rows, y, a->ldy, a->n - t * TILE_ROWS, c0 > 0, x, 2 * kp, kp, sx, xs, nb, pb,
                                  codes, &sc, (size_t)t * pb * TILE_ROWS, 0);
            }
        }
    }
    release_tiles();
}
#endif

// Tiles [begin, end) of linear_q.
static void linear_q_tiles(void *ctx, int begin, int end) {
    const struct linear_q_args *a = ctx;
#if HAVE_AMX
    if (a->tiled) {
        amx_tiles(a, begin, end);
        return;
    }
#endif
    const int nb = a->kp / BLOCK, ldy = a->ldy, kp = a->kp, padded = (a->n + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
    // (a tile of x's rows against every weight tile of the chunk, a panel at a time: the
    // rows' panel stays in L1 while the chunk's tiles come from L2 or memory)
    for (int r = 0; r < a->m; r += X_ROWS) {
        const int rows = a->m - r < X_ROWS ? a->m - r : X_ROWS;
        for (int c0 = 0; c0 < kp; c0 += PANEL) {
            const int pk = kp - c0 < PANEL ? kp - c0 : PANEL, pb = pk / BLOCK, add = c0 > 0;
            const uint8_t *codes = a->codes + (size_t)padded * c0 * a->bits / 8;
            const struct scales sc = panel_scales(&a->scales, (size_t)padded * (c0 / BLOCK));
            const char *xr = a->xq + ((size_t)r * kp + c0) * a->act;
            const float *sr = a->sx + (size_t)r * nb + c0 / BLOCK, *xsr = a->xs + (size_t)r * nb + c0 / BLOCK;
            for (int t = begin; t < end; t++) {
                const uint8_t *q = codes + (size_t)t * TILE_ROWS * pk * a->bits / 8;
                const size_t at = (size_t)t * pb * TILE_ROWS;
                const int count = a->n - t * TILE_ROWS;
                float *yr = a->y + (size_t)r * ldy + t * TILE_ROWS;
                if (a->bits == 4 && a->act == 1) {
                    FOR_ROWS(tile_rows, rows, 4, 1, yr, ldy, count, add, xr, sr, xsr, kp, nb, pb, q, &sc, at)
                } else if (a->bits == 4) {
                    FOR_ROWS(tile_rows, rows, 4, 2, yr, ldy, count, add, xr, sr, xsr, kp, nb, pb, q, &sc, at)
                } else if (a->act == 1) {
                    FOR_ROWS(tile_rows, rows, 8, 1, yr, ldy, count, add, xr, sr, xsr, kp, nb, pb, q, &sc, at)
                } else {
                    FOR_ROWS(tile_rows, rows, 8, 2, yr, ldy, count, add, xr, sr, xsr, kp, nb, pb, q, &sc, at)
                }
            }
        }
    }
}

// y[M, N] (row stride ldy) = x[M, k] (row stride ldx) @ w^T, w in u4 (bits 4) or u8
// (bits 8) over kp columns in PANEL_LAYOUT and TILE_LAYOUT with its block scales (struct
// scales: d, m or z or zero, half), laid out for activations of `act` bytes: x quantized
// first into xq [M, kp] of them, sx and xs [M, kp / 32].
void linear_q(float *y, int ldy, const float *x, int ldx, int m, int k, const int32_t *perm, void *xq, float *sx,
              float *xs, int kp, const uint8_t *codes, const void *d, const void *mins, const uint8_t *zeros, int zero,
              int half, int n, int bits, int act) {
    const int nb = kp / BLOCK, tiles = (n + TILE_ROWS - 1) / TILE_ROWS, tiled = amx && m >= AMX_LEAST_ROWS(bits, act);
    for (int r = 0; r < m; r++) {
        const float *row = x + (size_t)r * ldx;
        char *out = (char *)xq + (size_t)r * kp * act;
        if (act == 1) quantize_row(row, k, kp, perm, 1, 0, out, sx + (size_t)r * nb, xs + (size_t)r * nb);
        else if (tiled) quantize_row(row, k, kp, perm, 2, 1, out, sx + (size_t)r * nb, xs + (size_t)r * nb);
        else quantize_row(row, k, kp, perm, 2, 0, out, sx + (size_t)r * nb, xs + (size_t)r * nb);
    }
    struct linear_q_args a = {y, ldy, m, kp, n, bits, act, tiled, xq, sx, xs, codes, {d, mins, zeros, half, zero}};
    parallel_for(tiles, chunk_size(tiles, (size_t)m * n * kp, 1), linear_q_tiles, &a);
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
    parallel_for(n, chunk_size(n, (size_t)m * n * k, 4), linear_float_rows, &a);
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
