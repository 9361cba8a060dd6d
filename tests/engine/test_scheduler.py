"""The scheduler's order within a step: decodes first, then prompts sharing the rest of
the budget (driven without a model: a step only advances the sequences)."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence


def sequence(name: str, prompt_len: int, max_tokens: int = 100) -> Sequence:
    """A sequence whose prompt shares no prefix with another name's (nothing is cached)."""
    first = 1000 * sum(map(ord, name))
    return Sequence(name, list(range(first, first + prompt_len)), SamplingParams(), max_tokens)


def step(scheduler: Scheduler) -> dict[str, int]:
    """One step: {request id: tokens scheduled}; sampled tokens come back at once."""
    batch = scheduler.schedule()
    for s in batch:
        s.seq.num_computed_tokens += s.num_tokens
        if s.samples:
            s.seq.output_ids.append(7)
    return {s.seq.request_id: s.num_tokens for s in batch}


def test_a_decoding_sequence_gets_a_token_every_step_of_a_long_prefill():
    scheduler = Scheduler(BlockManager(1024, 16), max_num_seqs=8, max_num_batched_tokens=256)
    scheduler.add(sequence("stream", 10))
    step(scheduler)  # its prompt
    scheduler.add(sequence("long", 8000))
    steps = [step(scheduler) for _ in range(30)]
    assert all(s["stream"] == 1 for s in steps)
    assert all(s["long"] == 255 for s in steps)  # the rest of the budget


def test_a_short_request_behind_a_long_prompt_starts_in_the_next_step():
    scheduler = Scheduler(BlockManager(1024, 16), max_num_seqs=8, max_num_batched_tokens=256)
    scheduler.add(sequence("long", 8185))
    assert step(scheduler) == {"long": 256}  # alone, a prompt takes the whole budget
    scheduler.add(sequence("short", 5))
    assert step(scheduler) == {"long": 251, "short": 5}  # (at most half at first, then what is left)
    assert step(scheduler) == {"long": 255, "short": 1}  # short decodes from here on


def test_prompts_waiting_together_are_admitted_in_arrival_order():
    scheduler = Scheduler(BlockManager(1024, 16), max_num_seqs=8, max_num_batched_tokens=256)
    for i in range(6):
        scheduler.add(sequence(f"p{i}", 60))
    assert step(scheduler) == {"p0": 60, "p1": 60, "p2": 60, "p3": 60, "p4": 16}
    assert step(scheduler) == {"p0": 1, "p1": 1, "p2": 1, "p3": 1, "p4": 44, "p5": 60}


def test_two_long_prompts_share_the_budget():
    scheduler = Scheduler(BlockManager(1024, 16), max_num_seqs=8, max_num_batched_tokens=256)
    scheduler.add(sequence("a", 5000))
    scheduler.add(sequence("b", 5000))
    assert step(scheduler) == {"a": 128, "b": 128}


def test_a_running_prompt_takes_what_the_free_blocks_hold_before_anything_is_preempted():
    scheduler = Scheduler(BlockManager(10, 16), max_num_seqs=8, max_num_batched_tokens=64)
    scheduler.add(sequence("long", 1000))
    assert step(scheduler) == {"long": 64}
    scheduler.add(sequence("stream", 30))
    assert step(scheduler) == {"long": 34, "stream": 30}  # 7 blocks and 2: one is left
    assert step(scheduler) == {"stream": 1, "long": 30}  # to position 128, all the free block holds
    assert scheduler.num_preemptions == 0 and scheduler.block_manager.num_free_blocks == 0


def test_a_waiting_prompt_is_admitted_only_when_its_chunk_fits():
    scheduler = Scheduler(BlockManager(10, 16), max_num_seqs=8, max_num_batched_tokens=256)
    scheduler.add(sequence("stream", 30))
    step(scheduler)
    scheduler.add(sequence("long", 1000))
    assert step(scheduler) == {"stream": 1}  # its first chunk needs 16 blocks: it waits
    assert list(scheduler.waiting)[0].request_id == "long" and scheduler.block_manager.num_free_blocks == 8


def run_to_the_end(scheduler: Scheduler) -> int:
    """Steps until every request has its max_tokens; the most sequences running at once."""
    most = 0
    while scheduler.has_work():
        step(scheduler)
        most = max(most, len(scheduler.running))
        for seq in [s for s in scheduler.running if s.all_sampled]:
            scheduler.finish(seq)
    return most


def test_an_output_reserve_trades_sequences_at_once_for_preemptions():
    """Twelve requests of 20 prompt tokens and 60 output tokens in 40 blocks of 16 (eight
    at full length). Admitting while the prompts fit runs all twelve and preempts as they
    grow; keeping room for all of max_tokens runs eight and never preempts; half of it,
    ten at first."""
    outcome = {}
    for reserve in (0.0, 0.5, 1.0):
        scheduler = Scheduler(BlockManager(40, 16), max_num_seqs=12, max_num_batched_tokens=256, output_reserve=reserve)
        for i in range(12):
            scheduler.add(sequence(f"r{i}", 20, max_tokens=60))
        outcome[reserve] = run_to_the_end(scheduler), scheduler.num_preemptions
        assert scheduler.block_manager.num_free_blocks == 40
    assert outcome[0.0][0] == 12 and outcome[0.0][1] > 0
    assert outcome[0.5][0] == 10
    assert outcome[1.0] == (8, 0)


def test_a_reserve_larger_than_the_cache_still_admits_a_request_alone():
    """A request whose reserve exceeds what is free waits for the running ones, and runs
    once it is alone (its prompt and max_tokens fit the context, which fits the cache)."""
    scheduler = Scheduler(BlockManager(8, 16), max_num_seqs=4, max_num_batched_tokens=256, output_reserve=1.0)
    scheduler.add(sequence("a", 20, max_tokens=100))
    scheduler.add(sequence("b", 20, max_tokens=100))
    step(scheduler)
    assert [s.request_id for s in scheduler.running] == ["a"]
    assert run_to_the_end(scheduler) == 1 and scheduler.num_preemptions == 0
