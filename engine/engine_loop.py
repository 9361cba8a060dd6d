"""The engine thread: the only thread that touches the engine (and the GPU).

RPC handlers call `submit` and `abort` from their own threads; both only enqueue.
The loop applies them between steps, steps while there is work, and pushes each
request's deltas to that request's own queue. It emits a step's deltas (detokenizing,
stop strings, the hand-over to the streams) while the backend computes the next step.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from typing import Callable, Protocol

from engine.llm_engine import LLMEngine
from engine.output import RequestOutput
from engine.sequence import Sequence

log = logging.getLogger("llamastream.engine")


class OutputSink(Protocol):
    def put(self, out: RequestOutput) -> None: ...


class DuplicateRequest(ValueError):
    """A request id that is already in flight."""


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_fatal: Callable[[str], None] | None = None):
        self.engine = engine
        self.on_fatal = on_fatal
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outputs: dict[str, OutputSink] = {}
        self._lock = threading.Lock()  # guards _outputs against the RPC threads
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.fatal_error: str | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._inbox.put(None)
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal_error is None

    def submit(self, seq: Sequence, out: OutputSink | None = None) -> OutputSink:
        """Queue a validated sequence; its RequestOutputs are put to `out` (by default a
        new queue.SimpleQueue), which is returned."""
        out = queue.SimpleQueue() if out is None else out
        with self._lock:
            if seq.request_id in self._outputs:
                raise DuplicateRequest(f"request_id {seq.request_id!r} is already in flight: use a unique id")
            self._outputs[seq.request_id] = out
        self._inbox.put(("add", seq))
        return out

    def abort(self, request_id: str) -> bool:
        """Ask the engine to stop a request; True if it was in flight."""
        with self._lock:
            known = request_id in self._outputs
        if known:
            self._inbox.put(("abort", request_id))
        return known

    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._outputs)

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._apply_inbox(block=not self.engine.has_work())
            if not self.engine.has_work():
                continue
            try:
                self.engine.step_overlapped(self._dispatch)
            except Exception as e:  # a fault fails the requests of this step only...
                log.error("engine step failed:\n%s", traceback.format_exc())
                error = f"engine fault: {type(e).__name__}: {e}"
                outputs = self.engine.fail_step(error)
                if getattr(self.engine.backend, "is_fatal", lambda _: False)(e):
                    # ...unless the device may be unusable: stop serving, fail everything, stop.
                    self.fatal_error = error
                    if self.on_fatal:
                        self.on_fatal(error)
                    self._dispatch(outputs + self.engine.fail_all(error))
                    return
                self._dispatch(outputs)

    def _apply_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if item is not None:
                    kind, arg = item
                    if kind == "add":
                        self.engine.add(arg)
                    else:
                        out = self.engine.abort(arg)
                        if out is not None:
                            self._dispatch([out])
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._lock:
                q = self._outputs.pop(out.request_id) if out.finished else self._outputs.get(out.request_id)
            if q is not None:
                q.put(out)

