"""Load-test a llamastream server over gRPC, in the manner of `vllm bench serve`.

    python bench/serve.py --model DIR --device cuda --max-concurrency 1,16,64,256 \\
        --num-prompts 256 --result-json serve.json --plot serve.png

Starts `python -m server serve` with --model/--device (or uses --address), sends
--num-prompts requests of random token ids (input and output lengths uniform in the
given ranges, eos ignored) at --request-rate (Poisson; inf = all at once) with at most
--max-concurrency in flight, once per concurrency in the list. Reports, per run:
output tokens/s, requests/s, and time to first token (TTFT), time per output token
after the first (TPOT) and inter-token latency between stream messages (ITL) at
p50/p90/p99. A message can carry several tokens when a reader falls behind; ITL is
per message, TPOT per token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llamastream.v1 import generation_pb2 as pb  # noqa: E402
from llamastream.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402
from devtools.servers import ServerProcess  # noqa: E402


@dataclass
class RequestResult:
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


async def one_request(stub, ids: list[int], max_tokens: int) -> RequestResult:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(temperature=0.0),
                                 stop=pb.StopCriteria(max_tokens=max_tokens, ignore_eos=True))
    result = RequestResult(prompt_tokens=len(ids))
    start = last = time.perf_counter()
    try:
        async for msg in stub.Generate(request, timeout=3600):
            if msg.HasField("delta") and msg.delta.token_ids:
                now = time.perf_counter()
                if result.output_tokens == 0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
                result.output_tokens += len(msg.delta.token_ids)
    except grpc.aio.AioRpcError as e:
        result.error = f"{e.code().name}: {e.details()}"
    result.latency_s = time.perf_counter() - start
    return result


async def run_load(address: str, prompts, outputs, concurrency: int, rate: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    limit = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def limited(ids, n):
            async with limit:
                return await one_request(stub, ids, n)

        start = time.perf_counter()
        tasks = []
        for ids, n in zip(prompts, outputs):
            tasks.append(asyncio.create_task(limited(ids, n)))
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
    args = ap.parse_args()

    server = None
    if args.address is None:
        flags = [*(["--model", args.model] if args.model else []), "--device", args.device, *args.server_arg]
        server = ServerProcess(*flags).__enter__()
        address = server.address
    else:
        address = args.address
    try:
        with grpc.insecure_channel(address) as channel:
            info = pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        rng = np.random.default_rng(args.seed)
        (lo_in, hi_in), (lo_out, hi_out) = (map(int, r.split(":")) for r in (args.input_len, args.output_len))
        vocab = args.vocab or info.vocab_size
        prompts = [rng.integers(0, vocab, rng.integers(lo_in, hi_in + 1)).tolist() for _ in range(args.num_prompts)]
        outputs = rng.integers(lo_out, hi_out + 1, args.num_prompts).tolist()
        runs = []
        print(f"model {info.model} on {info.backend}; {args.num_prompts} requests, input {args.input_len}, output {args.output_len}")
        print(f"{'conc':>5} | {'ok':>4} | {'fail':>4} | {'out tok/s':>9} | {'TTFT p50/p90/p99 ms':>22} | {'TPOT p50/p90/p99 ms':>20} | {'ITL p50/p90/p99 ms':>20}")
        for conc in (int(c) for c in args.max_concurrency.split(",")):
            r = asyncio.run(run_load(address, prompts, outputs, conc, args.request_rate, args.seed))
            runs.append(r)
            t, p, i = r["ttft_ms"], r["tpot_ms"], r["itl_ms"]
            print(f"{conc:>5} | {r['completed']:>4} | {r['failed']:>4} | {r['output_tokens_per_s']:9.1f} | "
                  f"{t['p50']:6.1f} {t['p90']:7.1f} {t['p99']:7.1f} | {p['p50']:6.2f} {p['p90']:6.2f} {p['p99']:6.2f} | "
                  f"{i['p50']:6.2f} {i['p90']:6.2f} {i['p99']:6.2f}")
        result = {"model": info.model, "backend": info.backend, "num_prompts": args.num_prompts,
                  "input_len": args.input_len, "output_len": args.output_len, "runs": runs}
        if args.result_json:
            Path(args.result_json).write_text(json.dumps(result, indent=2))
        if args.plot:
            plot(runs, args.plot)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
