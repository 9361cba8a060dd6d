// The paged KV cache's element, as the kernels that write it (rope_cache.cu, gemv.cu)
// and read it (attention.cu) see it: bfloat16, or, in the build with -DKV_CACHE_FP8
// (--kv-cache-dtype fp8), half the bytes: the e4m3 code of the value times the
// reciprocal of its layer's K or V scale (engine/quantization/kv_cache.py; 1 without
// calibrated scales). Either way the attention kernels compute on bfloat16: an e4m3
// code widens to bfloat16 exactly, and the scales are applied to the sums.
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

// `words` words of bfloat16 pairs (2 * words values) from the cache at src (aligned to
// the bytes it reads): 16-byte loads of codes where they fill them, else 8-byte ones.
template <int words>
__device__ __forceinline__ void load_kv_words(uint32_t* dst, const kv_t* __restrict__ src) {
    if constexpr (words % 8 == 0) {
#pragma unroll
        for (int i = 0; i < words / 8; i++) {
            const uint4 c = __ldg(reinterpret_cast<const uint4*>(src) + i);
            widen_e4m3x4(c.x, dst[8 * i], dst[8 * i + 1]);
            widen_e4m3x4(c.y, dst[8 * i + 2], dst[8 * i + 3]);
            widen_e4m3x4(c.z, dst[8 * i + 4], dst[8 * i + 5]);
            widen_e4m3x4(c.w, dst[8 * i + 6], dst[8 * i + 7]);
        }
    } else {
        static_assert(words % 4 == 0, "whole 8-byte loads");
#pragma unroll
        for (int i = 0; i < words / 4; i++) {
            const uint2 c = __ldg(reinterpret_cast<const uint2*>(src) + i);
            widen_e4m3x4(c.x, dst[4 * i], dst[4 * i + 1]);
            widen_e4m3x4(c.y, dst[4 * i + 2], dst[4 * i + 3]);
        }
    }
}
#else
typedef bf16 kv_t;

__device__ __forceinline__ kv_t to_kv(float x, float) { return to_bf16(x); }  // (a bfloat16 cache has no scale)

template <int words>
__device__ __forceinline__ void load_kv_words(uint32_t* dst, const kv_t* __restrict__ src) {
    static_assert(words % 4 == 0, "whole 16-byte loads");
#pragma unroll
    for (int i = 0; i < words / 4; i++) reinterpret_cast<uint4*>(dst)[i] = __ldg(reinterpret_cast<const uint4*>(src) + i);
}
#endif
