"""The engine: admit requests, run one continuous-batching step at a time, emit deltas.

Not thread-safe: one thread (EngineLoop's) owns it, and with it the backend. Its
facts for serving (EngineInfo) and its load (EngineStats) travel to other threads
and processes.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from engine.backends.base import MAX_STEPS_IN_FLIGHT, Backend, SampleLater, Wait
from engine.block_manager import BlockManager, KvEvent
from engine.config import ModelConfig
from engine.model_loader import LoadedModel
from engine.output import OutputStream, RequestOutput, Usage
from engine.sampling_params import DEFAULT_MAX_TOKENS, InvalidRequest, SamplingParams
from engine.scheduler import DEFAULT_OUTPUT_RESERVE, ScheduledSeq, Scheduler
from engine.sequence import FinishReason, Sequence
from engine.structured import (DEFAULT_MAX_GRAMMAR_BYTES, FillingMasks, Guide, GuideCompiler, accept_tokens,
                               fill_masks, start_filling_masks)
from engine.tokenizer import Tokenizer

log = logging.getLogger("llamastream.engine")


@dataclass
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's, within the KV cache
    enable_prefix_caching: bool = True
    output_reserve: float = DEFAULT_OUTPUT_RESERVE  # admission's room for outputs to come (Scheduler), 0 to 1
    record_kv_events: bool = False  # for take_kv_events (a gateway's cache-aware routing)
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES  # the largest structured-output constraint taken


@dataclass(frozen=True)
class EngineInfo:
    """What serving needs to know of an engine, fixed once it is built: enough to check
    and build requests without it (it may run in another process)."""

    model_name: str
    config: ModelConfig
    tokenizer: Tokenizer
    backend_name: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    guides: GuideCompiler
    prefix_caching: bool
    weight_format: str  # the checkpoint's layers (LoadedModel.weight_format)
    weight_dtype: str  # what the backend computes with them in
    weight_bytes: int  # as the backend holds them
    kv_cache_dtype: str

    def make_sequence(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Check a request against the model and the context; raise InvalidRequest if it
        cannot run. A structured-output constraint is compiled here (milliseconds, off
        the engine's thread: the caller's)."""
        vocab = self.config.vocab_size
        params.validate(vocab)
        if not prompt_ids:
            raise InvalidRequest("the input is empty: send a non-empty prompt, chat or token_ids")
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:  # (builtins: a long prompt's check stays short)
            bad = next(t for t in prompt_ids if not 0 <= t < vocab)
            raise InvalidRequest(f"token_ids: {bad} is outside the vocabulary [0, {vocab})")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise InvalidRequest(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.max_model_len}, "
                "including at least one generated token: shorten the prompt"
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequest(
                f"stop.max_tokens is {params.max_tokens} but only {room} tokens fit after the "
                f"{len(prompt_ids)}-token prompt in the {self.max_model_len}-token context"
            )
        max_tokens = params.max_tokens or min(DEFAULT_MAX_TOKENS, room)
        if params.min_tokens > max_tokens:
            raise InvalidRequest(f"stop.min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens that fit")
        seq = Sequence(request_id, list(prompt_ids), params, max_tokens, eos_token_ids=self.tokenizer.eos_token_ids)
        if params.constraint is not None:
            seq.grammar = self.guides.grammar(params.constraint)
            self.start_guide(seq)
        return seq

    def start_guide(self, seq: Sequence) -> None:
        """Give a sequence with a grammar its guide, if it has none (it lost it on its way
        to the engine's process)."""
        if seq.grammar is not None and seq.guide is None:
            seq.guide = self.guides.guide(seq.grammar)


@dataclass
class InFlightStep:
    """A batch queued on the backend, and what waits for its samples. A batch whose
    structured outputs' masks need the tokens of the step before it is queued without
    its sampling (`wait` None): once those tokens are back its masks start filling
    (`masks`) and `sample` queues its sampling with them, before the next batch is
    queued (a GPU queues it at once, to run once the masks are done)."""

    batch: list[ScheduledSeq]
    wait: Wait | None
    sample: SampleLater | None = None
    masks: FillingMasks | None = None

    def queue_sampling(self) -> None:
        self.wait = self.sample(self.masks)


@dataclass(frozen=True)
class EngineStats:
    """The engine's load, for metrics and for checks that nothing leaked."""

    running: int
    waiting: int
    kv_blocks_free: int  # free or evictable (cached, held by no sequence)
    num_preemptions: int
    live_requests: int
    kv_blocks_evictable: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, found there


class LLMEngine:
    def __init__(self, model: LoadedModel, backend: Backend, config: EngineConfig):
        self.model = model
        self.tokenizer = model.tokenizer
        self.backend = backend
        self.config = config
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                          config.record_kv_events)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.output_reserve)
        max_model_len = self._context_length(model.config.max_position_embeddings)
        backend.allocate_kv_cache(config.num_kv_blocks, config.block_size, config.max_num_seqs, max_model_len)
        self.info = EngineInfo(
            model_name=model.name, config=model.config, tokenizer=model.tokenizer, backend_name=backend.name,
            max_model_len=max_model_len, num_kv_blocks=config.num_kv_blocks, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            guides=GuideCompiler(model.tokenizer, model.config.vocab_size, config.max_grammar_bytes),
            prefix_caching=config.enable_prefix_caching, weight_format=model.weight_format,
            weight_dtype=backend.weight_dtype, weight_bytes=backend.weight_bytes, kv_cache_dtype=backend.kv_cache_dtype)
        self._streams: dict[str, OutputStream] = {}
        # batches launched and not yet ended, oldest first, each with what waits for its samples
        self._in_flight: deque[InFlightStep] = deque()  # launched, not yet ended, oldest first
        self._launching: list[ScheduledSeq] = []  # a batch being queued on the backend
        self._unsent: list[OutputStream] = []  # streams with recorded tokens not yet emitted
        self._with_penalties = 0  # live requests whose sampling reads their earlier tokens
        self._mask_buffers: list[np.ndarray] = []  # made on first use, taken in turn: see _mask_buffer

    def _context_length(self, model_context: int) -> int:
        """The model's context, or max_model_len, within the KV cache; says why if it is less than asked."""
        asked = self.config.max_model_len
        cache_tokens = self.config.num_kv_blocks * self.config.block_size
        length = min(model_context, cache_tokens, asked or model_context)
        if asked and asked > length:
            limit = "the model's context" if length == model_context else "what the KV cache holds"
            log.warning("--max-model-len %d is more than %s: the context is %d tokens", asked, limit, length)
        elif length < model_context and not asked:
            log.warning("the KV cache holds %d tokens, less than the model's %d-token context: the context is %d "
                        "(more KV-cache memory gives more)", cache_tokens, model_context, length)
        return length

    # -- admission (pure: safe to call from any thread) -------------------------
    def make_sequence(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        return self.info.make_sequence(request_id, prompt_ids, params)

    # -- the engine thread's side -----------------------------------------------
    def add(self, seq: Sequence) -> None:
        self._streams[seq.request_id] = OutputStream(seq, self.tokenizer)
        self._with_penalties += seq.params.has_penalties
        self.scheduler.add(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._in_flight) or bool(self._unsent)

    def abort(self, request_id: str) -> RequestOutput | None:
        stream = self._streams.get(request_id)
        if stream is None:
            return None
        return self._finish(stream.seq, RequestOutput(request_id, finish_reason=FinishReason.ABORT))

    def step(self) -> list[RequestOutput]:
        """Run one batch; return its deltas (finished requests' last ones included)."""
        self.begin_step()
        while self._in_flight:
            self.end_step()
        return self.emit()

    def step_overlapped(self, on_deltas: Callable[[list[RequestOutput]], None]) -> bool:
        """One step with the host's work hidden under the device's: schedule and launch
        a batch while the previous one still runs (the tokens that one samples reach
        this one on the device: see Sequence.num_pending), then end the previous batch and hand its
        deltas to `on_deltas` while the device computes this one. Deltas come out one
        call late (has_work() stays true until they have). False if no batch ran.
        Requests with penalties need their tokens on the host before the next
        sampling: while any runs, a batch is ended before the next is scheduled."""
        if self._with_penalties:
            while self._in_flight:
                self.end_step()
        launched = self.begin_step()
        if len(self._in_flight) >= MAX_STEPS_IN_FLIGHT or (self._in_flight and not launched):
            self.end_step()
        on_deltas(self.emit())
        return launched

    # The parts of a step: begin_step, end_step, emit.
    def begin_step(self) -> bool:
        """Schedule a batch and queue it on the backend; False if nothing was scheduled.
        Its sampled tokens are pending until end_step. Where a structured output's last
        token is still pending, its mask cannot be known yet: the forward pass is queued
        now, and the sampling once end_step has that token, to run on the device when
        another thread has filled the masks (meanwhile the device computes the forward
        pass, and the engine's thread emits and schedules the next batch)."""
        batch = self.scheduler.schedule()
        if not batch:
            return False
        self._launching = batch
        guided = [s for s in batch if s.samples and s.seq.guide is not None]
        if any(s.seq.num_pending for s in guided):
            step = InFlightStep(batch, None, self.backend.launch_forward(batch))
        else:
            step = InFlightStep(batch, self.backend.launch(batch, self._masks(batch) if guided else None))
        self._launching = []
        for scheduled in batch:
            if scheduled.samples:
                scheduled.seq.num_pending += 1
            scheduled.seq.num_computed_tokens += scheduled.num_tokens
        self._in_flight.append(step)
        return True

    def _masks(self, batch: list[ScheduledSeq]) -> np.ndarray:
        """The allowed tokens of each sampling sequence with a guide, in order (engine/structured)."""
        return fill_masks(self._guides(batch), self.model.config.vocab_size, self._mask_buffer())

    def _mask_buffer(self) -> np.ndarray:
        """Memory for a step's masks that the backend uploads without waiting. Steps take
        the buffers in turn: a step's masks are filled when at most one step before it
        is in flight, so the buffer it takes was last a step's that has ended."""
        if not self._mask_buffers:
            shape = (self.config.max_num_seqs, -(-self.model.config.vocab_size // 32))
            self._mask_buffers = [self.backend.host_array(shape, np.int32) for _ in range(MAX_STEPS_IN_FLIGHT)]
        self._mask_buffers.append(self._mask_buffers.pop(0))
        return self._mask_buffers[0]

    @staticmethod
    def _guides(batch: list[ScheduledSeq]) -> list[Guide]:
        return [s.seq.guide for s in batch if s.samples and s.seq.guide is not None]

    def end_step(self) -> None:
        """Wait for the oldest batch in flight, record its tokens and take the sequences
        that hit a stop token, their grammar's end or their length out of the schedule.
        If the next batch's sampling waits for these tokens, its masks start filling and
        its sampling is queued. Deltas wait for emit()."""
        step = self._in_flight[0]
        if step.wait is None:
            step.queue_sampling()
        samples = step.wait()
        self._in_flight.popleft()
        taken = [(scheduled.seq, sample) for scheduled, sample in zip(step.batch, samples)
                 if sample is not None and not scheduled.seq.is_finished]  # (one that ended while this batch ran: dropped)
        accepted = [(seq.guide, sample.token_id) for seq, sample in taken if seq.guide is not None]
        waiting = self._in_flight[0] if self._in_flight else None
        masks_wait = waiting is not None and waiting.wait is None
        if masks_wait:
            waiting.masks = start_filling_masks(self._guides(waiting.batch), self.model.config.vocab_size,
                                                self._mask_buffer(), accepted)
        else:
            accept_tokens(accepted)
        for seq, sample in taken:
            stream = self._streams[seq.request_id]
            if stream.record(sample):
                self.scheduler.finish(seq)
            self._unsent.append(stream)
        if masks_wait:  # (after the tokens are recorded: a CPU waits here for the masks, which may raise)
            waiting.queue_sampling()

    def emit(self) -> list[RequestOutput]:
        """The deltas of the tokens recorded since the last call."""
        outputs = []
        for stream in self._unsent:
            if self._streams.get(stream.seq.request_id) is stream:  # (not aborted or failed since)
                out = stream.emit()
                outputs.append(self._finish(stream.seq, out) if out.finished else out)
        self._unsent = []
        return outputs

    def fail_step(self, error: str) -> list[RequestOutput]:
        """After begin_step, end_step or emit raised: end the requests they were working
        on with an error; the rest go on."""
        launched = [s.seq for step in self._in_flight for s in step.batch]
        doomed = launched + [s.seq for s in self._launching] + [stream.seq for stream in self._unsent]
        failed = [
            self._finish(seq, RequestOutput(seq.request_id, finish_reason=FinishReason.ERROR, error=error))
            for seq in doomed
            if seq.request_id in self._streams  # (checked as the list is built: each fails once)
        ]
        for step in self._in_flight:  # (masks being filled read their guides: let them finish)
            if step.masks is not None:
                step.masks.done.exception()
        self._in_flight.clear()
        self._launching, self._unsent = [], []
        return failed

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every live request with an error (the backend can no longer run)."""
        return [
            self._finish(stream.seq, RequestOutput(rid, finish_reason=FinishReason.ERROR, error=error))
            for rid, stream in list(self._streams.items())
        ]

    def _finish(self, seq: Sequence, out: RequestOutput) -> RequestOutput:
        self.scheduler.finish(seq, keep_cached=out.finish_reason is not FinishReason.ERROR)
        seq.drop_pending()
        self._with_penalties -= seq.params.has_penalties
        del self._streams[seq.request_id]
        now = time.monotonic()
        first = seq.first_token_time or now
        out.usage = Usage(
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids),
            time_to_first_token_ms=(first - seq.arrival_time) * 1e3,
            total_ms=(now - seq.arrival_time) * 1e3,
            cached_tokens=seq.num_cached_tokens,
        )
        return out

    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.block_manager
        return EngineStats(len(s.running), len(s.waiting), bm.num_free_blocks, s.num_preemptions, len(self._streams),
                           bm.num_evictable_blocks, bm.stats.queries, bm.stats.hits)

    def reset_prefix_cache(self) -> int:
        """Forget the cached prefixes no request holds; returns the blocks freed."""
        return self.block_manager.reset_prefix_cache()

    def take_kv_events(self) -> list[KvEvent]:
        """The prefix cache's blocks stored and removed since the last call (with
        EngineConfig.record_kv_events)."""
        return self.block_manager.take_events()
