#include "rmsnorm.cuh"
#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif

// For each output row i, with r = rows[i]:
//   residual[r] += delta[r]            (skipped when delta is null; rounded to bfloat16)
//   out[i] = weight * bf16(residual[r] / sqrt(mean(residual[r]^2) + eps))
// Fusing the residual add saves a pass over the activations. `rows` picks the rows
// to normalise (all of them, or the last token of each sequence before the head).
// The ends of W8A8 products (fp8_activations.cu) ride along: where delta_col_scales is
// not null, delta holds a product's sums, scaled back here by delta_row_scales[r] and
// delta_col_scales; where out_scales is not null, out[i] is the normalised row's e4m3
// codes (uint8), out_scales[i] its scale.
// Each thread takes 8 consecutive elements at a time (16- and 32-byte accesses).
// grid: output rows; block: 256 threads; shared: 2 * hidden bytes with out_scales;
// hidden % 8 == 0 (checked by the host)
extern "C" __global__ void add_rmsnorm(float* __restrict__ residual, const bf16* __restrict__ delta,
                                       const float* __restrict__ delta_row_scales,
                                       const float* __restrict__ delta_col_scales, const bf16* __restrict__ weight,
                                       void* __restrict__ out, float* __restrict__ out_scales,
                                       const int* __restrict__ rows, int hidden, float eps) {
    extern __shared__ uint4 stash[];  // quantize_row's
    __shared__ float scratch[32];
    await_previous_kernel();
    const int r = rows[blockIdx.x];
    float* x = residual + (size_t)r * hidden;
    const float sum_sq = add_and_sum_squares(x, delta ? delta + (size_t)r * hidden : nullptr, hidden,
                                             delta_col_scales ? delta_row_scales[r] : 1.f, delta_col_scales);
    const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / hidden + eps);
    if (out_scales) {
        const float scale = quantize_row(x, weight, static_cast<uint8_t*>(out) + (size_t)blockIdx.x * hidden, hidden,
                                         inv_rms, stash, scratch);
        if (threadIdx.x == 0) out_scales[blockIdx.x] = scale;
    } else {
        scale_row(x, weight, static_cast<bf16*>(out) + (size_t)blockIdx.x * hidden, hidden, inv_rms);
    }
}

// For each token t, and each query and key head of t's row of the fused projection
// [q heads | kv heads of k | kv heads of v], in place:
//   x = weight * bf16(x / sqrt(mean(x^2) + eps)),  weight: q_weight for the first
//   `heads` heads, k_weight for the `kv_heads` after them (Qwen3's q/k norm, before RoPE)
// V is not touched. One warp a head, HEAD_DIM / 32 elements a lane.
// grid: (tokens, heads + kv_heads); block: 32 threads; HEAD_DIM % 32 == 0
extern "C" __global__ void head_rmsnorm(bf16* __restrict__ qkv, const bf16* __restrict__ q_weight,
                                        const bf16* __restrict__ k_weight, int heads, int kv_heads, float eps) {
    constexpr int PER_LANE = HEAD_DIM / 32;
    await_previous_kernel();
    const int head = blockIdx.y;
    bf16* x = qkv + (size_t)blockIdx.x * (heads + 2 * kv_heads) * HEAD_DIM + (size_t)head * HEAD_DIM;
    const bf16* weight = head < heads ? q_weight : k_weight;
    float v[PER_LANE], sum_sq = 0.f;
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) {
        v[i] = to_f32(x[threadIdx.x + 32 * i]);
        sum_sq += v[i] * v[i];
    }
    const float inv_rms = rsqrtf(warp_sum(sum_sq) / HEAD_DIM + eps);
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) {
        const int d = threadIdx.x + 32 * i;
        x[d] = to_bf16(to_f32(weight[d]) * round_bf16(v[i] * inv_rms));
    }
}
