"""A stand-in for the part of PyCUDA, cuBLAS and the CUDA driver that the CUDA backend
uses: it computes nothing and records every launch, so that the backend's host side
(which kernels a step launches, with which grids and argument types) runs without a
GPU. Device arrays are host arrays at made-up addresses; kernels and GEMMs leave them
as they are, and sampled tokens read back as zeros.

    with recording_pycuda() as launches:
        from engine.backends.cuda.backend import CudaBackend  # (imported inside)

tests/kernels/test_launches.py checks the launches; bench/host_step.py times the host's
side of a step with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
import types
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from engine.model_loader import LoadedModel
from engine.weights import Tensor

TYPE_CODES = {"P": np.uintp, "i": np.int32, "f": np.float32}
BACKEND_MODULES = ("pycuda", "pycuda.", "engine.backends.cuda")  # (prefixes) loaded afresh against the stand-in


FUNCTION_ATTRIBUTES = types.SimpleNamespace(MAX_DYNAMIC_SHARED_SIZE_BYTES=8)  # (CUfunction_attribute)


@dataclass(frozen=True)
class Launch:
    kernel: str  # a kernel's name, "cublasGemmEx" or "cuGraphLaunch"
    grid: tuple[int, ...] = ()
    block: tuple[int, ...] = ()
    shared: int = 0
    args: tuple = ()  # scalars as values, pointers as "P" (0 for a null pointer)


class _Memory:
    """Made-up device addresses, 256-byte aligned, never reused."""

    def __init__(self) -> None:
        self.next = 1 << 32

    def allocate(self, nbytes: int) -> int:
        address, self.next = self.next, self.next + -(-max(1, int(nbytes)) // 256) * 256
        return address


class _GPUArray:
    def __init__(self, host: np.ndarray, gpudata: int):
        self.host, self.gpudata = host, gpudata
        self.shape, self.dtype, self.size, self.nbytes = host.shape, host.dtype, host.size, host.nbytes

    def __getitem__(self, index) -> "_GPUArray":
        assert isinstance(index, slice) and index.step is None and not index.start, "leading slices only"
        return _GPUArray(self.host[index], self.gpudata)

    def reshape(self, *dims) -> "_GPUArray":
        return _GPUArray(self.host.reshape(*dims), self.gpudata)

    def get(self, stream=None) -> np.ndarray:
        return self.host.copy()

    def set(self, values) -> None:
        self.host[...] = np.asarray(values).reshape(self.shape)

    def set_async(self, values, stream=None) -> None:
        self.set(values)


class _Function:
    """A prepared kernel: each launch is checked against its signature and recorded."""

    num_regs = 64

    def __init__(self, name: str, launches: list[Launch]):
        self.name, self.signature, self.launches = name, "", launches
        self.max_shared = 48 * 1024  # a block's without opting in

    def prepare(self, signature: str) -> None:
        self.signature = signature

    def set_attribute(self, attribute: int, value: int) -> None:
        assert attribute == FUNCTION_ATTRIBUTES.MAX_DYNAMIC_SHARED_SIZE_BYTES and value <= 227 * 1024, (attribute, value)
        self.max_shared = value

    def prepared_async_call(self, grid, block, stream, *args, shared_size: int = 0) -> None:
        assert len(args) == len(self.signature), f"{self.name}: {len(args)} arguments for {self.signature!r}"
        for i, (code, arg) in enumerate(zip(self.signature, args)):
            assert isinstance(arg, TYPE_CODES[code]), f"{self.name} argument {i}: {type(arg).__name__} for {code}"
        assert all(g >= 1 for g in grid) and 1 <= int(np.prod(block)) <= 1024, (self.name, grid, block)
        assert shared_size <= self.max_shared, (self.name, shared_size)
        recorded = tuple(("P" if int(a) else 0) if c == "P" else a.item() for c, a in zip(self.signature, args))
        self.launches.append(Launch(self.name, tuple(grid), tuple(block), shared_size, recorded))

    def prepared_call(self, grid, block, *args, shared_size: int = 0) -> None:
        self.prepared_async_call(grid, block, None, *args, shared_size=shared_size)


def _modules(memory: _Memory, launches: list[Launch]) -> dict[str, types.ModuleType]:
    pycuda, driver, gpuarray, compiler, tools = (types.ModuleType(n) for n in (
        "pycuda", "pycuda.driver", "pycuda.gpuarray", "pycuda.compiler", "pycuda.tools"))

    def empty(shape, dtype, allocator=None):
        host = np.zeros(shape, dtype)
        return _GPUArray(host, memory.allocate(host.nbytes) if host.size else None)  # (as PyCUDA: nothing for nothing)

    def to_gpu(values, allocator=None, stream=None):
        array = empty(np.shape(values), np.asarray(values).dtype)
        array.set(values)
        return array

    gpuarray.GPUArray, gpuarray.empty, gpuarray.zeros = _GPUArray, empty, empty
    gpuarray.to_gpu = gpuarray.to_gpu_async = to_gpu

    class Context:
        def push(self) -> None:
            pass

        @staticmethod
        def pop() -> None:
            pass

        @staticmethod
        def get_device() -> "Device":
            return Device(0)

    class Device:
        def __init__(self, ordinal: int):
            pass

        count = staticmethod(lambda: 1)
        compute_capability = staticmethod(lambda: (9, 0))
        get_attribute = staticmethod(lambda attribute: 16)
        name = staticmethod(lambda: "a recording stand-in")
        retain_primary_context = staticmethod(Context)

    class Stream:
        handle = 1

        def synchronize(self) -> None:
            pass

        def wait_for_event(self, event) -> None:
            pass

    class Event:
        def record(self, stream=None) -> None:
            pass

        def synchronize(self) -> None:
            pass

    driver.Error = type("Error", (Exception,), {})
    driver.Context, driver.Device, driver.Stream, driver.Event = Context, Device, Stream, Event
    driver.init = lambda: None
    driver.mem_alloc = memory.allocate
    driver.mem_get_info = lambda: (100 * 2**30, 140 * 2**30)
    driver.pagelocked_empty = lambda shape, dtype: np.zeros(shape, dtype)
    driver.memcpy_dtoh_async = lambda dest, src, stream=None: dest.fill(0)
    driver.memcpy_htod_async = lambda dest, src, stream=None: None
    driver.device_attribute = types.SimpleNamespace(MULTIPROCESSOR_COUNT=16)

    class SourceModule:
        def __init__(self, source: str, **options):
            pass

        def get_function(self, name: str) -> _Function:
            return _Function(name, launches)

    class DeviceMemoryPool:
        def allocate(self, nbytes: int) -> int:
            return memory.allocate(nbytes)

        def stop_holding(self) -> None:
            pass

    compiler.SourceModule, tools.DeviceMemoryPool = SourceModule, DeviceMemoryPool
    driver.function_attribute = FUNCTION_ATTRIBUTES
    pycuda.driver, pycuda.gpuarray, pycuda.compiler, pycuda.tools = driver, gpuarray, compiler, tools
    return {m.__name__: m for m in (pycuda, driver, gpuarray, compiler, tools)}


class _Library:
    """libcublas, libcublasLt and libcuda: every call succeeds; GEMMs and graph launches
    are recorded, and cuBLASLt's heuristic offers one algorithm."""

    def __init__(self, launches: list[Launch]):
        self.launches = launches

    def __getattr__(self, name: str):
        def call(*args) -> int:
            if name == "cublasGemmEx":  # (m, n, k, then the types of w, x and y)
                self.launches.append(Launch(name, args=(*args[3:6], args[8], args[11], args[15])))
            elif name in ("cuGraphLaunch", "cublasLtMatmul"):
                self.launches.append(Launch(name))
            elif name == "cublasLtMatmulAlgoGetHeuristic":  # (..., count, results, byref(returned))
                args[-1]._obj.value = 1
            return 0
        return call


def _forget_backend_modules() -> dict[str, types.ModuleType]:
    gone = {name: module for name, module in sys.modules.items() if name.startswith(BACKEND_MODULES)}
    for name in gone:
        del sys.modules[name]
    return gone


@contextlib.contextmanager
def recording_pycuda() -> Iterator[list[Launch]]:
    """Install the stand-in, and load the CUDA backend's modules against it, for the block."""
    launches: list[Launch] = []
    saved = _forget_backend_modules()
    sys.modules.update(_modules(_Memory(), launches))
    try:
        library = _Library(launches)
        importlib.import_module("engine.backends.cuda.cublas").load_cublas = lambda name="cublas": library
        importlib.import_module("engine.backends.cuda.driver").libcuda = lambda: library
        yield launches
    finally:
        _forget_backend_modules()
        sys.modules.update(saved)


def cuda_shaped(model: LoadedModel) -> LoadedModel:
    """A small test model with the head size the CUDA kernels take (64), random weights."""
    c = dataclasses.replace(model.config, head_dim=64, num_heads=4, num_kv_heads=2)
    shapes = model.architecture.tensor_shapes(c)
    rng = np.random.default_rng(0)
    weights = {name: Tensor.of(rng.standard_normal(shape).astype(np.float32) * 0.1) for name, shape in shapes.items()}
    return LoadedModel(model.name, c, weights, model.tokenizer)
