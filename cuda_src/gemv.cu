#include "common.cuh"

// y[r, o] = sum_i x[r, i] * w[o, i] for the first `rows` (at most GEMV_ROWS) rows of x:
// a linear layer for decode steps of a few tokens, which must do no more than read w
// once. cuBLAS leaves bandwidth unused on these shapes (bench/profile_step.py's gemm
// table has both).
//
// grid: ceil(d_out / OUTPUTS); block: GEMV_WARPS warps. A block computes OUTPUTS
// outputs; its warps split d_in into CHUNK-wide chunks (warp w takes chunks w,
// w + GEMV_WARPS, ...), each lane reading 8 consecutive weights of every output with
// 16-byte loads, so one block has OUTPUTS * GEMV_WARPS loads of 512 bytes in flight.
// Sums are reduced in a fixed order (lanes, then warps): a row's result does not
// depend on how many rows run with it. d_in must be a multiple of 8.
// The oracle is numpy's x @ w.T (tests/gpu/test_kernels.py).
#define GEMV_ROWS 8
#define GEMV_WARPS 8
#define OUTPUTS 4
#define CHUNK (32 * 8)

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv(
    void* __restrict__ y, int out_f32,  // [rows, d_out], float32 if out_f32 else bf16
    const bf16* __restrict__ x,         // [rows, d_in]
    const bf16* __restrict__ w,         // [d_out, d_in]
    int rows, int d_in, int d_out) {
    __shared__ float partial[GEMV_WARPS][OUTPUTS][GEMV_ROWS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, o0 = blockIdx.x * OUTPUTS;
    float acc[OUTPUTS][GEMV_ROWS];
#pragma unroll
    for (int o = 0; o < OUTPUTS; o++)
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r++) acc[o][r] = 0.f;

#pragma unroll 2
    for (int c = warp * CHUNK + lane * 8; c < d_in; c += GEMV_WARPS * CHUNK) {
        float wf[OUTPUTS][8];
#pragma unroll
        for (int o = 0; o < OUTPUTS; o++) {
            const int out = min(o0 + o, d_out - 1);  // past d_out: computed, never written
            load_bf16x8(w + (size_t)out * d_in + c, wf[o]);
        }
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r++) {
            if (r >= rows) break;
            float xf[8];
            load_bf16x8(x + (size_t)r * d_in + c, xf);
#pragma unroll
            for (int o = 0; o < OUTPUTS; o++)
#pragma unroll
                for (int i = 0; i < 8; i++) acc[o][r] += wf[o][i] * xf[i];
        }
    }
#pragma unroll
    for (int o = 0; o < OUTPUTS; o++)
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r++) {
            if (r >= rows) break;
            const float v = warp_sum(acc[o][r]);
            if (lane == 0) partial[warp][o][r] = v;
        }
    __syncthreads();
    if (threadIdx.x < OUTPUTS * GEMV_ROWS) {
        const int o = threadIdx.x / GEMV_ROWS, r = threadIdx.x % GEMV_ROWS;
        if (r < rows && o0 + o < d_out) {
            float sum = 0.f;
#pragma unroll
            for (int v = 0; v < GEMV_WARPS; v++) sum += partial[v][o][r];
            const size_t i = (size_t)r * d_out + o0 + o;
            if (out_f32) static_cast<float*>(y)[i] = sum;
            else static_cast<bf16*>(y)[i] = to_bf16(sum);
        }
    }
}
