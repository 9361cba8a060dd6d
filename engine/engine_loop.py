"""The engine thread: the only thread that touches the engine (and the GPU).

Others call `add` and `abort`; both only enqueue. The loop applies them between
steps, steps while there is work, and hands each step's outputs to `publish` in one
call. It emits a step's deltas (detokenizing, stop strings, the hand-over) while the
backend computes the next step.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
from typing import Callable

from engine.llm_engine import LLMEngine
from engine.output import RequestOutput
from engine.sequence import Sequence

log = logging.getLogger("llamastream.engine")
# A thread that lets go of the GIL (the engine's at each wait for the device, the
# structured outputs' mask thread at each llguidance call) must get it back at once when
# it returns, not after Python's default 5 ms: a mask thread kept waiting holds up the
# step that samples with its masks. Measured with bench/structured_output.py and
# bench/server_overhead.py --host-ms 1 --gil-releases 6.
GIL_SWITCH_INTERVAL_S = 1e-4


class EngineLoop:
    def __init__(self, engine: LLMEngine, publish: Callable[[list[RequestOutput]], None],
                 on_fatal: Callable[[str], None] | None = None):
        self.engine = engine
        self.publish = publish  # called on the engine thread
        self.on_fatal = on_fatal  # likewise, once, before the last outputs are published
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.fatal_error: str | None = None

    def start(self) -> None:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # (process-wide: this process serves)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._inbox.put(None)
        if self._thread.ident is not None:  # (started)
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal_error is None

    def add(self, seq: Sequence) -> None:
        """Queue a validated sequence; its outputs will be published."""
        self._inbox.put(("add", seq))

    def abort(self, request_id: str) -> None:
        """Stop a request, if it is still in the engine; its last output is published."""
        self._inbox.put(("abort", request_id))

    def reset_prefix_cache(self) -> None:
        """Forget the cached prefixes (LLMEngine.reset_prefix_cache) before the next step."""
        self._inbox.put(("reset_prefix_cache", None))

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._apply_inbox(block=not self.engine.has_work())
            if not self.engine.has_work():
                continue
            try:
                self.engine.step_overlapped(self.publish)
            except Exception as e:  # a fault fails the requests of this step only...
                log.exception("engine step failed")
                error = f"engine fault: {type(e).__name__}: {e}"
                outputs = self.engine.fail_step(error)
                if self.engine.backend.is_fatal(e):
                    # ...unless the device may be unusable: stop serving, fail everything, stop.
                    self.fatal_error = error
                    if self.on_fatal:
                        self.on_fatal(error)
                    self.publish(outputs + self.engine.fail_all(error))
                    return
                self.publish(outputs)

    def _apply_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if item is not None:
                    kind, arg = item
                    if kind == "add":
                        self.engine.add(arg)
                    elif kind == "reset_prefix_cache":
                        log.info("prefix cache flushed: %d blocks freed", self.engine.reset_prefix_cache())
                        self.publish([])  # (with the engine's state, which the flush changed)
                    else:
                        out = self.engine.abort(arg)
                        if out is not None:
                            self.publish([out])
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass
