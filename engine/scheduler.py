"""Continuous batching: decide which tokens of which sequences run in the next step.

Every step gives each running sequence, oldest first, the tokens it still needs
(one for a decoding sequence; a chunk of its prompt for a prefilling one) within a
token budget, then admits waiting sequences while the budget, `max_num_seqs` and
the free blocks allow. When blocks run out, the newest running sequence is
preempted: its blocks are freed and it waits to be recomputed from scratch.
"""

from __future__ import annotations

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
    # when scheduled (the sequence grows a PENDING token as the step is launched).
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        preemptions_before = self.num_preemptions
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.all_sampled:  # its last token is still on its way back: nothing left to compute
                i += 1
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            end = seq.num_computed_tokens + n
            if self.block_manager.blocks_needed(seq, end):  # (most steps of a decode need none)
                if not self._make_room(seq, end):
                    break  # seq itself was the newest, and is now waiting
                self.block_manager.allocate(seq, end)
            batch.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n
            i += 1
        # After a preemption the pool is tight: admitting more would only thrash.
        admit = self.num_preemptions == preemptions_before
        while admit and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.can_allocate(seq, seq.num_computed_tokens + n):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n
        return batch

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Preempt the newest sequences until `seq` can hold `num_tokens`; False if `seq` went."""
        while not self.block_manager.can_allocate(seq, num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out, returning its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
