#include "common.cuh"

// residual[t, :] = embedding[ids[t], :]   (the residual stream is float32 holding
// bfloat16 values, as transformers' bfloat16 hidden states)
// grid: tokens; block: any
extern "C" __global__ void embedding_gather(float* __restrict__ residual, const bf16* __restrict__ embedding,
                                            const int* __restrict__ ids, int hidden) {
    const bf16* row = embedding + (size_t)ids[blockIdx.x] * hidden;
    float* out = residual + (size_t)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[i] = to_f32(row[i]);
}
