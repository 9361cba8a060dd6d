// Warpgroup matrix products on Hopper's tensor cores (wgmma, sm_90a: the build for
// compute capability 9.0 defines __CUDA_ARCH_FEAT_SM90_ALL; others leave HAVE_WGMMA
// undefined and their kernels take mma.sync instead):
//
//   D[64 x 64] (+)= A[64 x 16] B[16 x 64]    bfloat16 in, float32 accumulate
//
// issued by the 4 warps of a warpgroup together, asynchronously. A is in registers:
// warp w of the group holds rows 16w.. in mma.sync's m16n8k16 A layout (4 words of
// bfloat16 pairs). D is too: d[j] is the m16n8 C fragment of columns 8j.. of the warp's
// rows. B is in shared memory, named by a descriptor of a tile of 128-byte rows (64
// bfloat16) in the 128-byte swizzle: 16-byte chunk c of row r sits at chunk c ^ (r % 8)
// of that row, each 8 rows a 1,024-byte aligned atom (swizzled_offset). A tile of K rows
// [position][dim] is B of S = Q K^T as it is ("K-major": its k, the dims, runs along a
// row, so a k16 step starts 32 bytes further on); a tile of V rows is B of O = P V read
// transposed ("MN-major": its n, the dims, runs along a row, so a k16 step starts 16
// rows, 2,048 bytes, further on).
#pragma once
#include <stdint.h>

#include <type_traits>

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HAVE_WGMMA 1

// Byte offset of 16-byte chunk `chunk` of row `row` in a 128-byte-swizzled tile.
__device__ __forceinline__ int swizzled_offset(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

// The descriptor of a 128-byte-swizzled tile at `smem` (1,024-byte aligned, or offset
// within its first row by a k step), in 16-byte units: the start address, and 1,024
// bytes between 8-row atoms as both the stride offset (from one 8 rows to the next) and
// the leading offset (the next 64 columns, which a 64-column tile never reaches).
__device__ __forceinline__ uint64_t sw128_descriptor(const void* smem) {
    const uint64_t address = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    return ((address & 0x3FFFF) >> 4) | ((1024ull >> 4) << 16) | ((1024ull >> 4) << 32) | (1ull << 62);
}

// Orders this thread's shared-memory writes (cp.async's too) before wgmma's reads of
// them, which go through the async proxy; a barrier then makes them the group's.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Pins a register array here: writes to it are not moved below this point nor reads
// of it above (an empty asm the compiler cannot see through).
template <typename T, int M, int N>
__device__ __forceinline__ void pin(T (&x)[M][N]) {
#pragma unroll
    for (int i = 0; i < M; i++)
#pragma unroll
        for (int j = 0; j < N; j++) {
            if constexpr (std::is_same_v<T, float>) asm volatile("" : "+f"(x[i][j])::"memory");
            else asm volatile("" : "+r"(x[i][j])::"memory");  // (uint32_t: words of bfloat16 pairs)
        }
}

// Orders this thread's writes of `registers` (the next products' A and D) before the
// warpgroup's products read them.
template <typename... Registers>
__device__ __forceinline__ void wgmma_fence(Registers&... registers) {
    (pin(registers), ...);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits for the products committed before; no read of their `results` is moved above it.
template <typename... Registers>
__device__ __forceinline__ void wgmma_wait(Registers&... results) {
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    (pin(results), ...);
}

// d (+)= a B over one k16 step: B from `b_desc`, read transposed (MN-major) where
// TRANSPOSE_B; d is overwritten where `accumulate` is 0.
template <int TRANSPOSE_B>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b_desc,
                                                int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
          "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "n"(TRANSPOSE_B), "r"(accumulate));
}
#endif
