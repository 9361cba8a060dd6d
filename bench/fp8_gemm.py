"""FP8 tensor-core GEMMs through cuBLASLt against what plain FP8 weights take (each
matrix dequantized to bfloat16, then cuBLAS) and against bfloat16 weights, for each layer
matrix of the Llama 3.2 1B shape at steps of 64 to 4,096 rows: µs a product (replayed
over the 16 layers' copies in a CUDA graph: bench/quantized.py's replay_us), beside the
floor (the larger of the FP8 weight's bytes over 4.27 TB/s and its FLOPs over the
H200's 1,979 dense FP8 TFLOP/s). `w8a8` is the engine's product for FP8-dynamic
checkpoints (linear.py: the rows quantized, the product, the rescale), all of it.

cuBLASLt's FP8 products scale their operands as a ScaleMode says. The modes tried:
`rows`, w's scale per output row with x's per token (OUTER_VEC_32F: per-row FP8
checkpoints and dynamic per-token activations); `blocks`, w's per 128 x 128 block with
x's per 128 columns of a token (BLK128x128_32F and VEC128_32F: Hugging Face's fp8
checkpoints); `scalar`, one scale an operand (w's the largest of its rows'). The
activations are quantized on the host (e4m3); the table times the product alone. Each
result is checked against float64 arithmetic on the same codes and scales (in
brackets: the largest error over the largest output); a mode the GPU's cuBLASLt
refuses gives the status it refused with.

    python3 bench/fp8_gemm.py [--rows 64,143,256,1024,4096]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.quantized import BANDWIDTH, bf16_rows, layer_matrices, replay_us  # noqa: E402
from devtools.checkpoints import LLAMA_32_1B, make_model  # noqa: E402
from devtools.quantized import fp8_model  # noqa: E402
from engine.backends.cuda.backend import WORKSPACE_BYTES, CudaBackend  # noqa: E402
from engine.backends.cuda.cublas import CublasError, DataType  # noqa: E402
from engine.backends.cuda.cublaslt import CublasLt, GemmShape, ScaleMode  # noqa: E402
from engine.backends.cuda.linear import Linear  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from engine.quantization.fp8 import E4M3_MAX, e4m3_to_f32  # noqa: E402
from engine.weights import bf16_bits_to_f32  # noqa: E402

FP8_PEAK = 1979e12  # FLOP/s, dense e4m3 with float32 accumulation (H200)


@dataclasses.dataclass
class Operand:
    """An FP8 operand as cuBLASLt gets it: codes, and scales on the GPU; and the same
    scales expanded to one per element on the host, for the check."""

    codes: object  # GPUArray of uint8
    scales: object  # GPUArray of float32
    full: np.ndarray  # float64 [rows, cols]: each element's scale


def quantize_activations(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """e4m3 codes of x [rows, d_in] and float32 scales, one per `group` columns of a row."""
    import ml_dtypes

    rows, d_in = x.shape
    grouped = x.reshape(rows, d_in // group, group)
    scale = (np.maximum(np.abs(grouped).max(axis=2), 1e-12) / E4M3_MAX).astype(np.float32)
    codes = np.clip(grouped / scale[:, :, None], -E4M3_MAX, E4M3_MAX).reshape(rows, d_in)
    return codes.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), scale


def activation_operands(x: np.ndarray) -> dict[str, Operand]:
    """x [rows, d_in] quantized for each mode."""
    import pycuda.gpuarray as gpuarray

    rows, d_in = x.shape
    per_token, per_token_scale = quantize_activations(x, d_in)
    blocks, block_scale = quantize_activations(x, 128)
    whole, whole_scale = quantize_activations(x.reshape(1, -1), x.size)
    whole = whole.reshape(rows, d_in)
    return {
        "rows": Operand(gpuarray.to_gpu(per_token), gpuarray.to_gpu(per_token_scale.ravel()),
                        np.repeat(per_token_scale, d_in, 1)),
        "blocks": Operand(gpuarray.to_gpu(blocks), gpuarray.to_gpu(block_scale), np.repeat(block_scale, 128, 1)),
        "scalar": Operand(gpuarray.to_gpu(whole), gpuarray.to_gpu(whole_scale.ravel()),
                          np.full((rows, d_in), whole_scale[0, 0])),
    }


def weight_operands(w, blocks_w) -> dict[str, Operand]:
    """A layer matrix's FP8 weight (scales per row) and the same one in 128 x 128 blocks, for each mode."""
    import pycuda.gpuarray as gpuarray

    row_scale = w.scale.get()
    block_scale = blocks_w.scale.get().reshape(-(-w.d_out // 128), -1)
    expand = np.repeat(np.repeat(block_scale, 128, 0), 128, 1)[: w.d_out, : w.d_in]
    largest = gpuarray.to_gpu(np.full(1, row_scale.max(), np.float32))
    return {
        "rows": Operand(w.data, w.scale, np.repeat(row_scale.reshape(-1, 1), w.d_in, 1)),
        "blocks": Operand(blocks_w.data, blocks_w.scale, expand),
        "scalar": Operand(w.data, largest, np.full((w.d_out, w.d_in), row_scale.max())),
    }


MODES = {"rows": (ScaleMode.OUTER_VEC_32F, ScaleMode.OUTER_VEC_32F),
         "blocks": (ScaleMode.BLK128x128_32F, ScaleMode.VEC128_32F),
         "scalar": (ScaleMode.SCALAR_32F, ScaleMode.SCALAR_32F)}


def refused(error: CublasError) -> str:
    return "status " + str(error).rsplit(" ", 1)[-1]


def fp8_cell(lt: CublasLt, backend: CudaBackend, mode: str, rows: int, y, x: Operand, ws: list[Operand],
             d_in: int, d_out: int) -> str:
    """'µs (err)' of cuBLASLt's first candidate for the mode, or the cuBLAS status that
    refused it (7, INVALID_VALUE: the H200's cuBLASLt 13.1 takes only scalar scales)."""
    w_mode, x_mode = MODES[mode]
    try:
        plan = lt.plan(GemmShape(rows, d_in, d_out, x_type=DataType.E4M3, w_type=DataType.E4M3, w_scale=w_mode,
                                 x_scale=x_mode), 4)
    except CublasError as e:
        return refused(e)
    try:
        if not plan.candidates:
            return "no algorithm"

        def product(w: Operand) -> None:
            lt.matmul(plan, 0, int(y.gpudata), int(x.codes.gpudata), int(w.codes.gpudata), int(w.scales.gpudata),
                      int(x.scales.gpudata))

        us = replay_us(backend, lambda: [product(w) for w in ws], len(ws))
        product(ws[0])
        backend.stream.synchronize()
    except CublasError as e:
        return refused(e)
    finally:
        plan.close()
    w, got = ws[0], bf16_bits_to_f32(y.get()[:rows])
    want = ((e4m3_to_f32(x.codes.get()[:rows]) * x.full[:rows]) @ (e4m3_to_f32(w.codes.get()) * w.full).T)
    return f"{us:6.1f} ({np.abs(got - want).max() / np.abs(want).max():.0e})"


def main() -> None:
    import pycuda.gpuarray as gpuarray

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,143,256,1024,4096")
    args = ap.parse_args()
    row_counts = [int(r) for r in args.rows.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp), LLAMA_32_1B, seed=0)
        base = load_model(tmp)
    models = {"bf16": base, "fp8": fp8_model(base), "fp8 blocks": fp8_model(base, (128, 128))}
    backends = {name: CudaBackend(m.config, m.model_weights(), cuda_graphs=False) for name, m in models.items()}
    backend = backends["fp8"]
    print(f"{'matrix':<26} | {'rows':>5} | {'floor':>6} | {'bf16':>6} | {'fp8 deq.':>8} | {'w8a8':>6} | "
          + " | ".join(f"{m:>15}" for m in MODES) + "   (µs a product (max err))", flush=True)
    with backend._context():
        lt = CublasLt(backend.stream.handle, int(backend.workspace), WORKSPACE_BYTES)
        w8a8_linear = Linear(backend.blas, backend.stream, backend.linear.scratch, lt=lt)
        matrices = {name: layer_matrices(b) for name, b in backends.items()}
        for matrix, ws_bf16 in matrices["bf16"].items():
            ws_fp8 = matrices["fp8"][matrix]
            ws_w8a8 = [dataclasses.replace(w, w8a8=True) for w in ws_fp8]
            weights = [weight_operands(w, b) for w, b in zip(ws_fp8, matrices["fp8 blocks"][matrix])]
            d_out, d_in = ws_fp8[0].d_out, ws_fp8[0].d_in
            x = bf16_rows(max(row_counts), d_in)
            activations = activation_operands(bf16_bits_to_f32(x.get()))
            y = gpuarray.empty((max(row_counts), d_out), np.uint16)
            for rows in row_counts:
                floor = max(ws_fp8[0].nbytes / BANDWIDTH, 2 * rows * d_in * d_out / FP8_PEAK) * 1e6

                def bf16_pass() -> None:
                    for w in ws_bf16:
                        backend.blas.gemm(int(y.gpudata), DataType.BF16, int(x.gpudata), DataType.BF16,
                                          int(w.data.gpudata), DataType.BF16, rows, d_in, d_out)

                def dequantized_pass() -> None:
                    for w in ws_fp8:
                        backend.linear(backend.kernels, y[:rows], x[:rows], w, [(0, rows)])

                def w8a8_pass() -> None:
                    for w in ws_w8a8:
                        w8a8_linear(backend.kernels, y[:rows], x[:rows], w, [(0, rows)])

                cells = [f"{replay_us(backend, bf16_pass, len(ws_bf16)):6.1f}",
                         f"{replay_us(backend, dequantized_pass, len(ws_fp8)):8.1f}",
                         f"{replay_us(backend, w8a8_pass, len(ws_w8a8)):6.1f}"]
                for mode in MODES:
                    ws_mode = [w[mode] for w in weights]
                    cells.append(f"{fp8_cell(lt, backend, mode, rows, y, activations[mode], ws_mode, d_in, d_out):>15}")
                print(f"{matrix:<26} | {rows:>5} | {floor:6.1f} | " + " | ".join(cells), flush=True)
        lt.close()


if __name__ == "__main__":
    main()
