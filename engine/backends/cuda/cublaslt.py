"""cuBLASLt through ctypes: Cublas.gemm's product with a chosen algorithm, and FP8 products.

cublasGemmEx runs its heuristic's first choice for a shape. cuBLASLt lists the
heuristic's candidates for the same product (other tiles, split-K, swizzles), each
runnable by its descriptor; `candidates` returns them, and `matmul` runs one. Layouts as
in cublas.py: row-major [rows, cols] read column-major as [cols, rows], so Y^T = W^T' X^T
with W transposed by the operation, nothing in memory (the "TN" layout, the only one
cuBLASLt multiplies FP8 in).

FP8 operands (DataType.E4M3) carry scales, each read as its ScaleMode says: w's per
output row and x's per token (OUTER_VEC_32F), or w's per 128 x 128 block and x's per
128 columns of a token (BLK128x128_32F, VEC128_32F), or one for the whole operand.
cuBLASLt 13.1 on the H200 takes only the last (SCALAR_32F): its heuristic refuses the
others (bench/fp8_gemm.py probes each), so the engine's W8A8 products pass scales of 1
and apply theirs in a kernel of their own (linear.py).
"""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass

from engine.backends.cuda.cublas import CUBLAS_COMPUTE_32F, CUBLAS_OP_N, CUBLAS_OP_T, DataType, check, load_cublas

# cublasLtMatmulDescAttributes_t (A is w, B is x)
MATMUL_DESC_TRANSA, MATMUL_DESC_TRANSB = 3, 4
MATMUL_DESC_A_SCALE_POINTER, MATMUL_DESC_B_SCALE_POINTER = 17, 18
MATMUL_DESC_A_SCALE_MODE, MATMUL_DESC_B_SCALE_MODE = 31, 32
PREF_MAX_WORKSPACE_BYTES = 1  # cublasLtMatmulPreferenceAttributes_t


class ScaleMode(enum.IntEnum):
    """cublasLtMatmulMatrixScale_t: what an FP8 operand's scales are, float32 each."""

    SCALAR_32F = 0  # one for the operand
    OUTER_VEC_32F = 3  # one per row: w's output rows, x's tokens
    VEC128_32F = 4  # one per 128 columns of each row (x's, beside w's blocks)
    BLK128x128_32F = 5  # one per 128 x 128 block (w's)


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@dataclass(frozen=True)
class GemmShape:
    """y[tokens, d_out] (rows ldy apart) = x[tokens, d_in] @ w[d_out, d_in]^T, float32 compute."""

    tokens: int
    d_in: int
    d_out: int
    y_type: DataType = DataType.BF16
    x_type: DataType = DataType.BF16
    w_type: DataType = DataType.BF16
    ldy: int = 0  # 0: d_out
    w_scale: ScaleMode | None = None  # FP8 operands: how their scales are read
    x_scale: ScaleMode | None = None


class LtPlan:
    """A shape's descriptors and the heuristic's candidate algorithms for it, best guess first."""

    def __init__(self, lt: CublasLt, shape: GemmShape, count: int):
        self.lt, self.shape = lt, shape
        lib, s = lt.lib, shape
        self.desc, self.layouts = ctypes.c_void_p(), []
        check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, int(DataType.F32)),
                 "cublasLtMatmulDescCreate")
        attributes = [(MATMUL_DESC_TRANSA, CUBLAS_OP_T), (MATMUL_DESC_TRANSB, CUBLAS_OP_N)]
        attributes += [(mode, int(scale)) for mode, scale in ((MATMUL_DESC_A_SCALE_MODE, s.w_scale),
                                                              (MATMUL_DESC_B_SCALE_MODE, s.x_scale)) if scale is not None]
        for attribute, value in attributes:
            self.set(attribute, ctypes.c_int32(value))
        # (A: w as [d_in, d_out] column-major, transposed; B: x as [d_in, tokens]; C = D: y as [d_out, tokens])
        for dtype, rows, cols, ld in ((s.w_type, s.d_in, s.d_out, s.d_in), (s.x_type, s.d_in, s.tokens, s.d_in),
                                      (s.y_type, s.d_out, s.tokens, s.ldy or s.d_out)):
            layout = ctypes.c_void_p()
            check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), int(dtype), ctypes.c_uint64(rows),
                                                    ctypes.c_uint64(cols), ctypes.c_int64(ld)), "cublasLtMatrixLayoutCreate")
            self.layouts.append(layout)
        preference = ctypes.c_void_p()
        check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "cublasLtMatmulPreferenceCreate")
        try:
            limit = ctypes.c_uint64(lt.workspace_bytes)
            check(lib.cublasLtMatmulPreferenceSetAttribute(preference, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit),
                                                              ctypes.sizeof(limit)), "cublasLtMatmulPreferenceSetAttribute")
            results, returned = (_Heuristic * count)(), ctypes.c_int(0)
            w_layout, x_layout, y_layout = self.layouts
            check(lib.cublasLtMatmulAlgoGetHeuristic(lt.handle, self.desc, w_layout, x_layout, y_layout, y_layout,
                                                        preference, count, results, ctypes.byref(returned)),
                     "cublasLtMatmulAlgoGetHeuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(preference)
        self.candidates = [results[i] for i in range(returned.value) if results[i].state == 0]

    def set(self, attribute: int, value: ctypes.c_int32 | ctypes.c_void_p) -> None:
        """A matmul descriptor attribute."""
        check(self.lt.lib.cublasLtMatmulDescSetAttribute(self.desc, attribute, ctypes.byref(value), ctypes.sizeof(value)),
              "cublasLtMatmulDescSetAttribute")

    def close(self) -> None:
        for layout in self.layouts:
            self.lt.lib.cublasLtMatrixLayoutDestroy(layout)
        self.lt.lib.cublasLtMatmulDescDestroy(self.desc)
        self.layouts = []


class CublasLt:
    """A cuBLASLt handle on a stream, with the workspace its algorithms may use."""

    def __init__(self, stream_handle: int, workspace_ptr: int, workspace_bytes: int):
        self.lib = load_cublas("cublasLt")
        self.stream, self.workspace, self.workspace_bytes = ctypes.c_void_p(stream_handle), workspace_ptr, workspace_bytes
        self.handle = ctypes.c_void_p()
        check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def plan(self, shape: GemmShape, count: int = 16) -> LtPlan:
        """The descriptors of `shape` and up to `count` candidate algorithms."""
        return LtPlan(self, shape, count)

    def matmul(self, plan: LtPlan, candidate: int, y: int, x: int, w: int, w_scale: int = 0, x_scale: int = 0) -> None:
        """plan's product with its `candidate`-th algorithm, queued on the stream; FP8
        operands with the addresses of their scales."""
        if plan.shape.w_scale is not None:
            plan.set(MATMUL_DESC_A_SCALE_POINTER, ctypes.c_void_p(w_scale))
        if plan.shape.x_scale is not None:
            plan.set(MATMUL_DESC_B_SCALE_POINTER, ctypes.c_void_p(x_scale))
        w_layout, x_layout, y_layout = plan.layouts
        check(self.lib.cublasLtMatmul(
            self.handle, plan.desc, ctypes.byref(self._one), ctypes.c_void_p(w), w_layout, ctypes.c_void_p(x), x_layout,
            ctypes.byref(self._zero), ctypes.c_void_p(y), y_layout, ctypes.c_void_p(y), y_layout,
            ctypes.byref(plan.candidates[candidate].algo), ctypes.c_void_p(self.workspace),
            ctypes.c_size_t(self.workspace_bytes), self.stream), "cublasLtMatmul")

    def close(self) -> None:
        if self.handle:
            self.lib.cublasLtDestroy(self.handle)
            self.handle = ctypes.c_void_p()
