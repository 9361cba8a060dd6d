#include <cooperative_groups.h>

#include "weights.cuh"

// y[m, o] = sum_i x[m, i] * w[o, i] for steps of 2 to 64 rows (decode batches, the rest
// of a prompt past a cached prefix): like the GEMV it must do little more than read w
// once, which cuBLAS does not at these shapes (bench/skinny_gemm.py has both). On
// tensor cores (mma.sync m16n8k16: bfloat16 in, float32 accumulate). FP8 codes are
// widened to bfloat16 in registers, exactly (every e4m3 value is a bfloat16), and their
// scales multiply the float32 sums: a row's scale once at the end, a block scale once
// per 128 columns.
//
// A block's SKINNY_WARPS warps take SKINNY_ROWS consecutive rows of w (16 a warp: two
// n8 tiles) over one of SPLIT slices of the columns. A warp streams its rows from
// global memory into registers, each weight read by one lane once. A k-step of mma
// multiplies 16 columns, of which a lane holds 2q, 2q + 1, 2q + 8 and 2q + 9
// (q = lane % 4) in both operands. A sum does not depend on which columns a k-step
// takes as long as x's and w's fragments agree, so a lane's 16-byte load of C
// consecutive weights of a row feeds C / 4 k-steps, with x's fragments read at the
// same columns: a chunk is the 4 C columns of a row that a quad of lanes loads at once.
//
// The block's slice of x's rows is staged in shared memory by cp.async at the start, in
// one wait, while the first weights are on their way (read through L1, x's fragments
// put an L2 round trip in every chunk's chain); each lane keeps the loads of its rows'
// next SKINNY_CHUNKS chunks in flight. It reads the weights at 1.1 to 1.5 TB/s: ahead
// of dequantizing FP8 for cuBLAS up to 32 rows, behind cuBLAS on bfloat16 (4 KB in
// flight a warp, 4 warps a block, is too little an SM; bench/HISTORY.md).
//
// The SPLIT blocks of a group of rows are one thread-block cluster: each leaves its
// partial sums in shared memory, and block r sums rows r, r + SPLIT, ... of the group
// over the cluster's blocks in order. A row's result depends on its own x and the
// grid alone, never on the other rows of the step, so that steps are batch-invariant
// as they are. rows <= SKINNY_MAX_ROWS; d_in % (SPLIT * 4 C) == 0 (checked by the host);
// dynamic shared memory: skinny_shared_bytes(rows, width). The oracle: numpy's x @ w.T
// (tests/gpu/test_kernels.py, test_quantized.py).
#define SKINNY_WARPS 4
#define SKINNY_THREADS (32 * SKINNY_WARPS)
#define SKINNY_ROWS (16 * SKINNY_WARPS)  // rows of w a block takes
#define SKINNY_CHUNKS 4                  // chunks of a lane's loads in flight (8: 10-70% slower, more registers)
#define SKINNY_MAX_TILES 4               // m16 tiles of x
#define SKINNY_MAX_ROWS (16 * SKINNY_MAX_TILES)

namespace cg = cooperative_groups;

// bfloat16 values a staged row of x takes, for a slice `width` columns wide: padded to
// SKINNY_X_OFFSET<W> bytes past a multiple of 128, so that the 8 lanes of a
// quarter-warp, which read 16 bytes each of two rows, hit different banks.
template <WeightFormat W> constexpr int SKINNY_X_OFFSET = W == W_BF16 ? 64 : 16;
template <WeightFormat W>
__device__ __forceinline__ int x_stride(int width) {
    return width + ((SKINNY_X_OFFSET<W> - 2 * width) % 128 + 128) % 128 / 2;
}

// A lane's 16-byte load of C weights as C / 2 words of bfloat16 pairs, in column order.
template <WeightFormat W>
__device__ __forceinline__ void weight_words(const uint4& raw, uint32_t* words) {
    const uint32_t r[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if constexpr (W == W_BF16) {
            words[i] = r[i];
        } else {
            words[2 * i] = e4m3x2_to_bf16x2(r[i]);
            words[2 * i + 1] = e4m3x2_to_bf16x2(r[i] >> 16);
        }
    }
}

// C staged values of x at `p` (shared memory) as C / 2 words of bfloat16 pairs.
template <WeightFormat W>
__device__ __forceinline__ void x_words(const bf16* p, uint32_t* words) {
#pragma unroll
    for (int i = 0; i < COLS<W> / 8; i++) {
        const uint4 v = reinterpret_cast<const uint4*>(p)[i];
        words[4 * i] = v.x;
        words[4 * i + 1] = v.y;
        words[4 * i + 2] = v.z;
        words[4 * i + 3] = v.w;
    }
}

template <WeightFormat W, int SPLIT>
__device__ __forceinline__ void skinny_gemm(void* __restrict__ y, bool out_f32, const bf16* __restrict__ x, int rows,
                                            const WeightRef w, int d_in, int d_out) {
    extern __shared__ __align__(16) uint8_t skinny_shared[];
    constexpr int C = COLS<W>, CHUNK = 4 * C, AHEAD = SKINNY_CHUNKS * CHUNK;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int group_row = blockIdx.x * SKINNY_ROWS, warp_row = min(group_row + warp * 16, d_out - 1);
    const int width = d_in / SPLIT, begin = blockIdx.y * width, end = begin + width;
    const uint8_t* w_rows[2];  // this lane's rows of the warp's two n8 tiles: g and 8 + g
#pragma unroll
    for (int j = 0; j < 2; j++) w_rows[j] = w.data + (size_t)min(warp_row + 8 * j + g, d_out - 1) * d_in * 16 / C;
    // This lane's loads of the chunk at column c (zeros past the slice).
    auto load = [&](uint4* raw, int c) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int col = c + q * C;
            raw[j] = c < end ? __ldg(reinterpret_cast<const uint4*>(w_rows[j] + (size_t)col * 16 / C)) : make_uint4(0, 0, 0, 0);
        }
    };
    // The weights are no earlier kernel's output: the first loads go out before the wait.
    uint4 raw[SKINNY_CHUNKS][2];
#pragma unroll
    for (int u = 0; u < SKINNY_CHUNKS; u++) load(raw[u], begin + u * CHUNK);
    await_previous_kernel();

    // x's rows (the last one again past the end) over the slice, into shared memory.
    const int tiles = (rows + 15) / 16, stride = x_stride<W>(width), copies = width / 8;  // (of 16 bytes, a row)
    bf16* staged = reinterpret_cast<bf16*>(skinny_shared);  // [16 tiles][stride]
    for (int i = threadIdx.x; i < 16 * tiles * copies; i += SKINNY_THREADS) {
        const int m = i / copies, c = i % copies * 8;
        copy16_async(staged + (size_t)m * stride + c, x + (size_t)min(m, rows - 1) * d_in + begin + c, true);
    }
    copy_commit();
    const float* block_scales = W == W_FP8 && w.scale_cols ? w.scale + (size_t)(warp_row / FP8_BLOCK) * w.scale_cols : nullptr;

    float acc[SKINNY_MAX_TILES][2][4] = {};  // C fragments: rows g, 8 + g of each tile; columns 2q, 2q + 1 of each n8 tile
    // d += the products of a chunk: its weights in `words`, x's values at `xs` (this lane's columns of row 0).
    auto multiply = [&](float (&d)[SKINNY_MAX_TILES][2][4], const uint32_t (&words)[2][C / 2], const bf16* xs) {
#pragma unroll
        for (int mt = 0; mt < SKINNY_MAX_TILES; mt++) {
            if (mt >= tiles) break;
            uint32_t xa[C / 2], xb[C / 2];
            x_words<W>(xs + (16 * mt + g) * stride, xa);
            x_words<W>(xs + (16 * mt + 8 + g) * stride, xb);
#pragma unroll
            for (int s = 0; s < C / 4; s++) {
                const uint32_t a[4] = {xa[2 * s], xb[2 * s], xa[2 * s + 1], xb[2 * s + 1]};
#pragma unroll
                for (int j = 0; j < 2; j++) mma_bf16(d[mt][j], a, words[j][2 * s], words[j][2 * s + 1]);
            }
        }
    };
    copy_wait<0>();
    __syncthreads();  // every thread's copies are visible
    for (int base = begin; base < end; base += AHEAD) {
#pragma unroll
        for (int u = 0; u < SKINNY_CHUNKS; u++) {
            const int c = base + u * CHUNK;  // (the same for every lane of the warp: width % CHUNK == 0)
            if (c >= end) break;
            uint32_t words[2][C / 2];
#pragma unroll
            for (int j = 0; j < 2; j++) weight_words<W>(raw[u][j], words[j]);
            load(raw[u], c + AHEAD);  // in flight while this chunk and the next ones are multiplied
            const bf16* xs = staged + (c - begin) + q * C;
            if (block_scales) {
                float part[SKINNY_MAX_TILES][2][4] = {};
                multiply(part, words, xs);
                const float scale = block_scales[c / FP8_BLOCK];
#pragma unroll
                for (int mt = 0; mt < SKINNY_MAX_TILES; mt++)
#pragma unroll
                    for (int j = 0; j < 2; j++)
#pragma unroll
                        for (int e = 0; e < 4; e++) acc[mt][j][e] += part[mt][j][e] * scale;
            } else {
                multiply(acc, words, xs);
            }
        }
    }

    auto store = [&](int m, int o, float sum) {
        if (o >= d_out) return;
        if (W == W_FP8 && !block_scales) sum *= w.scale[o];
        if (out_f32) static_cast<float*>(y)[(size_t)m * d_out + o] = sum;
        else static_cast<bf16*>(y)[(size_t)m * d_out + o] = to_bf16(sum);
    };
    // Fragment e of n8 tile j, m16 tile mt: row 16 mt + 8 (e / 2) + g, column 16 warp + 8 j + 2 q + e % 2 of the group.
    if constexpr (SPLIT == 1) {
#pragma unroll
        for (int mt = 0; mt < SKINNY_MAX_TILES; mt++)
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int m = 16 * mt + 8 * (e / 2) + g;
                    if (m < rows) store(m, group_row + 16 * warp + 8 * j + 2 * q + e % 2, acc[mt][j][e]);
                }
    } else {
        constexpr int T = SKINNY_ROWS + 4;  // floats a row of the partial sums takes (padded: fewer bank conflicts)
        __syncthreads();  // every warp is done with the staged x
        float* partial = reinterpret_cast<float*>(skinny_shared);  // [16 tiles][T], over the staged x
#pragma unroll
        for (int mt = 0; mt < SKINNY_MAX_TILES; mt++)
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    if (mt < tiles) partial[(16 * mt + 8 * (e / 2) + g) * T + 16 * warp + 8 * j + 2 * q + e % 2] = acc[mt][j][e];
        cg::cluster_group cluster = cg::this_cluster();
        cluster.sync();  // every block's partial sums are written
        const int rank = blockIdx.y, mine = (rows - rank + SPLIT - 1) / SPLIT;  // rows rank, rank + SPLIT, ...
        for (int i = threadIdx.x; i < mine * SKINNY_ROWS; i += SKINNY_THREADS) {
            const int m = rank + SPLIT * (i / SKINNY_ROWS), col = i % SKINNY_ROWS;
            float sum = 0.f;
#pragma unroll
            for (int r = 0; r < SPLIT; r++) sum += cluster.map_shared_rank(partial + m * T + col, r)[0];
            store(m, group_row + col, sum);
        }
        cluster.sync();  // no block leaves while another reads its partial sums
    }
}

// The kernels: y = x @ w^T for `rows` rows x (y float32 if out_f32, else bfloat16),
// skinny_gemm_sN with bfloat16 weights, skinny_gemm_fp8_sN with e4m3 codes and their
// scales (scale_cols 0: one a row; else 128 x 128 blocks), over N slices of the
// columns. grid: (ceil(d_out / SKINNY_ROWS), N); dynamic shared memory: x's rows (16 a
// tile) over a slice, x_stride values each, and at least the partial sums' rows.
extern "C" __global__ void __cluster_dims__(1, 1, 1) __launch_bounds__(SKINNY_THREADS)
    skinny_gemm_s1(void* __restrict__ y, int out_f32, const bf16* __restrict__ x, int rows, const bf16* __restrict__ w,
                   int d_in, int d_out) {
    skinny_gemm<W_BF16, 1>(y, out_f32, x, rows, bf16_weight(w), d_in, d_out);
}
extern "C" __global__ void __cluster_dims__(1, 1, 1) __launch_bounds__(SKINNY_THREADS)
    skinny_gemm_fp8_s1(void* __restrict__ y, int out_f32, const bf16* __restrict__ x, int rows,
                       const uint8_t* __restrict__ w, const float* __restrict__ w_scale, int scale_cols, int d_in,
                       int d_out) {
    skinny_gemm<W_FP8, 1>(y, out_f32, x, rows, {w, w_scale, scale_cols}, d_in, d_out);
}

extern "C" __global__ void __cluster_dims__(1, 2, 1) __launch_bounds__(SKINNY_THREADS)
    skinny_gemm_s2(void* __restrict__ y, int out_f32, const bf16* __restrict__ x, int rows, const bf16* __restrict__ w,
                   int d_in, int d_out) {
    skinny_gemm<W_BF16, 2>(y, out_f32, x, rows, bf16_weight(w), d_in, d_out);
}
extern "C" __global__ void __cluster_dims__(1, 2, 1) __launch_bounds__(SKINNY_THREADS)
    skinny_gemm_fp8_s2(void* __restrict__ y, int out_f32, const bf16* __restrict__ x, int rows,
                       const uint8_t* __restrict__ w, const float* __restrict__ w_scale, int scale_cols, int d_in,
                       int d_out) {
    skinny_gemm<W_FP8, 2>(y, out_f32, x, rows, {w, w_scale, scale_cols}, d_in, d_out);
}

extern "C" __global__ void __cluster_dims__(1, 4, 1) __launch_bounds__(SKINNY_THREADS)
    skinny_gemm_s4(void* __restrict__ y, int out_f32, const bf16* __restrict__ x, int rows, const bf16* __restrict__ w,
                   int d_in, int d_out) {
    skinny_gemm<W_BF16, 4>(y, out_f32, x, rows, bf16_weight(w), d_in, d_out);
}
extern "C" __global__ void __cluster_dims__(1, 4, 1) __launch_bounds__(SKINNY_THREADS)
    skinny_gemm_fp8_s4(void* __restrict__ y, int out_f32, const bf16* __restrict__ x, int rows,
                       const uint8_t* __restrict__ w, const float* __restrict__ w_scale, int scale_cols, int d_in,
                       int d_out) {
    skinny_gemm<W_FP8, 4>(y, out_f32, x, rows, {w, w_scale, scale_cols}, d_in, d_out);
}

extern "C" __global__ void __cluster_dims__(1, 8, 1) __launch_bounds__(SKINNY_THREADS)
    skinny_gemm_s8(void* __restrict__ y, int out_f32, const bf16* __restrict__ x, int rows, const bf16* __restrict__ w,
                   int d_in, int d_out) {
    skinny_gemm<W_BF16, 8>(y, out_f32, x, rows, bf16_weight(w), d_in, d_out);
}
extern "C" __global__ void __cluster_dims__(1, 8, 1) __launch_bounds__(SKINNY_THREADS)
    skinny_gemm_fp8_s8(void* __restrict__ y, int out_f32, const bf16* __restrict__ x, int rows,
                       const uint8_t* __restrict__ w, const float* __restrict__ w_scale, int scale_cols, int d_in,
                       int d_out) {
    skinny_gemm<W_FP8, 8>(y, out_f32, x, rows, {w, w_scale, scale_cols}, d_in, d_out);
}
