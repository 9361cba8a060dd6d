"""cuda_src/wgmma.cuh alone, on Hopper: one warpgroup's two products as prompt attention
uses them, S = A K^T (K's rows as B) and O = A V (V's rows as B read transposed), against
numpy in float64. A layout or descriptor mistake shows here as a wrong product, apart
from the attention kernel's other logic (tests/gpu/test_kernels.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.conftest import require_gpu  # noqa: E402

require_gpu()

import pycuda.driver as cuda  # noqa: E402
import pycuda.gpuarray as gpuarray  # noqa: E402
from pycuda.compiler import SourceModule  # noqa: E402

from engine.backends.cuda.kernels import CUDA_SRC, nvcc_target  # noqa: E402
from engine.weights import f32_to_bf16_bits  # noqa: E402
from tests.gpu.conftest import bf16, rel_l2  # noqa: E402

# s = a k^T and o = a v for 64 x 64 bfloat16 matrices (row-major), by one warpgroup: a's
# rows in registers as each warp's A fragments, k and v copied into shared memory in the
# 128-byte swizzle, each product four k16 steps.
SOURCE = r"""
#include "common.cuh"
#include "wgmma.cuh"

extern "C" __global__ void __launch_bounds__(128) wgmma_products(float* s_out, float* o_out, const bf16* a,
                                                                 const bf16* k, const bf16* v) {
    __shared__ __align__(16) uint8_t raw[2 * 64 * 128 + 1024];
    uint8_t* const k_s = raw + (-static_cast<int>(__cvta_generic_to_shared(raw)) & 1023);
    uint8_t* const v_s = k_s + 64 * 128;
    for (int e = threadIdx.x; e < 64 * 8; e += 128) {  // 16-byte chunk e % 8 of row e / 8
        const int row = e / 8, chunk = e % 8;
        *reinterpret_cast<uint4*>(k_s + swizzled_offset(row, chunk)) = reinterpret_cast<const uint4*>(k)[e];
        *reinterpret_cast<uint4*>(v_s + swizzled_offset(row, chunk)) = reinterpret_cast<const uint4*>(v)[e];
    }
    fence_proxy_async();
    __syncthreads();
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, q = threadIdx.x & 3;
    uint32_t frag[4][4];
    for (int kk = 0; kk < 4; kk++)
        for (int r = 0; r < 4; r++)
            frag[kk][r] = *reinterpret_cast<const uint32_t*>(a + (16 * warp + g + 8 * (r & 1)) * 64 + kk * 16 + 2 * q
                                                             + 8 * (r >> 1));
    float s[8][4], o[8][4];
    wgmma_fence(frag, s);
    for (int kk = 0; kk < 4; kk++) wgmma_m64n64k16<0>(s, frag[kk], sw128_descriptor(k_s) + 2 * kk, kk > 0);
    wgmma_commit();
    wgmma_wait(s);
    wgmma_fence(frag, o);
    for (int kk = 0; kk < 4; kk++) wgmma_m64n64k16<1>(o, frag[kk], sw128_descriptor(v_s) + 128 * kk, kk > 0);
    wgmma_commit();
    wgmma_wait(o);
    for (int j = 0; j < 8; j++)
        for (int c = 0; c < 4; c++) {
            const int idx = (16 * warp + g + 8 * (c >> 1)) * 64 + 8 * j + 2 * q + (c & 1);
            s_out[idx] = s[j][c];
            o_out[idx] = o[j][c];
        }
}
"""


@pytest.fixture(scope="module")
def wgmma_products(cuda_context):
    device = cuda.Context.get_device()
    if device.compute_capability() != (9, 0):
        pytest.skip("wgmma is Hopper's (compute capability 9.0)")
    module = SourceModule(SOURCE, no_extern_c=True, options=["-O3"], include_dirs=[str(CUDA_SRC)], **nvcc_target("sm_90"))
    return module.get_function("wgmma_products")


def test_wgmma_products_match_numpy(wgmma_products):
    rng = np.random.default_rng()
    a, k, v = (rng.standard_normal((64, 64)).astype(np.float32) for _ in range(3))
    s = gpuarray.to_gpu(np.full((64, 64), np.nan, np.float32))
    o = gpuarray.to_gpu(np.full((64, 64), np.nan, np.float32))
    wgmma_products(s, o, *(gpuarray.to_gpu(f32_to_bf16_bits(x)) for x in (a, k, v)), block=(128, 1, 1), grid=(1, 1))
    a, k, v = (bf16(x).astype(np.float64) for x in (a, k, v))
    assert rel_l2(s.get(), a @ k.T) < 1e-5
    assert rel_l2(o.get(), a @ v) < 1e-5
