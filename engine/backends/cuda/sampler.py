"""Sampling on the GPU (sampling.cu): penalties and bans applied to the logits in place,
then one token drawn per row into `sampled`, of which only the token ids are copied to
the host. Logprobs, where asked for, describe the raw distribution: those rows are read
before the penalties."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pycuda.driver as cuda
import pycuda.gpuarray as gpuarray

from engine.backends.cuda.kernels import Kernels
from engine.sampler import SampleOutput, TokenLogprob, log_softmax
from engine.sequence import Sequence


@dataclass
class BatchRequests:
    """What sampling reads of a batch's requests that stays fixed while they run."""

    seqs: list[Sequence]
    fields: np.ndarray  # int32 [6, rows]: the sampling kernel's per-request arrays but the last (tokens generated)
    logprob_rows: list[int]  # rows that want logprobs
    entry_rows: list[int]  # rows that may penalise or ban tokens: with penalties or min_tokens (_apply_penalties)

    @classmethod
    def of(cls, seqs: list[Sequence]) -> BatchRequests:
        p = [q.params for q in seqs]
        fields = np.stack([
            np.array([x.temperature for x in p], np.float32).view(np.int32),
            np.array([x.top_p for x in p], np.float32).view(np.int32),
            np.array([x.top_k for x in p], np.int32),
            np.array([x.min_p for x in p], np.float32).view(np.int32),
            np.array([q.seed & 0xFFFFFFFF for q in seqs], np.uint32).view(np.int32),
            np.array([(q.seed >> 32) & 0xFFFFFFFF for q in seqs], np.uint32).view(np.int32),
        ])
        return cls(list(seqs), fields, [i for i, x in enumerate(p) if x.top_logprobs is not None],
                   [i for i, x in enumerate(p) if x.has_penalties or x.min_tokens])


class GpuSampler:
    def __init__(self, kernels: Kernels, stream, vocab_size: int, allocate):
        self.kernels, self.stream, self.vocab_size, self.allocate = kernels, stream, vocab_size, allocate
        # the last batch's: a decode samples the same sequences step after step
        self._requests = BatchRequests.of([])

    def sample(self, logits: gpuarray.GPUArray, seqs: list[Sequence], sampled: gpuarray.GPUArray,
               tokens_host: np.ndarray, masks: np.ndarray | None = None) -> Callable[[], list[SampleOutput]]:
        """Queue sampling into `sampled` and the copy of the tokens to `tokens_host`;
        return what reads them once the stream has got that far. The rows of sequences
        with a guide keep only the tokens their row of `masks` allows (a row each, in
        order; in page-locked memory, CudaBackend.host_array, their upload does not
        wait for the stream)."""
        st, S = self.stream, len(seqs)
        if seqs != self._requests.seqs:
            self._requests = BatchRequests.of(seqs)
        requests = self._requests
        raw = {}
        if requests.logprob_rows:
            host = logits.get(stream=st)
            st.synchronize()
            raw = {i: log_softmax(host[i].astype(np.float64)) for i in requests.logprob_rows}
        guided = [i for i, q in enumerate(seqs) if q.guide is not None] if masks is not None else []
        if guided:  # only those rows have masks: unguided rows cost nothing
            rows = gpuarray.empty(masks.shape, np.int32, allocator=self.allocate)
            cuda.memcpy_htod_async(rows.gpudata, np.ascontiguousarray(masks, np.int32), st)
            self.kernels.apply_token_bitmask(st, logits, rows, self._upload(guided, np.int32), len(guided),
                                             masks.shape[1], self.vocab_size)
        self._apply_penalties(logits, seqs, requests.entry_rows)
        generated = np.array([q.num_generated for q in seqs], np.int32)
        # one upload: the kernel's seven per-request arrays, row by row
        fields = self._upload(np.concatenate((requests.fields, generated[None])), np.int32)
        rows = [int(fields.gpudata) + 4 * S * i for i in range(7)]
        self.kernels.sample_tokens(st, sampled, logits, S, self.vocab_size, *rows)
        tokens = tokens_host[:S]
        cuda.memcpy_dtoh_async(tokens, sampled.gpudata, st)

        def collect() -> list[SampleOutput]:
            if not raw:  # (no logprobs: the tokens alone)
                return [SampleOutput(t) for t in tokens.tolist()]
            results = []
            for i, (q, t) in enumerate(zip(seqs, tokens.tolist())):
                lp = None
                if i in raw:
                    top = np.argsort(-raw[i], kind="stable")[: q.params.top_logprobs]
                    lp = TokenLogprob(t, float(raw[i][t]), [(int(j), float(raw[i][j])) for j in top])
                results.append(SampleOutput(t, lp))
            return results
        return collect

    def _upload(self, values, dtype) -> gpuarray.GPUArray:
        """A small host array to the device, queued on the stream, from the memory pool."""
        return gpuarray.to_gpu_async(np.asarray(values, dtype=dtype), allocator=self.allocate, stream=self.stream)

    def _apply_penalties(self, logits: gpuarray.GPUArray, seqs: list[Sequence], candidates: list[int]) -> None:
        """An entry per (row, token) to penalise or ban: the prompt's and output's tokens
        of rows with penalties, the banned tokens of every row. Only the `candidates` rows
        can have any (a sequence bans tokens only before its min_tokens)."""
        rows, toks, counts, banned = [], [], [], []
        for i in candidates:
            q = seqs[i]
            pp = q.params
            ban = set(q.banned_token_ids())  # one entry per token: two would race
            if pp.has_penalties:
                seen = np.unique(np.asarray(q.prompt_ids + q.output_ids))
                out_ids, out_counts = np.unique(np.asarray(q.output_ids, dtype=np.int64), return_counts=True)
                count = dict(zip(out_ids.tolist(), out_counts.tolist()))
                for t in seen.tolist():
                    if t not in ban:
                        rows.append(i); toks.append(t); counts.append(count.get(t, 0)); banned.append(0)
            for t in ban:
                rows.append(i); toks.append(t); counts.append(0); banned.append(1)
        if not rows:
            return
        entries = [self._upload(a, np.int32) for a in (rows, toks, counts, banned)]
        penalties = [self._upload([getattr(q.params, name) for q in seqs], np.float32)
                     for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")]
        self.kernels.apply_penalties(self.stream, logits, self.vocab_size, len(rows), *entries, *penalties)
