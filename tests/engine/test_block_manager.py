"""Invariants of the paged KV cache's bookkeeping under random scheduling histories.

A hypothesis state machine drives the real Scheduler and BlockManager (without a
model: a step only advances the sequences, writing each token's id where its keys and
values would go) through admits of prompts that share prefixes, steps, finishes,
aborts, failures, preemptions and prefix-cache resets. After every move reference
counts must equal the block tables holding each block, no block being written may be
shared, and every block must be held, evictable or free; every step must find, in
the cache, the tokens its sequences' earlier positions hold (whether computed or
claimed from the prefix cache). At the end every block must be free or evictable.
The blocks-stored and blocks-removed events, replayed, must always give exactly the
findable blocks, each stored with its parent's hash and its tokens.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine import block_manager
from engine.block_manager import BlockManager, BlocksRemoved, token_bytes
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence


class SchedulingMachine(RuleBasedStateMachine):
    OUTPUT_RESERVE = 0.0  # the scheduler's

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=24, block_size=4, record_events=True)
        self.mirror: dict[int, tuple[int, ...]] = {}  # the findable blocks, as the events tell
        self.scheduler = Scheduler(self.bm, max_num_seqs=5, max_num_batched_tokens=16, output_reserve=self.OUTPUT_RESERVE)
        self.count = 0
        self.cache = np.full(24 * 4, -1)  # the token id whose K/V each slot holds

    def live(self) -> list[Sequence]:
        return self.scheduler.running + list(self.scheduler.waiting)

    # prompts: one of a few shared prefixes, then tokens of their own
    @rule(shared=st.sampled_from([0, 3, 8, 13]), prefix=st.integers(0, 2), own=st.integers(0, 30),
          max_tokens=st.integers(1, 40))
    def admit(self, shared, prefix, own, max_tokens):
        self.count += 1
        prompt = [100 * prefix + i for i in range(shared)] + [1000 * self.count + i for i in range(own)] or [5]
        max_tokens = min(max_tokens, 24 * 4 - len(prompt)) or 1  # fits the cache, as admission guarantees
        self.scheduler.add(Sequence(f"r{self.count}", prompt, SamplingParams(), max_tokens))

    def slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        return np.array([self.bm.slot(seq, p) for p in range(start, end)], np.int64)

    @rule()
    def step(self):
        for s in self.scheduler.schedule():
            seq = s.seq
            end = s.start + s.num_tokens
            assert len(seq.block_table) * self.bm.block_size >= end
            assert self.cache[self.slots(seq, 0, s.start)].tolist() == seq.tokens(0, s.start), "read a wrong prefix"
            self.cache[self.slots(seq, s.start, end)] = seq.tokens(s.start, end)
            seq.num_computed_tokens += s.num_tokens
            if s.samples:
                seq.output_ids.append(7 + len(seq.output_ids) % 3)
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
    def fail(self, data):
        """A failed step: the sequence's blocks may hold anything, and are not cached."""
        seq = data.draw(st.sampled_from(self.scheduler.running))
        for i, block in enumerate(seq.block_table.tolist()):  # (it never writes a block another holds)
            if self.bm._refs[block] == 1:
                self.cache[block * 4 : (block + 1) * 4] = -2
        self.scheduler.finish(seq, keep_cached=False)

    @rule()
    def reset_prefix_cache(self):
        self.bm.reset_prefix_cache()

    @precondition(lambda self: self.scheduler.running)
    @rule(data=st.data())
    def preempt(self, data):
        self.scheduler.preempt(data.draw(st.sampled_from(self.scheduler.running)))

    @invariant()
    def events_tell_the_findable_blocks(self):
        for event in self.bm.take_events():
            if isinstance(event, BlocksRemoved):
                for h in event.block_hashes:
                    del self.mirror[h]  # (raises if it was not there)
                continue
            previous = event.parent_hash
            for i, h in enumerate(event.block_hashes):
                tokens = event.token_ids[4 * i : 4 * (i + 1)]
                assert block_manager.block_hash(previous or 0, token_bytes(tokens)) == h and h not in self.mirror
                self.mirror[h], previous = token_bytes(tokens), h
        assert self.mirror == {h: self.bm._hash_of[b][1] for h, b in self.bm._by_hash.items()}

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


class ReservingMachine(SchedulingMachine):
    """The same, with admission keeping room for half of each request's max_tokens."""
    OUTPUT_RESERVE = 0.5


TestScheduling = SchedulingMachine.TestCase
TestScheduling.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestReservingScheduling = ReservingMachine.TestCase
TestReservingScheduling.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


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


def admitted(bm: BlockManager, prompt: list[int]) -> Sequence:
    """A sequence admitted as the scheduler admits one: cached prefix first, then the rest."""
    seq = Sequence("s", prompt, SamplingParams(), 4)
    bm.claim_cached_prefix(seq)
    bm.allocate(seq, len(prompt))
    bm.admitted(seq)
    seq.num_computed_tokens = len(prompt)
    return seq


def test_a_cached_prefix_is_claimed_in_whole_blocks_and_never_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = admitted(bm, list(range(12)))
    blocks = first.block_table.tolist()
    bm.free(first)
    assert bm.num_evictable_blocks == 3
    again = admitted(bm, list(range(12)))  # all cached, but its last token is computed for its logits
    assert again.num_cached_tokens == 8 and again.block_table[:2].tolist() == blocks[:2]
    assert again.block_table[2] != blocks[2]
    longer = admitted(bm, list(range(12)) + [99, 98])  # two blocks shared with `again`, the third evictable
    assert longer.num_cached_tokens == 12 and longer.block_table[:3].tolist() == blocks
    assert bm.stats.queries == 12 + 12 + 14 and bm.stats.hits == 0 + 8 + 12
    bm.check_invariants([again, longer])


def test_evictable_blocks_are_reused_least_recently_used_and_a_prefix_tail_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = admitted(bm, list(range(8))), admitted(bm, list(range(100, 108)))
    a_blocks = a.block_table.tolist()
    bm.free(a)
    bm.free(b)
    c = Sequence("c", list(range(200, 204)), SamplingParams(), 1)
    bm.allocate(c, 4)  # nothing is free: the least recently released, a's tail
    assert c.block_table.tolist() == a_blocks[1:]
    assert admitted(bm, list(range(8)) + [1]).num_cached_tokens == 4  # a's head is still found


def test_a_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(block_manager, "block_hash", lambda previous, tokens: 42)
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.free(admitted(bm, [1, 2, 3, 4, 5]))
    assert admitted(bm, [6, 7, 8, 9, 10]).num_cached_tokens == 0


def test_without_prefix_caching_nothing_is_kept():
    bm = BlockManager(num_blocks=8, block_size=4, prefix_caching=False)
    bm.free(admitted(bm, list(range(9))))
    assert bm.num_evictable_blocks == 0 and admitted(bm, list(range(9))).num_cached_tokens == 0


def test_a_flush_drops_only_what_no_sequence_holds():
    bm = BlockManager(num_blocks=16, block_size=4)
    held = admitted(bm, list(range(9)))
    bm.cache_full_blocks(held)  # (as the scheduler does each step)
    bm.free(admitted(bm, list(range(100, 109))))
    assert bm.reset_prefix_cache() == 2
    assert admitted(bm, list(range(9))).num_cached_tokens == 8  # still held, still found
    assert admitted(bm, list(range(100, 109))).num_cached_tokens == 0
