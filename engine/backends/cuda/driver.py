"""The CUDA driver API calls PyCUDA has no wrapper for, through ctypes: graphs
(graph.py) and a stream that waits for the host (HostGate)."""

from __future__ import annotations

import ctypes

import numpy as np
import pycuda.driver as cuda

CU_STREAM_WAIT_VALUE_GEQ = 0
_lib: ctypes.CDLL | None = None


def libcuda() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        _lib = ctypes.PyDLL("libcuda.so.1")  # keeps the GIL: these calls only queue work (see cublas.py)
    return _lib


def check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUresult {result}")


class HostGate:
    """A counter in page-locked memory that the device reads: work queued on the stream
    after `close()` runs once the host has called `open` with the number it returned
    (cuStreamWaitValue32). So work that needs host data not ready yet (a step's token
    masks) is queued at once and the device waits for the data, not the host. Whatever
    happens, each number must be opened: until then the stream stops there."""

    def __init__(self, stream: cuda.Stream):
        self.stream = ctypes.c_void_p(stream.handle)
        # (page-locked host memory has the same address on the device: unified addressing)
        self.counter = cuda.pagelocked_empty(1, np.uint32)
        self.address = ctypes.c_uint64(self.counter.ctypes.data)
        self.closed = 0  # the last number the stream waits for

    def close(self) -> int:
        """Queue a wait on the stream for the next number; return it."""
        self.closed += 1
        # (>= in 32-bit wrapping arithmetic: an open number opens every one before it)
        check(libcuda().cuStreamWaitValue32_v2(self.stream, self.address, ctypes.c_uint32(self.closed & 0xFFFFFFFF),
                                               CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32")
        return self.closed

    def open(self, number: int) -> None:
        """Let the stream past the wait for `number` (on any thread: data the host wrote
        before this call is what the device reads after the wait)."""
        self.counter[0] = number & 0xFFFFFFFF
