#include "activation.cuh"

// The two ends of an FP8 x FP8 product (W8A8, engine/backends/cuda/linear.py): the
// step's activations quantized a token at a time, the product of the codes on the FP8
// tensor cores (cuBLASLt, which on sm_90 takes one scale an operand: both 1 there), and
// its sums scaled back by the token's scale and the weight row's:
//     y[t, o] = bf16(sum_i xq[t, i] wq[o, i]) * x_scale[t] * w_scale[o].
// Where the kernels before and after a product can, they do the two ends themselves
// (add_rmsnorm, rope_and_cache, silu_and_mul_e4m3: engine/backends/cuda/forward.py);
// these kernels are the rest.

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
    const float scale = e4m3_row_scale(block_max(amax, scratch));
    for (int i = 8 * threadIdx.x; i < d_in; i += 8 * blockDim.x) {
        float v[8];
        load_bf16x8(row + i, v);
        *reinterpret_cast<uint2*>(codes + (size_t)blockIdx.x * d_in + i) = pack_e4m3x8(v, scale);
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
    if (y_f32) {
        load_f32x8(static_cast<float*>(y) + at, v);
        load_f32x8(col_scales + o, s);
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] *= row_scale * s[j];
        store_f32x8(static_cast<float*>(y) + at, v);
    } else {
        load_bf16x8(static_cast<bf16*>(y) + at, v);
        unscale_sums8(v, row_scale, col_scales + o);
        *reinterpret_cast<uint4*>(static_cast<bf16*>(y) + at) = pack_bf16x8(v);
    }
}

// silu_and_mul (activation.cu) of a W8A8 gate/up product, quantized for the next one:
//   a[t, i] = bf16(silu(gate[t, i]) * up[t, i]), gate and up scaled back first where
//   row_scales is not null (each bf16(sum * row_scales[t] * col_scales[column]));
//   codes[t, i] = e4m3(a[t, i] / scales[t]), scales[t] = max_i |a[t, i]| / 448,
// the same codes as scale_rows_and_cols, silu_and_mul and quantize_rows_e4m3 in turn,
// in one pass over the row: a waits in shared memory for the row's largest magnitude.
// grid: tokens; block: any multiple of 32; shared: 2 * inter bytes; inter % 8 == 0
// (checked by the host).
extern "C" __global__ void silu_and_mul_e4m3(uint8_t* __restrict__ codes, float* __restrict__ scales,
                                             const bf16* __restrict__ gate_up, const float* __restrict__ row_scales,
                                             const float* __restrict__ col_scales, int inter) {
    extern __shared__ uint4 activations[];  // a's row, 8 bfloat16 values an element
    __shared__ float scratch[32];
    await_previous_kernel();
    const bf16* row = gate_up + (size_t)blockIdx.x * 2 * inter;
    const float row_scale = row_scales ? row_scales[blockIdx.x] : 1.f;
    float amax = 0.f;
    for (int i = 8 * threadIdx.x; i < inter; i += 8 * blockDim.x) {
        float a[8], u[8];
        load_bf16x8(row + i, a);
        load_bf16x8(row + inter + i, u);
        if (row_scales) {
            unscale_sums8(a, row_scale, col_scales + i);
            unscale_sums8(u, row_scale, col_scales + inter + i);
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            a[j] = round_bf16(silu_and_mul1(a[j], u[j]));
            amax = fmaxf(amax, fabsf(a[j]));
        }
        activations[i / 8] = pack_bf16x8(a);
    }
    const float scale = store_e4m3_row(codes + (size_t)blockIdx.x * inter, activations, inter, amax, scratch);
    if (threadIdx.x == 0) scales[blockIdx.x] = scale;
}
