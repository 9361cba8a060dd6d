"""Continuous batching: decide which tokens of which sequences run in the next step.

Every step first gives each decoding sequence (one that needs a single token: its
next one), oldest first, that token, so that a running stream is never held up by
someone else's prompt. Prompts (prefills, and recomputations after a preemption)
share what is left of the token budget: running ones oldest first, then waiting
ones admitted in arrival order while `max_num_seqs` and the free blocks allow.
While several prompts want the budget, none takes more than half of it at first, and
what is left then goes to the same prompts in the same order; so a short request
arriving behind a long prompt starts in the next step, at little cost to the long one.

When a decode needs a block and none is free, the newest running sequence not yet
scheduled in this step is preempted: its blocks are freed and it waits to be
recomputed (its computed full blocks stay in the prefix cache, where it may find them
again). A prompt takes what the free blocks hold, and preempts only when not one more
token fits. A waiting sequence starts past the longest prefix of it that the prefix
cache holds (BlockManager): those tokens cost neither budget nor compute.

Admission may keep room for the outputs to come (`output_reserve`, as SGLang's
new-token ratio): a waiting sequence starts only if the free blocks hold the rest of
its prompt and of every running one, and `output_reserve` of each one's remaining
max_tokens (at most RESERVE_CLIP of them). At 0 admission fills the blocks and
decodes preempt when they run out; at 1 requests of up to RESERVE_CLIP output tokens
are never preempted. Engines take DEFAULT_OUTPUT_RESERVE: on the offline workload in
a 4 GB cache it removed all 137 preemptions and gave 18% more tokens/s than 0, and 0.5
fewer (bench/RESULTS.md).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed in this step
    num_tokens: int
    # Whether this step reaches the end of the sequence, and so yields a token: fixed
    # when scheduled (the sequence grows a pending token as the step is launched).
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens == self.seq.num_tokens


# A request's output counted by admission's reserve: at most this many tokens (a
# request without max_tokens may have the whole context left).
RESERVE_CLIP = 4096
DEFAULT_OUTPUT_RESERVE = 0.25  # engines' output_reserve, measured (the module's docstring)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 output_reserve: float = 0.0):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.output_reserve = output_reserve
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        chunks: dict[Sequence, int] = {}  # tokens of each scheduled sequence, in batch order
        preemptions_before = self.num_preemptions
        for seq in self.running:  # blocks that the steps so far have filled, for the prefix cache
            self.block_manager.cache_full_blocks(seq)
        for seq in list(self.running):  # decodes
            if budget == 0:
                break
            if seq.status is SequenceStatus.RUNNING and not seq.all_sampled and seq.num_uncomputed_tokens == 1:
                end = seq.num_computed_tokens + 1
                if self.block_manager.holds(seq, end) or self._make_room(seq, end, chunks):
                    chunks[seq] = 1
                    budget -= 1

        prompts = [s for s in self.running if s not in chunks and not s.all_sampled and s.num_uncomputed_tokens > 1]
        share = max(1, budget // 2) if len(prompts) + len(self.waiting) > 1 else budget
        scheduled_prompts = []
        for seq in prompts:
            if budget and seq.status is SequenceStatus.RUNNING:  # (not preempted by a prompt before it)
                n = self._fit(seq, min(share, budget), chunks)
                if n:
                    chunks[seq] = n
                    budget -= n
                    scheduled_prompts.append(seq)
        # After a preemption the pool is tight: admitting more would only thrash.
        admit = self.num_preemptions == preemptions_before
        reserved = sum(map(self._reserve, self.running)) if admit and self.waiting and self.output_reserve else 0
        while admit and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            self.block_manager.claim_cached_prefix(seq)
            n = min(seq.num_uncomputed_tokens, share, budget)
            reserved += self._reserve(seq) if self.output_reserve else 0
            if (not self.block_manager.can_allocate(seq, seq.num_computed_tokens + n)
                    or self.block_manager.num_free_blocks < reserved):
                self._release(seq)
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, seq.num_computed_tokens + n)
            self.block_manager.admitted(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks[seq] = n
            budget -= n
            scheduled_prompts.append(seq)
        for seq in scheduled_prompts:  # what is left, to the same prompts
            if budget == 0:
                break
            extra = self._fit(seq, budget, chunks, preempt=False)
            chunks[seq] += extra
            budget -= extra
        return [ScheduledSeq(seq, seq.num_computed_tokens, n) for seq, n in chunks.items()]

    def _reserve(self, seq: Sequence) -> int:
        """Blocks `seq` is expected to take beyond those it holds: the rest of its prompt
        and output_reserve of its remaining max_tokens (at most RESERVE_CLIP)."""
        output = self.output_reserve * min(seq.max_tokens - seq.num_generated, RESERVE_CLIP)
        expected = seq.num_tokens + math.ceil(output)
        return max(0, -(-expected // self.block_manager.block_size) - len(seq.block_table))

    def _fit(self, seq: Sequence, most: int, chunks: dict[Sequence, int], preempt: bool = True) -> int:
        """Allocate up to `most` more prompt tokens of `seq` (after those it has in
        `chunks`) within the free blocks; if not one fits, preempt newer unscheduled
        sequences for one (unless told not to). Returns how many."""
        start = seq.num_computed_tokens + chunks.get(seq, 0)
        wanted = min(most, seq.num_tokens - start)
        if wanted <= 0:
            return 0
        if self.block_manager.room(seq) <= start and not (preempt and self._make_room(seq, start + 1, chunks)):
            return 0
        n = min(wanted, self.block_manager.room(seq) - start)
        self.block_manager.allocate(seq, start + n)
        return n

    def _make_room(self, seq: Sequence, num_tokens: int, scheduled: dict[Sequence, int]) -> bool:
        """Let `seq` hold `num_tokens`, preempting the newest running sequences not in
        `scheduled` as needed; False if `seq` itself had to go (it is waiting now)."""
        while not self.block_manager.can_allocate(seq, num_tokens):
            victim = next(s for s in reversed(self.running) if s not in scheduled)  # (seq is a candidate: never empty)
            self.preempt(victim)
            if victim is seq:
                return False
        self.block_manager.allocate(seq, num_tokens)
        return True

    def _release(self, seq: Sequence, keep_cached: bool = True) -> None:
        """Give `seq`'s blocks back; it has computed nothing now."""
        self.block_manager.free(seq, keep_cached)
        seq.num_computed_tokens = 0

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, keep_cached: bool = True) -> None:
        """Take a finished or aborted sequence out, returning its blocks (not into the
        prefix cache unless `keep_cached`: after a failed step they may be wrong)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq, keep_cached)
        seq.status = SequenceStatus.FINISHED
