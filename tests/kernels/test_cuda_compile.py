"""Every kernel in cuda_src/ compiles for sm_90 (Hopper) without register spills.

Runs where nvcc is, GPU or not (CI has nvcc); the kernels' numerics are tested on a
GPU by tests/gpu/.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

CUDA_SRC = Path(__file__).resolve().parents[2] / "cuda_src"
NVCC = shutil.which("nvcc") or next((str(p) for p in Path("/usr/local/cuda/bin").glob("nvcc")), None)
SOURCES = sorted(CUDA_SRC.glob("*.cu"))


def test_there_are_kernels():
    assert {p.stem for p in SOURCES} >= {"embedding", "rmsnorm", "rope_cache", "attention", "activation", "sampling", "gemv"}


BUILDS = {"eager": [], "graphs": ["-DPROGRAMMATIC_LAUNCH"], "graphs, fp8 KV cache": ["-DPROGRAMMATIC_LAUNCH", "-DKV_CACHE_FP8"]}


def builds(source: Path) -> list[str]:
    """The builds a source is compiled in: the FP8 KV cache's changes only the kernels
    that read or write the cache."""
    return [b for b in BUILDS if "KV_CACHE_FP8" not in " ".join(BUILDS[b]) or '"kv_cache.cuh"' in source.read_text()]


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed (CI and the development machines have it)")
@pytest.mark.parametrize("source, build", [(s, b) for s in SOURCES for b in builds(s)],
                         ids=[f"{s.name}-{b}" for s in SOURCES for b in builds(s)])
@pytest.mark.parametrize("head_dim, group", [(64, 4), (128, 8), (64, 3), (128, 3)])
def test_compiles_for_sm90_without_spills(source, build, head_dim, group, tmp_path):
    result = subprocess.run(
        [NVCC, "-arch=sm_90", "-cubin", "-O3", f"-DHEAD_DIM={head_dim}", f"-DGROUP={group}", *BUILDS[build], "-Xptxas", "-v", f"-I{CUDA_SRC}",
         "-o", str(tmp_path / "k.cubin"), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = result.stderr
    assert "Compiling entry function" in report
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spills and not any(spills), report
    stacks = [int(n) for n in re.findall(r"(\d+) bytes stack frame", report)]
    assert not any(stacks), report


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed (CI and the development machines have it)")
@pytest.mark.parametrize("source", SOURCES, ids=[p.name for p in SOURCES])
def test_every_kernel_awaits_its_predecessor(source, tmp_path):
    """CUDA graphs make the edges into our kernels programmatic (engine/backends/cuda/graph.py):
    that is safe only if each of them, as built for graphs, waits for the kernel before it
    (common.cuh); the build for eager launches has no such wait."""
    def ptx(*build: str) -> str:
        out = tmp_path / "k.ptx"
        subprocess.run([NVCC, "-arch=sm_90", "-ptx", "-O3", *build, f"-I{CUDA_SRC}", "-o", str(out), str(source)],
                       check=True, timeout=300)
        return out.read_text()

    entries = re.split(r"\.entry\s+", ptx("-DPROGRAMMATIC_LAUNCH"))[1:]
    assert entries
    for body in entries:
        name = body.split("(", 1)[0].strip()
        assert "griddepcontrol.wait" in body and "griddepcontrol.launch_dependents" in body, name
    assert "griddepcontrol" not in ptx()
