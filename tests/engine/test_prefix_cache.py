"""Prefix caching changes nothing a request sees but its cost (tiny Llama, on the numpy
backend and on the cpu backend): with the cache on and off, requests one after another
or in mixed batches, in chunked prefill, under preemption and in the overlapped loop give
the same tokens and the same logprobs, bit for bit. Requests that share a prefix find it
cached."""

from __future__ import annotations

import numpy as np
import pytest

from engine.sampling_params import SamplingParams
from tests.conftest import greedy, logprobs, make_engine, run, tokens

RNG = np.random.default_rng(7)
SYSTEM = RNG.integers(5, 500, 45).tolist()  # a shared "system prompt" of nearly three 16-token blocks
OWN = [RNG.integers(5, 500, n).tolist() for n in (3, 20, 1, 40)]
UNRELATED = RNG.integers(5, 500, 30).tolist()


def requests(engine) -> list:
    """Requests sharing the system prompt (greedy with logprobs, and seeded sampling), a
    second turn that resends the first one's prompt, and one that shares nothing."""
    seqs = [engine.make_sequence(f"r{i}", SYSTEM + own, greedy(12, top_logprobs=3)) for i, own in enumerate(OWN)]
    seqs.append(engine.make_sequence("sampled", SYSTEM + OWN[0], SamplingParams(temperature=0.9, top_p=0.9, seed=11,
                                                                                max_tokens=12, ignore_eos=True)))
    seqs.append(engine.make_sequence("turn2", SYSTEM + OWN[1] + [7, 8, 9] + OWN[2], greedy(12)))
    seqs.append(engine.make_sequence("unrelated", UNRELATED, greedy(12)))
    return seqs


@pytest.mark.parametrize("label, config, overlapped", [
    ("one request after another", dict(max_num_seqs=1), False),
    ("one step after another", dict(), False),
    ("overlapped", dict(), True),
    ("chunked prefill", dict(max_num_batched_tokens=7), False),
    ("preemption by a tiny cache", dict(num_kv_blocks=32, block_size=4, output_reserve=0.0), False),
])
@pytest.mark.parametrize("device", ["numpy", "cpu"])
def test_cache_on_and_off_give_the_same_tokens_in_any_batching(tiny_model, device, label, config, overlapped):
    results, cached = {}, {}
    for caching in (False, True):
        engine = make_engine(tiny_model, device, enable_prefix_caching=caching, **config)
        seqs = requests(engine)
        outputs = run(engine, seqs[:1], {4 + 2 * i: [s] for i, s in enumerate(seqs[1:])}, overlapped=overlapped)
        results[caching] = {rid: (tokens(outs), logprobs(outs)) for rid, outs in outputs.items()}
        cached[caching] = sum(outs[-1].usage.cached_tokens for outs in outputs.values())
        if label.startswith("preemption"):
            assert engine.scheduler.num_preemptions > 0
    for rid, (ids, lps) in results[False].items():
        assert results[True][rid][0] == ids, rid
        assert np.array_equal(results[True][rid][1], lps), rid
    assert cached[False] == 0 and cached[True] >= 2 * 16  # (later requests find the system prompt's blocks)


def test_a_repeated_prompt_finds_all_but_its_last_partial_block_cached(tiny_model):
    engine = make_engine(tiny_model)
    prompt = SYSTEM + OWN[3]  # 85 tokens: five full blocks and five tokens
    first = run(engine, [engine.make_sequence("a", prompt, greedy(4))])["a"][-1].usage
    second = run(engine, [engine.make_sequence("b", prompt, greedy(4))])["b"][-1].usage
    assert first.cached_tokens == 0 and second.cached_tokens == 80
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (170, 80)
    assert stats.kv_blocks_evictable > 0 and engine.reset_prefix_cache() == stats.kv_blocks_evictable
    third = run(engine, [engine.make_sequence("c", prompt, greedy(4))])["c"][-1].usage
    assert third.cached_tokens == 0
