"""CPU decode throughput: llamastream's CPU backends beside llama.cpp and Hugging Face
transformers, on the same GGUF files, the same prompts and the same cores, in one run:

    python bench/cpu_decode.py [--backends numpy,cpu,cpu-int8] [--new-tokens 128] [--repeats 3]
                               [--llama-cpp-python .venv-bench/bin/python] [--compare-with CHECKOUT]

(`make bench-cpu` builds llama-cpp-python into .venv-bench and runs this with it.) The
models: SmolLM2-135M-Instruct from the embedded Q4_1 GGUF at batch 1 and 8, and a random
Llama 3.2 1B-shaped model in Q8_0 and in Q4_0 at batch 1 (devtools/gguf_models.py writes
them into --models-dir on first use, a minute or two each).

Every engine generates exactly --new-tokens greedy tokens per sequence (eos ignored);
tokens/s counts them over the wall time of the whole generation, prefill included, the
best of --repeats runs after a warm-up run of a few tokens (the cores may be shared: the
load averages printed before and after say how busy they were). Each engine runs in a
process of its own, one at a time, so that no engine's threads or memory outlive its
figure, each on --threads threads (default: the cores this process may use; numpy's own
BLAS takes them all): llamastream's with each backend --backends names
(engine.backends.create_backend's, and cpu-int8: cpu with --cpu-activations int8; in a
fork of this process, which holds the model),
llama.cpp's (bench/llama_cpp_decode.py), transformers' in float32, dequantizing the GGUF,
where torch is installed (a fork too). A column an engine cannot fill says why.

Each figure is beside its ceiling: the batch over the floor of a step's time, the weight
bytes one step reads, as stored (quantized blocks; the tied embedding counted whole, as
the head that reads it all, plus the rows its lookup reads), over this machine's memory
read bandwidth (numpy's maximum of a 512 MiB array, one part a thread, measured here). The
KV cache's reads are left out of the floor: at these lengths they are a few MB a sequence.

--compare-with ranks two builds: each of llamastream's figures is measured for this tree
and for another checkout of it (its own engine and kernels), in fresh processes that take
turns, one timed run each, --repeats times; the best of each is shown, the other's in a
column of its own. The speed of a shared machine swings by a third or more within
minutes, so figures from separate runs rank nothing; taking turns within one run does.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
# the llamastream whose engine is measured: this tree's, or --compare-with's in a worker
sys.path.insert(0, os.environ.get("LLAMASTREAM_TREE", str(ROOT)))

from engine.backends import create_backend  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model_loader import LoadedModel, embedded_model_path, load_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Write a short poem about the sea.", "Explain photosynthesis simply.",
    "List three prime numbers.", "Why is the sky blue?", "Describe a cat in one sentence.",
    "What is 12 times 12?", "Name a famous painter.",
]
EMBED = "model.embed_tokens.weight"
WARMUP_TOKENS = 4


def memory_bandwidth() -> float:
    """Bytes per second of a large numpy copy (read + write)."""
    a = np.ones(2**27 // 4, dtype=np.float32)  # 128 MiB
    b = np.empty_like(a)
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(5))
    return 2 * a.nbytes / best


def read_bandwidth(threads: int) -> float:
    """Bytes per second read by `threads` threads each taking the maximum of its part of a
    512 MiB array (numpy lets go of the GIL in it): what a decode step's weight reads can
    reach. (A maximum, not a sum: numpy's float32 sum is slower than memory even in cache.)"""
    parts = np.array_split(np.ones(2**29 // 4, dtype=np.float32), threads)
    with ThreadPoolExecutor(threads) as pool:
        best = min(_timed(lambda: list(pool.map(np.max, parts))) for _ in range(5))
    return sum(p.nbytes for p in parts) / best


def matmul_flops() -> float:
    """FLOP/s of a large float32 numpy matmul: the compute peak this machine offers numpy."""
    a = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
    best = min(_timed(lambda: a @ a) for _ in range(5))
    return 2 * 1024**3 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def forked(fn, *args):
    """fn(*args) in a fork of this process, and its result; an exception in it is raised
    here as a RuntimeError saying what it was, as is the fork's death."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def child() -> None:
        try:
            send.send((True, fn(*args)))
        except Exception as e:
            send.send((False, f"{type(e).__name__}: {e}"))

    process = context.Process(target=child)
    process.start()
    send.close()  # (so that the fork's death ends the wait below)
    try:
        ok, result = receive.recv()
    except EOFError:
        ok, result = False, "the process died"
    process.join()
    if not ok:
        raise RuntimeError(f"{result} (exit code {process.exitcode})" if process.exitcode else result)
    return result


def step_bytes(model: LoadedModel, batch: int) -> int:
    """Weight bytes one decode step of `batch` sequences reads, as stored: every matrix
    and norm, the head (the embedding whole, if tied), and a row of the embedding each."""
    w = model.weights
    embed = w[EMBED]
    head = 0 if "lm_head.weight" in w else embed.nbytes
    return sum(t.nbytes for name, t in w.items() if name != EMBED) + head + batch * embed.nbytes // embed.shape[0]


def ours(model: LoadedModel, backend_name: str, prompts: list[list[int]], new_tokens: int, repeats: int,
         threads: int) -> tuple[float, str]:
    """Tokens/s of llamastream's engine on `backend_name`, greedy, and the backend's class
    (what the name means today); `threads` is the cpu backend's. The prefix cache is off: the warm-up's prompts would
    otherwise spare the timed run's prefill."""
    device, _, activations = backend_name.partition("-")  # (cpu-int8: the cpu backend with int8 activations)
    backend = create_backend(device, model.config, model.model_weights(), threads=threads,
                             cpu_activations=activations or "int16")
    blocks = len(prompts) * (-(-(max(map(len, prompts)) + new_tokens) // 16) + 1)  # (16: the block size)
    engine = LLMEngine(model, backend, EngineConfig(num_kv_blocks=blocks, max_num_seqs=len(prompts),
                                                    max_model_len=blocks * 16, enable_prefix_caching=False))

    def generate(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add(engine.make_sequence(f"r{i}", p, params))
        generated = 0
        while engine.has_work():
            generated += sum(len(o.token_ids) for o in engine.step())
        assert generated == n * len(prompts)
        return time.perf_counter() - start

    generate(WARMUP_TOKENS)
    return new_tokens * len(prompts) / min(generate(new_tokens) for _ in range(repeats)), type(backend).__name__


def ours_in(tree: Path, path: Path, backend_name: str, prompts: list[list[int]], new_tokens: int,
            threads: int) -> tuple[float, str]:
    """ours() with the engine and kernels of the llamastream checkout `tree`, in a fresh
    process (this script's --worker): one timed run."""
    job = {"path": str(path), "backend": backend_name, "prompts": prompts, "new_tokens": new_tokens, "threads": threads}
    run = subprocess.run([sys.executable, __file__, "--worker"], input=json.dumps(job), capture_output=True, text=True,
                         env={**os.environ, "LLAMASTREAM_TREE": str(tree)})
    if run.returncode != 0:
        raise RuntimeError(f"{tree}: {run.stderr.strip()[-2000:]}")
    result = json.loads(run.stdout.splitlines()[-1])
    return result["tokens_per_s"], result["backend"]


def taking_turns(trees: list[Path], path: Path, backend_name: str, prompts: list[list[int]], new_tokens: int,
                 threads: int, repeats: int) -> list[tuple[float, str]]:
    """The best tokens/s of each tree's engine and its backend's class, the trees' runs
    taking turns `repeats` times."""
    runs: list[list[tuple[float, str]]] = [[] for _ in trees]
    for _ in range(repeats):
        for tree, results in zip(trees, runs):
            results.append(ours_in(tree, path, backend_name, prompts, new_tokens, threads))
    return [max(results) for results in runs]


def worker() -> None:
    """--worker: one job of ours_in (JSON on stdin), its result as JSON on stdout."""
    job = json.load(sys.stdin)
    tps, backend = ours(load_model(Path(job["path"])), job["backend"], job["prompts"], job["new_tokens"], 1,
                        job["threads"])
    print(json.dumps({"tokens_per_s": tps, "backend": backend}))


def llama_cpp(python: str | None, path: Path, prompts: list[list[int]], new_tokens: int, threads: int,
              repeats: int) -> tuple[float | None, str]:
    """llama.cpp's tokens/s and its build (or None and why not), from
    bench/llama_cpp_decode.py run by `python`."""
    if python is None:
        return None, "llama-cpp-python is not installed: `make bench-cpu` builds it into .venv-bench"
    if shutil.which(python) is None:
        return None, f"{python} does not exist: `make bench-cpu` builds llama-cpp-python into .venv-bench"
    command = [python, str(ROOT / "bench" / "llama_cpp_decode.py"), str(path), "--threads", str(threads),
               "--new-tokens", str(new_tokens), "--repeats", str(repeats)]
    run = subprocess.run(command, input=json.dumps(prompts), capture_output=True, text=True)
    crashed = ""
    if run.returncode < 0:  # killed by a signal: on a CPU with AMX, its AMX buffers have crashed (SIGSEGV)
        crashed = (f"crashed (signal {-run.returncode}) with its extra buffer types (AMX tiles, repacked blocks) on "
                   "this CPU, so measured without them (--no-extra-buffers); ")
        run = subprocess.run(command + ["--no-extra-buffers"], input=json.dumps(prompts), capture_output=True, text=True)
    if run.returncode != 0:
        return None, f"{crashed}bench/llama_cpp_decode.py failed ({run.returncode}): {run.stderr.strip()[-2000:]}"
    result = json.loads(run.stdout)
    return result["tokens_per_s"], f"{crashed}llama-cpp-python {result['version']}: {result['system_info']}"


def default_llama_cpp_python() -> str | None:
    """.venv-bench's interpreter if `make bench-cpu` built it, else this one if it has
    llama-cpp-python, else None."""
    bench = ROOT / ".venv-bench" / "bin" / "python"
    if bench.exists():
        return str(bench)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    return sys.executable


def transformers_tps(path: Path, prompts: list[list[int]], new_tokens: int, threads: int,
                     repeats: int) -> tuple[float | None, str]:
    """transformers' float32 tokens/s on the GGUF file (dequantized as it loads), greedy,
    the prompts left-padded into one batch; or None and why not."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as transformers_logging
        import accelerate  # noqa: F401 (transformers loads GGUF files only with it)
    except ImportError as e:
        return None, (f"{e.name or e} is not installed here (pip install torch transformers accelerate, to add "
                      "this column)")
    transformers_logging.disable_progress_bar()  # (its loader's bars would break the table)
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def generate(n: int) -> float:
        with torch.no_grad():
            start = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
            elapsed = time.perf_counter() - start
        assert out.shape[1] - width == n
        return elapsed

    generate(WARMUP_TOKENS)
    seconds = min(generate(new_tokens) for _ in range(repeats))
    return new_tokens * len(prompts) / seconds, f"transformers float32, torch {torch.__version__}"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit(tree: Path = ROOT) -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=tree,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + (" with uncommitted changes" if dirty else "")


def models(models_dir: Path) -> list[tuple[str, Path, list[int]]]:
    """(label, GGUF file, batch sizes) of each model measured, writing the 1B-shaped
    files if they are missing."""
    from devtools.checkpoints import LLAMA_32_1B
    from devtools.gguf_models import TYPES, write_gguf

    cases = [("SmolLM2-135M Q4_1", embedded_model_path(), [1, 8])]
    for kind in ("q8_0", "q4_0"):
        path = models_dir / f"llama-3.2-1b-random.{kind}.gguf"
        if not path.exists():
            print(f"writing {path} (a random Llama 3.2 1B-shaped model in {kind.upper()}, a minute or two)", flush=True)
            models_dir.mkdir(parents=True, exist_ok=True)
            write_gguf(path, LLAMA_32_1B, TYPES[kind])
        cases.append((f"Llama-3.2-1B-shaped {kind.upper()}", path, [1]))
    return cases


def prompts_for(model: LoadedModel) -> list[list[int]]:
    """The questions as token ids: in the chat template where the model has one."""
    tok = model.tokenizer
    if tok.chat_template:
        return [tok.encode_chat([{"role": "user", "content": q}])[0] for q in QUESTIONS]
    return [tok.encode(q) for q in QUESTIONS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="numpy,cpu,cpu-int8",
                    help="llamastream's backends, by create_backend's names; cpu-int8: cpu with --cpu-activations int8")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each figure, the best taken")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="every engine's")
    ap.add_argument("--llama-cpp-python", default=default_llama_cpp_python(),
                    help="an interpreter with llama-cpp-python (default: .venv-bench's, else this one's if it has it)")
    ap.add_argument("--models-dir", type=Path, default=ROOT / "bench" / "out")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--compare-with", type=lambda p: Path(p).resolve(), metavar="CHECKOUT",
                    help="another llamastream checkout, measured taking turns with this one (see above)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker()
    backends = [b for b in args.backends.split(",") if b]
    other = f"@{commit(args.compare_with)}" if args.compare_with else None
    trees = [ROOT, args.compare_with] if other else [ROOT]
    suffixes = ["", other] if other else [""]  # of a backend's columns: this tree's, then the other's
    cases = models(args.models_dir)

    bandwidth = read_bandwidth(args.threads)
    print(f"machine: {cpu_name()}, {len(os.sched_getaffinity(0))} cores, {platform.system()} {platform.release()}; "
          f"memory read {bandwidth / 1e9:.1f} GB/s ({args.threads} threads), copy {memory_bandwidth() / 1e9:.1f} GB/s")
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; llamastream {commit()}; "
          f"load average {os.getloadavg()[0]:.1f}")
    if other:
        print(f"each backend also as {args.compare_with} ({other[1:]}) has it, in the columns NAME{other}, "
              "its runs and this tree's taking turns")
    print(f"{args.new_tokens} greedy tokens a sequence, best of {args.repeats}; tok/s (in brackets: of the ceiling, "
          "the batch over the floor, bytes a step / bandwidth)")
    ours_columns = [c for b in backends for c in [b + s for s in suffixes]]
    columns = [*ours_columns, "llama.cpp", "transformers"]
    widths = [max(14, len(c)) for c in columns]
    header = " | ".join([f"{'model':<26}", f"{'batch':>5}", f"{'MB/step':>7}", f"{'floor ms':>8}", f"{'ceiling':>7}",
                         *(f"{c:>{w}}" for c, w in zip(columns, widths))])
    print(header)
    print("-" * len(header))
    notes: dict[str, list[str]] = {}  # a column's note: the rows it is true of
    for label, path, batches in cases:
        model = load_model(path)
        prompts = prompts_for(model)
        for batch in batches:
            ps = prompts[:batch]
            floor = step_bytes(model, batch) / bandwidth
            ceiling = batch / floor
            row = f"{label} batch {batch}"
            cells = []
            for name in backends:
                try:
                    if other:
                        results = taking_turns(trees, path, name, ps, args.new_tokens, args.threads, args.repeats)
                    else:
                        results = [forked(ours, model, name, ps, args.new_tokens, args.repeats, args.threads)]
                    for (tps, cls), column in zip(results, [name + s for s in suffixes]):
                        notes.setdefault(f"{column}: {cls}", []).append(row)
                        cells.append(tps)
                except RuntimeError as e:  # (an unknown name, a missing compiler, a format it does not serve)
                    notes.setdefault(f"{name}: skipped, {e}", []).append(row)
                    cells.extend([None] * len(trees))
            tps, note = llama_cpp(args.llama_cpp_python, path, ps, args.new_tokens, args.threads, args.repeats)
            notes.setdefault(f"llama.cpp: {note}", []).append(row)
            cells.append(tps)
            if args.no_transformers:
                tps, note = None, "left out (--no-transformers)"
            else:
                try:
                    tps, note = forked(transformers_tps, path, ps, args.new_tokens, args.threads, args.repeats)
                except RuntimeError as e:
                    tps, note = None, f"failed, {e}"
            notes.setdefault(f"transformers: {note}", []).append(row)
            cells.append(tps)
            text = [f"{f'{t:7.1f} ({t / ceiling:3.0%})' if t else '-':>{w}}" for t, w in zip(cells, widths)]
            megabytes = step_bytes(model, batch) / 1e6
            print(" | ".join([f"{label:<26}", f"{batch:>5}", f"{megabytes:7.1f}", f"{floor * 1e3:8.2f}",
                             f"{ceiling:7.1f}", *text]), flush=True)
        del model
    rows = sum(len(b) for _, _, b in cases)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    print("notes:")
    for note, where in notes.items():
        print(f"  {note}" + ("" if len(where) == rows else f" ({'; '.join(where)})"))


if __name__ == "__main__":
    main()
