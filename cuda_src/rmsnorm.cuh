// The two halves of RMSNorm over one row, shared by add_rmsnorm (rmsnorm.cu) and the
// GEMV that normalises its own input (gemv.cu), so that both compute it bit for bit
// alike: each thread takes the same 8-element chunks (i = 8 * threadIdx.x, then every
// 8 * blockDim.x) in the same order, and both reduce over 256-thread blocks.
#pragma once
#include "common.cuh"

// x[i] = bf16(x[i] + delta[i]) where delta is not null; returns this thread's share of
// sum(x[i]^2). hidden % 8 == 0.
__device__ __forceinline__ float add_and_sum_squares(float* __restrict__ x, const bf16* __restrict__ delta, int hidden) {
    float sum_sq = 0.f;
    for (int i = 8 * threadIdx.x; i < hidden; i += 8 * blockDim.x) {
        float v[8];
        load_f32x8(x + i, v);
        if (delta) {
            float d[8];
            load_bf16x8(delta + i, d);
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = round_bf16(v[j] + d[j]);
            store_f32x8(x + i, v);
        }
#pragma unroll
        for (int j = 0; j < 8; j++) sum_sq += v[j] * v[j];
    }
    return sum_sq;
}

// out[i] = bf16(weight[i] * bf16(x[i] * inv_rms)), over this thread's chunks (out may
// be shared memory).
__device__ __forceinline__ void scale_row(const float* __restrict__ x, const bf16* __restrict__ weight, bf16* out,
                                          int hidden, float inv_rms) {
    for (int i = 8 * threadIdx.x; i < hidden; i += 8 * blockDim.x) {
        float v[8], w[8];
        load_f32x8(x + i, v);
        load_bf16x8(weight + i, w);
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = w[j] * round_bf16(v[j] * inv_rms);
        *reinterpret_cast<uint4*>(out + i) = pack_bf16x8(v);
    }
}
