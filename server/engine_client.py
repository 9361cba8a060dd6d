"""The server's handle on the engine, wherever the engine runs.

InProcessEngine steps the engine on a thread of the server's process (EngineLoop).
EngineProcess runs that thread in a process of its own, as vLLM runs its engine core:
the engine's Python then holds a GIL of its own instead of sharing one with the RPC
loop, and under many streams that sharing, not the GPU, set the pace. The server
sees one interface either way: it submits checked sequences, each request's outputs
come to the sink it gave, the prefix cache's events to `on_kv_events`, and the
engine's fixed facts (EngineInfo) are at hand without asking it.
"""

from __future__ import annotations

import abc
import logging
import multiprocessing
import queue
import signal
import threading
from multiprocessing.connection import Connection
from typing import Callable, Protocol

from engine.block_manager import KvEvent
from engine.engine_loop import EngineLoop
from engine.llm_engine import EngineInfo, EngineStats, LLMEngine
from engine.output import RequestOutput
from engine.sequence import FinishReason, Sequence
from server.log_format import configure_logging, logging_settings


class OutputSink(Protocol):
    def put(self, out: RequestOutput) -> None: ...


class DuplicateRequest(ValueError):
    """A request id that is already in flight."""


class EngineClient(abc.ABC):
    """Routes each request's outputs to the sink it was submitted with; how the engine
    runs is the subclass's."""

    def __init__(self, info: EngineInfo, on_fatal: Callable[[str], None] | None):
        self.info = info
        self.on_fatal = on_fatal  # the engine can no longer run (called once, on the thread that saw it)
        self.fatal_error: str | None = None
        # Given the prefix cache's events of each step (on the thread that routes outputs),
        # if set before start(); the engine records them only where its config says so.
        self.on_kv_events: Callable[[list[KvEvent]], None] | None = None
        self._sinks: dict[str, OutputSink] = {}
        self._lock = threading.Lock()  # guards _sinks: the RPC loop submits, the engine's outputs arrive elsewhere

    def submit(self, seq: Sequence, out: OutputSink | None = None) -> OutputSink:
        """Queue a checked sequence (from info.make_sequence); its RequestOutputs are put
        to `out` (by default a new queue.SimpleQueue), which is returned."""
        out = queue.SimpleQueue() if out is None else out
        with self._lock:
            if seq.request_id in self._sinks:
                raise DuplicateRequest(f"request_id {seq.request_id!r} is already in flight: use a unique id")
            self._sinks[seq.request_id] = out
        self._add(seq)
        return out

    def abort(self, request_id: str) -> bool:
        """Ask the engine to stop a request; True if it was in flight."""
        with self._lock:
            known = request_id in self._sinks
        if known:
            self._abort(request_id)
        return known

    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._sinks)

    def _route(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            sinks = [self._sinks.pop(o.request_id, None) if o.finished else self._sinks.get(o.request_id) for o in outputs]
        for out, sink in zip(outputs, sinks):
            if sink is not None:
                sink.put(out)

    def _route_kv_events(self, events: list[KvEvent]) -> None:
        if events and self.on_kv_events:
            self.on_kv_events(events)

    def _fatal(self, error: str) -> None:
        self.fatal_error = error
        if self.on_fatal:
            self.on_fatal(error)

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def stop(self) -> None: ...

    @property
    @abc.abstractmethod
    def alive(self) -> bool: ...

    @abc.abstractmethod
    def stats(self) -> EngineStats: ...

    @abc.abstractmethod
    def _add(self, seq: Sequence) -> None: ...

    @abc.abstractmethod
    def _abort(self, request_id: str) -> None: ...

    @abc.abstractmethod
    def reset_prefix_cache(self) -> None:
        """Forget the cached prompt prefixes, before the engine's next step."""


class InProcessEngine(EngineClient):
    """The engine on a thread of this process (`llamastream serve --engine-in-process`)."""

    def __init__(self, engine: LLMEngine, on_fatal: Callable[[str], None] | None = None):
        super().__init__(engine.info, on_fatal)
        self.engine = engine
        self._loop = EngineLoop(engine, publish=self._publish, on_fatal=self._fatal)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        self._route(outputs)
        self._route_kv_events(self.engine.take_kv_events())

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    @property
    def alive(self) -> bool:
        return self._loop.alive

    def stats(self) -> EngineStats:
        return self.engine.stats()  # (read across threads: a snapshot, good enough for metrics)

    def _add(self, seq: Sequence) -> None:
        self._loop.add(seq)

    def _abort(self, request_id: str) -> None:
        self._loop.abort(request_id)

    def reset_prefix_cache(self) -> None:
        self._loop.reset_prefix_cache()


class EngineProcess(EngineClient):
    """The engine in a child process, built there by `build` (a picklable callable).
    Requests go to it over a pipe; each step's outputs come back as one message,
    with the engine's stats, and a thread here routes them. Raises what `build`
    raised if the engine cannot be built."""

    def __init__(self, build: Callable[[], LLMEngine], on_fatal: Callable[[str], None] | None = None):
        context = multiprocessing.get_context("spawn")  # (a forked child would share the parent's CUDA and gRPC state)
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_engine_process_main, args=(build, child, *logging_settings()),
                                        name="llamastream-engine", daemon=True)
        self._process.start()
        child.close()
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self._process.join(timeout=5)
            raise RuntimeError(f"the engine process exited (code {self._process.exitcode}) while building the "
                               "engine: see its log above") from None
        if kind == "failed":
            self._process.join(timeout=5)
            raise value
        super().__init__(value, on_fatal)
        self._stats = EngineStats(running=0, waiting=0, kv_blocks_free=value.num_kv_blocks, num_preemptions=0,
                                  live_requests=0)
        self._send_lock = threading.Lock()
        self._stopping = False
        self._reader = threading.Thread(target=self._read, name="engine-outputs", daemon=True)

    def start(self) -> None:
        self._reader.start()

    def stop(self) -> None:
        self._stopping = True
        self._post(None)
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        if self._reader.is_alive():  # (it ends once the process has closed its end)
            self._reader.join(timeout=10)
        self._conn.close()

    @property
    def alive(self) -> bool:
        return self._process.is_alive() and self.fatal_error is None

    def stats(self) -> EngineStats:
        return self._stats  # as of the engine's last outputs

    def _add(self, seq: Sequence) -> None:
        self._post(("add", seq))

    def _abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def reset_prefix_cache(self) -> None:
        self._post(("reset_prefix_cache", None))

    def _post(self, message) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except OSError:  # the process is gone: _read has seen it, and the streams are told
            pass

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                if message[0] == "outputs":
                    _, outputs, self._stats, kv_events = message
                    self._route(outputs)
                    self._route_kv_events(kv_events)
                else:  # ("fatal", error): its last outputs follow
                    self._fatal(message[1])
        except (EOFError, OSError):
            if not self._stopping and self.fatal_error is None:  # it died: end what it ran, as it would have
                self._process.join(timeout=5)
                error = f"the engine process exited unexpectedly (code {self._process.exitcode})"
                self._fatal(error)
                with self._lock:
                    in_flight = list(self._sinks)
                self._route([RequestOutput(rid, finish_reason=FinishReason.ERROR, error=error) for rid in in_flight])


def _engine_process_main(build: Callable[[], LLMEngine], conn: Connection, log_level: int, log_format: str) -> None:
    """The engine process: build the engine, then step it on its thread while this one
    passes the server's requests on, until the server says stop or goes away. It logs
    as the server does."""
    configure_logging(log_level, log_format)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C drains the server, which then stops us
    try:
        engine = build()
    except Exception as e:
        try:
            conn.send(("failed", e))
        except Exception:  # (an exception that does not pickle)
            conn.send(("failed", RuntimeError(f"{type(e).__name__}: {e}")))
        return
    conn.send(("ready", engine.info))
    loop = EngineLoop(engine, publish=lambda outputs: conn.send(("outputs", outputs, engine.stats(),
                                                                  engine.take_kv_events())),
                      on_fatal=lambda error: conn.send(("fatal", error)))
    loop.start()
    try:
        while (message := conn.recv()) is not None:
            kind, arg = message
            if kind == "add":
                try:
                    engine.info.start_guide(arg)  # (here, not on the engine's thread: it takes milliseconds)
                except Exception as e:  # (checked in the server already: not expected)
                    conn.send(("outputs", [RequestOutput(arg.request_id, finish_reason=FinishReason.ERROR,
                                                         error=f"structured output: {e}")], engine.stats(), []))
                    continue
                loop.add(arg)
            elif kind == "reset_prefix_cache":
                loop.reset_prefix_cache()
            else:
                loop.abort(arg)
    except EOFError:  # the server is gone
        pass
    loop.stop()
