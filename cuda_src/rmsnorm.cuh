// The two halves of RMSNorm over one row, shared by add_rmsnorm (rmsnorm.cu) and the
// GEMV that normalises its own input (gemv.cu), so that both compute it bit for bit
// alike: each thread takes the same 8-element chunks (i = 8 * threadIdx.x, then every
// 8 * blockDim.x) in the same order, and both reduce over 256-thread blocks.
#pragma once
#include "common.cuh"

// x[i] = bf16(x[i] + delta[i]) where delta is not null; returns this thread's share of
// sum(x[i]^2). Where delta_col_scales is not null, delta holds a W8A8 product's sums,
// each scaled back first (unscale_sums8, with the token's delta_row_scale). hidden % 8 == 0.
__device__ __forceinline__ float add_and_sum_squares(float* __restrict__ x, const bf16* __restrict__ delta, int hidden,
                                                     float delta_row_scale = 1.f,
                                                     const float* __restrict__ delta_col_scales = nullptr) {
    float sum_sq = 0.f;
    for (int i = 8 * threadIdx.x; i < hidden; i += 8 * blockDim.x) {
        float v[8];
        load_f32x8(x + i, v);
        if (delta) {
            float d[8];
            load_bf16x8(delta + i, d);
            if (delta_col_scales) unscale_sums8(d, delta_row_scale, delta_col_scales + i);
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = round_bf16(v[j] + d[j]);
            store_f32x8(x + i, v);
        }
#pragma unroll
        for (int j = 0; j < 8; j++) sum_sq += v[j] * v[j];
    }
    return sum_sq;
}

// RMSNorm's 8 values from x + i: v[j] = bf16(weight[i + j] * bf16(x[i + j] * inv_rms)).
__device__ __forceinline__ void normed8(const float* __restrict__ x, const bf16* __restrict__ weight, int i,
                                        float inv_rms, float* v) {
    float w[8];
    load_f32x8(x + i, v);
    load_bf16x8(weight + i, w);
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = round_bf16(w[j] * round_bf16(v[j] * inv_rms));
}

// out[i] = normed8's values, over this thread's chunks (out may be shared memory).
__device__ __forceinline__ void scale_row(const float* __restrict__ x, const bf16* __restrict__ weight, bf16* out,
                                          int hidden, float inv_rms) {
    for (int i = 8 * threadIdx.x; i < hidden; i += 8 * blockDim.x) {
        float v[8];
        normed8(x, weight, i, inv_rms, v);
        *reinterpret_cast<uint4*>(out + i) = pack_bf16x8(v);
    }
}

// The same values as e4m3 codes over the row's scale (quantize_rows_e4m3's), which it
// returns; they wait in `stash` (shared, 2 * hidden bytes) for the row's largest magnitude.
__device__ __forceinline__ float quantize_row(const float* __restrict__ x, const bf16* __restrict__ weight,
                                              uint8_t* __restrict__ codes, int hidden, float inv_rms, uint4* stash,
                                              float* scratch) {
    float amax = 0.f;
    for (int i = 8 * threadIdx.x; i < hidden; i += 8 * blockDim.x) {
        float v[8];
        normed8(x, weight, i, inv_rms, v);
#pragma unroll
        for (int j = 0; j < 8; j++) amax = fmaxf(amax, fabsf(v[j]));
        stash[i / 8] = pack_bf16x8(v);
    }
    return store_e4m3_row(codes, stash, hidden, amax, scratch);
}
