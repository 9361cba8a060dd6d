#include "common.cuh"

// For each output row i, with r = rows[i]:
//   residual[r] += delta[r]            (skipped when delta is null; rounded to bfloat16)
//   out[i] = weight * bf16(residual[r] / sqrt(mean(residual[r]^2) + eps))
// Fusing the residual add saves a pass over the activations. `rows` picks the rows
// to normalise (all of them, or the last token of each sequence before the head).
// Each thread takes 8 consecutive elements at a time (16- and 32-byte accesses).
// grid: output rows; block: 256 threads; hidden % 8 == 0 (checked by the host)
extern "C" __global__ void add_rmsnorm(float* __restrict__ residual, const bf16* __restrict__ delta,
                                       const bf16* __restrict__ weight, bf16* __restrict__ out,
                                       const int* __restrict__ rows, int hidden, float eps) {
    await_previous_kernel();
    __shared__ float scratch[32];
    const int r = rows[blockIdx.x];
    float* x = residual + (size_t)r * hidden;
    float sum_sq = 0.f;
    for (int i = 8 * threadIdx.x; i < hidden; i += 8 * blockDim.x) {
        float v[8];
        load_f32x8(x + i, v);
        if (delta) {
            float d[8];
            load_bf16x8(delta + (size_t)r * hidden + i, d);
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = round_bf16(v[j] + d[j]);
            store_f32x8(x + i, v);
        }
#pragma unroll
        for (int j = 0; j < 8; j++) sum_sq += v[j] * v[j];
    }
    const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / hidden + eps);
    bf16* y = out + (size_t)blockIdx.x * hidden;
    for (int i = 8 * threadIdx.x; i < hidden; i += 8 * blockDim.x) {
        float v[8], w[8];
        load_f32x8(x + i, v);
        load_bf16x8(weight + i, w);
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = w[j] * round_bf16(v[j] * inv_rms);
        *reinterpret_cast<uint4*>(y + i) = pack_bf16x8(v);
    }
}
