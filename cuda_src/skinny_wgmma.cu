#include <cooperative_groups.h>

#include "common.cuh"
#include "wgmma.cuh"

// y[m, o] = sum_i x[m, i] * w[o, i] for steps of 2 to 64 rows with bfloat16 weights, on
// Hopper (sm_90a; other builds leave these kernels out): decode batches and the rest of a
// prompt past a cached prefix. Like the GEMV it must do little more than read w once,
// and it must start doing so before the kernel ahead of it ends: a product of a few MB
// costs cuBLAS ~4 µs beyond its bytes at these shapes (its launch, ramp and tail;
// bench/HISTORY.md), and skinny_gemm.cu's register-fed loads keep too few bytes in
// flight an SM to reach the bandwidth.
//
// A block (one warpgroup) takes WG_N consecutive rows of w over one of SPLIT slices of
// the columns, WG_K columns a stage: the stage's 64 x WG_K tile of x (rows past `rows`
// are left as they are: a row's sums depend on its own values alone, and those rows are
// never stored) and its WG_N x WG_K tile of w are copied by cp.async into shared memory
// in wgmma's 128-byte swizzle, WG_STAGES stages a block in flight, and multiplied by
// wgmma from there, both operands K-major (wgmma.cuh). The weights are no earlier
// kernel's output: the first stages' weight copies go out before the block awaits its
// predecessor (programmatic launch), x's after.
//
// The SPLIT blocks of a group of rows are one thread-block cluster, reduced as in
// skinny_gemm.cu: each leaves its partial sums in shared memory and block r sums rows
// r, r + SPLIT, ... over the cluster's blocks in order, so that a row's result depends
// on its own x and the grid alone (batch invariance). Needs d_in % (SPLIT * WG_K) == 0
// and an even d_out (checked by the host: pairs of outputs are stored at once).
// The oracle: numpy's x @ w.T (tests/gpu/test_kernels.py).
#define WG_N 128      // rows of w a block takes: two n64 products
#define WG_K 64       // columns a stage takes: one 128-byte swizzled row a tile row
#define WG_STAGES 4   // 4 x 24 KB: two blocks an SM, 6 stages' copies in flight
#define WG_THREADS 128

#if defined(HAVE_WGMMA)
namespace cg = cooperative_groups;

constexpr int X_TILE = 64 * 128, W_TILE = WG_N * 128, STAGE = X_TILE + W_TILE;  // bytes
constexpr int PARTIAL_ROW = WG_N + 4;  // floats a row of the partial sums takes (padded: fewer bank conflicts)
static_assert(64 * PARTIAL_ROW * 4 <= WG_STAGES * STAGE, "the partial sums fit over the stages");

// Wait until at most `pending` (0 to WG_STAGES - 2) of this thread's copy groups are in flight.
__device__ __forceinline__ void copy_wait_at_most(int pending) {
    static_assert(WG_STAGES == 4, "one case a pending count");
    if (pending == 0) copy_wait<0>();
    else if (pending == 1) copy_wait<1>();
    else copy_wait<2>();
}

template <int SPLIT>
__device__ __forceinline__ void skinny_wgmma(void* __restrict__ y, bool out_f32, const bf16* __restrict__ x, int rows,
                                             const bf16* __restrict__ w, int d_in, int d_out) {
    extern __shared__ uint8_t wg_shared_raw[];
    uint8_t* shared = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(wg_shared_raw) + 1023) & ~uintptr_t(1023));
    const int group_row = blockIdx.x * WG_N, width = d_in / SPLIT, begin = blockIdx.y * width, steps = width / WG_K;
    // Each thread copies 16-byte chunk `chunk` of tile rows first, first + 16, ...:
    // eight threads read a row's 128 bytes.
    const int chunk = threadIdx.x & 7, first = threadIdx.x >> 3;
    auto copy_w = [&](int step) {
        uint8_t* tile = shared + step % WG_STAGES * STAGE + X_TILE;
        const bf16* src = w + begin + step * WG_K + 8 * chunk;
#pragma unroll
        for (int r = first; r < WG_N; r += 16)  // (rows past d_out copy the last one: never stored)
            copy16_async(tile + swizzled_offset(r, chunk), src + (size_t)min(group_row + r, d_out - 1) * d_in, true);
    };
    auto copy_x = [&](int step) {
        uint8_t* tile = shared + step % WG_STAGES * STAGE;
        const bf16* src = x + begin + step * WG_K + 8 * chunk;
#pragma unroll
        for (int r = first; r < 64; r += 16)
            if (r < rows) copy16_async(tile + swizzled_offset(r, chunk), src + (size_t)r * d_in, true);
    };
    // Copy groups: the weights of stages 0 .. WG_STAGES - 2, one group each, then x's of
    // all of them in one, then one group a step (stage step + WG_STAGES - 1, or none).
    for (int s = 0; s < WG_STAGES - 1; s++) {
        if (s < steps) copy_w(s);
        copy_commit();
    }
    await_previous_kernel();
    for (int s = 0; s < WG_STAGES - 1 && s < steps; s++) copy_x(s);
    copy_commit();

    float d[2][8][4] = {};  // the two n64 products' C fragments (wgmma.cuh)
    for (int step = 0; step < steps; step++) {
        copy_wait_at_most(min(step, WG_STAGES - 2));  // this step's weights and x are in
        fence_proxy_async();
        __syncthreads();  // every thread's copies are visible, and the stage copied next is free
        if (step + WG_STAGES - 1 < steps) {
            copy_w(step + WG_STAGES - 1);
            copy_x(step + WG_STAGES - 1);
        }
        copy_commit();
        const uint8_t* stage = shared + step % WG_STAGES * STAGE;
        wgmma_fence(d[0], d[1]);
#pragma unroll
        for (int k = 0; k < WG_K / 16; k++) {  // a k16 step starts 32 bytes further on a row
            const uint64_t a = sw128_descriptor(stage) + 2 * k;
#pragma unroll
            for (int h = 0; h < 2; h++)
                wgmma_m64n64k16_ss(d[h], a, sw128_descriptor(stage + X_TILE + h * (W_TILE / 2)) + 2 * k, step | k);
        }
        wgmma_commit();
        wgmma_wait(d[0], d[1]);
    }

    // Fragment e of n8 tile j of product h: row 16 warp + 8 (e / 2) + g, column
    // 64 h + 8 j + 2 q + e % 2 of the group; e and e + 1 are a pair of columns.
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, q = threadIdx.x & 3;
    auto store_pair = [&](int m, int col, float lo, float hi) {
        const int o = group_row + col;
        if (o >= d_out) return;
        if (out_f32) *reinterpret_cast<float2*>(static_cast<float*>(y) + (size_t)m * d_out + o) = make_float2(lo, hi);
        else *reinterpret_cast<uint32_t*>(static_cast<bf16*>(y) + (size_t)m * d_out + o) = pack_bf16(lo, hi);
    };
    if constexpr (SPLIT == 1) {
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e += 2) {
                    const int m = 16 * warp + 8 * (e / 2) + g;
                    if (m < rows) store_pair(m, 64 * h + 8 * j + 2 * q, d[h][j][e], d[h][j][e + 1]);
                }
    } else {
        float* partial = reinterpret_cast<float*>(shared);  // [64][PARTIAL_ROW], over the stages
        __syncthreads();  // every warp's products have read them
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e += 2) {
                    const int m = 16 * warp + 8 * (e / 2) + g;
                    *reinterpret_cast<float2*>(partial + m * PARTIAL_ROW + 64 * h + 8 * j + 2 * q) =
                        make_float2(d[h][j][e], d[h][j][e + 1]);
                }
        cg::cluster_group cluster = cg::this_cluster();
        cluster.sync();  // every block's partial sums are written
        const int rank = blockIdx.y, mine = (rows - rank + SPLIT - 1) / SPLIT;  // rows rank, rank + SPLIT, ...
        for (int i = threadIdx.x; i < mine * WG_N / 2; i += WG_THREADS) {
            const int m = rank + SPLIT * (i / (WG_N / 2)), col = 2 * (i % (WG_N / 2));
            float2 sum = make_float2(0.f, 0.f);
#pragma unroll
            for (int r = 0; r < SPLIT; r++) {
                const float2 part = *cluster.map_shared_rank(reinterpret_cast<float2*>(partial + m * PARTIAL_ROW + col), r);
                sum.x += part.x;
                sum.y += part.y;
            }
            store_pair(m, col, sum.x, sum.y);
        }
        cluster.sync();  // no block leaves while another reads its partial sums
    }
}

// The kernels: y = x @ w^T for `rows` (<= 64) rows x (y float32 if out_f32, else
// bfloat16) over N slices of the columns. grid: (ceil(d_out / WG_N), N); block:
// WG_THREADS; dynamic shared memory: WG_STAGES * STAGE + 1,024 (for the alignment).
extern "C" __global__ void __cluster_dims__(1, 1, 1) __launch_bounds__(WG_THREADS, 2)
    skinny_wgmma_s1(void* __restrict__ y, int out_f32, const bf16* __restrict__ x, int rows, const bf16* __restrict__ w,
                    int d_in, int d_out) {
    skinny_wgmma<1>(y, out_f32, x, rows, w, d_in, d_out);
}
extern "C" __global__ void __cluster_dims__(1, 2, 1) __launch_bounds__(WG_THREADS, 2)
    skinny_wgmma_s2(void* __restrict__ y, int out_f32, const bf16* __restrict__ x, int rows, const bf16* __restrict__ w,
                    int d_in, int d_out) {
    skinny_wgmma<2>(y, out_f32, x, rows, w, d_in, d_out);
}
extern "C" __global__ void __cluster_dims__(1, 4, 1) __launch_bounds__(WG_THREADS, 2)
    skinny_wgmma_s4(void* __restrict__ y, int out_f32, const bf16* __restrict__ x, int rows, const bf16* __restrict__ w,
                    int d_in, int d_out) {
    skinny_wgmma<4>(y, out_f32, x, rows, w, d_in, d_out);
}
extern "C" __global__ void __cluster_dims__(1, 8, 1) __launch_bounds__(WG_THREADS, 2)
    skinny_wgmma_s8(void* __restrict__ y, int out_f32, const bf16* __restrict__ x, int rows, const bf16* __restrict__ w,
                    int d_in, int d_out) {
    skinny_wgmma<8>(y, out_f32, x, rows, w, d_in, d_out);
}
#endif
