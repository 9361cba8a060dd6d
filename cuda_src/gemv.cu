#include "common.cuh"

// y[r, o] = sum_i x[r, i] * w[o, i] for the first `rows` (at most GEMV_MAX_ROWS) rows
// of x: a linear layer for decode steps of a few tokens, which must do no more than
// read w once. cuBLAS leaves bandwidth unused on some of these shapes
// (bench/profile_step.py's gemm table has both).
//
// grid: ceil(d_out / GEMV_WARPS); block: GEMV_WARPS warps, one output row each. A
// lane reads 8 consecutive weights with one 16-byte load, UNROLL loads at a time
// (4 KB of the row in flight per warp), and uses them for every row of x. Sums are
// reduced in a fixed order (lanes, then the warp), so a row's result does not depend
// on how many rows run with it. d_in must be a multiple of 8.
// The oracle is numpy's x @ w.T (tests/gpu/test_kernels.py).
#define GEMV_MAX_ROWS 8
#define GEMV_WARPS 4
#define UNROLL 8
#define SPAN (32 * 8)  // weights one warp reads with one load per lane

// UNROLL of a lane's 16-byte pieces of a weight row, from column `first` on (zeros past d_in).
__device__ __forceinline__ void load_weights(uint4* raw, const bf16* __restrict__ w_row, int first, int d_in) {
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        const int c = first + u * SPAN;
        raw[u] = c < d_in ? __ldg(reinterpret_cast<const uint4*>(w_row + c)) : make_uint4(0, 0, 0, 0);
    }
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv(
    void* __restrict__ y, int out_f32,  // [rows, d_out], float32 if out_f32 else bf16
    const bf16* __restrict__ x,         // [rows, d_in]
    const bf16* __restrict__ w,         // [d_out, d_in]
    int rows, int d_in, int d_out) {
    const int lane = threadIdx.x & 31, o = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    const bf16* w_row = w + (size_t)min(o, d_out - 1) * d_in;
    // The weights are no earlier kernel's output: the first loads go out before the
    // wait for the previous kernel, and overlap its tail.
    uint4 raw[UNROLL];
    load_weights(raw, w_row, lane * 8, d_in);
    await_previous_kernel();
    if (o >= d_out) return;  // a whole warp: no block-level sync follows
    float acc[GEMV_MAX_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; r++) acc[r] = 0.f;

    for (int base = lane * 8; base < d_in; base += SPAN * UNROLL) {
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int c = base + u * SPAN;
            if (c >= d_in) break;
            float wf[8];
            unpack_bf16x8(raw[u], wf);
#pragma unroll
            for (int r = 0; r < GEMV_MAX_ROWS; r++) {
                if (r >= rows) break;
                float xf[8];
                load_bf16x8(x + (size_t)r * d_in + c, xf);
#pragma unroll
                for (int i = 0; i < 8; i++) acc[r] += wf[i] * xf[i];
            }
        }
        load_weights(raw, w_row, base + SPAN * UNROLL, d_in);
    }
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; r++) {
        if (r >= rows) break;
        const float sum = warp_sum(acc[r]);
        if (lane == 0) {
            const size_t i = (size_t)r * d_out + o;
            if (out_f32) static_cast<float*>(y)[i] = sum;
            else static_cast<bf16*>(y)[i] = to_bf16(sum);
        }
    }
}
