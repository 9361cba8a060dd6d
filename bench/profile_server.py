"""Where the server's Python time goes under load: `llamastream serve --engine-in-process`
runs in this process with its engine thread and its RPC loop thread each under
cProfile, while `bench/serve.py` (a process of its own) sends the offline workload
through gRPC. Prints the load's summary, then both profiles by own time. (Served
this way, the two threads share one GIL; by default the engine runs in a process of
its own, and each profile is what one process spends.)

    python bench/profile_server.py --model DIR --device cuda --max-num-seqs 256 --max-num-batched-tokens 8192
    python bench/profile_server.py --num-prompts 16        # the embedded model, on the CPU

--num-prompts and --max-concurrency (default 256 each) go to the load; every other
flag to `llamastream serve`, whose --host and --port are chosen here.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.engine_loop import EngineLoop  # noqa: E402
from server import cli  # noqa: E402
from server.app import Server  # noqa: E402
from devtools.servers import free_port, wait_serving  # noqa: E402

ENGINE, LOOP = cProfile.Profile(), cProfile.Profile()


def profile_engine_thread() -> None:
    run = EngineLoop._run

    def profiled(self) -> None:
        ENGINE.enable()
        try:
            run(self)
        finally:
            ENGINE.disable()
    EngineLoop._run = profiled


def profile_loop_thread() -> None:
    start = Server.start

    async def enable() -> None:  # cProfile profiles the thread that enables it: the loop's
        LOOP.enable()

    def started(self) -> None:
        start(self)
        self._on_aio(enable())
    Server.start = started


def drive_load(address: str, prompts: int, concurrency: int) -> None:
    """The client, in its own process; then SIGINT, which drains the server."""
    try:
        wait_serving(address)
        subprocess.run([sys.executable, str(ROOT / "bench" / "serve.py"), "--address", address, "--num-prompts", str(prompts),
                        "--max-concurrency", str(concurrency)], check=True)
    finally:
        os.kill(os.getpid(), signal.SIGINT)


def report(title: str, profile: cProfile.Profile) -> None:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(30)
    print(f"\n=== {title} ===\n{out.getvalue()}")


def main() -> int:
    load = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    load.add_argument("--num-prompts", type=int, default=256)
    load.add_argument("--max-concurrency", type=int, default=256)
    args, serve_args = load.parse_known_args()
    port = free_port()
    profile_engine_thread()
    profile_loop_thread()
    threading.Thread(target=drive_load, args=(f"127.0.0.1:{port}", args.num_prompts, args.max_concurrency), daemon=True).start()
    code = cli.main(["serve", *serve_args, "--engine-in-process", "--host", "127.0.0.1", "--port", str(port)])
    report("engine thread", ENGINE)
    report("RPC loop thread", LOOP)
    return code


if __name__ == "__main__":
    sys.exit(main())
