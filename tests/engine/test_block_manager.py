"""Invariants of the paged KV cache's bookkeeping under random scheduling histories.

A hypothesis state machine drives the real Scheduler and BlockManager (without a
model: a step only advances the sequences) through admits, steps, finishes, aborts
and preemptions, and after every move checks that no block has two owners and
that every block is either free or owned. At the end every block must be free.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence


class SchedulingMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=24, block_size=4)
        self.scheduler = Scheduler(self.bm, max_num_seqs=5, max_num_batched_tokens=16)
        self.count = 0

    def live(self) -> list[Sequence]:
        return self.scheduler.running + list(self.scheduler.waiting)

    @rule(prompt_len=st.integers(1, 40), max_tokens=st.integers(1, 40))
    def admit(self, prompt_len, max_tokens):
        max_tokens = min(max_tokens, 24 * 4 - prompt_len) or 1  # fits the cache, as admission guarantees
        self.count += 1
        seq = Sequence(f"r{self.count}", list(range(prompt_len)), SamplingParams(), max_tokens)
        self.scheduler.add(seq)

    @rule()
    def step(self):
        for s in self.scheduler.schedule():
            seq = s.seq
            assert len(seq.block_table) * self.bm.block_size >= s.start + s.num_tokens
            seq.num_computed_tokens += s.num_tokens
            if s.samples:
                seq.output_ids.append(7)
                if len(seq.output_ids) >= seq.max_tokens:
                    self.scheduler.finish(seq)

    @precondition(lambda self: self.scheduler.running)
    @rule(data=st.data())
    def finish_running(self, data):
        self.scheduler.finish(data.draw(st.sampled_from(self.scheduler.running)))

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def abort_any(self, data):
        self.scheduler.finish(data.draw(st.sampled_from(self.live())))

    @precondition(lambda self: self.scheduler.running)
    @rule(data=st.data())
    def preempt(self, data):
        self.scheduler.preempt(data.draw(st.sampled_from(self.scheduler.running)))

    @invariant()
    def blocks_have_one_owner(self):
        self.bm.check_invariants(self.live())
        for seq in self.scheduler.running:
            assert len(seq.block_table) * self.bm.block_size >= seq.num_computed_tokens

    def teardown(self):
        # Everything admitted must finish without help: the oldest sequence always
        # progresses, so the work left bounds the steps (recomputes included).
        work = sum(s.num_tokens + s.max_tokens for s in self.live())
        for _ in range(work * len(self.live()) + 1):
            if not self.scheduler.has_work():
                break
            self.step()
        assert not self.scheduler.has_work(), "the scheduler stalled"
        assert self.bm.num_free_blocks == self.bm.num_blocks, "blocks leaked"


TestScheduling = SchedulingMachine.TestCase
TestScheduling.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_allocate_refuses_more_than_is_free():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = Sequence("a", [1] * 9, SamplingParams(), 1)
    assert not bm.can_allocate(seq, 9)
    with pytest.raises(RuntimeError, match="can_allocate"):
        bm.allocate(seq, 9)
    assert bm.num_free_blocks == 2


def test_slots_follow_the_block_table():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = Sequence("a", [1] * 5, SamplingParams(), 1), Sequence("b", [1] * 3, SamplingParams(), 1)
    bm.allocate(a, 4)
    bm.allocate(b, 3)
    bm.allocate(a, 5)  # a's second block comes after b's first
    assert a.block_table.tolist() == [0, 2] and b.block_table.tolist() == [1]
    assert [bm.slot(a, p) for p in range(5)] == [0, 1, 2, 3, 8]
