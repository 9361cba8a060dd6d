#include "common.cuh"

// residual[t, :] = embedding[id, :], id = ids[t], or where ids[t] = -(i + 1) a token
// still on the device: id = sampled[i], sampled by the previous step (the residual
// stream is float32 holding bfloat16 values, as transformers' bfloat16 hidden states)
// grid: tokens; block: any
extern "C" __global__ void embedding_gather(float* __restrict__ residual, const bf16* __restrict__ embedding,
                                            const int* __restrict__ ids, const int* __restrict__ sampled, int hidden) {
    await_previous_kernel();
    const int id = ids[blockIdx.x] >= 0 ? ids[blockIdx.x] : sampled[-ids[blockIdx.x] - 1];
    const bf16* row = embedding + (size_t)id * hidden;
    float* out = residual + (size_t)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[i] = to_f32(row[i]);
}
