"""A request's state inside the engine: its tokens, its KV blocks, its output so far."""

from __future__ import annotations

import enum
import functools
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured import Guide


NO_BLOCKS = np.empty(0, np.int32)  # the block table of a sequence that holds none
NO_BLOCKS.flags.writeable = False


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # eos, a stop string or a stop token
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # an engine fault in a step this sequence was part of


@dataclass(eq=False)  # compared by identity: the scheduler's lists look sequences up
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: the default or the request's, within the context
    eos_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)  # the generated tokens back on the host
    # Tokens sampled by steps still in flight, after output_ids (at most one a step in
    # flight). A step's input may be the first of them: the backend that sampled it
    # reads it from its own previous step.
    num_pending: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: np.ndarray = field(default_factory=lambda: NO_BLOCKS)  # int32 block ids (see BlockManager)
    # the prefix cache's view (BlockManager): hashes of the full blocks of known tokens
    # computed so far, how many of its blocks are registered, and the prompt tokens
    # found cached at its first admission
    block_hashes: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    # structured output: the checked grammar of params.constraint, and where the output
    # is in it (a guide is rebuilt from the grammar where the sequence goes to another
    # process; recomputing its tokens after a preemption leaves it as it is)
    grammar: str | None = None
    guide: Guide | None = field(default=None, repr=False)
    seed: int = field(init=False)  # the request's, or a random one

    def __post_init__(self) -> None:
        self.seed = self.params.seed if self.params.seed is not None else random.getrandbits(64)

    @functools.cached_property
    def rng(self) -> np.random.Generator:
        """Philox, seeded per request: draws do not depend on the rest of the batch. Built
        on first use (~20 µs): the CPU backends sample with it, the GPU from the seed alone."""
        return np.random.Generator(np.random.Philox(self.seed))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "guide": None}  # (llguidance's matcher does not pickle)

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of prompt + output (none of them pending), without
        building the whole list."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    def step_tokens(self, start: int, end: int) -> tuple[list[int], bool]:
        """The known tokens of positions start..end-1, and whether the one at end-1 is
        pending instead (then it is not in the list)."""
        known = len(self.prompt_ids) + len(self.output_ids)
        if start >= known:  # (a decode of its pending token: the common case, with nothing to read)
            return [], end > known
        return self.tokens(start, min(end, known)), end > known

    # (The counts below are read several times per sequence per step: each is spelled
    # out rather than built on the others, which halves their cost.)
    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_generated(self) -> int:
        """Tokens sampled so far, pending ones included."""
        return len(self.output_ids) + self.num_pending

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def all_sampled(self) -> bool:
        """Whether every token it may generate has been sampled (some maybe still pending)."""
        return len(self.output_ids) + self.num_pending >= self.max_tokens

    def drop_pending(self) -> None:
        """Forget the pending tokens (the sequence ended before they came back)."""
        self.num_pending = 0

    def banned_token_ids(self) -> list[int]:
        """Tokens that would end the sequence before min_tokens (unless its grammar
        allows nothing else: a complete structure ends it)."""
        if self.num_generated >= self.params.min_tokens or (self.guide is not None and self.guide.must_stop):
            return []
        return self.eos_token_ids + self.params.stop_token_ids
