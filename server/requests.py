"""What every generation service does with a request between its wire format and the
engine, whichever service it is: refuse it while loading, draining or full; prepare it
(tokenize) off the event loop; submit it; relay the engine's outputs, ending the call
with the right status when the engine fails, the client reads too slowly or the
shutdown cuts the stream; free it if the call ends early; and note it for the metrics
and the request log. A servicer only translates messages around this.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, TypeVar

import grpc

from engine.output import RequestOutput
from engine.sequence import FinishReason, Sequence
from server.engine_client import DuplicateRequest, EngineClient
from server.observability import Observer, RequestRecord
from server.streams import AsyncOutputs, EngineStopped, OutputHub, StreamBacklogExceeded

log = logging.getLogger("llamastream.server")
PREPARE_THREADS = 4  # requests tokenized at once (the tokenizer releases the GIL)
# A call cancelled this close to its deadline ended by it: the client's clock started
# first, so its expiry can reach a busy server as a cancellation before the server's own.
DEADLINE_SLACK_S = 0.25
T = TypeVar("T")


class Requests:
    def __init__(self, engine: EngineClient, hub: OutputHub, observer: Observer, max_in_flight: int,
                 log_prompts: bool = False):
        self.engine, self.hub, self.observer = engine, hub, observer
        self.max_in_flight = max_in_flight
        self.log_prompts = log_prompts  # prompts are never logged otherwise
        self.accepting = threading.Event()  # set once warmed up; cleared when draining
        self.draining = threading.Event()  # set when draining begins
        # Tokenizing and rendering a chat take up to seconds for megabytes of prompt: off
        # the event loop, which every stream and health check shares.
        self._prepare = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="prepare")
        self._owners: dict[str, str | None] = {}  # in-flight request id -> who may abort it (caller_identity)
        self._cut: set[str] = set()  # requests ended by the shutdown (cut_all)

    def close(self) -> None:
        self._prepare.shutdown(wait=False, cancel_futures=True)

    @contextlib.asynccontextmanager
    async def call(self, context: grpc.aio.ServicerContext) -> AsyncIterator[RequestRecord]:
        """The record of one generation call, logged and counted when the call ends
        however it ends (a client that went away, or whose deadline passed, included)."""
        record = RequestRecord("-")  # (until the request's id is known to be fit to log)
        try:
            yield record
        except (asyncio.CancelledError, GeneratorExit):
            if not record.ended:
                remaining = context.time_remaining()
                expired = remaining is not None and remaining <= DEADLINE_SLACK_S
                record.status = "DEADLINE_EXCEEDED" if expired else "CANCELLED"
            raise
        finally:
            self.observer.finished(record)

    async def refuse(self, context: grpc.aio.ServicerContext, record: RequestRecord, code: grpc.StatusCode,
                     details: str) -> None:
        """End the call with `code`, noting it for the metrics and the request log."""
        record.status, record.ended = code.name, True
        await context.abort(code, details)

    async def check_available(self, context: grpc.aio.ServicerContext, record: RequestRecord) -> None:
        if not self.accepting.is_set():
            await self.refuse(context, record, grpc.StatusCode.UNAVAILABLE,
                              "the server is loading or draining: retry shortly, or another replica")
        if not self.engine.alive:
            await self.refuse(context, record, grpc.StatusCode.UNAVAILABLE,
                              f"the engine has stopped: {self.engine.fatal_error or 'restart the server'}")

    async def prepare(self, work: Callable[..., T], *args) -> T:
        """`work(*args)` on the preparing threads (tokenizing: off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._prepare, work, *args)

    async def outputs(self, seq: Sequence, context: grpc.aio.ServicerContext,
                      record: RequestRecord) -> AsyncIterator[RequestOutput | None]:
        """Submit `seq` and yield None once the engine has it (a service may announce the
        request then), then its outputs until the last. A fault, a slow reader or the
        shutdown ends the call with INTERNAL, RESOURCE_EXHAUSTED or UNAVAILABLE (a cut
        stream gets what it had generated first, without a finish)."""
        request_id = seq.request_id
        await self.check_available(context, record)  # (again: preparing may have taken a while)
        if self.engine.num_in_flight() >= self.max_in_flight:
            await self.refuse(context, record, grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{self.max_in_flight} requests are in flight, the most this server queues: retry with backoff")
        if self.log_prompts:
            log.info("request %s prompt: %r", request_id, self.engine.info.tokenizer.decode(seq.prompt_ids))
        outputs = self.hub.outputs(on_overflow=lambda: self.engine.abort(request_id))
        try:
            self.engine.submit(seq, outputs)
        except DuplicateRequest as e:
            await self.refuse(context, record, grpc.StatusCode.ALREADY_EXISTS, str(e))
        self._owners[request_id] = caller_identity(context)
        try:
            record.prompt_tokens = len(seq.prompt_ids)
            yield None
            while not record.ended:
                out = await self._next_output(outputs, context, record)
                if out.finish_reason is FinishReason.ERROR:
                    await self.refuse(context, record, grpc.StatusCode.INTERNAL, out.error or "engine fault")
                record.completion_tokens += len(out.token_ids)
                if out.finish_reason is FinishReason.ABORT and request_id in self._cut:
                    out.finish_reason = None
                    yield out
                    await self.refuse(context, record, grpc.StatusCode.UNAVAILABLE,
                                      f"the server is shutting down: the stream was cut after {record.completion_tokens} "
                                      "tokens; retry on another replica")
                if out.finished:
                    record.finish_reason, record.usage = out.finish_reason.name.lower(), out.usage
                    record.ended = True
                yield out
        finally:  # a cancel, a deadline or a failed write ends the RPC early: free the sequence
            if not record.ended:
                self.engine.abort(request_id)
            self._owners.pop(request_id, None)
            self._cut.discard(request_id)

    async def _next_output(self, outputs: AsyncOutputs, context: grpc.aio.ServicerContext,
                           record: RequestRecord) -> RequestOutput:
        try:
            return await outputs.get()
        except StreamBacklogExceeded as e:
            await self.refuse(context, record, grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"the client read too slowly: {e}; read the stream as it arrives "
                              "(the server's --max-stream-backlog sets the limit)")
        except EngineStopped as e:
            await self.refuse(context, record, grpc.StatusCode.INTERNAL, f"the engine stopped: {e}")

    def abort(self, context: grpc.aio.ServicerContext, request_ids) -> int:
        """Abort the named requests that the caller may abort: with mutual TLS, those made
        with the same client certificate; otherwise any (see caller_identity)."""
        caller = caller_identity(context)
        mine = [rid for rid in set(request_ids) if rid in self._owners and self._owners[rid] == caller]
        return sum(self.engine.abort(rid) for rid in mine)

    def cut_all(self) -> int:
        """End every stream still in flight (the shutdown's grace has run out): each ends
        with UNAVAILABLE saying how many tokens it was sent. Returns how many."""
        in_flight = list(self._owners)
        self._cut.update(in_flight)
        for request_id in in_flight:
            self.engine.abort(request_id)
        return len(in_flight)


def caller_identity(context: grpc.aio.ServicerContext) -> str | None:
    """Who is calling, as far as the transport says: the client certificate under mutual
    TLS, else None. A bearer token is one identity shared by all who hold it, so without
    client certificates every caller is the same one."""
    certificate = context.auth_context().get("x509_pem_cert")
    return certificate[0].decode() if certificate else None
