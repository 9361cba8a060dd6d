"""CUDA graphs through the driver API (PyCUDA has none): capture the work queued on a
stream once, then replay it with a single launch instead of hundreds.

Edges into the kernels that await their predecessor (cuda_src/common.cuh's
`await_previous_kernel`) are made programmatic, so that each of those kernels is
scheduled while the one before it still runs and only its dependent part waits:
a kernel boundary then costs no launch gap and no ramp-up (programmatic dependent
launch, sm_90 and later). Other edges (into cuBLAS's kernels) stay as captured."""

from __future__ import annotations

import ctypes
import gc
from typing import Callable, Iterable

from engine.backends.cuda import driver
from engine.backends.cuda.driver import check

CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1
CU_GRAPH_NODE_TYPE_KERNEL = 0
CU_GRAPH_DEPENDENCY_TYPE_DEFAULT, CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC = 0, 1
CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC = 1  # fires once every block of the source has triggered or exited


class _EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class _KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem_bytes", ctypes.c_uint), ("kernel_params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class CudaGraph:
    def __init__(self, stream_handle: int, record: Callable[[], None], awaiting_kernels: Iterable[str] = ()):
        """Capture what `record` queues on the stream (it must not allocate or synchronize).
        `awaiting_kernels` names the kernels whose incoming edges may be programmatic."""
        lib, self.stream = driver.libcuda(), ctypes.c_void_p(stream_handle)
        # No garbage collection while capturing: freeing a collected PyCUDA object (another
        # backend's module or memory) is not permitted then, and would end the capture.
        collecting = gc.isenabled()
        gc.disable()
        check(lib.cuStreamBeginCapture_v2(self.stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture")
        graph = ctypes.c_void_p()
        try:
            record()
        finally:
            check(lib.cuStreamEndCapture(self.stream, ctypes.byref(graph)), "cuStreamEndCapture")
            if collecting:
                gc.enable()
        self.exec = ctypes.c_void_p()
        try:
            self.programmatic_edges = _make_programmatic(graph, frozenset(awaiting_kernels))
            check(lib.cuGraphInstantiateWithFlags(ctypes.byref(self.exec), graph, ctypes.c_ulonglong(0)), "cuGraphInstantiate")
        finally:
            lib.cuGraphDestroy(graph)

    def launch(self) -> None:
        check(driver.libcuda().cuGraphLaunch(self.exec, self.stream), "cuGraphLaunch")

    def close(self) -> None:
        if self.exec:
            driver.libcuda().cuGraphExecDestroy(self.exec)
            self.exec = ctypes.c_void_p()


def _kernel_name(node: ctypes.c_void_p) -> str | None:
    """The function a kernel node launches, or None for other nodes."""
    lib, kind = driver.libcuda(), ctypes.c_int()
    check(lib.cuGraphNodeGetType(node, ctypes.byref(kind)), "cuGraphNodeGetType")
    if kind.value != CU_GRAPH_NODE_TYPE_KERNEL:
        return None
    params, name = _KernelNodeParams(), ctypes.c_char_p()
    check(lib.cuGraphKernelNodeGetParams_v2(node, ctypes.byref(params)), "cuGraphKernelNodeGetParams")
    if not params.func or lib.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(params.func)) != 0:
        return None
    return name.value.decode()


def _make_programmatic(graph: ctypes.c_void_p, awaiting: frozenset[str]) -> int:
    """Turn every kernel-to-kernel edge whose target is in `awaiting` programmatic;
    return how many. A driver older than CUDA 12.3 has no edge data: none are."""
    lib = driver.libcuda()
    if not awaiting or not hasattr(lib, "cuGraphGetEdges_v2") or not hasattr(lib, "cuFuncGetName"):
        return 0
    count = ctypes.c_size_t()
    check(lib.cuGraphGetEdges_v2(graph, None, None, None, ctypes.byref(count)), "cuGraphGetEdges")
    n = count.value
    sources, targets, data = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (_EdgeData * n)()
    check(lib.cuGraphGetEdges_v2(graph, sources, targets, data, ctypes.byref(count)), "cuGraphGetEdges")
    names = {node: _kernel_name(ctypes.c_void_p(node)) for node in set(sources) | set(targets)}  # (each node once)
    changed = 0
    for source, target, edge in zip(sources, targets, data):
        if edge.type != CU_GRAPH_DEPENDENCY_TYPE_DEFAULT or names[target] not in awaiting or names[source] is None:
            continue
        source, target = ctypes.c_void_p(source), ctypes.c_void_p(target)
        programmatic = _EdgeData(from_port=CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC, type=CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
        check(lib.cuGraphRemoveDependencies_v2(graph, ctypes.byref(source), ctypes.byref(target), ctypes.byref(edge),
                                                ctypes.c_size_t(1)), "cuGraphRemoveDependencies")
        check(lib.cuGraphAddDependencies_v2(graph, ctypes.byref(source), ctypes.byref(target), ctypes.byref(programmatic),
                                             ctypes.c_size_t(1)), "cuGraphAddDependencies")
        changed += 1
    return changed
