#include "common.cuh"

// out[t, i] = bf16(silu(gate[t, i])) * up[t, i], with gate_up = [gate | up] of width
// 2 * inter (the fused gate/up projection).
// grid: (ceil(inter / blockDim), tokens)
extern "C" __global__ void silu_and_mul(bf16* __restrict__ out, const bf16* __restrict__ gate_up, int inter) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= inter) return;
    const bf16* row = gate_up + (size_t)blockIdx.y * 2 * inter;
    float g = to_f32(row[i]);
    float act = round_bf16(g / (1.f + __expf(-g)));
    out[(size_t)blockIdx.y * inter + i] = to_bf16(act * to_f32(row[inter + i]));
}
