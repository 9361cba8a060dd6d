// SiLU-and-multiply, shared by silu_and_mul (activation.cu) and the gate/up GEMV that
// applies it to its own outputs (gemv.cu), so that both round alike.
#pragma once
#include "common.cuh"

// bf16(silu(gate)) * up, for bfloat16 gate and up (the caller rounds the product)
__device__ __forceinline__ float silu_and_mul1(float gate, float up) {
    return round_bf16(gate / (1.f + __expf(-gate))) * up;
}
