"""A small typed binding to cuBLAS through ctypes: a handle on a stream, and GEMM in
the data types of the operands (DataType: bfloat16 and float32 today; cuBLAS also takes
FP8 inputs with float32 compute).

Weights are row-major [out, in], activations row-major [tokens, in]. cuBLAS is
column-major, where a row-major [r, c] matrix reads as [c, r]; so Y = X W^T is asked
for as Y^T = op(W) X^T with op(W) = transpose: nothing is transposed in memory.

The library is loaded as a PyDLL: its calls keep the GIL. They only queue work on
the stream and return in microseconds, and giving the GIL up around each one would
let the server's threads take it, each time, for up to Python's switch interval.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import glob
import os
import sys
from pathlib import Path

CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1


class DataType(enum.IntEnum):
    """cudaDataType_t of the operands cuBLAS multiplies (library_types.h)."""

    F32 = 0
    BF16 = 14
    E4M3 = 28  # FP8 (cuBLASLt only)


class CublasError(RuntimeError):
    pass


def check(status: int, what: str) -> None:
    """Raise CublasError for a cuBLAS (or cuBLASLt) call's failing status."""
    if status != 0:
        raise CublasError(f"{what} failed with cuBLAS status {status}")


def _candidates(library: str) -> list[str]:
    """Where lib`library` (cublas or cublasLt) may be, in the order searched."""
    places = []
    for home in filter(None, (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda")):
        places += sorted(glob.glob(f"{home}/lib64/lib{library}.so*")) or [f"{home}/lib64/lib{library}.so"]
    found = ctypes.util.find_library(library)
    places.append(found or f"lib{library}.so (the loader path)")
    for site in sys.path:  # the nvidia-cublas wheel
        for sub in ("nvidia/cublas/lib", "nvidia/cu13/lib", "nvidia/cu12/lib"):
            places += sorted(glob.glob(str(Path(site) / sub / f"lib{library}.so*")))
    return places


def load_cublas(library: str = "cublas") -> ctypes.CDLL:
    """libcublas, or its sibling libcublasLt (library="cublasLt")."""
    tried = []
    for place in _candidates(library):
        name = f"lib{library}.so" if place.endswith("(the loader path)") else place
        try:
            return ctypes.PyDLL(name)
        except OSError as e:
            tried.append(f"{place}: {e}")
    raise CublasError(
        f"cuBLAS (lib{library}.so) was not found. Searched:\n  " + "\n  ".join(tried)
        + "\nSet CUDA_HOME to your CUDA toolkit, add its lib64 to LD_LIBRARY_PATH, or pip install nvidia-cublas."
    )


class Cublas:
    def __init__(self, stream_handle: int, workspace_ptr: int, workspace_bytes: int):
        self.lib = load_cublas()
        self.handle = ctypes.c_void_p()
        check(self.lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream_handle)), "cublasSetStream")
        check(self.lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(workspace_ptr), ctypes.c_size_t(workspace_bytes)),
                    "cublasSetWorkspace")
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def gemm(self, y: int, y_type: DataType, x: int, x_type: DataType, w: int, w_type: DataType, tokens: int, d_in: int,
             d_out: int, ldy: int | None = None) -> None:
        """y[tokens, d_out] = x[tokens, d_in] @ w[d_out, d_in]^T in float32 compute, each
        operand of its type (all row-major, x and w dense; y's rows `ldy` apart, d_out
        unless given: a block of y's columns)."""
        check(self.lib.cublasGemmEx(
            self.handle, CUBLAS_OP_T, CUBLAS_OP_N, d_out, tokens, d_in,
            ctypes.byref(self._one), ctypes.c_void_p(w), int(w_type), d_in,
            ctypes.c_void_p(x), int(x_type), d_in,
            ctypes.byref(self._zero), ctypes.c_void_p(y), int(y_type), ldy or d_out,
            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT,
        ), "cublasGemmEx")

    def close(self) -> None:
        if self.handle:
            self.lib.cublasDestroy_v2(self.handle)
            self.handle = ctypes.c_void_p()
