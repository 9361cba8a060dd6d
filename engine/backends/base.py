"""What the engine asks of a compute backend (numpy, cuda): it holds the weights and
the KV cache and runs one scheduled batch at a time."""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from engine.sampler import SampleOutput
from engine.scheduler import ScheduledSeq
from engine.structured import FillingMasks

Wait = Callable[[], list[SampleOutput | None]]  # a launched step's samples, one per scheduled sequence
# A step whose forward pass is queued: queue its sampling, given its token masks
# (engine/structured: int32 bitmask rows, one per sampling sequence with a guide, in
# order, or None), filled already or still being filled (FillingMasks: a GPU queues the
# sampling at once, to run when they are done; a CPU waits for them).
SampleLater = Callable[[np.ndarray | FillingMasks | None], Wait]
# A step is launched while the one before it still runs, and ended (its tokens read
# back) before a third is launched: a backend keeps this many steps' buffers.
MAX_STEPS_IN_FLIGHT = 2
# --kv-cache-dtype: the backend's own (auto: float32 on numpy, bfloat16 on CUDA) or FP8 e4m3
KV_CACHE_DTYPES = ("auto", "fp8")
CPU_ACTIVATIONS = ("int8", "int16")  # what the CPU backend's products of quantized weights quantize activations to


def is_fp8_kv_cache(kv_cache_dtype: str) -> bool:
    """Whether --kv-cache-dtype asks for e4m3 K and V (ValueError for a dtype there is not)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype}: choose one of {', '.join(KV_CACHE_DTYPES)}")
    return kv_cache_dtype == "fp8"


class Backend(Protocol):
    name: str  # "numpy", "cpu" or "cuda"
    weight_dtype: str  # what it computes with the weights in: "float32", "bfloat16"
    weight_bytes: int  # the weights as it holds them
    kv_cache_dtype: str

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes of K and V one block of `block_size` tokens takes, every layer's: to size the cache."""

    def allocate_kv_cache(self, num_blocks: int, block_size: int, max_batch: int, max_context: int) -> None:
        """The paged cache; `max_batch` is the most sequences one step holds, `max_context`
        the most tokens one sequence does."""

    def host_array(self, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        """Host memory that a launch copies to the device without waiting for the
        device to reach the copy (page-locked on a GPU): for the token masks."""

    def launch(self, batch: list[ScheduledSeq], masks: np.ndarray | None = None) -> Wait:
        """Queue the step (a GPU returns at once, a CPU computes it first); the returned
        function waits for its samples (None for a sequence that samples nothing).
        A sequence's pending last token is the one this backend sampled for it in the
        step before. `masks` holds the tokens each sampling sequence with a guide may
        choose from, a row each in order (a set bit allows a token).
        The same as launch_forward(batch)(masks)."""

    def launch_forward(self, batch: list[ScheduledSeq]) -> SampleLater:
        """Queue the step's forward pass; its sampling is queued by the returned function
        (before the next step is launched)."""

    def execute(self, batch: list[ScheduledSeq], masks: np.ndarray | None = None) -> list[SampleOutput | None]:
        """launch(batch, masks)(), for tests and benchmarks."""

    def forward(self, batch: list[ScheduledSeq]) -> np.ndarray:
        """The logits of the sampling sequences, on the host (tests, benchmarks, logprobs)."""

    def is_fatal(self, error: BaseException) -> bool:
        """Whether the backend can no longer run after `error` (the server then stops)."""
