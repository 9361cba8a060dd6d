// Helpers shared by the kernels: bfloat16 conversion and warp/block reductions.
// Storage is bfloat16; arithmetic is float32.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 to_bf16(float x) { return __float2bfloat16_rn(x); }
// Programmatic dependent launch (sm_90 and later). In a CUDA graph whose kernel-to-
// kernel edges are programmatic (engine/backends/cuda_graph.py), a kernel's blocks are
// scheduled while the kernel before it still runs, so that its launch (and the GEMV's
// first weight reads) overlap the other's tail. So every kernel calls this in every
// thread before it reads what an earlier kernel wrote, writes anything, or exits: it
// returns once the previous kernel has completed and its writes are visible (that one
// waited for its own predecessor, so all earlier kernels have completed too), and then
// lets the next kernel's blocks be scheduled. Only the build for graphs
// (-DPROGRAMMATIC_LAUNCH, engine/backends/cuda_kernels.py's Kernels) has it: eager
// launches take a build without it.
__device__ __forceinline__ void await_previous_kernel() {
#if defined(PROGRAMMATIC_LAUNCH) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Round a float32 to the nearest bfloat16 value, kept as float32: where
// transformers computes in bfloat16, this reproduces its rounding.
__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// 8 bfloat16 values (16 bytes, one load) to float32.
__device__ __forceinline__ void unpack_bf16x8(const uint4& raw, float* out) {
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 f = __bfloat1622float2(pairs[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

// Read-only data: 8 bfloat16 values at p (16-byte aligned) as float32.
__device__ __forceinline__ void load_bf16x8(const bf16* p, float* out) {
    unpack_bf16x8(__ldg(reinterpret_cast<const uint4*>(p)), out);
}

// 8 float32 values to 8 bfloat16 (16 bytes, one store), rounded to nearest.
__device__ __forceinline__ uint4 pack_bf16x8(const float* in) {
    uint4 raw;
    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; i++) pairs[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
    return raw;
}

// 8 float32 values at p (32-byte aligned), in two 16-byte accesses.
__device__ __forceinline__ void load_f32x8(const float* p, float* out) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

__device__ __forceinline__ void store_f32x8(float* p, const float* in) {
    reinterpret_cast<float4*>(p)[0] = make_float4(in[0], in[1], in[2], in[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(in[4], in[5], in[6], in[7]);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

// Reduce over the block with `op` (identity `init`); every thread gets the result.
// `scratch` holds 32 floats.
template <typename Op>
__device__ __forceinline__ float block_reduce(float v, float* scratch, float init, Op op) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffff, v, o));
    __syncthreads();  // scratch may still be read by a previous reduction
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : init;
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

struct Add { __device__ float operator()(float a, float b) const { return a + b; } };
struct Max { __device__ float operator()(float a, float b) const { return fmaxf(a, b); } };

__device__ __forceinline__ float block_sum(float v, float* scratch) { return block_reduce(v, scratch, 0.f, Add()); }
__device__ __forceinline__ float block_max(float v, float* scratch) { return block_reduce(v, scratch, -INFINITY, Max()); }

// d += a b on tensor cores: one m16n8k16 tile, bfloat16 in, float32 accumulate, in the
// fragment layouts of the PTX manual (a: 4 words of bfloat16 pairs, b: 2, d: 4 floats).
__device__ __forceinline__ void mma_bf16(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The same with float16 in (mma_kv: kv_cache.cuh).
__device__ __forceinline__ void mma_f16(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two float32 as one word of bfloat16 pairs, lo in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// A word's low two e4m3 codes (the lower byte first) as float32, exactly: the
// hardware's pairwise conversion.
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t codes) {
    return __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(codes & 0xFFFF), __NV_E4M3)));
}

// The same as a word of two float16, exactly (every e4m3 value is a float16 value), in
// one instruction (cvt.rn.f16x2.e4m3x2).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t codes) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(codes & 0xFFFF), __NV_E4M3);
    return (uint32_t)h.x | (uint32_t)h.y << 16;
}

// Two float32 as one word of float16 pairs, lo in the low half, rounded to nearest.
__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// The same as a word of two bfloat16 (exact: e4m3's 3 mantissa bits fit bfloat16's 7).
// (Moving the codes' bits into bfloat16's and one bfloat16x2 multiply by 2^120, as exact,
// made decode attention on an e4m3 cache 1-3% slower: bench/HISTORY.md.)
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t codes) {
    const float2 f = e4m3x2_to_float2(codes);
    return pack_bf16(f.x, f.y);
}

// The e4m3 code nearest to x, saturating at +-448, a tie going to the smaller
// magnitude: exactly the numpy backend's f32_to_e4m3 (engine/quantization/fp8.py).
// Normal values round their float32 bits to 3 mantissa bits (the carry may reach the
// exponent), rebiased from 127 to 7; below 2^-6 the codes are multiples of 2^-9.
__device__ __forceinline__ uint8_t to_e4m3(float x) {
    const float a = fminf(fabsf(x), 448.f);
    const uint32_t code = a < 0x1p-6f ? (uint32_t)ceilf(a * 512.f - 0.5f)
                                      : ((__float_as_uint(a) + (1u << 19) - 1) >> 20) - (120u << 3);
    return (uint8_t)(code | (x < 0.f ? 0x80u : 0u));
}

// The ends of a W8A8 product (fp8_activations.cu): a row of activations goes in as e4m3
// codes over one scale, its largest magnitude over 448 (1 for a row of zeros), ...
__device__ __forceinline__ float e4m3_row_scale(float amax) { return amax > 0.f ? amax / 448.f : 1.f; }

// ... 8 values at a time, their codes packed in 8 bytes, the first lowest ...
__device__ __forceinline__ uint2 pack_e4m3x8(const float* v, float scale) {
    uint32_t word[2] = {0u, 0u};
#pragma unroll
    for (int j = 0; j < 8; j++) word[j / 4] |= (uint32_t)to_e4m3(v[j] / scale) << (8 * (j % 4));
    return make_uint2(word[0], word[1]);
}

// ... the codes of a row a block computed into `stash` (shared, 8 bfloat16 values an
// element), over the scale of its largest magnitude `amax` (this thread's share), each
// thread storing the chunks it computed; returns the scale ...
__device__ __forceinline__ float store_e4m3_row(uint8_t* __restrict__ codes, const uint4* stash, int width, float amax,
                                                float* scratch) {
    const float scale = e4m3_row_scale(block_max(amax, scratch));
    for (int i = 8 * threadIdx.x; i < width; i += 8 * blockDim.x) {
        float v[8];
        unpack_bf16x8(stash[i / 8], v);
        *reinterpret_cast<uint2*>(codes + i) = pack_e4m3x8(v, scale);
    }
    return scale;
}

// ... and its 8 sums y[t, o..o+7] come out in bfloat16, to be scaled back by the token's
// scale and the weight rows' (col_scales + o): v[j] = bf16(v[j] * (row_scale * col_scales[j])).
__device__ __forceinline__ void unscale_sums8(float* v, float row_scale, const float* col_scales) {
    float s[8];
    load_f32x8(col_scales, s);
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = round_bf16(v[j] * (row_scale * s[j]));
}

// 16 bytes from global to shared memory without passing through registers (cp.async,
// sm_80 and later), or 16 zero bytes where `valid` is false.
__device__ __forceinline__ void copy16_async(void* smem, const void* gmem, bool valid) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most `pending` of this thread's commit groups are still in flight.
template <int pending>
__device__ __forceinline__ void copy_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(pending)); }

// Four 8x8 bfloat16 matrices from shared memory, transposed: lanes 8i..8i+7 give the row
// addresses of matrix i, and register i gets this lane's fragment of it (ldmatrix.trans).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* smem) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
