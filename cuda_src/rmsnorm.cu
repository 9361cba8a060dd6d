#include "rmsnorm.cuh"

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
    const float sum_sq = add_and_sum_squares(x, delta ? delta + (size_t)r * hidden : nullptr, hidden);
    const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / hidden + eps);
    scale_row(x, weight, out + (size_t)blockIdx.x * hidden, hidden, inv_rms);
}
