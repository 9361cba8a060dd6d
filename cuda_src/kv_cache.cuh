// The paged KV cache's element, as the kernels that write it (rope_cache.cu, gemv.cu)
// and read it (attention.cu) see it: bfloat16, or, in the build with -DKV_CACHE_FP8
// (--kv-cache-dtype fp8), half the bytes: the e4m3 code of the value times the
// reciprocal of its layer's K or V scale (engine/quantization/kv_cache.py; 1 without
// calibrated scales). Prompt attention computes on bfloat16 either way, and decode
// attention on bfloat16 or, from e4m3 codes, on float16 (below): a code widens to
// either exactly, and the scales are applied to the sums.
#pragma once
#include "common.cuh"

// A layer's K (or V) cache is [blocks, kv_heads, block_size, head_dim]: each KV head's
// positions of a block are one run of memory, as an attention block (one KV head) reads
// them (against [slots, kv_heads, head_dim], decode attention gained ~5%). A block holds
// 2^block_shift positions: position p of a sequence is at offset in_block(p) of block
// block_table[p >> block_shift]. (Shifts: a division by a block size known only at run
// time cost decode attention ~7% more.)
__device__ __forceinline__ int in_block(int pos, int block_shift) { return pos - (pos >> block_shift << block_shift); }

// The cache row (head_dim elements) of KV head kvh at `offset` in block `block`.
__device__ __forceinline__ size_t kv_row(int block, int offset, int kvh, int kv_heads, int block_shift) {
    return ((size_t)(block * kv_heads + kvh) << block_shift) + offset;
}

// The cache row of KV head kvh in slot `slot` (block * 2^block_shift + offset).
__device__ __forceinline__ size_t kv_slot_row(int slot, int kvh, int kv_heads, int block_shift) {
    return kv_row(slot >> block_shift, in_block(slot, block_shift), kvh, kv_heads, block_shift);
}

#ifdef KV_CACHE_FP8
typedef uint8_t kv_t;

__device__ __forceinline__ kv_t to_kv(float x, float inv_scale) { return to_e4m3(x * inv_scale); }

// 4 codes (one word) as two words of bfloat16 pairs, codes 0, 1 in lo and 2, 3 in hi.
__device__ __forceinline__ void widen_e4m3x4(uint32_t codes, uint32_t& lo, uint32_t& hi) {
    lo = e4m3x2_to_bf16x2(codes);
    hi = e4m3x2_to_bf16x2(codes >> 16);
}

// The 32-bit words of codes that hold `words` words of pairs.
__host__ __device__ constexpr int kv_code_words(int words) { return words / 2; }

// Decode attention (attention.cu) multiplies the codes' values as float16, not bfloat16:
// every e4m3 value is a float16 value, and a pair widens to float16 in one instruction
// where bfloat16 takes four (through float32): 96 fewer a warp's 16-position chunk, for
// 1-4% of the kernel's time (bench/HISTORY.md). Q and P go in as float16 with them: P,
// in [0, 1], keeps 3 bits more than in bfloat16, and Q's bfloat16 values are float16
// values where float16 reaches (its exponent's range is smaller: beyond 65504 they are
// held to it).

// load_kv_codes' codes as `words` words of the decode kernel's pairs (float16).
template <int words>
__device__ __forceinline__ void widen_kv_codes(uint32_t* dst, const uint32_t* codes) {
#pragma unroll
    for (int i = 0; i < words / 2; i++) {
        dst[2 * i] = e4m3x2_to_f16x2(codes[i]);
        dst[2 * i + 1] = e4m3x2_to_f16x2(codes[i] >> 16);
    }
}

// A word of bfloat16 pairs (Q) as the decode kernel's pairs.
__device__ __forceinline__ uint32_t bf16x2_to_kv_pair(uint32_t w) {
    const float lo = __uint_as_float(w << 16), hi = __uint_as_float(w & 0xFFFF0000u);
    return pack_f16(fminf(fmaxf(lo, -65504.f), 65504.f), fminf(fmaxf(hi, -65504.f), 65504.f));
}

// Two float32 (P) as the decode kernel's pair.
__device__ __forceinline__ uint32_t pack_kv_pair(float lo, float hi) { return pack_f16(lo, hi); }

// d += a b in the decode kernel's pairs (an m16n8k16 tile: common.cuh's mma_bf16).
__device__ __forceinline__ void mma_kv(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) { mma_f16(d, a, b0, b1); }
#else
typedef bf16 kv_t;

__device__ __forceinline__ kv_t to_kv(float x, float) { return to_bf16(x); }  // (a bfloat16 cache has no scale)

__host__ __device__ constexpr int kv_code_words(int words) { return words; }  // (bfloat16 pairs are their own codes)

template <int words>
__device__ __forceinline__ void widen_kv_codes(uint32_t* dst, const uint32_t* codes) {
#pragma unroll
    for (int i = 0; i < words; i++) dst[i] = codes[i];
}

__device__ __forceinline__ uint32_t bf16x2_to_kv_pair(uint32_t w) { return w; }

__device__ __forceinline__ uint32_t pack_kv_pair(float lo, float hi) { return pack_bf16(lo, hi); }

__device__ __forceinline__ void mma_kv(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) { mma_bf16(d, a, b0, b1); }
#endif

// The codes of `words` words of bfloat16 pairs (2 * words values) from the cache at src
// (aligned to the bytes it reads), as they are: 16-byte loads where they fill them, else
// 8-byte ones. widen_kv_codes widens them apart, once a chunk's loads are all issued
// (attention.cu's ChunkCodes says why).
template <int words>
__device__ __forceinline__ void load_kv_codes(uint32_t* codes, const kv_t* __restrict__ src) {
    constexpr int n = kv_code_words(words);
    if constexpr (n % 4 == 0) {
#pragma unroll
        for (int i = 0; i < n / 4; i++) reinterpret_cast<uint4*>(codes)[i] = __ldg(reinterpret_cast<const uint4*>(src) + i);
    } else {
        static_assert(n % 2 == 0, "whole 8-byte loads");
#pragma unroll
        for (int i = 0; i < n / 2; i++) reinterpret_cast<uint2*>(codes)[i] = __ldg(reinterpret_cast<const uint2*>(src) + i);
    }
}
