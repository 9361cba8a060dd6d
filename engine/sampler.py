"""Turn one sequence's logits into its next token, on the CPU.

Order, as in vLLM: penalties, then token masks (min_tokens, and a structured
output's grammar), then temperature, top-k, top-p and min-p, then a draw from the
sequence's own Philox generator, so a seeded request samples the same tokens
whatever else shares its batch. Logprobs describe the model's raw distribution,
before any of this (as vLLM's by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.sampling_params import SamplingParams


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class SampleOutput:
    token_id: int
    logprob: TokenLogprob | None = None


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def apply_penalties(logits: np.ndarray, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> np.ndarray:
    """Repetition penalty over prompt and output (as in transformers and vLLM);
    presence and frequency penalties over the output only (as in OpenAI's API)."""
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(prompt_ids + output_ids, dtype=np.int64))
        values = logits[seen]
        logits[seen] = np.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        ids, counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True)
        logits[ids] -= params.frequency_penalty * counts + params.presence_penalty
    return logits


def top_k_top_p_min_p(probs: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Zero out tokens outside top-k, the top-p nucleus and the min-p floor; renormalise."""
    order = np.argsort(-probs, kind="stable")
    sorted_probs = probs[order]
    keep = np.ones_like(sorted_probs, dtype=bool)
    if params.top_k > 0:
        keep[params.top_k :] = False
    if params.top_p < 1.0:
        before = np.cumsum(sorted_probs) - sorted_probs  # mass of strictly better tokens
        keep &= before < params.top_p
    if params.min_p > 0.0:
        keep &= sorted_probs >= params.min_p * sorted_probs[0]
    keep[0] = True
    out = np.zeros_like(probs)
    out[order[keep]] = sorted_probs[keep]
    return out / out.sum()


def unpack_bitmask(words: np.ndarray, vocab: int) -> np.ndarray:
    """A bitmask row (int32 words, token t at bit t % 32 of word t // 32) as booleans."""
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab].astype(bool)


def sample(
    logits: np.ndarray,
    params: SamplingParams,
    prompt_ids: list[int],
    output_ids: list[int],
    rng: np.random.Generator,
    banned_ids: list[int],
    allowed: np.ndarray | None = None,
) -> SampleOutput:
    """Sample one token from float32 `logits` [vocab]; `banned_ids` can never be chosen,
    nor a token whose bit is clear in `allowed` (int32 words: token t is bit t % 32 of
    word t // 32)."""
    logprob = None
    if params.top_logprobs is not None:
        raw = log_softmax(logits.astype(np.float64))
    x = apply_penalties(logits.astype(np.float64), params, prompt_ids, output_ids)
    if banned_ids:
        x[banned_ids] = -np.inf
    if allowed is not None:
        x[~unpack_bitmask(allowed, len(x))] = -np.inf
    if params.greedy:
        token = int(np.argmax(x))
    else:
        probs = np.exp(log_softmax(x / params.temperature))
        probs = top_k_top_p_min_p(probs, params)
        cdf = np.cumsum(probs)
        token = int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(cdf) - 1))
    if params.top_logprobs is not None:
        n = params.top_logprobs
        top = np.argpartition(-raw, n)[:n] if n else np.empty(0, dtype=np.int64)
        top = top[np.argsort(-raw[top], kind="stable")]
        logprob = TokenLogprob(token, float(raw[token]), [(int(t), float(raw[t])) for t in top])
    return SampleOutput(token, logprob)
