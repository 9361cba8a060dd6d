#include "common.cuh"

// The two ends of an FP8 x FP8 product (W8A8, engine/backends/cuda/linear.py): the
// step's activations quantized a token at a time, the product of the codes on the FP8
// tensor cores (cuBLASLt, which on sm_90 takes one scale an operand: both 1 there), and
// its sums scaled back by the token's scale and the weight row's:
//     y[t, o] = bf16(sum_i xq[t, i] wq[o, i]) * x_scale[t] * w_scale[o].

// codes[t, i] = e4m3(x[t, i] / scale[t]), scale[t] = max_i |x[t, i]| / 448 (1 for a row
// of zeros), rounded as to_e4m3 (numpy's f32_to_e4m3 of the float32 quotient).
// grid: rows; block: any multiple of 32; d_in % 8 == 0 (checked by the host).
extern "C" __global__ void quantize_rows_e4m3(uint8_t* __restrict__ codes, float* __restrict__ scales,
                                              const bf16* __restrict__ x, int d_in) {
    __shared__ float scratch[32];
    await_previous_kernel();
    const bf16* row = x + (size_t)blockIdx.x * d_in;
    float amax = 0.f;
    for (int i = 8 * threadIdx.x; i < d_in; i += 8 * blockDim.x) {
        float v[8];
        load_bf16x8(row + i, v);
#pragma unroll
        for (int j = 0; j < 8; j++) amax = fmaxf(amax, fabsf(v[j]));
    }
    amax = block_max(amax, scratch);
    const float scale = amax > 0.f ? amax / 448.f : 1.f;
    for (int i = 8 * threadIdx.x; i < d_in; i += 8 * blockDim.x) {
        float v[8];
        load_bf16x8(row + i, v);
        uint32_t word[2] = {0u, 0u};
#pragma unroll
        for (int j = 0; j < 8; j++) word[j / 4] |= (uint32_t)to_e4m3(v[j] / scale) << (8 * (j % 4));
        *reinterpret_cast<uint2*>(codes + (size_t)blockIdx.x * d_in + i) = make_uint2(word[0], word[1]);
    }
    if (threadIdx.x == 0) scales[blockIdx.x] = scale;
}

// y[t, o] *= row_scales[t] * col_scales[o] in float32, y [rows, cols] bfloat16 (rounded
// again) or float32 (y_f32). Each thread takes 8 consecutive elements of a row.
// grid: (ceil(cols / (8 * blockDim)), rows); cols % 8 == 0 (checked by the host).
extern "C" __global__ void scale_rows_and_cols(void* __restrict__ y, int y_f32, const float* __restrict__ row_scales,
                                               const float* __restrict__ col_scales, int cols) {
    await_previous_kernel();
    const int o = 8 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (o >= cols) return;
    const size_t at = (size_t)blockIdx.y * cols + o;
    const float row_scale = row_scales[blockIdx.y];
    float v[8], s[8];
    load_f32x8(col_scales + o, s);
    if (y_f32) load_f32x8(static_cast<float*>(y) + at, v);
    else load_bf16x8(static_cast<bf16*>(y) + at, v);
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] *= row_scale * s[j];
    if (y_f32) store_f32x8(static_cast<float*>(y) + at, v);
    else *reinterpret_cast<uint4*>(static_cast<bf16*>(y) + at) = pack_bf16x8(v);
}
