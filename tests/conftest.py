"""Shared fixtures: the tiny golden model, the embedded SmolLM2, engines over them."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

from engine.backends import create_backend
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_loader import LoadedModel, load_model
from engine.output import RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

# Under CI the property tests draw the same examples every run (a failure found by
# exploring locally is kept in the example database and shows up there first).
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

FIXTURES = Path(__file__).parent / "fixtures"
TINY_MODEL = FIXTURES / "tiny-llama"
TINY_QWEN3 = FIXTURES / "tiny-qwen3"


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    return load_model(TINY_MODEL)


@pytest.fixture(scope="session")
def tiny_qwen3() -> LoadedModel:
    return load_model(TINY_QWEN3)


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return load_model()


def make_engine(model: LoadedModel, device: str = "numpy", **config) -> LLMEngine:
    """An engine over `model` on the numpy backend, or on another --device's."""
    config.setdefault("num_kv_blocks", 256)
    return LLMEngine(model, create_backend(device, model.config, model.model_weights()), EngineConfig(**config))


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(engine: LLMEngine, seqs: list[Sequence], arrivals: dict[int, list[Sequence]] | None = None,
        check_blocks: bool = True, overlapped: bool = False) -> dict[str, list[RequestOutput]]:
    """Step the engine until idle; `arrivals` adds sequences before the given step.
    `overlapped` steps as EngineLoop does (LLMEngine.step_overlapped)."""
    arrivals = dict(arrivals or {})
    for s in seqs:
        engine.add(s)
    outputs: dict[str, list[RequestOutput]] = {}
    step = 0
    while engine.has_work() or arrivals:
        for s in arrivals.pop(step, []):
            engine.add(s)
        if overlapped:
            emitted = []
            engine.step_overlapped(emitted.extend)
        else:
            emitted = engine.step()
        for out in emitted:
            outputs.setdefault(out.request_id, []).append(out)
        if check_blocks:
            live = engine.scheduler.running + list(engine.scheduler.waiting)
            engine.block_manager.check_invariants(live)
        step += 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "blocks leaked"
    return outputs


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def logprobs(outputs: list[RequestOutput]) -> np.ndarray:
    """Each output token's log-prob and its top alternatives' (a request asking top_logprobs)."""
    return np.array([[lp.logprob] + [v for _, v in lp.top] for o in outputs for lp in o.logprobs])


def text(outputs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outputs)


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> dict[str, Path]:
    """Throwaway certificates (tests/pki.py; imported here, so that the GPU tests and
    benchmarks, which import this module, do not need cryptography)."""
    from tests.pki import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))


def check_a_mask_fault_fails_its_step_only(engine: LLMEngine, prompt: list[int], monkeypatch) -> None:
    """Served as EngineLoop serves: when filling a step's masks on their thread raises,
    that step's requests end with the error (a GPU's stream, which waits for the masks,
    is let go all the same), and the requests after it run."""
    import queue

    import engine.structured.guide as guide
    from engine.engine_loop import EngineLoop
    from engine.sequence import FinishReason
    from engine.structured import Constraint

    fill, calls = guide.fill_masks, []

    def failing_fill(*args):
        calls.append(1)
        if len(calls) == 2:  # (the masks' thread's second step)
            raise RuntimeError("injected mask fault")
        return fill(*args)
    monkeypatch.setattr(guide, "fill_masks", failing_fill)
    ended: queue.SimpleQueue = queue.SimpleQueue()
    loop = EngineLoop(engine, publish=lambda outs: [ended.put(o) for o in outs if o.finished])
    loop.start()
    try:
        loop.add(engine.make_sequence("held", prompt, SamplingParams(temperature=0.0, max_tokens=24,
                                                                     constraint=Constraint("regex", "[a-z]{40}"))))
        held = ended.get(timeout=120)
        assert held.request_id == "held" and held.finish_reason is FinishReason.ERROR
        assert "injected mask fault" in held.error
        loop.add(engine.make_sequence("after", prompt, greedy(8)))
        after = ended.get(timeout=120)
        assert after.request_id == "after" and after.finish_reason is FinishReason.LENGTH
        assert after.usage.completion_tokens == 8
    finally:
        loop.stop()
    assert len(calls) >= 2 and engine.stats().live_requests == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
