#include "activation.cuh"
#include "kv_cache.cuh"
#include "rmsnorm.cuh"
#include "rope.cuh"
#include "weights.cuh"

// y[o] = sum_i x[i] * w[o, i]: a linear layer for a decode step of one token, which
// must do no more than read w once. cuBLAS leaves bandwidth unused on these shapes
// (bench/profile_step.py's gemm table has both); steps of more rows take cuBLAS. One
// row keeps the kernel within 64 registers, 4 blocks an SM: built for up to 8 rows it
// took 80 and 3 blocks, and a batch-1 step 1.09 ms against 0.97 (bench/RESULTS.md).
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
// warp). Sums are reduced in a fixed order (lanes, the warp, then the group's slices in
// order), so the result does not depend on the grid. d_in must be a multiple of 8.
//
// Three variants take the kernels around a layer's GEMMs into the GEMV, each with the
// arithmetic of the kernel it replaces, so that they compute bit for bit what the
// separate kernels do:
//   gemv_rmsnorm_rope: x = RMSNorm(residual) (add_rmsnorm without a delta), staged in
//                      shared memory by the block before the product, and w = the
//                      fused QKV projection: a group computes the rows of one RoPE
//                      pair (i, i + half of a head) and stores them as rope_and_cache
//                      does: q rotated in place, k rotated and v into the paged cache
//   gemv_rmsnorm_silu: the same x, and w = [gate | up] of 2 * d_out rows: a group
//                      computes gate row o and up row d_out + o and stores
//                      silu_and_mul of the two (silu_and_mul's arithmetic), so the
//                      down projection reads its input as it is
//   gemv_add:          residual += bf16(y) (add_rmsnorm's residual add), instead of storing y
// The oracles: numpy's x @ w.T for gemv, and the separate kernels for the variants
// (tests/gpu/test_kernels.py).
//
// Each kernel comes in three weight formats (WeightFormat): bfloat16; FP8 (e4m3 codes,
// 16 to a lane's 16-byte load, times float32 scales: one per output row, or one per
// 128 x 128 block as Hugging Face's fp8 checkpoints store them); and INT4 (32 codes a
// load, with a scale and a zero point per group of columns, as AWQ and GPTQ store them).
// The FP8 kernels (name_fp8) sum code * x in float32 and scale each row's sum (each
// block's part of it, for block scales) once; the INT4 ones (name_int4) sum (code -
// zero) * x, exact in float32 but for the sum, and scale each 32 columns' part. Their
// oracle is numpy's x @ w.T of the dequantized weight (tests/gpu/test_quantized.py).
#define GEMV_WARPS 8  // 256 threads: the block add_rmsnorm reduces a row over (rmsnorm.cuh)
#define UNROLL 8
#define SPAN (32 * 8)  // bfloat16 weights one warp reads with one load per lane
// Warps a row of w is split over: a power of two, each slice at least UNROLL loads
// wide (bench/profile_step.py's gemv rows). Mirrored by cuda_kernels.gemv_split.
template <WeightFormat W>
__device__ __forceinline__ int gemv_split(int d_in) {
    int split = 1;
    while (split < GEMV_WARPS && d_in >= 2 * split * 32 * COLS<W> * UNROLL) split *= 2;
    return split;
}
// At least 4 blocks an SM (32 warps, 128 KB of weights in flight).
#define GEMV_BOUNDS __launch_bounds__(GEMV_WARPS * 32, 4)
// INT4's unpacking takes more registers than 4 blocks an SM leave (it spills): 3 blocks.
#define GEMV_INT4_BOUNDS __launch_bounds__(GEMV_WARPS * 32, 3)
// The variants whose outputs take two weight rows keep both in flight (64 registers of
// loads a thread): at least 2 blocks an SM (16 warps, 128 KB in flight); with 3 they spill.
#define GEMV_PAIR_BOUNDS __launch_bounds__(GEMV_WARPS * 32, 2)

enum GemvInput { X_GIVEN, X_RMSNORM };
enum GemvOutput { Y_STORE, Y_ROPE_AND_CACHE, Y_SILU_AND_MUL, Y_ADD_TO_RESIDUAL };  // Y_STORE: float32 if out_f32, else bfloat16

// Where gemv_rmsnorm_rope's outputs go, and the rotation's inputs (as rope_and_cache's).
struct RopeCache {
    kv_t* k_cache;  // [blocks, kv_heads, 2^block_shift, head_dim] (kv_cache.cuh)
    kv_t* v_cache;
    const int* positions;  // of the token: [1]
    const int* slots;
    const float2* cos_sin;  // [positions, head_dim / 2] (rope_cache.cu)
    int heads, kv_heads, head_dim, block_shift;
    float k_inv, v_inv;  // the reciprocals of the layer's K and V cache scales (rope_cache.cu)
};

// The token's inputs to the rotation and the cache write. Step metadata and the
// cos/sin table are no earlier kernel's output, so the GEMV reads them before its wait.
struct RopeRow {
    int position;
    int slot;
};

__device__ __forceinline__ RopeRow rope_row(const RopeCache& c) { return {c.positions[0], c.slots[0]}; }

// Where KV head kvh of the token's k (or v) goes in the cache, in elements.
__device__ __forceinline__ size_t cache_offset(const RopeCache& c, const RopeRow& row, int kvh) {
    return kv_slot_row(row.slot, kvh, c.kv_heads, c.block_shift) * c.head_dim;
}

// Output o of gemv_rmsnorm_rope, a RoPE pair: the projection rows of dims i and
// i + half of head o / half (q heads, then k, then v), with their sums.
__device__ __forceinline__ void store_rope_pair(bf16* __restrict__ qkv, const RopeCache& c, const RopeRow& row,
                                                float2 cs, int o, const float* sums) {
    const int half = c.head_dim / 2, head = o / half, i = o % half;
    const float x1 = round_bf16(sums[0]), x2 = round_bf16(sums[1]);  // (qkv's bfloat16 values)
    if (head >= c.heads + c.kv_heads) {  // v, as it is
        kv_t* v = c.v_cache + cache_offset(c, row, head - c.heads - c.kv_heads);
        v[i] = to_kv(x1, c.v_inv);
        v[i + half] = to_kv(x2, c.v_inv);
        return;
    }
    const float2 y = rope_rotate(x1, x2, cs);
    if (head < c.heads) {
        bf16* q = qkv + (size_t)head * c.head_dim;
        q[i] = to_bf16(y.x);
        q[i + half] = to_bf16(y.y);
    } else {
        kv_t* k = c.k_cache + cache_offset(c, row, head - c.heads);
        k[i] = to_kv(y.x, c.k_inv);
        k[i + half] = to_kv(y.y, c.k_inv);
    }
}

// UNROLL of a lane's 16-byte pieces of a weight row, from column `first` on (zeros from
// `end`), the row read by `lanes` lanes.
template <WeightFormat W>
__device__ __forceinline__ void load_weights(uint4* raw, const uint8_t* __restrict__ w_row, int first, int end, int lanes) {
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        const int c = first + u * lanes * COLS<W>;
        raw[u] = c < end ? __ldg(reinterpret_cast<const uint4*>(w_row + (size_t)c * 16 / COLS<W>)) : make_uint4(0, 0, 0, 0);
    }
}

// Writes RMSNorm(residual) with `norm_weight` to `staged` ([d_in], bfloat16).
__device__ __forceinline__ void stage_rmsnorm(bf16* staged, const float* residual, const bf16* __restrict__ norm_weight,
                                              float eps, int d_in) {
    __shared__ float scratch[32];
    float* x = const_cast<float*>(residual);  // (read only: no delta)
    const float inv_rms = rsqrtf(block_sum(add_and_sum_squares(x, nullptr, d_in), scratch) / d_in + eps);
    scale_row(x, norm_weight, staged, d_in, inv_rms);
}

// 8 bfloat16 values of x at c (read-only global memory, or shared memory) as float32.
template <GemvInput IN>
__device__ __forceinline__ void load_x8(const bf16* x, int c, float* out) {
    if constexpr (IN == X_GIVEN) load_bf16x8(x + c, out);
    else unpack_bf16x8(*reinterpret_cast<const uint4*>(x + c), out);  // (shared memory)
}

// This lane's share of x[begin:end] . w_row[begin:end], with its first UNROLL pieces
// already in raw; leaves the first pieces of next_row's slice (if any) in raw. For FP8
// the sum of codes times x, each 128-column block's part times `row_scales`' entry
// for it where given (the row's block scales), else left for the row's scale. For INT4
// each piece's sum of (code - zero) times x, times the scale, of its group of
// `group_cols` columns (`row_scales`: the row's (scale, zero) pairs).
template <GemvInput IN, WeightFormat W>
__device__ __forceinline__ float gemv_slice(uint4* raw, const bf16* x, const uint8_t* __restrict__ w_row,
                                            const uint8_t* __restrict__ next_row, const float* __restrict__ row_scales,
                                            int group_cols, int lane, int lanes, int begin, int end) {
    constexpr int C = COLS<W>;
    const int STEP = lanes * C;
    float acc = 0.f;
    for (int base = begin + lane * C; base < end; base += STEP * UNROLL) {
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int c = base + u * STEP;
            if (c >= end) break;
            float wf[8], xf[8];
            if constexpr (W == W_BF16) {
                unpack_bf16x8(raw[u], wf);
                load_x8<IN>(x, c, xf);
#pragma unroll
                for (int i = 0; i < 8; i++) acc += wf[i] * xf[i];
            } else if constexpr (W == W_FP8) {  // (in halves of 8, to stay within the registers of 4 blocks an SM)
                float dot = 0.f;
                unpack_e4m3x8(raw[u].x, raw[u].y, wf);
                load_x8<IN>(x, c, xf);
#pragma unroll
                for (int i = 0; i < 8; i++) dot += wf[i] * xf[i];
                unpack_e4m3x8(raw[u].z, raw[u].w, wf);
                load_x8<IN>(x, c + 8, xf);
#pragma unroll
                for (int i = 0; i < 8; i++) dot += wf[i] * xf[i];
                acc += row_scales ? dot * row_scales[c / group_cols] : dot;
            } else {  // INT4: the piece's 32 columns lie in one group (group_cols is a multiple of 32)
                const float2 scale_zero = reinterpret_cast<const float2*>(row_scales)[c / group_cols];
                const float zero = int4_biased_zero(scale_zero.y);
                const uint32_t words[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
                float dot = 0.f;
#pragma unroll
                for (int h = 0; h < 4; h++) {
                    unpack_int4x8(words[h], zero, wf);
                    load_x8<IN>(x, c + 8 * h, xf);
#pragma unroll
                    for (int i = 0; i < 8; i++) dot += wf[i] * xf[i];
                }
                acc += dot * scale_zero.x;
            }
        }
        const int next = base + STEP * UNROLL;
        if (next < end) load_weights<W>(raw, w_row, next, end, lanes);
        else if (next_row) load_weights<W>(raw, next_row, begin + lane * C, end, lanes);
    }
    return acc;
}

// x's dot product with the group's weight row, for the lanes of the group's first
// warp (slice 0), summed in a fixed order: lanes, then the slices in order. Every
// warp of the block must call it together when split > 1 (it syncs the block). A row
// of fewer lanes than the warp's (split 1) is summed over its own lanes.
__device__ __forceinline__ float group_sum(float acc, float* slice_sums, int warp, int lane, int lanes, int slice,
                                           int split) {
    float sum = acc;  // (every lane of the row gets the sum)
    for (int o = lanes / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
    if (split == 1) return sum;
    if (lane == 0) slice_sums[warp] = sum;
    __syncthreads();
    if (slice == 0)
        for (int s = 1; s < split; s++) sum += slice_sums[warp + s];
    __syncthreads();
    return sum;
}

// A warp's lanes take 32 / lanes output rows at once, `lanes` lanes a row: a whole warp
// would leave half its loads unused on an FP8 row of 2048 columns (128 of its 16-byte
// pieces), so half a warp takes an FP8 row of up to 2048 columns (mirrored by
// kernels.gemv_rows_per_block). (FP8 batch-1 steps took 0.871 ms before and after,
// bench/RESULTS.md: at this size a GEMV's time is more its start and end than its loads.)
// An INT4 row takes a whole warp, as a bfloat16 one: with 8 lanes a row (as few as
// covered 2048 columns with their UNROLL loads) a lane unpacked 256 codes in a chain and
// a 2048 x 2048 matrix filled 64 blocks, half the SMs; it took 6.9 µs against
// bfloat16's 5.0 (bench/RESULTS.md, cf033b8).
template <WeightFormat W>
__device__ __forceinline__ int row_lanes(int d_in) {
    if constexpr (W == W_BF16) return 32;
    constexpr int fewest = W == W_FP8 ? 16 : 32;
    int lanes = 32;
    while (lanes > fewest && d_in <= lanes / 2 * COLS<W> * UNROLL) lanes /= 2;
    return lanes;
}
template <GemvInput IN, GemvOutput OUT, WeightFormat W>
__device__ __forceinline__ void gemv_rows(void* __restrict__ y, bool out_f32, const void* __restrict__ src,
                                          const bf16* __restrict__ norm_weight, float eps, const WeightRef w,
                                          int d_in, int d_out, const RopeCache& rope = {}) {
    extern __shared__ __align__(16) bf16 staged[];  // [d_in] when IN is X_RMSNORM
    __shared__ float slice_sums[GEMV_WARPS];
    // Weight rows an output takes: a RoPE pair's two, or gate row o and up row d_out + o.
    constexpr int PARTS = OUT == Y_ROPE_AND_CACHE || OUT == Y_SILU_AND_MUL ? 2 : 1;
    constexpr int C = COLS<W>;
    const int lanes = row_lanes<W>(d_in), ROWS = 32 / lanes;
    const int lane = threadIdx.x % lanes, sub = (threadIdx.x & 31) / lanes, warp = threadIdx.x >> 5;
    const int split = lanes == 32 ? gemv_split<W>(d_in) : 1, groups = GEMV_WARPS / split, slice = warp % split;
    const int width = (d_in / C + split - 1) / split * C;  // (a multiple of C, as the loads need)
    const int begin = slice * width, end = min(d_in, begin + width);
    const int stride = gridDim.x * groups * ROWS;
    // The weight row of output o's part (the row's index, its data, its block scales).
    auto row_of = [&](int o, int part) -> size_t {
        if constexpr (OUT == Y_ROPE_AND_CACHE) {
            const int half = rope.head_dim / 2;
            return (size_t)(o / half) * rope.head_dim + o % half + part * half;
        }
        return (size_t)part * d_out + o;
    };
    auto weight_row = [&](int o, int part) { return w.data + row_of(o, part) * d_in * 16 / C; };
    // FP8's block scales of the row (null for a scale a row), or INT4's (scale, zero) pairs.
    auto row_scales = [&](int o, int part) -> const float* {
        if (W == W_INT4) return w.scale + row_of(o, part) * w.scale_cols * 2;
        if (W == W_BF16 || w.scale_cols == 0) return nullptr;
        return w.scale + row_of(o, part) / FP8_BLOCK * w.scale_cols;
    };
    const int group_cols = W == W_INT4 ? d_in / w.scale_cols : FP8_BLOCK;
    int first = blockIdx.x * groups * ROWS;  // the block's first output; its group's is first + warp / split * ROWS
    // The weights are no earlier kernel's output: the first loads of the group's first
    // output (of each of its rows) go out before the wait for the previous kernel, and
    // overlap its tail; then each part keeps the next output's row in flight.
    uint4 raw[PARTS][UNROLL];
    const int first_o = min(first + warp / split * ROWS + sub, d_out - 1);
#pragma unroll
    for (int part = 0; part < PARTS; part++)
        load_weights<W>(raw[part], weight_row(first_o, part), begin + lane * C, end, lanes);
    RopeRow row{};
    float2 first_cs{};
    if constexpr (OUT == Y_ROPE_AND_CACHE) {
        if (slice == 0 && lane == 0) {
            row = rope_row(rope);
            first_cs = rope.cos_sin[(size_t)row.position * (rope.head_dim / 2) + first_o % (rope.head_dim / 2)];
        }
    }
    await_previous_kernel();
    const bf16* x = static_cast<const bf16*>(src);
    if constexpr (IN == X_RMSNORM) {
        stage_rmsnorm(staged, static_cast<const float*>(src), norm_weight, eps, d_in);
        __syncthreads();
        x = staged;
    }
    // (Every warp of the block takes the same turns of this loop: the slices' sums meet
    // at __syncthreads.)
    for (; first < d_out; first += stride) {
        const int o = first + warp / split * ROWS + sub;
        float sums[PARTS];
#pragma unroll
        for (int part = 0; part < PARTS; part++) {
            float acc = 0.f;
            if (o < d_out) {
                const uint8_t* next = o + stride < d_out ? weight_row(o + stride, part) : nullptr;
                acc = gemv_slice<IN, W>(raw[part], x, weight_row(o, part), next, row_scales(o, part), group_cols, lane,
                                        lanes, begin, end);
            }
            sums[part] = group_sum(acc, slice_sums, warp, lane, lanes, slice, split);
            if (W == W_FP8 && w.scale_cols == 0 && o < d_out) sums[part] *= w.scale[row_of(o, part)];
        }
        if (slice != 0 || lane != 0 || o >= d_out) continue;
        if constexpr (OUT == Y_ADD_TO_RESIDUAL) {
            static_cast<float*>(y)[o] = round_bf16(static_cast<float*>(y)[o] + round_bf16(sums[0]));
        } else if constexpr (OUT == Y_ROPE_AND_CACHE) {
            const int half = rope.head_dim / 2;
            const float2 cs = o == first_o ? first_cs : rope.cos_sin[(size_t)row.position * half + o % half];
            store_rope_pair(static_cast<bf16*>(y), rope, row, cs, o, sums);
        } else if constexpr (OUT == Y_SILU_AND_MUL) {
            static_cast<bf16*>(y)[o] = to_bf16(silu_and_mul1(round_bf16(sums[0]), round_bf16(sums[1])));
        } else {
            if (out_f32) static_cast<float*>(y)[o] = sums[0];
            else static_cast<bf16*>(y)[o] = to_bf16(sums[0]);
        }
    }
}

// The kernels, each in the three formats: NAME with bfloat16 weights `w`, NAME_fp8 with
// e4m3 codes `w` and their `w_scale` (scale_cols 0: one a row; else 128 x 128 blocks),
// NAME_int4 with INT4 codes `w` and their (scale, zero) pairs, scale_cols groups a row.

// y = x @ w^T, y float32 if out_f32 else bfloat16
extern "C" __global__ void GEMV_BOUNDS gemv(void* __restrict__ y, int out_f32, const bf16* __restrict__ x,
                                            const bf16* __restrict__ w, int d_in, int d_out) {
    gemv_rows<X_GIVEN, Y_STORE, W_BF16>(y, out_f32, x, nullptr, 0.f, bf16_weight(w), d_in, d_out);
}

extern "C" __global__ void GEMV_BOUNDS gemv_fp8(void* __restrict__ y, int out_f32, const bf16* __restrict__ x,
                                                const uint8_t* __restrict__ w, const float* __restrict__ w_scale,
                                                int scale_cols, int d_in, int d_out) {
    gemv_rows<X_GIVEN, Y_STORE, W_FP8>(y, out_f32, x, nullptr, 0.f, {w, w_scale, scale_cols}, d_in, d_out);
}

extern "C" __global__ void GEMV_INT4_BOUNDS gemv_int4(void* __restrict__ y, int out_f32, const bf16* __restrict__ x,
                                                 const uint8_t* __restrict__ w, const float* __restrict__ w_scale,
                                                 int scale_cols, int d_in, int d_out) {
    gemv_rows<X_GIVEN, Y_STORE, W_INT4>(y, out_f32, x, nullptr, 0.f, {w, w_scale, scale_cols}, d_in, d_out);
}

// qkv = RMSNorm(residual) @ w^T, then rope_and_cache: q rotated in place, k rotated and
// v into the cache (qkv's k and v are left unwritten); d_out = qkv's width / 2 (RoPE
// pairs); dynamic shared memory: d_in * 2 bytes
extern "C" __global__ void GEMV_PAIR_BOUNDS gemv_rmsnorm_rope(bf16* __restrict__ qkv, const float* __restrict__ residual,
                                                         const bf16* __restrict__ norm_weight, float eps,
                                                         const bf16* __restrict__ w, kv_t* __restrict__ k_cache,
                                                         kv_t* __restrict__ v_cache, const int* __restrict__ positions,
                                                         const int* __restrict__ slots, const float2* __restrict__ cos_sin,
                                                         int heads, int kv_heads, int head_dim, int block_shift,
                                                         float k_inv, float v_inv, int d_in, int d_out) {
    gemv_rows<X_RMSNORM, Y_ROPE_AND_CACHE, W_BF16>(
        qkv, false, residual, norm_weight, eps, bf16_weight(w), d_in, d_out,
        {k_cache, v_cache, positions, slots, cos_sin, heads, kv_heads, head_dim, block_shift, k_inv, v_inv});
}

extern "C" __global__ void GEMV_PAIR_BOUNDS gemv_rmsnorm_rope_fp8(
    bf16* __restrict__ qkv, const float* __restrict__ residual, const bf16* __restrict__ norm_weight, float eps,
    const uint8_t* __restrict__ w, const float* __restrict__ w_scale, int scale_cols, kv_t* __restrict__ k_cache,
    kv_t* __restrict__ v_cache, const int* __restrict__ positions, const int* __restrict__ slots,
    const float2* __restrict__ cos_sin, int heads, int kv_heads, int head_dim, int block_shift, float k_inv, float v_inv,
    int d_in, int d_out) {
    gemv_rows<X_RMSNORM, Y_ROPE_AND_CACHE, W_FP8>(
        qkv, false, residual, norm_weight, eps, {w, w_scale, scale_cols}, d_in, d_out,
        {k_cache, v_cache, positions, slots, cos_sin, heads, kv_heads, head_dim, block_shift, k_inv, v_inv});
}

extern "C" __global__ void GEMV_PAIR_BOUNDS gemv_rmsnorm_rope_int4(
    bf16* __restrict__ qkv, const float* __restrict__ residual, const bf16* __restrict__ norm_weight, float eps,
    const uint8_t* __restrict__ w, const float* __restrict__ w_scale, int scale_cols, kv_t* __restrict__ k_cache,
    kv_t* __restrict__ v_cache, const int* __restrict__ positions, const int* __restrict__ slots,
    const float2* __restrict__ cos_sin, int heads, int kv_heads, int head_dim, int block_shift, float k_inv, float v_inv,
    int d_in, int d_out) {
    gemv_rows<X_RMSNORM, Y_ROPE_AND_CACHE, W_INT4>(
        qkv, false, residual, norm_weight, eps, {w, w_scale, scale_cols}, d_in, d_out,
        {k_cache, v_cache, positions, slots, cos_sin, heads, kv_heads, head_dim, block_shift, k_inv, v_inv});
}

// act = silu_and_mul(RMSNorm(residual) @ w^T), w = [gate | up] of 2 * d_out rows;
// dynamic shared memory: d_in * 2 bytes
extern "C" __global__ void GEMV_PAIR_BOUNDS gemv_rmsnorm_silu(bf16* __restrict__ act, const float* __restrict__ residual,
                                                         const bf16* __restrict__ norm_weight, float eps,
                                                         const bf16* __restrict__ w, int d_in, int d_out) {
    gemv_rows<X_RMSNORM, Y_SILU_AND_MUL, W_BF16>(act, false, residual, norm_weight, eps, bf16_weight(w), d_in, d_out);
}

extern "C" __global__ void GEMV_PAIR_BOUNDS gemv_rmsnorm_silu_fp8(bf16* __restrict__ act, const float* __restrict__ residual,
                                                             const bf16* __restrict__ norm_weight, float eps,
                                                             const uint8_t* __restrict__ w,
                                                             const float* __restrict__ w_scale, int scale_cols, int d_in,
                                                             int d_out) {
    gemv_rows<X_RMSNORM, Y_SILU_AND_MUL, W_FP8>(act, false, residual, norm_weight, eps, {w, w_scale, scale_cols}, d_in,
                                                d_out);
}

extern "C" __global__ void GEMV_PAIR_BOUNDS gemv_rmsnorm_silu_int4(bf16* __restrict__ act, const float* __restrict__ residual,
                                                              const bf16* __restrict__ norm_weight, float eps,
                                                              const uint8_t* __restrict__ w,
                                                              const float* __restrict__ w_scale, int scale_cols, int d_in,
                                                              int d_out) {
    gemv_rows<X_RMSNORM, Y_SILU_AND_MUL, W_INT4>(act, false, residual, norm_weight, eps, {w, w_scale, scale_cols}, d_in,
                                                 d_out);
}

// residual += x @ w^T
extern "C" __global__ void GEMV_BOUNDS gemv_add(float* __restrict__ residual, const bf16* __restrict__ x,
                                                const bf16* __restrict__ w, int d_in, int d_out) {
    gemv_rows<X_GIVEN, Y_ADD_TO_RESIDUAL, W_BF16>(residual, false, x, nullptr, 0.f, bf16_weight(w), d_in, d_out);
}

extern "C" __global__ void GEMV_BOUNDS gemv_add_fp8(float* __restrict__ residual, const bf16* __restrict__ x,
                                                    const uint8_t* __restrict__ w, const float* __restrict__ w_scale,
                                                    int scale_cols, int d_in, int d_out) {
    gemv_rows<X_GIVEN, Y_ADD_TO_RESIDUAL, W_FP8>(residual, false, x, nullptr, 0.f, {w, w_scale, scale_cols}, d_in, d_out);
}

extern "C" __global__ void GEMV_INT4_BOUNDS gemv_add_int4(float* __restrict__ residual, const bf16* __restrict__ x,
                                                     const uint8_t* __restrict__ w, const float* __restrict__ w_scale,
                                                     int scale_cols, int d_in, int d_out) {
    gemv_rows<X_GIVEN, Y_ADD_TO_RESIDUAL, W_INT4>(residual, false, x, nullptr, 0.f, {w, w_scale, scale_cols}, d_in, d_out);
}

// out[o, i] = bf16(w[o, i]): a quantized weight as bfloat16, for the GEMMs of steps of
// more rows than the GEMV (or the skinny GEMM) takes (cuBLAS multiplies in bfloat16).
// Rows [first_row, first_row + rows) of w into out's rows 0.. (a chunk of a weight
// larger than the scratch buffer); a thread per 16-byte piece of codes (COLS<W>).
template <WeightFormat W>
__device__ __forceinline__ void dequantize_rows(bf16* __restrict__ out, const WeightRef w, int first_row, int rows,
                                                int d_in) {
    await_previous_kernel();
    constexpr int C = COLS<W>;
    const int pieces = d_in / C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)rows * pieces;
         i += (size_t)gridDim.x * blockDim.x) {
        const int r = first_row + (int)(i / pieces), c = (int)(i % pieces) * C;
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(w.data + ((size_t)r * d_in + c) * 16 / C));
        float f[C], scale;
        if constexpr (W == W_FP8) {
            scale = w.scale_cols ? w.scale[(size_t)(r / FP8_BLOCK) * w.scale_cols + c / FP8_BLOCK] : w.scale[r];
            unpack_e4m3x16(raw, f);
        } else {
            const float2 scale_zero = reinterpret_cast<const float2*>(w.scale)[(size_t)r * w.scale_cols + c / (d_in / w.scale_cols)];
            const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
            for (int h = 0; h < 4; h++) unpack_int4x8(words[h], int4_biased_zero(scale_zero.y), f + 8 * h);
            scale = scale_zero.x;
        }
        uint4* dst = reinterpret_cast<uint4*>(out + i * C);
#pragma unroll
        for (int k = 0; k < C / 8; k++) {
            float scaled[8];
#pragma unroll
            for (int j = 0; j < 8; j++) scaled[j] = f[8 * k + j] * scale;
            dst[k] = pack_bf16x8(scaled);
        }
    }
}

extern "C" __global__ void dequantize_fp8(bf16* __restrict__ out, const uint8_t* __restrict__ w,
                                          const float* __restrict__ w_scale, int scale_cols, int first_row, int rows,
                                          int d_in) {
    dequantize_rows<W_FP8>(out, {w, w_scale, scale_cols}, first_row, rows, d_in);
}

extern "C" __global__ void dequantize_int4(bf16* __restrict__ out, const uint8_t* __restrict__ w,
                                           const float* __restrict__ w_scale, int scale_cols, int first_row, int rows,
                                           int d_in) {
    dequantize_rows<W_INT4>(out, {w, w_scale, scale_cols}, first_row, rows, d_in);
}
