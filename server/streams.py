"""Engine outputs, from the engine thread to the RPC handlers on the asyncio loop.

The engine thread posts each request's outputs as a step ends; the loop is woken once
for everything posted since its last wakeup, however many streams there are, so the
cost to the engine thread does not grow with thread hand-offs per stream.
"""

from __future__ import annotations

import asyncio
import collections
import threading

from engine.output import RequestOutput


class OutputHub:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[AsyncOutputs, RequestOutput]] = []

    def outputs(self) -> AsyncOutputs:
        """A new request's output queue (call on the loop)."""
        return AsyncOutputs(self)

    def _post(self, outputs: AsyncOutputs, out: RequestOutput) -> None:  # the engine thread
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
    """One request's outputs. `put` is called by the engine thread; `get` is awaited on
    the loop and returns everything that arrived since the last get as one output, so a
    reader that falls behind gets fewer, larger deltas and loses nothing."""

    def __init__(self, hub: OutputHub):
        self._hub = hub
        self._items: collections.deque[RequestOutput] = collections.deque()
        self._ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        self._hub._post(self, out)

    def _arrived(self, out: RequestOutput) -> None:
        self._items.append(out)
        self._ready.set()

    async def get(self, timeout: float) -> RequestOutput:
        """The next output, coalesced; TimeoutError if none comes within `timeout` s."""
        while not self._items:
            self._ready.clear()
            await asyncio.wait_for(self._ready.wait(), timeout)
        out = self._items.popleft()
        while self._items and not out.finished:
            out.absorb(self._items.popleft())
        return out
