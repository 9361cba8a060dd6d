"""What a request asks of generation, validated before it reaches the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.structured import Constraint

DEFAULT_MAX_TOKENS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_LOGPROBS = 20


class InvalidRequest(ValueError):
    """A request the engine cannot serve; the message names the field and the allowed range."""


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None  # None: DEFAULT_MAX_TOKENS, capped by the context
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    top_logprobs: int | None = None  # None: no logprobs
    skip_special_tokens: bool = False
    constraint: Constraint | None = None  # structured output (engine/structured)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether sampling reads the tokens generated so far."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    def validate(self, vocab_size: int) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise InvalidRequest(message)

        def finite(name: str, value: float) -> None:
            check(math.isfinite(value), f"{name} must be a finite number, got {value}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            finite(f"sampling.{name}", getattr(self, name))
        check(0.0 <= self.temperature <= 100.0, f"sampling.temperature must be in [0, 100] (0 = greedy), got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, f"sampling.top_p must be in (0, 1], got {self.top_p}")
        check(self.top_k == -1 or self.top_k >= 1, f"sampling.top_k must be -1 (all) or at least 1, got {self.top_k}")
        check(0.0 <= self.min_p <= 1.0, f"sampling.min_p must be in [0, 1], got {self.min_p}")
        check(0.0 < self.repetition_penalty <= 10.0, f"sampling.repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(-2.0 <= value <= 2.0, f"sampling.{name} must be in [-2, 2], got {value}")
        if self.max_tokens is not None:
            check(self.max_tokens >= 1, f"stop.max_tokens must be at least 1, got {self.max_tokens}")
            check(self.min_tokens <= self.max_tokens,
                  f"stop.min_tokens ({self.min_tokens}) must not exceed stop.max_tokens ({self.max_tokens})")
        check(len(self.stop) <= MAX_STOP_STRINGS, f"stop.stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        for s in self.stop:
            check(0 < len(s) <= MAX_STOP_STRING_CHARS,
                  f"each stop.stop string must have 1 to {MAX_STOP_STRING_CHARS} characters, got one of {len(s)}")
        check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
              f"stop.stop_token_ids has {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
        for t in self.stop_token_ids:
            check(0 <= t < vocab_size, f"stop.stop_token_ids: {t} is outside the vocabulary [0, {vocab_size})")
        if self.top_logprobs is not None:
            check(0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
                  f"output.top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
