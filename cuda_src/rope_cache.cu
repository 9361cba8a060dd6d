#include "kv_cache.cuh"
#include "rope.cuh"

// The cos and sin of every RoPE angle, position p * inv_freq[i], each rounded to
// bfloat16 as transformers does: cos_sin[p, i] = (cos, sin). Filled once, when the
// backend starts, for every position the model takes.
// grid: positions; block: head_dim / 2
extern "C" __global__ void rope_cos_sin(float2* __restrict__ cos_sin, const float* __restrict__ inv_freq, int half) {
    await_previous_kernel();
    const int p = blockIdx.x, i = threadIdx.x;
    float s, c;
    sincosf((float)p * inv_freq[i], &s, &c);
    cos_sin[(size_t)p * half + i] = make_float2(round_bf16(c), round_bf16(s));
}

// RoPE ("rotate half" layout) on Q and K of the fused projection, and K, V into the
// paged cache:
//   for each head, i < head_dim / 2, angle = position * inv_freq[i]:
//     x[i]            <- x[i] * cos - x[i + half] * sin
//     x[i + half]     <- x[i + half] * cos + x[i] * sin
//   q is rotated in place in qkv; rotated k and plain v go to cache slot slots[t] (as
//   kv_cache.cuh's elements: bfloat16, or e4m3 codes of the bfloat16 values times
//   k_inv and v_inv, the reciprocals of the layer's scales).
// cos and sin come from rope_cos_sin's table; the rounding is rope.cuh's. Where
// col_scales is not null, qkv holds a W8A8 product's sums (fp8_activations.cu), each
// scaled back first: bf16(x * (row_scales[t] * col_scales[column])).
// qkv: [tokens, (heads + 2 * kv_heads) * head_dim]; caches: [blocks, kv_heads, 2^block_shift,
// head_dim] (kv_cache.cuh)
// grid: tokens; block: (heads + kv_heads) * head_dim / 2 threads at most 1024, looping
// (cuda_kernels.rope_and_cache_threads)
extern "C" __global__ void rope_and_cache(bf16* __restrict__ qkv, const float* __restrict__ row_scales,
                                          const float* __restrict__ col_scales, kv_t* __restrict__ k_cache,
                                          kv_t* __restrict__ v_cache, const int* __restrict__ positions,
                                          const int* __restrict__ slots, const float2* __restrict__ cos_sin,
                                          int heads, int kv_heads, int head_dim, int block_shift, float k_inv,
                                          float v_inv) {
    await_previous_kernel();
    const int t = blockIdx.x, half = head_dim / 2;
    const float2* angle_cs = cos_sin + (size_t)positions[t] * half;
    const size_t width = (size_t)(heads + 2 * kv_heads) * head_dim;
    bf16* row = qkv + t * width;
    const float row_scale = col_scales ? row_scales[t] : 1.f;
    auto value = [&](int column) {
        const float x = to_f32(row[column]);
        return col_scales ? round_bf16(x * (row_scale * col_scales[column])) : x;
    };
    const int slot = slots[t];
    const int pairs = (heads + kv_heads) * half;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int head = p / half, i = p % half;  // heads first, then kv heads (the k part)
        const int column = head * head_dim + i;
        const float2 y = rope_rotate(value(column), value(column + half), angle_cs[i]);
        if (head < heads) {
            row[column] = to_bf16(y.x);
            row[column + half] = to_bf16(y.y);
        } else {
            kv_t* k = k_cache + kv_slot_row(slot, head - heads, kv_heads, block_shift) * head_dim;
            k[i] = to_kv(y.x, k_inv);
            k[i + half] = to_kv(y.y, k_inv);
        }
    }
    const int v_start = (heads + kv_heads) * head_dim;
    for (int j = threadIdx.x; j < kv_heads * head_dim; j += blockDim.x)
        v_cache[kv_slot_row(slot, j / head_dim, kv_heads, block_shift) * head_dim + j % head_dim] =
            to_kv(value(v_start + j), v_inv);
}
