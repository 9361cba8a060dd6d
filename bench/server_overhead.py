"""What the gRPC server costs on top of the engine, without a GPU: the offline workload
(256 requests, prompt and output lengths uniform in 100..1024, ignore_eos) on a backend
that spends --step-ms of wall time per step and no CPU, as a GPU does, run in process
and then through the server under --max-concurrency streams.

    python bench/server_overhead.py [--step-ms 10] [--max-concurrency 256]
    python bench/server_overhead.py --host-ms 1 --gil-releases 6    # like the CUDA backend
    python bench/server_overhead.py --engine-in-process             # the engine on the server's thread

--host-ms and --gil-releases make a step look like a CUDA step to the other threads:
Python work that holds the GIL, then short calls that drop it (ctypes calls and
PyCUDA's copies each let it go), then the wait for the GPU.

The ratio is the server's share of the in-process rate (issue target: 80% on the GPU).
The model is the small test fixture; only its tokenizer and shape matter here.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.serve import grpc_sender, run_load  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from engine.sampler import SampleOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from devtools.servers import ServerProcess  # noqa: E402

MODEL = ROOT / "tests" / "fixtures" / "tiny-llama"
CONFIG = dict(num_kv_blocks=40000, max_num_seqs=256, max_num_batched_tokens=8192)


class EmulatedBackend:
    """Sleeps `step_ms` per step (the GIL released, as while a GPU computes) and samples
    a token that depends only on the sequence's length."""

    name = "emulated"
    weight_dtype = kv_cache_dtype = "float32"
    weight_bytes = 0

    def __init__(self, step_ms: float, host_ms: float = 0.0, gil_releases: int = 0):
        self.step_s, self.host_s, self.gil_releases = step_ms / 1e3, host_ms / 1e3, gil_releases

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return 1

    def allocate_kv_cache(self, num_blocks: int, block_size: int, max_batch: int, max_context: int) -> None:
        pass

    def host_array(self, shape, dtype):
        return np.empty(shape, dtype)

    def execute(self, batch, masks=None):
        return self.launch(batch, masks)()

    def launch_forward(self, batch):
        return lambda masks: self.launch(batch, masks)

    def launch(self, batch, masks=None):
        """Host work now; the GPU's time runs from here, and the returned wait() sleeps out
        the rest. (No structured output: the masks are not read.)"""
        busy_until = time.perf_counter() + self.host_s
        while time.perf_counter() < busy_until:  # host work, the GIL held
            pass
        for _ in range(self.gil_releases):
            time.sleep(0)  # a short call that drops the GIL and takes it back
        done_at = time.perf_counter() + self.step_s
        samples = [SampleOutput(s.seq.num_tokens % 200 + 10, None) if s.samples else None for s in batch]

        def wait():
            time.sleep(max(0.0, done_at - time.perf_counter()))
            return samples
        return wait


def workload(vocab: int, n: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, rng.integers(100, 1025)).tolist() for _ in range(n)]
    return prompts, rng.integers(100, 1025, n).tolist()


def emulated_engine(cfg=None, **backend_args) -> LLMEngine:
    """The tiny model's engine on the emulated backend (the server builds it from its
    settings, in the engine's process; only the benchmark's CONFIG counts)."""
    return LLMEngine(load_model(str(MODEL)), EmulatedBackend(**backend_args), EngineConfig(**CONFIG))


def in_process(engine: LLMEngine, prompts, outputs) -> float:
    for i, (ids, n) in enumerate(zip(prompts, outputs)):
        engine.add(engine.make_sequence(f"r{i}", ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)))
    start, tokens = time.perf_counter(), 0

    def count(deltas) -> None:
        nonlocal tokens
        tokens += sum(len(o.token_ids) for o in deltas)
    while engine.has_work():  # as the server steps
        engine.step_overlapped(count)
    return tokens / (time.perf_counter() - start)


def serve(port: int, engine_process: bool, **backend_args) -> None:
    """The server of `llamastream serve`, on the emulated backend (runs in a subprocess)."""
    from server.app import Server, ServerConfig

    cfg = ServerConfig(model=str(MODEL), host="127.0.0.1", port=port, engine_process=engine_process, **CONFIG)
    sys.exit(Server(cfg, functools.partial(emulated_engine, **backend_args)).run_until_signal())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-ms", type=float, default=10.0, help="emulated GPU time per step")
    ap.add_argument("--host-ms", type=float, default=0.0, help="Python work per step, the GIL held")
    ap.add_argument("--gil-releases", type=int, default=0, help="short GIL-dropping calls per step")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-concurrency", type=int, default=256)
    ap.add_argument("--engine-in-process", action="store_true", help="the server's engine on a thread of its process")
    ap.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    step = ["--step-ms", str(args.step_ms), "--host-ms", str(args.host_ms), "--gil-releases", str(args.gil_releases)]
    backend_args = dict(step_ms=args.step_ms, host_ms=args.host_ms, gil_releases=args.gil_releases)
    if args.serve:
        return serve(args.serve, not args.engine_in_process, **backend_args)
    prompts, outputs = workload(load_model(str(MODEL)).config.vocab_size, args.requests)
    local = in_process(emulated_engine(**backend_args), prompts, outputs)
    where = ["--engine-in-process"] if args.engine_in_process else []
    with ServerProcess(*step, *where, command=(__file__, "--serve")) as server:
        remote = asyncio.run(run_load(grpc_sender(server.address), prompts, outputs, args.max_concurrency, float("inf"), 0))
    rate = remote["output_tokens_per_s"]
    print(f"emulated step: {args.host_ms} ms of host work, {args.gil_releases} GIL releases, {args.step_ms} ms of GPU; "
          f"{args.requests} requests, {args.max_concurrency} concurrent streams; the server's engine "
          + ("on a thread of its process" if args.engine_in_process else "in a process of its own"))
    print(f"{'path':<12} | {'output tok/s':>12} | {'share':>6} | {'TTFT p50/p99 ms':>16}")
    print(f"{'in process':<12} | {local:12.0f} | {'100%':>6} |")
    t = remote["ttft_ms"]
    print(f"{'gRPC':<12} | {rate:12.0f} | {rate / local:6.0%} | {t['p50']:7.0f} {t['p99']:8.0f}")


if __name__ == "__main__":
    main()
