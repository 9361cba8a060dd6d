#include "activation.cuh"

// out[t, i] = bf16(silu(gate[t, i])) * up[t, i], with gate_up = [gate | up] of width
// 2 * inter (the fused gate/up projection). Each thread takes 8 consecutive elements.
// grid: (ceil(inter / (8 * blockDim)), tokens); inter % 8 == 0 (checked by the host)
extern "C" __global__ void silu_and_mul(bf16* __restrict__ out, const bf16* __restrict__ gate_up, int inter) {
    await_previous_kernel();
    const int i = 8 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= inter) return;
    const bf16* row = gate_up + (size_t)blockIdx.y * 2 * inter;
    float g[8], u[8];
    load_bf16x8(row + i, g);
    load_bf16x8(row + inter + i, u);
#pragma unroll
    for (int j = 0; j < 8; j++) g[j] = silu_and_mul1(g[j], u[j]);
    *reinterpret_cast<uint4*>(out + (size_t)blockIdx.y * inter + i) = pack_bf16x8(g);
}
