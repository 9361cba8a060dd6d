// SiLU-and-multiply, shared by silu_and_mul (activation.cu) and the gate/up GEMV that
// applies it to its own outputs (gemv.cu), so that both round alike.
#pragma once
#include "common.cuh"

// bf16(silu(gate)) * up, for bfloat16 gate and up (the caller rounds the product)
__device__ __forceinline__ float silu_and_mul1(float gate, float up) {
    return round_bf16(gate / (1.f + __expf(-gate))) * up;
}

// bf16(bf16(silu(gate[i + j])) * up[i + j]) for j < 8, packed; row = [gate | up], width 2 * inter
__device__ __forceinline__ uint4 silu_and_mul8(const bf16* __restrict__ row, int inter, int i) {
    float g[8], u[8];
    load_bf16x8(row + i, g);
    load_bf16x8(row + inter + i, u);
#pragma unroll
    for (int j = 0; j < 8; j++) g[j] = silu_and_mul1(g[j], u[j]);
    return pack_bf16x8(g);
}
