"""The host's side of each kernel agrees with cuda_src/: the argument types it prepares
every launch with (SIGNATURES) match the kernel's parameters, and the launch
geometry mirrored in engine/backends/cuda/kernels.py matches the #defines. A mismatch would pass
pointers as ints or launch the wrong block size, which only a GPU run would show."""

from __future__ import annotations

import re

import pytest

from engine.backends.cuda import kernels as ck

KERNELS = sorted(ck.SIGNATURES.items())


def source(file: str) -> str:
    """A .cu file without its comments, launch bounds and cluster sizes."""
    text = re.sub(r"//[^\n]*", "", (ck.CUDA_SRC / file).read_text())
    return re.sub(r"__(?:launch_bounds|cluster_dims)__\([^)]*\)", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


def parameters(file: str, name: str) -> list[str]:
    """The parameter declarations of kernel `name` (an extern "C" __global__ function)."""
    text = source(file)
    match = re.search(r'extern "C" __global__ void\b[^;{]*?\b' + name + r"\s*\(([^)]*)\)\s*\{", text)
    assert match, f"no kernel {name} in {file}"
    return [p.strip() for p in match.group(1).split(",")]


def type_code(declaration: str) -> str:
    """PyCUDA's prepare() code for a parameter: P for a pointer, i for int, f for float."""
    if "*" in declaration:
        return "P"
    kind = declaration.split()[-2] if len(declaration.split()) > 1 else ""
    return {"int": "i", "float": "f"}[kind]


def defines(file: str) -> dict[str, int]:
    """The integer #defines of a .cu file (expressions over earlier ones evaluated)."""
    values: dict[str, int] = {}
    for name, expr in re.findall(r"^#define (\w+) ([^\n]+)$", source(file), flags=re.M):
        try:
            values[name] = int(eval(expr.strip(), {"__builtins__": {}}, dict(values)))  # (arithmetic on numbers only)
        except (NameError, SyntaxError, TypeError):
            pass  # macros with arguments, HEAD_DIM-dependent choices, and the like
    return values


@pytest.mark.parametrize("name, file, signature", [(n, f, s) for n, (f, s) in KERNELS], ids=[n for n, _ in KERNELS])
def test_signature_matches_the_kernel(name, file, signature):
    assert "".join(type_code(p) for p in parameters(file, name)) == signature


def test_every_kernel_is_prepared():
    declared = {name for path in ck.CUDA_SRC.glob("*.cu")
                for name in re.findall(r'extern "C" __global__ void\b[^;{(]*?\b(\w+)\s*\(', source(path.name))}
    assert declared == set(ck.SIGNATURES)


def test_launch_geometry_matches_the_sources():
    attention, gemv, sampling, skinny = (defines(f) for f in ("attention.cu", "gemv.cu", "sampling.cu", "skinny_gemm.cu"))
    assert ck.ATTENTION_THREADS == attention["WARPS"] * 32
    assert (ck.PREFILL_THREADS, ck.PREFILL_M_TILE, ck.MAX_PART_BLOCKS) == (
        attention["PREFILL_THREADS"], attention["M_TILE"], attention["MAX_PART_BLOCKS"])
    assert ck.GEMV_WARPS == gemv["GEMV_WARPS"]
    assert ck.GEMV_SLICE == gemv["SPAN"] * gemv["UNROLL"] and ck.GEMV_UNROLL == gemv["UNROLL"]
    fewest = re.search(r"constexpr int fewest = W == W_FP8 \? (\d+) : (\d+);", source("gemv.cu"))
    assert (ck.FEWEST_ROW_LANES["fp8"], ck.FEWEST_ROW_LANES["int4"]) == (int(fewest[1]), int(fewest[2]))
    columns = re.search(r"COLS = W == W_BF16 \? (\d+) : W == W_FP8 \? (\d+) : (\d+);", (ck.CUDA_SRC / "weights.cuh").read_text())
    assert tuple(ck.GEMV_COLUMNS.values()) == tuple(int(c) for c in columns.groups())
    assert (ck.SAMPLE_CLUSTER, ck.SAMPLE_THREADS) == (sampling["SAMPLE_CLUSTER"], sampling["SAMPLE_THREADS"])
    assert (ck.SKINNY_THREADS, ck.SKINNY_ROWS, ck.SKINNY_MAX_ROWS) == (
        skinny["SKINNY_THREADS"], skinny["SKINNY_ROWS"], skinny["SKINNY_MAX_ROWS"])
    offset = re.search(r"SKINNY_X_OFFSET = W == W_BF16 \? (\d+) : (\d+);", source("skinny_gemm.cu"))
    assert (ck.SKINNY_X_OFFSET["bf16"], ck.SKINNY_X_OFFSET["fp8"]) == (int(offset[1]), int(offset[2]))


@pytest.mark.parametrize("d_in, split", [(576, 1), (2048, 1), (4095, 1), (4096, 2), (8192, 4), (16384, 8), (65536, 8)])
def test_gemv_split(d_in, split):
    """gemv_split's rule, as gemv.cu states it: slices of at least GEMV_SLICE columns,
    at most one warp each."""
    assert ck.gemv_split(d_in) == split


@pytest.mark.parametrize("d_in, format, lanes, rows", [
    (2048, "bf16", 32, 8), (8192, "bf16", 32, 2), (576, "fp8", 16, 16), (2048, "fp8", 16, 16), (8192, "fp8", 32, 4),
    (576, "int4", 32, 8), (2048, "int4", 32, 8), (4096, "int4", 32, 8), (8192, "int4", 32, 8), (16384, "int4", 32, 4)])
def test_gemv_row_lanes(d_in, format, lanes, rows):
    """An FP8 row narrower than a warp's UNROLL loads takes half a warp (rows up to 2,048
    columns); bfloat16 and INT4 rows a whole warp."""
    assert (ck.gemv_row_lanes(d_in, format), ck.gemv_rows_per_block(d_in, format)) == (lanes, rows)


@pytest.mark.parametrize("rows, d_in, d_out, format, split", [
    (16, 2048, 2048, "bf16", 8), (16, 8192, 2048, "fp8", 8), (16, 2048, 3072, "fp8", 8), (16, 2048, 16384, "fp8", 2),
    (64, 8192, 2048, "bf16", 8),  # (a slice of 4,096 columns of 64 rows would not fit a block's shared memory)
    (8, 576, 960, "fp8", 1),  # (SmolLM2: 576 columns are 9 FP8 chunks, one slice)
    (8, 100, 64, "bf16", None),  # (no whole chunk)
])
def test_skinny_split(rows, d_in, d_out, format, split):
    """skinny_split's rule at the H200's 132 SMs: the fewest slices that give every SM two
    blocks, of those whose slice of x fits a block's shared memory."""
    assert ck.skinny_split(rows, d_in, d_out, format, sm_count=132) == split
    if split:
        assert ck.skinny_shared_bytes(rows, d_in // split, format) <= ck.SKINNY_MAX_SHARED
