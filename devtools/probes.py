"""Reading an engine's model directly, outside the scheduler: the logits of a prompt,
and greedy choices along a given continuation (for the GPU tests and benchmarks)."""

from __future__ import annotations

import numpy as np

from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq


def our_logits(engine, ids: list[int]) -> np.ndarray:
    seq = engine.make_sequence("logits", ids, SamplingParams(temperature=0.0, max_tokens=1))
    engine.block_manager.allocate(seq, len(ids))
    try:
        return engine.backend.forward([ScheduledSeq(seq, 0, len(ids))])[0]
    finally:
        engine.block_manager.free(seq)


def teacher_forced_argmax(engine, prompt: list[int], continuation: list[int]) -> np.ndarray:
    """Our greedy choice at each step while decoding along a given continuation
    (prompt + generated tokens): predictions for positions len(prompt) - 1 .. end - 1."""
    seq = engine.make_sequence("teacher-forced", prompt, SamplingParams(temperature=0.0, max_tokens=len(continuation)))
    engine.block_manager.allocate(seq, len(continuation))
    try:
        choices = [int(engine.backend.forward([ScheduledSeq(seq, 0, len(prompt))])[0].argmax())]
        for token in continuation[len(prompt) : -1]:
            seq.output_ids.append(token)
            choices.append(int(engine.backend.forward([ScheduledSeq(seq, seq.num_tokens - 1, 1)])[0].argmax()))
    finally:
        engine.block_manager.free(seq)
    return np.array(choices)
