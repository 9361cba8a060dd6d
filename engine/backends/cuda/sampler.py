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

from engine.backends.cuda.driver import HostGate
from engine.backends.cuda.kernels import Kernels
from engine.sampler import SampleOutput, TokenLogprob, log_softmax
from engine.sequence import Sequence
from engine.structured import FillingMasks


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
        # Device memory kept from step to step: its copies queue after the kernels that
        # read the last step's (on the stream; for the masks, after `_masks_read`).
        self._fields = gpuarray.empty(0, np.int32)  # the sampling kernel's arrays, then the guided rows (grown as needed)
        self._masks: gpuarray.GPUArray | None = None  # allocate_masks
        # The masks go up on a stream of their own, so that their copy runs beside the
        # forward pass; the copy waits there (`gate`) for masks still being filled.
        self._copies = cuda.Stream()
        self.gate = HostGate(self._copies)
        self._masks_in, self._masks_read = cuda.Event(), cuda.Event()

    def allocate_masks(self, rows: int) -> None:
        """Room on the device for the masks of up to `rows` sequences (outside the memory
        pool, whose reuse is ordered on the main stream only: the copies' stream writes it)."""
        self._masks = gpuarray.empty((rows, -(-self.vocab_size // 32)), np.int32)

    def sample(self, logits: gpuarray.GPUArray, seqs: list[Sequence], sampled: gpuarray.GPUArray,
               tokens_host: np.ndarray, masks: np.ndarray | FillingMasks | None = None
               ) -> Callable[[], list[SampleOutput]]:
        """Queue sampling into `sampled` and the copy of the tokens to `tokens_host`;
        return what reads them once the stream has got that far. The rows of sequences
        with a guide keep only the tokens their row of `masks` allows (a row each, in
        order; in page-locked memory, CudaBackend.host_array, their upload does not
        wait for the stream). Masks still being filled are waited for by the device,
        not here."""
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
        filling = masks if isinstance(masks, FillingMasks) else None
        if filling is not None and any(seqs[i].guide is not None for i in requests.entry_rows):
            filling.result()  # (their bans read what filling the masks found: Sequence.banned_token_ids)
        generated = np.array([q.num_generated for q in seqs], np.int32)
        # one upload: the kernel's seven per-request arrays, row by row, then the guided rows
        fields = self._upload_fields(np.concatenate((requests.fields.ravel(), generated, np.array(guided, np.int32))))
        if guided:  # only those rows have masks: unguided rows cost nothing
            rows = filling.rows if filling is not None else masks
            self._copies.wait_for_event(self._masks_read)
            if filling is not None:
                number = self.gate.close()
                filling.done.add_done_callback(lambda _: self.gate.open(number))  # (however the filling ends)
            cuda.memcpy_htod_async(self._masks.gpudata, rows, self._copies)
            self._masks_in.record(self._copies)
            st.wait_for_event(self._masks_in)
            self.kernels.apply_token_bitmask(st, logits, self._masks, int(fields.gpudata) + 4 * 7 * S, len(guided),
                                             rows.shape[1], self.vocab_size)
            self._masks_read.record(st)
        self._apply_penalties(logits, seqs, requests.entry_rows)
        self.kernels.sample_tokens(st, sampled, logits, S, self.vocab_size,
                                   *(int(fields.gpudata) + 4 * S * i for i in range(7)))
        tokens = tokens_host[:S]
        cuda.memcpy_dtoh_async(tokens, sampled.gpudata, st)

        def collect() -> list[SampleOutput]:
            if filling is not None:
                filling.result()  # (raises what filling them raised)
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

    def _to_device(self, values, dtype) -> gpuarray.GPUArray:
        """A small host array to the device, queued on the stream, from the memory pool."""
        return gpuarray.to_gpu_async(np.asarray(values, dtype=dtype), allocator=self.allocate, stream=self.stream)

    def _upload_fields(self, values: np.ndarray) -> gpuarray.GPUArray:
        """int32 values into the kept device array, queued on the stream."""
        if self._fields.size < values.size:
            self._fields = gpuarray.empty(max(values.size, 2 * self._fields.size), np.int32, allocator=self.allocate)
        cuda.memcpy_htod_async(self._fields.gpudata, values, self.stream)
        return self._fields

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
        entries = [self._to_device(a, np.int32) for a in (rows, toks, counts, banned)]
        penalties = [self._to_device([getattr(q.params, name) for q in seqs], np.float32)
                     for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")]
        self.kernels.apply_penalties(self.stream, logits, self.vocab_size, len(rows), *entries, *penalties)
