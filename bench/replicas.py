"""One replica per GPU behind the gateway, against one: `llamastream gateway --gpus`
started on the first GPU of --gpus, then on all of them, each time loaded with the
offline workload of bench/serve.py (random prompts decoded to text, input and output
lengths uniform in their ranges, eos ignored, all submitted at once with at most
--max-concurrency in flight) through the gateway's OpenAI endpoint and through gRPC to
the replicas directly (requests dealt round robin); throughput, TTFT and TPOT
percentiles, and what the replicas gain over one. Then, on all the GPUs, the last
replica's process is killed --kill-after seconds into the same load: the requests cut
on it fail, every other one is served, and the launcher starts it again on its GPU
(the run waits until it serves, and has it answer).

    python3 bench/replicas.py --model DIR --gpus 0,1 --vocab 128000 --server-arg=--max-num-seqs=256
    python3 bench/replicas.py --gpus 0,1 --device cpu --num-prompts 16 --input-len 16:64 --output-len 16:32
        (a fake device list: the replicas run on the CPU, each seeing its "GPU")
    python3 bench/replicas.py --model DIR --replicas 2 --vocab 128000 --server-arg=--gpu-memory-utilization=0.45
        (two replicas sharing one GPU, each sizing its KV cache from its share)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serve import as_text, flush_prefix_cache, grpc_sender, openai_sender, run_load  # noqa: E402
from devtools.servers import free_port, free_ports  # noqa: E402
from server.gateway import REPLICA_STARTED, model_directory, wait_serving  # noqa: E402


class Launcher:
    """`llamastream gateway` with `replicas` placed by `placement` (its --gpus or
    --replicas flag), its log in a temporary file."""

    def __init__(self, model: Path, replicas: int, placement: list[str], serve_args: list[str]):
        self.port, self.grpc_port = free_port(), free_ports(replicas)  # (replica i on grpc_port + i)
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server", "gateway", *placement, "--host", "127.0.0.1",
             "--port", str(self.port), "--grpc-port", str(self.grpc_port), "--gateway-metrics-port", str(free_port()),
             "--policy", "round_robin", "--model", str(model), "--", *serve_args],
            stdout=self.log, stderr=subprocess.STDOUT, text=True)
        self.addresses = [f"127.0.0.1:{self.grpc_port + i}" for i in range(replicas)]
        self.url, self.model = f"http://127.0.0.1:{self.port}", model.name

    def logged(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def started(self) -> list[tuple[int, int]]:
        """(replica, pid) of each start, in order."""
        return [(int(i), int(pid)) for i, _, _, pid in REPLICA_STARTED.findall(self.logged())]

    def wait_ready(self, timeout: float = 900) -> None:
        """Until every replica serves and the gateway answers /v1/models."""
        deadline = time.monotonic() + timeout
        for address in self.addresses:
            wait_serving(address, timeout=max(1.0, deadline - time.monotonic()))
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the launcher exited with {self.proc.returncode}:\n{self.logged()[-3000:]}")
            with contextlib.suppress(httpx2.HTTPError):
                if httpx2.get(f"{self.url}/v1/models", timeout=5).status_code == 200:
                    return
            time.sleep(1)
        raise TimeoutError(f"the gateway did not answer in {timeout:.0f} s:\n{self.logged()[-3000:]}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.asynccontextmanager
async def round_robin(addresses: list[str]):
    """send(prompt, max_tokens) over gRPC, each request to the next replica in turn."""
    async with contextlib.AsyncExitStack() as stack:
        sends = [await stack.enter_async_context(grpc_sender(a)) for a in addresses]
        turn = itertools.count()

        async def send(prompt, max_tokens: int):
            return await sends[next(turn) % len(sends)](prompt, max_tokens)
        yield send


def row(replicas: int, path: str, r: dict) -> str:
    t, p = r["ttft_ms"], r["tpot_ms"]
    return (f"{replicas:>8} | {path:>7} | {r['completed']:>4} | {r['failed']:>4} | {r['output_tokens_per_s']:9.1f} | "
            f"{t['p50']:7.1f} {t['p90']:7.1f} {t['p99']:7.1f} | {p['p50']:6.2f} {p['p90']:6.2f} {p['p99']:6.2f}")


def measure(launcher: Launcher, prompts: list[str], outputs: list[int], args) -> dict[str, dict]:
    runs = {}
    for path, sender in (("gateway", lambda: openai_sender(launcher.url, launcher.model)),
                         ("gRPC", lambda: round_robin(launcher.addresses))):
        for address in launcher.addresses:
            flush_prefix_cache(address)  # (every run sends the same prompts)
        runs[path] = asyncio.run(run_load(sender(), prompts, outputs, args.max_concurrency, float("inf"), args.seed))
        print(row(len(launcher.addresses), path, runs[path]), flush=True)
    return runs


def kill_one_mid_load(launcher: Launcher, prompts: list[str], outputs: list[int], args) -> dict:
    """The load through the gateway, the last replica killed --kill-after seconds in;
    then its restart: the figures, and the answer of the restarted replica."""
    victim = len(launcher.addresses) - 1
    pid = [p for i, p in launcher.started() if i == victim][-1]

    killed_at = 0.0

    async def load_and_kill() -> dict:
        nonlocal killed_at
        load = asyncio.create_task(run_load(openai_sender(launcher.url, launcher.model), prompts, outputs,
                                            args.max_concurrency, float("inf"), args.seed))
        await asyncio.sleep(args.kill_after)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        return await load

    for address in launcher.addresses:
        flush_prefix_cache(address)
    result = asyncio.run(load_and_kill())
    while [i for i, _ in launcher.started()].count(victim) < 2:
        if time.monotonic() - killed_at > 120:
            raise TimeoutError(f"the launcher did not restart replica {victim}:\n{launcher.logged()[-3000:]}")
        time.sleep(0.5)
    wait_serving(launcher.addresses[victim], timeout=900)
    restarted = time.monotonic() - killed_at  # (at most: polled after the load ends)

    async def ask() -> dict:
        async with grpc_sender(launcher.addresses[victim]) as send:
            return (await send(prompts[0], 8)).__dict__

    answer = asyncio.run(ask())
    return {**result, "killed_replica": victim, "restarted_in_s": restarted, "restarted_answer": answer}


def placements(args) -> dict[int, list[str]]:
    """The launcher's flags by replica count: one replica, then the largest run."""
    if args.replicas:
        return {n: ["--replicas", str(n)] for n in sorted({1, args.replicas})}
    gpus = [g.strip() for g in args.gpus.split(",")]
    return {n: ["--gpus", ",".join(gpus[:n])] for n in sorted({1, len(gpus)})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a Hugging Face directory or GGUF file (default: the embedded model)")
    place = ap.add_mutually_exclusive_group()
    place.add_argument("--gpus", default="0,1", help="the GPUs of the largest run, comma-separated (default 0,1)")
    place.add_argument("--replicas", type=int, help="instead of --gpus: this many replicas sharing the visible GPU(s) "
                                                     "in the largest run (give each its share of GPU memory)")
    ap.add_argument("--device", default="cuda", help="the replicas' --device (cpu with a fake --gpus list)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra flag for every replica (repeatable)")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", default="100:1024", help="MIN:MAX prompt tokens, uniform")
    ap.add_argument("--output-len", default="100:1024", help="MIN:MAX output tokens, uniform")
    ap.add_argument("--vocab", type=int, default=0, help="random ids below this (default: the tokenizer's vocabulary)")
    ap.add_argument("--max-concurrency", type=int, default=256)
    ap.add_argument("--kill-after", type=float, default=5.0, help="seconds into the load the replica is killed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-json")
    args = ap.parse_args()

    model = model_directory(args.model)
    rng = np.random.default_rng(args.seed)
    (lo_in, hi_in), (lo_out, hi_out) = (map(int, r.split(":")) for r in (args.input_len, args.output_len))
    vocab = args.vocab or json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = as_text([rng.integers(0, vocab, rng.integers(lo_in, hi_in + 1)).tolist()
                       for _ in range(args.num_prompts)], model)
    outputs = rng.integers(lo_out, hi_out + 1, args.num_prompts).tolist()
    serve_args = ["--device", args.device, *args.server_arg]
    runs = placements(args)
    largest = max(runs)
    where = f"{largest} replicas sharing the GPU(s)" if args.replicas else f"GPUs {args.gpus}"
    print(f"{model.name} on {args.device}, {where}; {args.num_prompts} requests, input {args.input_len}, "
          f"output {args.output_len}, at most {args.max_concurrency} in flight; prompts as text on both paths")
    print(f"{'replicas':>8} | {'path':>7} | {'ok':>4} | {'fail':>4} | {'out tok/s':>9} | {'TTFT p50/p90/p99 ms':>23} | "
          f"{'TPOT p50/p90/p99 ms':>20}")
    results = {}
    for n, placement in runs.items():
        launcher = Launcher(model, n, placement, serve_args)
        try:
            launcher.wait_ready()
            results[n] = measure(launcher, prompts, outputs, args)
            if n == largest > 1:
                results["kill"] = kill_one_mid_load(launcher, prompts, outputs, args)
        finally:
            launcher.stop()
    if largest > 1:
        for path in ("gateway", "gRPC"):
            gain = results[largest][path]["output_tokens_per_s"] / results[1][path]["output_tokens_per_s"]
            print(f"{path}: {largest} replicas {gain:.2f}x one")
        k = results["kill"]
        print(f"replica {k['killed_replica']} killed {args.kill_after:g} s into the load through the gateway: "
              f"{k['completed']} served, {k['failed']} failed ({'; '.join(k['errors'])[:300] or 'none'}), "
              f"{k['output_tokens_per_s']:.1f} tok/s; restarted and serving within {k['restarted_in_s']:.1f} s of the kill, "
              f"answering with {k['restarted_answer']['output_tokens']} tokens "
              f"({k['restarted_answer']['error'] or 'no error'})")
    if args.result_json:
        Path(args.result_json).write_text(json.dumps({str(k): v for k, v in results.items()}, indent=2))


if __name__ == "__main__":
    main()
