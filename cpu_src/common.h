// Shared by the CPU kernels: the x86-64 vector helpers they are written with.
//
// The kernels need AVX2, FMA and F16C (x86-64-v3); the integer dot products use
// AVX-512 VNNI or AVX-VNNI where the CPU has them (one instruction), and two or more
// AVX2 instructions where it does not. They are compiled for the CPU they run on
// (-march=native), so the choice is made by the compiler's predefined macros.
#pragma once

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the CPU kernels need AVX2, FMA and F16C"
#endif

#define BLOCK 32  // weights (and activations) that share one scale

// fn(ctx, begin, end) over [0, n) in chunks, on the pool's threads (pool.c).
typedef void (*task_fn)(void *ctx, int begin, int end);
void parallel_for(int n, int chunk, task_fn fn, void *ctx);
extern int threads;  // the pool's, the caller's among them (set_threads)

// acc + the sums of each pair of adjacent int16 products (one instruction with VNNI).
static inline __m256i dot_i16(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// acc + the sums of each four adjacent products of unsigned bytes w (u4 codes, or u8
// where bits is 8) and signed bytes x, in 32-bit lanes (one instruction with VNNI).
static inline __m256i dot_u8_i8(__m256i acc, __m256i w, __m256i x, const int bits) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    (void)bits;
    return _mm256_dpbusd_epi32(acc, w, x);
#elif defined(__AVXVNNI__)
    (void)bits;
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
    // (vpmaddubsw saturates its int16 sums of two products: a nibble's, at most 2 * 15 *
    // 127, never does, but a byte's can, so a byte goes as its two nibbles)
    const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0F);
    if (bits == 4) return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
    const __m256i low = _mm256_maddubs_epi16(_mm256_and_si256(w, nibble), x);
    const __m256i high = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), nibble), x);
    return _mm256_add_epi32(_mm256_add_epi32(acc, _mm256_madd_epi16(low, ones)),
                            _mm256_madd_epi16(high, _mm256_set1_epi16(16)));
#endif
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
