"""cuBLAS's own choice of GEMM against every candidate of cuBLASLt's heuristic, for each
layer matrix of the Llama 3.2 1B shape (random bfloat16 weights) at 1 to 256 rows: µs a
product (replayed over the 16 layers' copies in a CUDA graph, so that the weights come
from memory: bench/quantized.py's replay_us) and the TB/s of the weight's bytes, beside
the floor (the bytes over 4.27 TB/s); which candidate was fastest, and its largest
difference from cuBLAS's result (bfloat16 rounding of another summation order).

    python3 bench/gemm_algos.py [--rows 1,2,4,8,16,32,64,128,256] [--candidates 16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.quantized import BANDWIDTH, bf16_rows, layer_matrices, replay_us  # noqa: E402
from devtools.checkpoints import LLAMA_32_1B, make_model  # noqa: E402
from engine.backends.cuda.backend import WORKSPACE_BYTES, CudaBackend  # noqa: E402
from engine.backends.cuda.cublas import DataType  # noqa: E402
from engine.backends.cuda.cublaslt import CublasLt, GemmShape  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from engine.weights import bf16_bits_to_f32  # noqa: E402


def main() -> None:
    import pycuda.gpuarray as gpuarray

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--candidates", type=int, default=16, help="of the heuristic's, at most")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp), LLAMA_32_1B, seed=0)
        model = load_model(tmp)
    backend = CudaBackend(model.config, model.model_weights(), cuda_graphs=False)
    print(f"{'matrix':<26} | {'rows':>4} | {'floor':>5} | {'cuBLAS':>13} | {'Lt first':>13} | {'Lt fastest':>13} | "
          f"{'which':>8} | max diff   (µs a product (weight TB/s))")
    with backend._context():
        lt = CublasLt(backend.stream.handle, int(backend.workspace), WORKSPACE_BYTES)
        for matrix, ws in layer_matrices(backend).items():
            w0 = ws[0]
            rows_max = max(int(r) for r in args.rows.split(","))
            x, y, y_lt = bf16_rows(rows_max, w0.d_in), *(gpuarray.empty((rows_max, w0.d_out), np.uint16) for _ in range(2))
            floor = w0.nbytes / BANDWIDTH * 1e6

            def cell(us: float) -> str:
                return f"{us:5.1f} ({w0.nbytes / us / 1e6:4.2f})"

            for rows in (int(r) for r in args.rows.split(",")):
                plan = lt.plan(GemmShape(rows, w0.d_in, w0.d_out), args.candidates)

                def cublas() -> None:
                    for w in ws:
                        backend.blas.gemm(int(y.gpudata), DataType.BF16, int(x.gpudata), DataType.BF16,
                                          int(w.data.gpudata), DataType.BF16, rows, w.d_in, w.d_out)

                def candidate(i: int):
                    def one_pass() -> None:
                        for w in ws:
                            lt.matmul(plan, i, int(y_lt.gpudata), int(x.gpudata), int(w.data.gpudata))
                    return one_pass

                ours = replay_us(backend, cublas, len(ws))
                times = [replay_us(backend, candidate(i), len(ws)) for i in range(len(plan.candidates))]
                best = int(np.argmin(times))
                candidate(best)()
                backend.stream.synchronize()
                expected, got = (bf16_bits_to_f32(a.get()[:rows]) for a in (y, y_lt))
                diff = np.abs(got - expected).max() / np.abs(expected).max()
                print(f"{matrix:<26} | {rows:>4} | {floor:5.1f} | {cell(ours)} | {cell(times[0])} | {cell(times[best])} | "
                      f"{best:>3} of {len(times):>2} | {diff:.1e}", flush=True)
                plan.close()
        lt.close()


if __name__ == "__main__":
    main()
