"""The kernels of cpu_src/ as Python sees them: compiled once for this CPU by the C
compiler (-O3 -march=native), cached, and each bound with its argument types.

The library is cached under $XDG_CACHE_HOME/llamastream (~/.cache/llamastream), named
by a hash of the sources, the compiler's version and flags and this CPU's model: a new
CPU or a changed kernel compiles again, anything else loads in milliseconds.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

CPU_SRC = Path(__file__).resolve().parents[3] / "cpu_src"
SOURCES = ("pool.c", "linear.c", "layer.c")
# as read at import: a process builds and loads the kernels its own Python was written for
TEXTS = {name: (CPU_SRC / name).read_text() for name in SOURCES + ("common.h",)}
FLAGS = ("-O3", "-march=native", "-pthread", "-shared", "-fPIC", "-std=c11")
COMPILER = os.environ.get("CC", "cc")

log = logging.getLogger("llamastream.engine")

P, I, F, Z = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_size_t
RETURNS = {"use_amx": ctypes.c_int}  # the functions that return something (the others: void)
SIGNATURES = {  # function: argument types (as in cpu_src/)
    "use_amx": (I,),
    "linear_q_packed": (P,),
    "linear_float_packed": (P,),
    "rms_norm": (P, P, P, P, I, I, F),
    "add_to": (P, P, Z),
    "silu_and_mul": (P, P, I, I),
    "rope_and_cache": (P, I, I, I, I, P, P, P, P, P, I, F, F),
    "attention": (P, P, I, I, I, I, P, P, P, P, P, P, P, F, I, F),
}


class CompilerMissing(RuntimeError):
    """The CPU kernels cannot be built here (no C compiler, or a CPU they do not serve)."""


def _cpu_model() -> str:
    """This CPU's model and features (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    return "\n".join(next((line for line in lines if line.startswith(key)), "") for key in ("model name", "flags"))


def _library_path() -> Path:
    compiler = shutil.which(COMPILER)
    if compiler is None:
        raise CompilerMissing(f"no C compiler ({COMPILER}) is on PATH: install gcc (apt-get install gcc), or set CC")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    for part in [version, " ".join(FLAGS), _cpu_model(), *TEXTS.values()]:
        digest.update(part.encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llamastream"
    return cache / f"cpu-kernels-{digest.hexdigest()[:16]}.so"


def _compile(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("compiling the CPU kernels for this CPU, once (cached as %s)", target)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        for name, text in TEXTS.items():
            (Path(tmp) / name).write_text(text)
        objects = []
        for i, source in enumerate(SOURCES):
            log.info("compiling cpu_src/%s (%d of %d)", source, i + 1, len(SOURCES))
            objects.append(str(Path(tmp) / f"{source}.o"))
            _run([COMPILER, *FLAGS, "-c", "-o", objects[-1], str(Path(tmp) / source)])
        _run([COMPILER, *FLAGS, "-o", str(Path(tmp) / target.name), *objects])
        os.replace(Path(tmp) / target.name, target)  # (atomic: of servers starting together, one wins)
    log.info("compiled the CPU kernels in %.1f s", time.perf_counter() - started)


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise CompilerMissing(f"the CPU kernels did not compile ({' '.join(command)}): {result.stderr.strip()[-2000:]}")


class CpuKernels:
    """cpu_src/'s functions, each an attribute of its name taking addresses and numbers."""

    def __init__(self, threads: int):
        path = _library_path()
        if not path.exists():
            _compile(path)
        self.library = ctypes.CDLL(str(path))
        for name, argtypes in SIGNATURES.items():
            fn = getattr(self.library, name)
            fn.argtypes, fn.restype = argtypes, RETURNS.get(name)
            setattr(self, name, fn)
        self.threads = threads
        self.library.set_threads(threads)
        # products of many rows on the CPU's AMX tile unit, where it has one (linear.c)
        self.amx = bool(self.library.use_amx(1))


def addr(a: np.ndarray | None) -> int | None:
    """A C pointer to an array's first element (None for a null pointer)."""
    return None if a is None else a.__array_interface__["data"][0]
