"""llama.cpp's greedy decode throughput on a GGUF file, through llama-cpp-python's
low-level API (llama_batch / llama_decode, so that a batch of sequences decodes
together as in llama.cpp's own batched tools). bench/cpu_decode.py runs it in the
interpreter where llama-cpp-python is built (`make bench-cpu`: .venv-bench), a process
of its own, so that neither engine's threads or memory weigh on the other's figures:

    python bench/llama_cpp_decode.py MODEL.gguf --threads 2 [--new-tokens 128] [--repeats 1]
                                     [--no-extra-buffers] < prompts.json

stdin holds the prompts' token ids (a JSON list of lists, one sequence each); stdout
gets one JSON object: tokens/s, the same way as bench/cpu_decode.py counts them (every
sequence's `--new-tokens` greedy tokens, eos ignored, over the wall time of prefill and
decode together, the best of `--repeats` runs after a short warm-up run), and what
llama.cpp was built with.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import llama_cpp as lc

WARMUP_TOKENS = 4


class Decoder:
    """A llama.cpp context for `prompts`, each its own sequence, and a greedy sampler."""

    def __init__(self, path: str, prompts: list[list[int]], new_tokens: int, threads: int, extra_buffers: bool = True):
        lc.llama_backend_init()
        model_params = lc.llama_model_default_params()
        model_params.use_extra_bufts = extra_buffers  # (its weights repacked for AMX tiles or interleaved CPU blocks)
        self.model = lc.llama_model_load_from_file(path.encode(), model_params)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path} (its log, above, says why)")
        params = lc.llama_context_default_params()
        prompt_tokens = sum(map(len, prompts))
        per_sequence = max(map(len, prompts)) + new_tokens
        params.n_ctx = -(-len(prompts) * per_sequence // 256) * 256
        params.n_batch = params.n_ubatch = max(prompt_tokens, 512)  # (the prefill in one llama_decode)
        params.n_seq_max = len(prompts)
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise SystemExit(f"llama.cpp could not make a context of {params.n_ctx} tokens for {path}")
        self.sampler = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        lc.llama_sampler_chain_add(self.sampler, lc.llama_sampler_init_greedy())
        self.batch = lc.llama_batch_init(max(prompt_tokens, len(prompts)), 0, 1)
        self.prompts = prompts

    def _fill(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """The batch: (token, position, sequence, wants logits) each."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq

    def _decode(self) -> None:
        if (rc := lc.llama_decode(self.ctx, self.batch)) != 0:
            raise SystemExit(f"llama_decode failed with {rc}")

    def run(self, new_tokens: int) -> float:
        """Seconds to generate `new_tokens` tokens for every prompt, from an empty cache."""
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        entries, outputs = [], []
        for seq, prompt in enumerate(self.prompts):
            entries += [(t, pos, seq, pos == len(prompt) - 1) for pos, t in enumerate(prompt)]
            outputs.append(len(entries) - 1)
        self._fill(entries)
        self._decode()
        for step in range(new_tokens):
            tokens = [lc.llama_sampler_sample(self.sampler, self.ctx, i) for i in outputs]
            if step == new_tokens - 1:
                break
            self._fill([(t, len(p) + step, seq, True) for seq, (t, p) in enumerate(zip(tokens, self.prompts))])
            outputs = list(range(len(self.prompts)))
            self._decode()
        return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-extra-buffers", dest="extra_buffers", action="store_false",
                    help="keep the weights as the file stores them (no AMX or repacked CPU buffers)")
    args = ap.parse_args()
    prompts = json.load(sys.stdin)
    decoder = Decoder(args.model, prompts, args.new_tokens, args.threads, args.extra_buffers)
    decoder.run(WARMUP_TOKENS)
    seconds = min(decoder.run(args.new_tokens) for _ in range(args.repeats))
    print(json.dumps({
        "tokens_per_s": args.new_tokens * len(prompts) / seconds,
        "version": lc.__version__,
        "system_info": lc.llama_print_system_info().decode().strip(),
    }))


if __name__ == "__main__":
    main()
