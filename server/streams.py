"""Engine outputs, from the thread that routes them to the RPC handlers on the asyncio loop.

That thread (the engine's, or the one reading the engine process's outputs) posts
each request's outputs as a step ends; the loop is woken once for everything posted
since its last wakeup, however many streams there are, so the cost to that thread
does not grow with thread hand-offs per stream.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable

from engine.output import RequestOutput
from server.engine_client import EngineClient


class StreamBacklogExceeded(Exception):
    """The client left more than the allowed number of tokens unread."""


class EngineStopped(Exception):
    """The engine stopped while a stream waited for it."""


class OutputHub:
    def __init__(self, loop: asyncio.AbstractEventLoop, max_backlog: int):
        self._loop = loop
        self.max_backlog = max_backlog
        self._lock = threading.Lock()
        self._pending: list[tuple[AsyncOutputs, RequestOutput]] = []
        self._waiting: set[AsyncOutputs] = set()  # streams awaiting their next output
        self.engine_error: str | None = None  # once the engine is found stopped

    async def watch(self, engine: EngineClient, interval: float) -> None:
        """Check every `interval` s that the engine runs; once it does not, wake every
        waiting stream with EngineStopped. (The engine ends its requests itself when it
        can; this is for when it could not.)"""
        while engine.alive:
            await asyncio.sleep(interval)
        self.engine_error = engine.fatal_error or "the engine exited"
        for outputs in list(self._waiting):
            outputs._wake()

    def outputs(self, on_overflow: Callable[[], None]) -> AsyncOutputs:
        """A new request's output queue (call on the loop); `on_overflow` runs on the
        loop if the reader leaves more than `max_backlog` tokens unread."""
        return AsyncOutputs(self, on_overflow)

    def _post(self, outputs: AsyncOutputs, out: RequestOutput) -> None:  # the routing thread
        with self._lock:
            self._pending.append((outputs, out))
            if len(self._pending) > 1:  # a wakeup is on its way
                return
        self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:  # the loop
        with self._lock:
            pending, self._pending = self._pending, []
        for outputs, out in pending:
            outputs._arrived(out)


class AsyncOutputs:
    """One request's outputs. `put` is called by the routing thread; `get` is awaited on
    the loop and returns everything that arrived since the last get as one output, so a
    reader that falls behind gets fewer, larger deltas and loses nothing, up to the
    hub's backlog limit: past it the queue is dropped and `on_overflow` called (to free
    the request's engine resources at once), and `get` raises StreamBacklogExceeded."""

    def __init__(self, hub: OutputHub, on_overflow: Callable[[], None]):
        self._hub = hub
        self._on_overflow = on_overflow
        self._items: collections.deque[RequestOutput] = collections.deque()
        self._backlog = 0  # tokens queued
        self._overflowed = False
        self._waiter: asyncio.Future | None = None  # (a bare future: far cheaper than an Event with a timeout)

    def put(self, out: RequestOutput) -> None:  # the routing thread
        self._hub._post(self, out)

    def _arrived(self, out: RequestOutput) -> None:
        if self._overflowed:
            return
        self._items.append(out)
        self._backlog += len(out.token_ids)
        if self._backlog > self._hub.max_backlog and not out.finished:
            self._overflowed = True
            self._items.clear()
            self._on_overflow()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> RequestOutput:
        """The next output, coalesced. Raises StreamBacklogExceeded past the backlog
        limit, and EngineStopped if the engine stops first."""
        while not self._items and not self._overflowed:
            if self._hub.engine_error is not None:
                raise EngineStopped(self._hub.engine_error)
            self._waiter = self._hub._loop.create_future()
            self._hub._waiting.add(self)
            try:
                await self._waiter
            finally:
                self._waiter = None
                self._hub._waiting.discard(self)
        if self._overflowed:
            raise StreamBacklogExceeded(f"more than {self._hub.max_backlog} tokens of the stream were left unread")
        out = self._items.popleft()
        while self._items and not out.finished:
            out.absorb(self._items.popleft())
        self._backlog -= len(out.token_ids)  # (out holds every token it absorbed)
        return out
