"""Load-test a llamastream server over gRPC, in the manner of `vllm bench serve`.

    python bench/serve.py --model DIR --device cuda --max-concurrency 1,16,64,256 \\
        --num-prompts 256 --result-json serve.json --plot serve.png
    python bench/serve.py --model DIR --device cuda --gateway ...   # also through smg's OpenAI API

With --gateway the same load also goes through the Shepherd Model Gateway (smg, started
in front of the server) as streamed OpenAI completions, and each run is reported for
both, the gateway's cost beside the direct gRPC figure. The prompts are then text (the
random ids decoded), since the gateway tokenizes itself; both paths send that text.

Starts `python -m server serve` with --model/--device (or uses --address), drops its
prefix cache before each run (every run sends the same prompts), sends
--num-prompts requests of random token ids (input and output lengths uniform in the
given ranges, eos ignored) at --request-rate (Poisson; inf = all at once) with at most
--max-concurrency in flight, once per concurrency in the list. Reports, per run:
output tokens/s, requests/s, and time to first token (TTFT), time per output token
after the first (TPOT) and inter-token latency between stream messages (ITL) at
p50/p90/p99. A message can carry several tokens when a reader falls behind; ITL is
per message, TPOT per token. On the GPU each run is beside its floor: the output
tokens/s of decode steps of as many sequences as run at once, at the workload's mean
context, on an H200 (bench/floors.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx2
import numpy as np
import tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llamastream.v1 import generation_pb2 as pb  # noqa: E402
from llamastream.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402
from bench.floors import decode_floor_tokens_per_s  # noqa: E402
from devtools.servers import GatewayProcess, ServerProcess  # noqa: E402
from engine.model_loader import load_config  # noqa: E402
from server.gateway import model_directory  # noqa: E402


@dataclass
class RequestResult:
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


class Timing:
    """A request's clock: time to the first message with tokens, then between them."""

    def __init__(self, result: RequestResult):
        self.result, self.start = result, time.perf_counter()
        self.last = self.start

    def tokens(self, n: int) -> None:
        now = time.perf_counter()
        if self.result.ttft_s == 0.0:
            self.result.ttft_s = now - self.start
        else:
            self.result.itl_s.append(now - self.last)
        self.last = now
        self.result.output_tokens += n

    def end(self) -> RequestResult:
        self.result.latency_s = time.perf_counter() - self.start
        return self.result


@contextlib.asynccontextmanager
async def grpc_sender(address: str):
    """send(prompt, max_tokens): one streamed Generate (token ids or text), timed."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def send(prompt: list[int] | str, max_tokens: int) -> RequestResult:
            request = pb.GenerateRequest(sampling=pb.SamplingParams(temperature=0.0),
                                         stop=pb.StopCriteria(max_tokens=max_tokens, ignore_eos=True))
            if isinstance(prompt, str):
                request.prompt = prompt
            else:
                request.token_ids.ids.extend(prompt)
            timing = Timing(RequestResult(prompt_tokens=len(prompt)))
            try:
                async for msg in stub.Generate(request, timeout=3600):
                    if msg.HasField("delta") and msg.delta.token_ids:
                        timing.tokens(len(msg.delta.token_ids))
                    elif msg.HasField("started"):
                        timing.result.prompt_tokens = msg.started.prompt_tokens
            except grpc.aio.AioRpcError as e:
                timing.result.error = f"{e.code().name}: {e.details()}"
            return timing.end()
        yield send


@contextlib.asynccontextmanager
async def openai_sender(url: str, model: str):
    """send(text, max_tokens): one streamed OpenAI completion through the gateway, timed
    (a message's tokens are counted once the usage arrives at the end)."""
    async with httpx2.AsyncClient(base_url=url, timeout=3600, limits=httpx2.Limits(max_connections=None)) as client:
        async def send(prompt: str, max_tokens: int) -> RequestResult:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            timing = Timing(RequestResult(prompt_tokens=0))
            try:
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        timing.result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    async for message in server_sent_events(response):
                        if "error" in message:  # (the stream's replica failed)
                            timing.result.error = f"stream error: {json.dumps(message['error'])[:200]}"
                            break
                        if any(c.get("text") for c in message["choices"]):
                            timing.tokens(0)
                        if message.get("usage"):
                            timing.result.output_tokens = message["usage"]["completion_tokens"]
                            timing.result.prompt_tokens = message["usage"]["prompt_tokens"]
            except httpx2.HTTPError as e:
                timing.result.error = f"{type(e).__name__}: {e}"
            return timing.end()
        yield send


async def server_sent_events(response: httpx2.Response):
    """The JSON data of each event of a server-sent-event stream. Events end at a blank
    line and lines at "\n" alone (a text may hold other line breaks, such as U+2028)."""
    buffer = ""
    async for text in response.aiter_text():
        buffer += text
        *events, buffer = buffer.split("\n\n")
        for event in events:
            for line in event.split("\n"):
                if line.startswith("data: {"):
                    yield json.loads(line[len("data: "):])


async def run_load(sender, prompts, outputs, concurrency: int, rate: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    limit = asyncio.Semaphore(concurrency)
    async with sender as send:

        async def limited(prompt, n):
            async with limit:
                return await send(prompt, n)

        start = time.perf_counter()
        tasks = []
        for prompt, n in zip(prompts, outputs):
            tasks.append(asyncio.create_task(limited(prompt, n)))
            if np.isfinite(rate):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, concurrency, rate)


def percentiles(values, scale: float = 1e3) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    p = np.percentile(np.asarray(values) * scale, [50, 90, 99])
    return {"p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2])}


def summarize(results: list[RequestResult], duration: float, concurrency: int, rate: float) -> dict:
    ok = [r for r in results if not r.error]
    tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "max_concurrency": concurrency, "request_rate": rate, "completed": len(ok),
        "failed": len(results) - len(ok), "errors": sorted({r.error for r in results if r.error}),
        "duration_s": duration, "output_tokens": tokens, "output_tokens_per_s": tokens / duration,
        "requests_per_s": len(ok) / duration,
        "ttft_ms": percentiles([r.ttft_s for r in ok]), "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles([x for r in ok for x in r.itl_s]),
    }


def plot(runs: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    conc = [r["max_concurrency"] for r in runs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(conc, [r["output_tokens_per_s"] for r in runs], "o-")
    a.set(xscale="log", xlabel="max concurrency", ylabel="output tokens/s", title="throughput")
    for key in ("ttft_ms", "tpot_ms"):
        b.plot(conc, [r[key]["p50"] for r in runs], "o-", label=f"{key[:4].upper()} p50")
        b.plot(conc, [r[key]["p99"] for r in runs], "x--", label=f"{key[:4].upper()} p99")
    b.set(xscale="log", yscale="log", xlabel="max concurrency", ylabel="ms", title="latency")
    b.legend()
    for axis in (a, b):  # ticks at the measured concurrencies only
        axis.set_xticks(conc, [str(c) for c in conc])
        axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", help="a running server (default: start one with --model and --device)")
    ap.add_argument("--model", help="model for the server this script starts (default: the embedded one)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--server-arg", action="append", default=[], help="extra flag for the started server (repeatable)")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", default="100:1024", help="MIN:MAX prompt tokens, uniform")
    ap.add_argument("--output-len", default="100:1024", help="MIN:MAX output tokens, uniform")
    ap.add_argument("--vocab", type=int, default=0, help="random ids below this (default: the model's vocabulary)")
    ap.add_argument("--max-concurrency", default="256", help="comma-separated list: one run each")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson arrivals")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-json")
    ap.add_argument("--plot")
    ap.add_argument("--gateway", action="store_true",
                    help="also through smg's OpenAI API, in front of the server (needs the gateway extra)")
    args = ap.parse_args()

    with contextlib.ExitStack() as stack:
        # The gateway names the model after its tokenizer's folder, and routes a request
        # to the workers serving that name: the server serves the same folder.
        model = str(model_directory(args.model)) if args.gateway else args.model
        if args.address is None:
            flags = [*(["--model", model] if model else []), "--device", args.device, *args.server_arg]
            address = stack.enter_context(ServerProcess(*flags)).address
        else:
            address = args.address
        with grpc.insecure_channel(address) as channel:
            info = pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        rng = np.random.default_rng(args.seed)
        (lo_in, hi_in), (lo_out, hi_out) = (map(int, r.split(":")) for r in (args.input_len, args.output_len))
        vocab = args.vocab or info.vocab_size
        prompts = [rng.integers(0, vocab, rng.integers(lo_in, hi_in + 1)).tolist() for _ in range(args.num_prompts)]
        outputs = rng.integers(lo_out, hi_out + 1, args.num_prompts).tolist()
        senders = {"gRPC": lambda: grpc_sender(address)}
        if args.gateway:
            gateway = stack.enter_context(GatewayProcess([address], Path(model), "--policy", "round_robin"))
            senders["gateway"] = lambda: openai_sender(gateway.url, gateway.model)
            prompts = as_text(prompts, Path(model))
        runs = []
        config = load_config(model) if info.backend == "cuda" and args.address is None else None
        context = np.mean([len(p) for p in prompts]) + np.mean(outputs) / 2
        print(f"model {info.model} on {info.backend}; {args.num_prompts} requests, input {args.input_len}, output {args.output_len}"
              + ("; prompts as text, the same through both paths" if args.gateway else ""))
        print(f"{'path':>7} | {'conc':>5} | {'ok':>4} | {'fail':>4} | {'out tok/s':>9} | {'floor':>7} | "
              f"{'TTFT p50/p90/p99 ms':>22} | {'TPOT p50/p90/p99 ms':>20} | {'ITL p50/p90/p99 ms':>20}")
        for conc in (int(c) for c in args.max_concurrency.split(",")):
            floor = decode_floor_tokens_per_s(config, min(conc, args.num_prompts), context) if config else None
            for path, sender in senders.items():
                flush_prefix_cache(address)  # (every run sends the same prompts: none may find the last one's)
                r = {"path": path, **asyncio.run(run_load(sender(), prompts, outputs, conc, args.request_rate, args.seed)),
                     "floor_output_tokens_per_s": floor}
                runs.append(r)
                t, p, i = r["ttft_ms"], r["tpot_ms"], r["itl_ms"]
                print(f"{path:>7} | {conc:>5} | {r['completed']:>4} | {r['failed']:>4} | {r['output_tokens_per_s']:9.1f} | "
                      f"{f'{floor:7.0f}' if floor else '      -'} | "
                      f"{t['p50']:6.1f} {t['p90']:7.1f} {t['p99']:7.1f} | {p['p50']:6.2f} {p['p90']:6.2f} {p['p99']:6.2f} | "
                      f"{i['p50']:6.2f} {i['p90']:6.2f} {i['p99']:6.2f}")
        result = {"model": info.model, "backend": info.backend, "num_prompts": args.num_prompts,
                  "input_len": args.input_len, "output_len": args.output_len, "runs": runs}
        if args.result_json:
            Path(args.result_json).write_text(json.dumps(result, indent=2))
        if args.plot:
            plot([r for r in runs if r["path"] == "gRPC"], args.plot)


def flush_prefix_cache(address: str) -> None:
    """Drop the server's cached prefixes (the idle server's: all of them)."""
    with grpc.insecure_channel(address) as channel:
        pb_grpc.GenerationStub(channel).FlushCache(pb.FlushCacheRequest(), timeout=30)
    time.sleep(0.1)  # (applied before the engine's next step)


def as_text(prompts: list[list[int]], model_dir: Path) -> list[str]:
    """The random prompts as text, decoded by the model's tokenizer (what both paths send)."""
    tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return tokenizer.decode_batch(prompts, skip_special_tokens=True)


if __name__ == "__main__":
    main()
