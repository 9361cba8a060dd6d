"""Every kernel in cuda_src/ compiles for sm_90a (Hopper, as the engine builds them
there: kernels.nvcc_target) without register spills, and attention.cu for sm_80 too
(where prompt attention takes mma.sync instead of wgmma).

Runs where nvcc is, GPU or not (CI has nvcc); the kernels' numerics are tested on a
GPU by tests/gpu/.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from engine.backends.cuda.kernels import CUDA_SRC, nvcc_target

NVCC = shutil.which("nvcc") or next((str(p) for p in Path("/usr/local/cuda/bin").glob("nvcc")), None)
SOURCES = sorted(CUDA_SRC.glob("*.cu"))
HOPPER = [f"-{option}={value}" for option, value in nvcc_target("sm_90").items()]  # as the engine builds there
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed (CI and the development machines have it)")


def test_there_are_kernels():
    assert {p.stem for p in SOURCES} >= {"embedding", "rmsnorm", "rope_cache", "attention", "activation", "sampling", "gemv"}


BUILDS = {"eager": [], "graphs": ["-DPROGRAMMATIC_LAUNCH"], "graphs, fp8 KV cache": ["-DPROGRAMMATIC_LAUNCH", "-DKV_CACHE_FP8"]}


def builds(source: Path) -> list[str]:
    """The builds a source is compiled in: the FP8 KV cache's changes only the kernels
    that read or write the cache."""
    return [b for b in BUILDS if "KV_CACHE_FP8" not in " ".join(BUILDS[b]) or '"kv_cache.cuh"' in source.read_text()]


def compile_report(source: Path, target: list[str], *defines: str, out: Path) -> str:
    """ptxas's resource report of a build (-cubin: machine code, registers, spills)."""
    result = subprocess.run([NVCC, *target, "-cubin", "-O3", *defines, "-Xptxas", "-v", f"-I{CUDA_SRC}", "-o", str(out),
                             str(source)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Compiling entry function" in result.stderr
    return result.stderr


def assert_no_spills(report: str) -> None:
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spills and not any(spills), report
    stacks = [int(n) for n in re.findall(r"(\d+) bytes stack frame", report)]
    assert not any(stacks), report


@needs_nvcc
@pytest.mark.parametrize("source, build", [(s, b) for s in SOURCES for b in builds(s)],
                         ids=[f"{s.name}-{b}" for s in SOURCES for b in builds(s)])
@pytest.mark.parametrize("head_dim, group", [(64, 4), (128, 8), (64, 3), (128, 3)])
def test_compiles_for_sm90a_without_spills(source, build, head_dim, group, tmp_path):
    assert_no_spills(compile_report(source, HOPPER, f"-DHEAD_DIM={head_dim}", f"-DGROUP={group}", *BUILDS[build],
                                    out=tmp_path / "k.cubin"))


@needs_nvcc
@pytest.mark.parametrize("head_dim, group", [(64, 4), (128, 8), (64, 3)])
def test_attention_compiles_for_sm80_without_spills(head_dim, group, tmp_path):
    assert_no_spills(compile_report(CUDA_SRC / "attention.cu", ["-arch=sm_80"], f"-DHEAD_DIM={head_dim}",
                                    f"-DGROUP={group}", "-DPROGRAMMATIC_LAUNCH", out=tmp_path / "k.cubin"))


def ptx(source: Path, target: list[str], *defines: str, out: Path) -> str:
    subprocess.run([NVCC, *target, "-ptx", "-O3", *defines, f"-I{CUDA_SRC}", "-o", str(out), str(source)], check=True,
                   timeout=300)
    return out.read_text()


def entries(ptx_text: str) -> dict[str, str]:
    """Each kernel's PTX body, by name."""
    return {body.split("(", 1)[0].strip(): body for body in re.split(r"\.entry\s+", ptx_text)[1:]}


@needs_nvcc
@pytest.mark.parametrize("head_dim, kv_cache, wgmma", [(64, "bf16", True), (64, "fp8", False), (128, "bf16", False)])
def test_prompt_attention_takes_wgmma_on_hopper(head_dim, kv_cache, wgmma, tmp_path):
    """At HEAD_DIM 64 over a bfloat16 cache (Llama 3.2 1B, SmolLM2) the Hopper build's
    prompt attention multiplies with wgmma; elsewhere, and in other builds, with mma.sync."""
    defines = [f"-DHEAD_DIM={head_dim}", "-DGROUP=4"] + (["-DKV_CACHE_FP8"] if kv_cache == "fp8" else [])
    hopper = entries(ptx(CUDA_SRC / "attention.cu", HOPPER, *defines, out=tmp_path / "a.ptx"))["prefill_attention_partial"]
    assert ("wgmma.mma_async" in hopper) == wgmma and ("mma.sync" in hopper) != wgmma
    ampere = entries(ptx(CUDA_SRC / "attention.cu", ["-arch=sm_80"], *defines, out=tmp_path / "b.ptx"))
    assert "wgmma" not in ampere["prefill_attention_partial"] and "mma.sync" in ampere["prefill_attention_partial"]


@needs_nvcc
@pytest.mark.parametrize("source", SOURCES, ids=[p.name for p in SOURCES])
def test_every_kernel_awaits_its_predecessor(source, tmp_path):
    """CUDA graphs make the edges into our kernels programmatic (engine/backends/cuda/graph.py):
    that is safe only if each of them, as built for graphs, waits for the kernel before it
    (common.cuh); the build for eager launches has no such wait."""
    kernels = entries(ptx(source, HOPPER, "-DPROGRAMMATIC_LAUNCH", out=tmp_path / "k.ptx"))
    assert kernels
    for name, body in kernels.items():
        assert "griddepcontrol.wait" in body and "griddepcontrol.launch_dependents" in body, name
    assert "griddepcontrol" not in ptx(source, HOPPER, out=tmp_path / "k.ptx")
