#include "activation.cuh"
#include "rmsnorm.cuh"
#include "rope.cuh"

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
#define GEMV_WARPS 8  // 256 threads: the block add_rmsnorm reduces a row over (rmsnorm.cuh)
#define UNROLL 8
#define SPAN (32 * 8)  // weights one warp reads with one load per lane

// Warps a row of w is split over: a power of two, each slice at least UNROLL loads
// wide (bench/profile_step.py's gemv rows). Mirrored by cuda_kernels.gemv_split.
__host__ __device__ __forceinline__ int gemv_split(int d_in) {
    int split = 1;
    while (split < GEMV_WARPS && d_in >= 2 * split * SPAN * UNROLL) split *= 2;
    return split;
}
// At least 4 blocks an SM (32 warps, 128 KB of weights in flight).
#define GEMV_BOUNDS __launch_bounds__(GEMV_WARPS * 32, 4)
// The variants whose outputs take two weight rows keep both in flight (64 registers of
// loads a thread): at least 2 blocks an SM (16 warps, 128 KB in flight); with 3 they spill.
#define GEMV_PAIR_BOUNDS __launch_bounds__(GEMV_WARPS * 32, 2)

enum GemvInput { X_GIVEN, X_RMSNORM };
enum GemvOutput { Y_STORE, Y_ROPE_AND_CACHE, Y_SILU_AND_MUL, Y_ADD_TO_RESIDUAL };  // Y_STORE: float32 if out_f32, else bfloat16

// Where gemv_rmsnorm_rope's outputs go, and the rotation's inputs (as rope_and_cache's).
struct RopeCache {
    bf16* k_cache;  // [slots, kv_heads, head_dim]
    bf16* v_cache;
    const int* positions;  // of the token: [1]
    const int* slots;
    const float2* cos_sin;  // [positions, head_dim / 2] (rope_cache.cu)
    int heads, kv_heads, head_dim;
};

// The token's inputs to the rotation and the cache write. Step metadata and the
// cos/sin table are no earlier kernel's output, so the GEMV reads them before its wait.
struct RopeRow {
    int position;
    size_t cache_row;  // the token's slot in the cache, in elements
};

__device__ __forceinline__ RopeRow rope_row(const RopeCache& c) {
    return {c.positions[0], (size_t)c.slots[0] * c.kv_heads * c.head_dim};
}

// Output o of gemv_rmsnorm_rope, a RoPE pair: the projection rows of dims i and
// i + half of head o / half (q heads, then k, then v), with their sums.
__device__ __forceinline__ void store_rope_pair(bf16* __restrict__ qkv, const RopeCache& c, const RopeRow& row,
                                                float2 cs, int o, const float* sums) {
    const int half = c.head_dim / 2, head = o / half, i = o % half;
    const float x1 = round_bf16(sums[0]), x2 = round_bf16(sums[1]);  // (qkv's bfloat16 values)
    if (head >= c.heads + c.kv_heads) {  // v, as it is
        bf16* v = c.v_cache + row.cache_row + (size_t)(head - c.heads - c.kv_heads) * c.head_dim;
        v[i] = to_bf16(x1);
        v[i + half] = to_bf16(x2);
        return;
    }
    bf16* x = head < c.heads ? qkv + (size_t)head * c.head_dim
                             : c.k_cache + row.cache_row + (size_t)(head - c.heads) * c.head_dim;
    rope_rotate(x1, x2, cs, x[i], x[i + half]);
}

// UNROLL of a lane's 16-byte pieces of a weight row, from column `first` on (zeros from `end`).
__device__ __forceinline__ void load_weights(uint4* raw, const bf16* __restrict__ w_row, int first, int end) {
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        const int c = first + u * SPAN;
        raw[u] = c < end ? __ldg(reinterpret_cast<const uint4*>(w_row + c)) : make_uint4(0, 0, 0, 0);
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

// This lane's share of x[begin:end] . w_row[begin:end], with its first UNROLL pieces
// already in raw; leaves the first pieces of next_row's slice (if any) in raw.
template <GemvInput IN>
__device__ __forceinline__ float gemv_slice(uint4* raw, const bf16* x, const bf16* __restrict__ w_row,
                                            const bf16* __restrict__ next_row, int lane, int begin, int end) {
    float acc = 0.f;
    for (int base = begin + lane * 8; base < end; base += SPAN * UNROLL) {
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int c = base + u * SPAN;
            if (c >= end) break;
            float wf[8];
            unpack_bf16x8(raw[u], wf);
            float xf[8];
            if constexpr (IN == X_GIVEN) load_bf16x8(x + c, xf);
            else unpack_bf16x8(*reinterpret_cast<const uint4*>(x + c), xf);  // (shared memory)
#pragma unroll
            for (int i = 0; i < 8; i++) acc += wf[i] * xf[i];
        }
        const int next = base + SPAN * UNROLL;
        if (next < end) load_weights(raw, w_row, next, end);
        else if (next_row) load_weights(raw, next_row, begin + lane * 8, end);
    }
    return acc;
}

// x's dot product with the group's weight row, for the lanes of the group's first
// warp (slice 0), summed in a fixed order: lanes, then the slices in order. Every
// warp of the block must call it together when split > 1 (it syncs the block).
__device__ __forceinline__ float group_sum(float acc, float* slice_sums, int warp, int lane, int slice, int split) {
    float sum = warp_sum(acc);  // (every lane gets the sum)
    if (split == 1) return sum;
    if (lane == 0) slice_sums[warp] = sum;
    __syncthreads();
    if (slice == 0)
        for (int s = 1; s < split; s++) sum += slice_sums[warp + s];
    __syncthreads();
    return sum;
}

template <GemvInput IN, GemvOutput OUT>
__device__ __forceinline__ void gemv_rows(void* __restrict__ y, bool out_f32, const void* __restrict__ src,
                                          const bf16* __restrict__ norm_weight, float eps, const bf16* __restrict__ w,
                                          int d_in, int d_out, const RopeCache& rope = {}) {
    extern __shared__ __align__(16) bf16 staged[];  // [d_in] when IN is X_RMSNORM
    __shared__ float slice_sums[GEMV_WARPS];
    // Weight rows an output takes: a RoPE pair's two, or gate row o and up row d_out + o.
    constexpr int PARTS = OUT == Y_ROPE_AND_CACHE || OUT == Y_SILU_AND_MUL ? 2 : 1;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int split = gemv_split(d_in), groups = GEMV_WARPS / split, slice = warp % split;
    const int width = (d_in / 8 + split - 1) / split * 8;  // (a multiple of 8, as the loads need)
    const int begin = slice * width, end = min(d_in, begin + width);
    const int stride = gridDim.x * groups;
    auto weight_row = [&](int o, int part) {
        if constexpr (OUT == Y_ROPE_AND_CACHE) {
            const int half = rope.head_dim / 2;
            return w + ((size_t)(o / half) * rope.head_dim + o % half + part * half) * d_in;
        }
        return w + ((size_t)part * d_out + o) * d_in;
    };
    int first = blockIdx.x * groups;  // the block's first output; its group's is first + warp / split
    // The weights are no earlier kernel's output: the first loads of the group's first
    // output (of each of its rows) go out before the wait for the previous kernel, and
    // overlap its tail; then each part keeps the next output's row in flight.
    uint4 raw[PARTS][UNROLL];
    const int first_o = min(first + warp / split, d_out - 1);
#pragma unroll
    for (int part = 0; part < PARTS; part++) load_weights(raw[part], weight_row(first_o, part), begin + lane * 8, end);
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
        const int o = first + warp / split;
        float sums[PARTS];
#pragma unroll
        for (int part = 0; part < PARTS; part++) {
            float acc = 0.f;
            if (o < d_out) {
                const bf16* next = o + stride < d_out ? weight_row(o + stride, part) : nullptr;
                acc = gemv_slice<IN>(raw[part], x, weight_row(o, part), next, lane, begin, end);
            }
            sums[part] = group_sum(acc, slice_sums, warp, lane, slice, split);
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

// y = x @ w^T, y float32 if out_f32 else bfloat16
extern "C" __global__ void GEMV_BOUNDS gemv(void* __restrict__ y, int out_f32, const bf16* __restrict__ x,
                                            const bf16* __restrict__ w, int d_in, int d_out) {
    gemv_rows<X_GIVEN, Y_STORE>(y, out_f32, x, nullptr, 0.f, w, d_in, d_out);
}

// qkv = RMSNorm(residual) @ w^T, then rope_and_cache: q rotated in place, k rotated and
// v into the cache (qkv's k and v are left unwritten); d_out = qkv's width / 2 (RoPE
// pairs); dynamic shared memory: d_in * 2 bytes
extern "C" __global__ void GEMV_PAIR_BOUNDS gemv_rmsnorm_rope(bf16* __restrict__ qkv, const float* __restrict__ residual,
                                                         const bf16* __restrict__ norm_weight, float eps,
                                                         const bf16* __restrict__ w, bf16* __restrict__ k_cache,
                                                         bf16* __restrict__ v_cache, const int* __restrict__ positions,
                                                         const int* __restrict__ slots, const float2* __restrict__ cos_sin,
                                                         int heads, int kv_heads, int head_dim, int d_in, int d_out) {
    gemv_rows<X_RMSNORM, Y_ROPE_AND_CACHE>(qkv, false, residual, norm_weight, eps, w, d_in, d_out,
                                           {k_cache, v_cache, positions, slots, cos_sin, heads, kv_heads, head_dim});
}

// act = silu_and_mul(RMSNorm(residual) @ w^T), w = [gate | up] of 2 * d_out rows;
// dynamic shared memory: d_in * 2 bytes
extern "C" __global__ void GEMV_PAIR_BOUNDS gemv_rmsnorm_silu(bf16* __restrict__ act, const float* __restrict__ residual,
                                                         const bf16* __restrict__ norm_weight, float eps,
                                                         const bf16* __restrict__ w, int d_in, int d_out) {
    gemv_rows<X_RMSNORM, Y_SILU_AND_MUL>(act, false, residual, norm_weight, eps, w, d_in, d_out);
}

// residual += x @ w^T
extern "C" __global__ void GEMV_BOUNDS gemv_add(float* __restrict__ residual, const bf16* __restrict__ x,
                                                const bf16* __restrict__ w, int d_in, int d_out) {
    gemv_rows<X_GIVEN, Y_ADD_TO_RESIDUAL>(residual, false, x, nullptr, 0.f, w, d_in, d_out);
}
