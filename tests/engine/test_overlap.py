"""Overlapped stepping (EngineLoop's: the next batch is scheduled and launched before
the previous one's tokens are back, and a step's deltas are emitted while the next
step runs) emits exactly what plain steps do, stops included: a sequence that a stop
token, a stop string or its length ends has already begun its next step, whose token
is dropped."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from tests.conftest import make_engine, run, text, tokens

CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "Count to five.", "Name three colours."]


def summary(outputs) -> dict[str, tuple]:
    return {rid: (tokens(outs), text(outs), outs[-1].finish_reason, outs[-1].stop_string, outs[-1].stop_token_id,
                  outs[-1].usage.completion_tokens) for rid, outs in outputs.items()}


@pytest.fixture(scope="module")
def prompts(smollm2):
    return [smollm2.tokenizer.encode_chat([{"role": "user", "content": c}])[0] for c in CHATS]


@pytest.fixture(scope="module")
def stops(smollm2, prompts):
    """A stop string from the middle of each prompt's greedy answer."""
    engine = make_engine(smollm2)
    outs = run(engine, [engine.make_sequence(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=24))
                        for i, p in enumerate(prompts)])
    answers = [text(outs[f"r{i}"]) for i in range(len(prompts))]
    assert all(len(a) > 20 for a in answers)
    return [a[len(a) // 2 : len(a) // 2 + 3] for a in answers]


class LaunchLog:
    """Wraps a backend; counts the most launches that were in flight at once, and
    launches that gave a request with penalties a pending token. Checks that a batch
    still says which of its sequences sample when its samples are waited for (a GPU
    backend reads that then)."""

    def __init__(self, inner):
        self.inner, self.in_flight, self.most_in_flight, self.penalised_pending = inner, 0, 0, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def launch(self, batch, masks=None):
        self.penalised_pending += any(s.seq.num_pending for s in batch if s.seq.params.has_penalties)
        wait = self.inner.launch(batch, masks)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        sampling = [s.samples for s in batch]

        def counted_wait():
            self.in_flight -= 1
            assert [s.samples for s in batch] == sampling
            return wait()
        return counted_wait


@pytest.mark.parametrize("config", [dict(), dict(max_num_batched_tokens=16),
                                    dict(num_kv_blocks=8, max_num_batched_tokens=24, output_reserve=0.0)],
                         ids=["one batch", "chunked prefill", "preemption"])
@pytest.mark.parametrize("penalised", [False, True], ids=["run ahead", "with a penalised request"])
def test_overlapped_steps_emit_what_plain_steps_do(smollm2, prompts, stops, config, penalised):
    """While a request with penalties runs, overlapped steps wait for each batch's
    tokens before scheduling the next one (its sampling reads them on the host)."""
    params = [SamplingParams(temperature=0.0, max_tokens=24, stop=[stops[0]]),  # a stop string
              SamplingParams(temperature=0.0, max_tokens=24, stop=[stops[1]], min_tokens=2),
              SamplingParams(temperature=0.0, max_tokens=5),  # its length
              SamplingParams(temperature=0.8, seed=3, max_tokens=24)]  # eos, sampled
    if penalised:
        params[2] = SamplingParams(temperature=0.0, max_tokens=5, repetition_penalty=1.3)
    results = []
    for overlapped in (False, True):
        engine = make_engine(smollm2, **config)
        engine.backend = log = LaunchLog(engine.backend)
        seqs = [engine.make_sequence(f"r{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params))]
        results.append(summary(run(engine, seqs[:2], {2: seqs[2:]}, overlapped=overlapped)))
        assert (engine.scheduler.num_preemptions > 0) == ("num_kv_blocks" in config)
        assert log.most_in_flight == (2 if overlapped else 1) and log.penalised_pending == 0
    assert results[1] == results[0]
    assert results[0]["r0"][3] == stops[0] and results[0]["r1"][3] == stops[1]
    assert results[0]["r2"][2].name == "LENGTH"


def test_an_abort_while_a_batch_runs_ahead_counts_only_the_tokens_that_came_back(smollm2, prompts):
    engine = make_engine(smollm2)
    engine.backend = log = LaunchLog(engine.backend)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add(engine.make_sequence(f"r{i}", p, params))
    streamed: dict[str, list[int]] = {}

    def collect(outputs) -> None:
        for out in outputs:
            streamed.setdefault(out.request_id, []).extend(out.token_ids)
    for _ in range(6):
        engine.step_overlapped(collect)
    assert log.in_flight == 1  # the batch launched last, with r0's next token pending in it
    aborted = engine.abort("r0")
    assert aborted.finish_reason.name == "ABORT" and aborted.usage.completion_tokens == len(streamed["r0"]) > 0
    while engine.has_work():
        engine.step_overlapped(collect)
    assert [len(streamed[f"r{i}"]) for i in range(1, len(prompts))] == [24] * (len(prompts) - 1)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
