"""Linear layers on the GPU: a weight in its format, and y = x @ w^T by it.

bfloat16 is the one format today: a GEMM tile of one row takes our GEMV (gemv.cu),
larger ones cuBLAS. A quantized format adds its LinearWeight data (packed values,
scales) and its kernels here; the single-token fusions (gemv.cu's GEMVs that also
normalise, rotate or activate) take bfloat16 weights, and forward.py fuses only those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.backends.cuda.cublas import Cublas, DataType
from engine.backends.cuda.kernels import Kernels

BF16 = "bf16"
FORMATS = (BF16,)


@dataclass(frozen=True)
class LinearWeight:
    """A linear layer's weight on the GPU, [d_out, d_in] in `format`."""

    format: str
    data: Any  # bf16: a GPUArray of bfloat16 bits
    d_out: int
    d_in: int

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


class Linear:
    """y = x @ w^T on the stream, one product per GEMM tile of rows (step_metadata)."""

    def __init__(self, blas: Cublas, stream):
        self.blas, self.stream = blas, stream

    def __call__(self, kernels: Kernels, y, x, w: LinearWeight, tiles: list[tuple[int, int]]) -> None:
        """y [rows, d_out] (bfloat16, or float32 for logits) from x [rows, d_in] in bfloat16,
        over the (first row, rows) tiles."""
        if w.format != BF16:
            raise ValueError(f"no GPU product for {w.format} weights (formats: {', '.join(FORMATS)})")
        out_f32 = y.dtype == np.float32
        y_row, x_row = w.d_out * y.dtype.itemsize, w.d_in * 2
        y_type = DataType.F32 if out_f32 else DataType.BF16
        for r, rows in tiles:
            y_ptr, x_ptr = int(y.gpudata) + r * y_row, int(x.gpudata) + r * x_row
            if rows == 1:  # (d_in is a multiple of 8, as gemv.cu needs: checked by the backend)
                kernels.gemv(self.stream, y_ptr, x_ptr, w.data, w.d_in, w.d_out, out_f32)
            else:
                self.blas.gemm(y_ptr, y_type, x_ptr, DataType.BF16, int(w.data.gpudata), DataType.BF16, rows, w.d_in,
                               w.d_out)
