// A linear layer's weight as the product kernels read it (gemv.cu, skinny_gemm.cu): in
// bfloat16, as FP8 e4m3 codes with float32 scales, or as INT4 codes with a scale and a
// zero point per group of columns (gemv.cu only).
#pragma once
#include "common.cuh"

#define FP8_BLOCK 128  // rows and columns of a block scale

enum WeightFormat { W_BF16, W_FP8, W_INT4 };
// Weights in a lane's 16-byte load.
template <WeightFormat W> constexpr int COLS = W == W_BF16 ? 8 : W == W_FP8 ? 16 : 32;

// A linear's weight as the kernels read it: its rows of d_in values, and
// - FP8: w[o, i] = code[o, i] * scale[o] (scale_cols == 0), or
//   code[o, i] * scale[o / 128, i / 128] ([ceil(d_out / 128), scale_cols] block scales);
// - INT4: two codes 0..15 a byte (column 2b in byte b's low nibble, 2b + 1 in its high
//   one), w[o, i] = (code[o, i] - zero[o, g]) * scale[o, g] for group g = i / (d_in /
//   scale_cols), `scale` holding (scale, zero) pairs [d_out, scale_cols, 2].
struct WeightRef {
    const uint8_t* data;
    const float* scale;
    int scale_cols;
};

__device__ __forceinline__ WeightRef bf16_weight(const bf16* w) { return {reinterpret_cast<const uint8_t*>(w), nullptr, 0}; }

// 8 e4m3 codes (two words of a 16-byte load) to float32, by the hardware's pairwise conversion.
__device__ __forceinline__ void unpack_e4m3x8(uint32_t lo, uint32_t hi, float* out) {
    const uint32_t words[2] = {lo, hi};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 f = e4m3x2_to_float2(words[i / 2] >> (16 * (i % 2)));
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ void unpack_e4m3x16(const uint4& raw, float* out) {
    unpack_e4m3x8(raw.x, raw.y, out);
    unpack_e4m3x8(raw.z, raw.w, out + 8);
}

// 8 INT4 codes (one word, column k in bits 4k..4k+3) less a zero point, exactly: a code
// set into the mantissa of 2^23 is 2^23 + code; `biased_zero` is 2^23 + the zero point.
__device__ __forceinline__ void unpack_int4x8(uint32_t word, float biased_zero, float* out) {
#pragma unroll
    for (int k = 0; k < 8; k++) out[k] = __uint_as_float(0x4B000000u | ((word >> (4 * k)) & 0xFu)) - biased_zero;
}

__device__ __forceinline__ float int4_biased_zero(float zero) { return 8388608.f + zero; }
