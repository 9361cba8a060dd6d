#include "common.cuh"

// For each output row i, with r = rows[i]:
//   residual[r] += delta[r]            (skipped when delta is null; rounded to bfloat16)
//   out[i] = weight * bf16(residual[r] / sqrt(mean(residual[r]^2) + eps))
// Fusing the residual add saves a pass over the activations. `rows` picks the rows
// to normalise (all of them, or the last token of each sequence before the head).
// grid: output rows; block: 256 threads
extern "C" __global__ void add_rmsnorm(float* __restrict__ residual, const bf16* __restrict__ delta,
                                       const bf16* __restrict__ weight, bf16* __restrict__ out,
                                       const int* __restrict__ rows, int hidden, float eps) {
    __shared__ float scratch[32];
    const int r = rows[blockIdx.x];
    float* x = residual + (size_t)r * hidden;
    float sum_sq = 0.f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = x[i];
        if (delta) {
            v = round_bf16(v + to_f32(delta[(size_t)r * hidden + i]));
            x[i] = v;
        }
        sum_sq += v * v;
    }
    float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / hidden + eps);
    bf16* y = out + (size_t)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        y[i] = to_bf16(to_f32(weight[i]) * round_bf16(x[i] * inv_rms));
}
