#include "common.cuh"

// RoPE ("rotate half" layout) on Q and K of the fused projection, and K, V into the
// paged cache:
//   for each head, i < head_dim / 2, angle = position * inv_freq[i]:
//     x[i]            <- x[i] * cos - x[i + half] * sin
//     x[i + half]     <- x[i + half] * cos + x[i] * sin
//   q is rotated in place in qkv; rotated k and plain v go to cache slot slots[t].
// cos and sin are rounded to bfloat16 and each product too, as transformers does.
// qkv: [tokens, (heads + 2 * kv_heads) * head_dim]; caches: [slots, kv_heads, head_dim]
// grid: tokens; block: (heads + kv_heads) * head_dim / 2 threads at most 1024, looping
extern "C" __global__ void rope_and_cache(bf16* __restrict__ qkv, bf16* __restrict__ k_cache,
                                          bf16* __restrict__ v_cache, const int* __restrict__ positions,
                                          const int* __restrict__ slots, const float* __restrict__ inv_freq,
                                          int heads, int kv_heads, int head_dim) {
    await_previous_kernel();
    const int t = blockIdx.x, half = head_dim / 2;
    const float pos = (float)positions[t];
    const size_t width = (size_t)(heads + 2 * kv_heads) * head_dim;
    bf16* row = qkv + t * width;
    const size_t cache_row = (size_t)slots[t] * kv_heads * head_dim;
    const int pairs = (heads + kv_heads) * half;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        int head = p / half, i = p % half;  // heads first, then kv heads (the k part)
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        c = round_bf16(c);
        s = round_bf16(s);
        bf16* x = row + head * head_dim;
        float x1 = to_f32(x[i]), x2 = to_f32(x[i + half]);
        bf16 y1 = to_bf16(round_bf16(x1 * c) - round_bf16(x2 * s));
        bf16 y2 = to_bf16(round_bf16(x2 * c) + round_bf16(x1 * s));
        if (head < heads) {
            x[i] = y1;
            x[i + half] = y2;
        } else {
            bf16* k = k_cache + cache_row + (head - heads) * head_dim;
            k[i] = y1;
            k[i + half] = y2;
        }
    }
    const bf16* v = row + (size_t)(heads + kv_heads) * head_dim;
    for (int j = threadIdx.x; j < kv_heads * head_dim; j += blockDim.x) v_cache[cache_row + j] = v[j];
}
