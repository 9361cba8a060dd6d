// SiLU-and-multiply on 8 elements, shared by silu_and_mul (activation.cu) and the GEMV
// that computes its own input (gemv.cu), so that both round alike.
#pragma once
#include "common.cuh"

// bf16(bf16(silu(gate[i + j])) * up[i + j]) for j < 8, packed; row = [gate | up], width 2 * inter
__device__ __forceinline__ uint4 silu_and_mul8(const bf16* __restrict__ row, int inter, int i) {
    float g[8], u[8];
    load_bf16x8(row + i, g);
    load_bf16x8(row + inter + i, u);
#pragma unroll
    for (int j = 0; j < 8; j++) g[j] = round_bf16(g[j] / (1.f + __expf(-g[j]))) * u[j];
    return pack_bf16x8(g);
}
