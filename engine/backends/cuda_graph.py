"""CUDA graphs through the driver API (PyCUDA has none): capture the work queued on a
stream once, then replay it with a single launch instead of hundreds."""

from __future__ import annotations

import ctypes
from typing import Callable

CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1
_lib: ctypes.CDLL | None = None


def _driver() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        _lib = ctypes.PyDLL("libcuda.so.1")  # keeps the GIL: these calls only queue work (see cublas.py)
    return _lib


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUresult {result}")


class CudaGraph:
    def __init__(self, stream_handle: int, record: Callable[[], None]):
        """Capture what `record` queues on the stream (it must not allocate or synchronize)."""
        lib, self.stream = _driver(), ctypes.c_void_p(stream_handle)
        _check(lib.cuStreamBeginCapture_v2(self.stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture")
        graph = ctypes.c_void_p()
        try:
            record()
        finally:
            _check(lib.cuStreamEndCapture(self.stream, ctypes.byref(graph)), "cuStreamEndCapture")
        self.exec = ctypes.c_void_p()
        try:
            _check(lib.cuGraphInstantiateWithFlags(ctypes.byref(self.exec), graph, ctypes.c_ulonglong(0)), "cuGraphInstantiate")
        finally:
            lib.cuGraphDestroy(graph)

    def launch(self) -> None:
        _check(_driver().cuGraphLaunch(self.exec, self.stream), "cuGraphLaunch")

    def close(self) -> None:
        if self.exec:
            _driver().cuGraphExecDestroy(self.exec)
            self.exec = ctypes.c_void_p()
