"""The kernels of cuda_src/ as the host sees them: compiled for the device and prepared
for launch (`Kernels`), with the launch geometry that must agree with the .cu files
(each constant says where its twin is; tests/kernels/test_kernel_contract.py checks them, and
the signatures, against the sources). Imports without PyCUDA, for those tests."""

from __future__ import annotations

from pathlib import Path

CUDA_SRC = Path(__file__).resolve().parents[2] / "cuda_src"
ATTENTION_THREADS = 128  # WARPS * 32 in attention.cu
PREFILL_THREADS, PREFILL_M_TILE = 128, 64  # as in attention.cu
MAX_PART_BLOCKS = 256  # as in attention.cu
GEMV_WARPS = 8  # as in gemv.cu
GEMV_SLICE = 2048  # columns of one warp's loads (SPAN * UNROLL in gemv.cu)
SAMPLE_CLUSTER, SAMPLE_THREADS = 8, 1024  # blocks a row and threads a block of sample_tokens (sampling.cu)
STAGED_INPUT_BYTES = 47 * 1024  # gemv.cu's staged input: 48 KB a block takes without opting in, less its static shared memory


def prefill_query_rows(group: int) -> int:
    """Query positions per prefill_attention block (Q_POS in attention.cu)."""
    return PREFILL_M_TILE // group


def rope_and_cache_threads(heads: int, kv_heads: int, head_dim: int) -> int:
    """rope_and_cache's block: a thread per rotated pair of q and k, at most 1024 (it loops)."""
    return min(1024, (heads + kv_heads) * head_dim // 2)


def blocks_per_sm(fn, threads: int) -> int:
    """Blocks of a kernel an SM holds at once as its registers allow (64K an SM,
    allocated 8 a thread at a time; 2,048 threads an SM)."""
    regs = -(-fn.num_regs // 8) * 8
    return max(1, min(65536 // (regs * threads), 2048 // threads))


def gemv_split(d_in: int) -> int:
    """Warps a gemv.cu weight row is split over (gemv_split there): a power of two,
    each slice at least GEMV_SLICE columns."""
    split = 1
    while split < GEMV_WARPS and d_in >= 2 * split * GEMV_SLICE:
        split *= 2
    return split


class Kernels:
    """The kernels of cuda_src/, compiled for this device and prepared for launch.
    `programmatic` builds them to await their predecessor in-kernel (common.cuh), for
    CUDA graphs whose edges into them are programmatic; eager launches take the plain build."""

    SIGNATURES = {
        "embedding_gather": ("embedding.cu", "PPPPi"),
        "add_rmsnorm": ("rmsnorm.cu", "PPPPPif"),
        "head_rmsnorm": ("rmsnorm.cu", "PPPiif"),
        "rope_cos_sin": ("rope_cache.cu", "PPi"),
        "rope_and_cache": ("rope_cache.cu", "PPPPPPiii"),
        "paged_attention_partial": ("attention.cu", "PPPPPPPPPiPPiiiif"),
        "paged_attention_merge": ("attention.cu", "PPPPPii"),
        "prefill_attention_partial": ("attention.cu", "PPPPPPPiPPPiiiif"),
        "silu_and_mul": ("activation.cu", "PPi"),
        "gemv": ("gemv.cu", "PiPPii"),
        "gemv_add": ("gemv.cu", "PPPii"),
        "gemv_rmsnorm_rope": ("gemv.cu", "PPPfPPPPPPiiiii"),
        "gemv_rmsnorm_silu": ("gemv.cu", "PPPfPii"),
        "apply_penalties": ("sampling.cu", "PiiPPPPPPP"),
        "sample_tokens": ("sampling.cu", "PPiPPPPPPP"),
    }

    def __init__(self, head_dim: int, group: int, arch: str, programmatic: bool = False):
        from pycuda.compiler import SourceModule

        modules = {}
        options = ["-O3", f"-DHEAD_DIM={head_dim}", f"-DGROUP={group}"] + (["-DPROGRAMMATIC_LAUNCH"] if programmatic else [])
        for name, (file, signature) in self.SIGNATURES.items():
            if file not in modules:
                modules[file] = SourceModule(
                    (CUDA_SRC / file).read_text(), no_extern_c=True, arch=arch, options=options,
                    include_dirs=[str(CUDA_SRC)],
                )
            fn = modules[file].get_function(name)
            fn.prepare(signature)
            fn.num_regs = fn.num_regs  # (PyCUDA asks the driver at every read; the GEMV's grid reads it every launch)
            setattr(self, name, fn)
