// RoPE's rotation of one pair, shared by rope_and_cache (rope_cache.cu) and the QKV GEMV
// that applies it to its own outputs (gemv.cu), so that both round alike.
#pragma once
#include "common.cuh"

// ("rotate half" layout) (y1, y2) = (x1 * cos - x2 * sin, x2 * cos + x1 * sin), with
// each product and the results rounded to bfloat16 as transformers does; cs = (cos, sin)
// of the pair's angle from the table rope_cos_sin fills (rope_cache.cu).
__device__ __forceinline__ float2 rope_rotate(float x1, float x2, float2 cs) {
    return make_float2(round_bf16(round_bf16(x1 * cs.x) - round_bf16(x2 * cs.y)),
                       round_bf16(round_bf16(x2 * cs.x) + round_bf16(x1 * cs.y)));
}
