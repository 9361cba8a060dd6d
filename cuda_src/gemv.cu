#include "activation.cuh"
#include "rmsnorm.cuh"

// y[r, o] = sum_i x[r, i] * w[o, i] for the first `rows` (at most GEMV_MAX_ROWS) rows
// of x: a linear layer for decode steps of a few tokens, which must do no more than
// read w once. cuBLAS leaves bandwidth unused on some of these shapes
// (bench/profile_step.py's gemm table has both).
//
// grid: any number of blocks of GEMV_WARPS warps. A row of w is split into
// gemv_split(d_in) slices of at most one warp's UNROLL loads, each taken by one warp
// of a group; group g of the grid computes output rows g, g + (groups in the grid), ...
// The host launches as many blocks as are resident at once, so that the weights
// stream without waves of blocks ending and starting: a warp issues the first loads
// of its next row before it reduces and stores the one it has. (Without the split, a
// warp walked an 8192-wide row of the down projection in four dependent rounds of
// loads; it ran at half the bandwidth of the others.) A lane reads 8 consecutive
// weights with one 16-byte load, UNROLL loads at a time (4 KB of a row in flight per
// warp), and uses them for every row of x. Sums are reduced in a fixed order (lanes,
// the warp, then the group's slices in order), so a row's result depends neither on
// the rows of x beside it nor on the grid. d_in must be a multiple of 8.
//
// Three variants take the kernels around a layer's GEMMs into the GEMV, for steps
// whose GEMMs are all GEMVs (a step of one token), each with the arithmetic of the
// kernel it replaces, so that they compute bit for bit what the separate kernels do:
//   gemv_rmsnorm:  x = RMSNorm(residual) (add_rmsnorm without a delta), staged in
//                  shared memory by the block before the product
//   gemv_add:      residual += bf16(y) (add_rmsnorm's residual add), instead of storing y
//   gemv_silu_add: x = silu_and_mul(gate_up), staged likewise; residual += bf16(y)
// The oracles: numpy's x @ w.T for gemv, and the separate kernels for the variants
// (tests/gpu/test_kernels.py).
#define GEMV_MAX_ROWS 8
#define GEMV_WARPS 8  // 256 threads: the block add_rmsnorm reduces a row over (rmsnorm.cuh)
#define UNROLL 8
#define SPAN (32 * 8)  // weights one warp reads with one load per lane

// Warps a row of w is split over: a power of two, each slice at least UNROLL loads
// wide (bench/profile_step.py's gemv rows). Mirrored by cuda_backend.gemv_split.
__host__ __device__ __forceinline__ int gemv_split(int d_in) {
    int split = 1;
    while (split < GEMV_WARPS && d_in >= 2 * split * SPAN * UNROLL) split *= 2;
    return split;
}
// At least 3 blocks an SM (24 warps, 96 KB of weights in flight); without the bound
// ptxas holds gemv_silu_add to 64 registers and spills.
#define GEMV_BOUNDS __launch_bounds__(GEMV_WARPS * 32, 3)

enum GemvInput { X_GIVEN, X_RMSNORM, X_SILU };
enum GemvOutput { Y_STORE, Y_ADD_TO_RESIDUAL };  // Y_STORE: float32 if out_f32, else bfloat16

// UNROLL of a lane's 16-byte pieces of a weight row, from column `first` on (zeros from `end`).
__device__ __forceinline__ void load_weights(uint4* raw, const bf16* __restrict__ w_row, int first, int end) {
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        const int c = first + u * SPAN;
        raw[u] = c < end ? __ldg(reinterpret_cast<const uint4*>(w_row + c)) : make_uint4(0, 0, 0, 0);
    }
}

// Writes the block's input rows [rows, d_in] to `staged`: RMSNorm of the residual rows
// (`src`, float32) with `norm_weight`, or SiLU-and-multiply of the gate_up rows (`src`,
// bfloat16, width 2 * d_in).
template <GemvInput IN>
__device__ __forceinline__ void stage_input(bf16* staged, const void* src, const bf16* __restrict__ norm_weight,
                                            float eps, int rows, int d_in) {
    __shared__ float scratch[32];
    for (int r = 0; r < rows; r++) {
        bf16* out = staged + (size_t)r * d_in;
        if constexpr (IN == X_RMSNORM) {
            float* x = const_cast<float*>(static_cast<const float*>(src)) + (size_t)r * d_in;  // (read only: no delta)
            const float inv_rms = rsqrtf(block_sum(add_and_sum_squares(x, nullptr, d_in), scratch) / d_in + eps);
            scale_row(x, norm_weight, out, d_in, inv_rms);
        } else {
            const bf16* row = static_cast<const bf16*>(src) + (size_t)r * 2 * d_in;
#pragma unroll 1
            for (int i = 8 * threadIdx.x; i < d_in; i += 8 * blockDim.x)
                *reinterpret_cast<uint4*>(out + i) = silu_and_mul8(row, d_in, i);
        }
    }
}

// acc[r] += this lane's share of x[r, begin:end] . w_row[begin:end], with its first
// UNROLL pieces already in raw; leaves the first pieces of next_row's slice (if any) in raw.
template <GemvInput IN>
__device__ __forceinline__ void gemv_slice(float* acc, uint4* raw, const bf16* x, const bf16* __restrict__ w_row,
                                           const bf16* __restrict__ next_row, int lane, int rows, int begin, int end,
                                           int d_in) {
    for (int base = begin + lane * 8; base < end; base += SPAN * UNROLL) {
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int c = base + u * SPAN;
            if (c >= end) break;
            float wf[8];
            unpack_bf16x8(raw[u], wf);
#pragma unroll
            for (int r = 0; r < GEMV_MAX_ROWS; r++) {
                if (r >= rows) break;
                float xf[8];
                if constexpr (IN == X_GIVEN) load_bf16x8(x + (size_t)r * d_in + c, xf);
                else unpack_bf16x8(*reinterpret_cast<const uint4*>(x + (size_t)r * d_in + c), xf);
#pragma unroll
                for (int i = 0; i < 8; i++) acc[r] += wf[i] * xf[i];
            }
        }
        const int next = base + SPAN * UNROLL;
        if (next < end) load_weights(raw, w_row, next, end);
        else if (next_row) load_weights(raw, next_row, begin + lane * 8, end);
    }
}

template <GemvOutput OUT>
__device__ __forceinline__ void store_output(void* __restrict__ y, bool out_f32, size_t i, float sum) {
    if constexpr (OUT == Y_ADD_TO_RESIDUAL) static_cast<float*>(y)[i] = round_bf16(static_cast<float*>(y)[i] + round_bf16(sum));
    else if (out_f32) static_cast<float*>(y)[i] = sum;
    else static_cast<bf16*>(y)[i] = to_bf16(sum);
}

template <GemvInput IN, GemvOutput OUT>
__device__ __forceinline__ void gemv_rows(void* __restrict__ y, bool out_f32, const void* __restrict__ src,
                                          const bf16* __restrict__ norm_weight, float eps, const bf16* __restrict__ w,
                                          int rows, int d_in, int d_out) {
    extern __shared__ __align__(16) bf16 staged[];  // [rows, d_in] when IN is not X_GIVEN
    __shared__ float slice_sums[GEMV_WARPS][GEMV_MAX_ROWS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int split = gemv_split(d_in), groups = GEMV_WARPS / split, slice = warp % split;
    const int width = (d_in / 8 + split - 1) / split * 8;  // (a multiple of 8, as the loads need)
    const int begin = slice * width, end = min(d_in, begin + width);
    const int stride = gridDim.x * groups;
    int first = blockIdx.x * groups;  // the block's first output row; its group's row is first + warp / split
    // The weights are no earlier kernel's output: the first loads go out before the
    // wait for the previous kernel, and overlap its tail.
    uint4 raw[UNROLL];
    load_weights(raw, w + (size_t)min(first + warp / split, d_out - 1) * d_in, begin + lane * 8, end);
    await_previous_kernel();
    const bf16* x = static_cast<const bf16*>(src);
    if constexpr (IN != X_GIVEN) {
        stage_input<IN>(staged, src, norm_weight, eps, rows, d_in);
        __syncthreads();
        x = staged;
    }
    // (Every warp of the block takes the same turns of this loop: the slices' sums meet
    // at __syncthreads.)
    for (; first < d_out; first += stride) {
        const int o = first + warp / split;
        float acc[GEMV_MAX_ROWS];
#pragma unroll
        for (int r = 0; r < GEMV_MAX_ROWS; r++) acc[r] = 0.f;
        if (o < d_out) {
            const bf16* w_row = w + (size_t)o * d_in;
            gemv_slice<IN>(acc, raw, x, w_row, o + stride < d_out ? w_row + (size_t)stride * d_in : nullptr, lane, rows,
                           begin, end, d_in);
        }
#pragma unroll
        for (int r = 0; r < GEMV_MAX_ROWS; r++) {
            if (r >= rows) break;
            const float sum = warp_sum(acc[r]);
            if (split == 1) {
                if (lane == 0 && o < d_out) store_output<OUT>(y, out_f32, (size_t)r * d_out + o, sum);
            } else if (lane == 0) {
                slice_sums[warp][r] = sum;
            }
        }
        if (split > 1) {
            __syncthreads();
            if (slice == 0 && lane < rows && o < d_out) {
                float sum = slice_sums[warp][lane];
                for (int s = 1; s < split; s++) sum += slice_sums[warp + s][lane];
                store_output<OUT>(y, out_f32, (size_t)lane * d_out + o, sum);
            }
            __syncthreads();
        }
    }
}

// y = x @ w^T, y float32 if out_f32 else bfloat16
extern "C" __global__ void GEMV_BOUNDS gemv(void* __restrict__ y, int out_f32, const bf16* __restrict__ x,
                                            const bf16* __restrict__ w, int rows, int d_in, int d_out) {
    gemv_rows<X_GIVEN, Y_STORE>(y, out_f32, x, nullptr, 0.f, w, rows, d_in, d_out);
}

// y = RMSNorm(residual) @ w^T; dynamic shared memory: rows * d_in * 2 bytes
extern "C" __global__ void GEMV_BOUNDS gemv_rmsnorm(bf16* __restrict__ y, const float* __restrict__ residual,
                                                    const bf16* __restrict__ norm_weight, float eps,
                                                    const bf16* __restrict__ w, int rows, int d_in, int d_out) {
    gemv_rows<X_RMSNORM, Y_STORE>(y, false, residual, norm_weight, eps, w, rows, d_in, d_out);
}

// residual += x @ w^T
extern "C" __global__ void GEMV_BOUNDS gemv_add(float* __restrict__ residual, const bf16* __restrict__ x,
                                                const bf16* __restrict__ w, int rows, int d_in, int d_out) {
    gemv_rows<X_GIVEN, Y_ADD_TO_RESIDUAL>(residual, false, x, nullptr, 0.f, w, rows, d_in, d_out);
}

// residual += silu_and_mul(gate_up) @ w^T, gate_up of width 2 * d_in; dynamic shared
// memory: rows * d_in * 2 bytes
extern "C" __global__ void GEMV_BOUNDS gemv_silu_add(float* __restrict__ residual, const bf16* __restrict__ gate_up,
                                                     const bf16* __restrict__ w, int rows, int d_in, int d_out) {
    gemv_rows<X_SILU, Y_ADD_TO_RESIDUAL>(residual, false, gate_up, nullptr, 0.f, w, rows, d_in, d_out);
}
