"""Continuous batching of the speech-token LM across concurrent requests.

:class:`BatchingLM` has the same ``inference(...)`` as :class:`~cosyserve.models.llm.TransformerLM`, so a
:class:`~cosyserve.runtime.pipeline.Pipeline` uses it unchanged; several pipeline threads then share one model.
Every call registers a request with one decode-loop thread, which alone owns the LM's KV cache (one cache row per
request). Between steps requests join (their prompt is prefilled into a free row) and leave (EOS, ``max_len``, or
their consumer closed the generator / went away: the row is freed at the next step). Each step samples every row
whose consumer is waiting for a token, hands the tokens out through per-request queues, then runs ONE batched
decode for all rows that continue (each row at its own position; its mask hides other rows' and stale positions).

Sampling is the unbatched code path (:func:`~cosyserve.models.llm.ras_sample`, the EOS mask before ``min_len``)
with the request's own ``torch.Generator``, and a row is sampled only while its consumer waits in ``next()``.
The pipeline draws flow and vocoder noise from the same generator between tokens (streaming), so sampling ahead
would change the order of draws; sampling on demand keeps it exactly that of the unbatched LM, and the generator
is never used by two threads at once (the consumer is blocked while the loop samples for it). The row's next
decode does not wait for demand: it runs in the step that samples the token, overlapping the consumer's work.

Batched and unbatched runs give the same tokens for the same seeds; log-probabilities differ only by float
rounding (matrix products over a different batch size, softmax over masked extra keys), well under 1e-4.

Sharing the other modules between pipeline threads is safe: the text encoder, flow and HiFT keep no per-call
state on the module (per-request state lives in the caller's generators); the one lazily grown object, the
relative-position table of each encoder, may be rebuilt twice by racing threads but is never read torn (its
rows do not depend on the table's length). Stacking those modules' concurrent calls is
:mod:`cosyserve.runtime.stacking`'s job.
"""

from __future__ import annotations

import heapq
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cosyserve.models.llm import SamplingConfig, TransformerLM, ras_sample
from cosyserve.runtime.cores import CoreShare

logger = logging.getLogger(__name__)

__all__ = ["BatchStats", "BatchingLM"]

_DONE = object()  # end of a request's tokens
_SEQ_ALIGN = 256  # cache positions grow in multiples of this


class _Request:
    """One request's LM state: set up by its consumer, then advanced only by the loop thread."""

    def __init__(
        self,
        lm_input: Tensor,
        min_len: int,
        max_len: int,
        sampling: SamplingConfig,
        generator: torch.Generator,
    ) -> None:
        self.lm_input = lm_input  # (1, T0, C)
        self.min_len = min_len
        self.max_len = max_len
        self.sampling = sampling
        self.generator = generator
        self.out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # under the scheduler's condition
        self.wants = False  # the consumer waits for its next token
        self.cancelled = False  # the consumer is gone
        self.finished = False  # the loop sent _DONE or an error
        # loop thread only
        self.row = -1
        self.pos = 0  # next cache position written
        self.produced = 0  # tokens sampled so far
        self.history: Tensor | None = None  # (1, win_size) last tokens for ras_sample, -1 for none
        self.logp: Tensor | None = None  # (1, V) log-probabilities of the next token, not yet sampled
        self.last_step = -1  # the step that last handed this request a token


@dataclass
class BatchStats:
    """Counters of the decode loop (read them for benchmarks and metrics)."""

    steps: int = 0  # batched decode steps
    rows_decoded: int = 0  # sum of their batch sizes
    prefills: int = 0
    tokens: int = 0  # tokens handed out
    peak_rows: int = 0

    @property
    def mean_batch(self) -> float:
        return self.rows_decoded / self.steps if self.steps else 0.0


class BatchingLM:
    """A :class:`TransformerLM` shared by concurrent requests through one decode loop.

    Args:
        lm: the model; from now on only the loop thread may touch its KV caches.
        max_batch_size: cache rows, i.e. requests decoded together; more wait (FIFO) for a free row.
        torch_threads: torch intra-op threads of the loop thread: a count, a
            :class:`~cosyserve.runtime.cores.CoreShare` (its share, set again before every step) or None (torch's
            default).
        gather_s: after a step, how long the loop waits for the consumers it just served to ask for their next
            token before stepping without them (they are usually back within microseconds; one that is busy
            with the vocoder misses at most this once per chunk).
        name: for the thread's name and logs.
    """

    def __init__(
        self,
        lm: TransformerLM,
        max_batch_size: int,
        *,
        torch_threads: int | CoreShare | None = None,
        gather_s: float = 0.002,
        name: str = "lm",
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if gather_s < 0:
            raise ValueError(f"gather_s must be >= 0, got {gather_s}")
        self.lm = lm
        self.max_batch_size = max_batch_size
        self.torch_threads = torch_threads
        self.gather_s = gather_s
        self.name = name
        self.stats = BatchStats()
        self._cv = threading.Condition()
        self._waiting: deque[_Request] = deque()  # joined, no row yet
        self._active: list[_Request] = []  # holding a row
        self._free_rows = list(range(max_batch_size))  # a heap: the lowest rows are reused first
        self._thread: threading.Thread | None = None
        self._closed = False
        self._step_no = 0

    @property
    def cfg(self) -> Any:
        return self.lm.cfg

    @property
    def active(self) -> int:
        """Requests holding a cache row now."""
        return len(self._active)

    # --- consumer side (pipeline threads) -------------------------------------------------------------------

    @torch.inference_mode()
    def inference(
        self,
        text: Tensor,
        text_len: Tensor,
        prompt_text: Tensor,
        prompt_text_len: Tensor,
        prompt_speech_token: Tensor,
        prompt_speech_token_len: Tensor,
        embedding: Tensor,
        *,
        sampling: SamplingConfig | None = None,
        max_token_text_ratio: float = 20.0,
        min_token_text_ratio: float = 2.0,
        generator: torch.Generator | None = None,
        max_tokens: int | None = None,
    ) -> Iterator[int]:
        """Generate speech token ids as :meth:`TransformerLM.inference` does, decoded in the shared batch.

        Same arguments, same tokens for the same generator state. Closing the generator (or dropping it) frees
        the request's cache row at the loop's next step.
        """
        # The prompt is encoded here, in the consumer's thread: the text encoder has no cache to share.
        lm_input, min_len, max_len, sampling, generator = self.lm.prepare_inference(
            text, text_len, prompt_text, prompt_text_len, prompt_speech_token, prompt_speech_token_len, embedding,
            sampling, max_token_text_ratio, min_token_text_ratio, generator, max_tokens,
        )  # fmt: skip
        if max_len <= 0:
            return
        req = _Request(lm_input, min_len, max_len, sampling, generator)
        self._join(req)
        try:
            while True:
                with self._cv:
                    req.wants = True
                    self._cv.notify()
                item = req.out.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise RuntimeError(f"batched LM ({self.name}) failed: {item!r}") from item
                yield item
        finally:
            with self._cv:
                if not req.finished:
                    req.cancelled = True
                    self._cv.notify()

    def _join(self, req: _Request) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError(f"batched LM ({self.name}) is closed")
            self._waiting.append(req)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._main, name=f"cosyserve-batch-{self.name}", daemon=True
                )
                self._thread.start()
            self._cv.notify()

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the loop; requests still running get an error. Idempotent."""
        with self._cv:
            self._closed = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # --- the loop thread ------------------------------------------------------------------------------------

    def _main(self) -> None:
        share = self.torch_threads if isinstance(self.torch_threads, CoreShare) else None
        if isinstance(self.torch_threads, int):
            torch.set_num_threads(self.torch_threads)
        error: BaseException = RuntimeError(f"batched LM ({self.name}) was closed while decoding")
        try:
            with torch.inference_mode():
                while True:
                    if share is not None:  # the requests running now may have changed since the last step
                        share.apply()
                    if not self._step():
                        break
        except BaseException as e:  # noqa: BLE001 - handed to every request below
            logger.exception("batched LM %s: decode loop failed", self.name)
            error = e
        finally:
            with self._cv:
                self._closed = True
                left = list(self._waiting) + self._active
                self._waiting.clear()
                self._active.clear()
                for req in left:
                    self._finish_locked(req, error)

    def _finish_locked(self, req: _Request, item: Any = _DONE) -> None:
        if req.row >= 0:
            heapq.heappush(self._free_rows, req.row)
            req.row = -1
        req.logp = None
        if not req.finished:
            req.finished = True
            if not req.cancelled:
                req.out.put(item)

    def _step(self) -> bool:
        """Admit, prefill, sample, decode once. False when closed."""
        with self._cv:
            while True:
                if self._closed:
                    return False
                self._reap_locked()
                joiners: list[_Request] = []
                while self._waiting and self._free_rows:
                    req = self._waiting.popleft()
                    req.row = heapq.heappop(self._free_rows)
                    self._active.append(req)
                    joiners.append(req)
                if joiners or self._gather_locked():
                    break
                self._cv.wait()
        for req in joiners:
            self._prefill(req)
        with self._cv:
            self._reap_locked()
            ready = [r for r in self._active if r.wants and r.logp is not None]
            for r in ready:
                r.wants = False
        if ready:
            self._sample_and_decode(ready)
        return True

    def _gather_locked(self) -> bool:
        # True once some row can be sampled; waits briefly for the rows served last step to ask again
        if not any(r.wants and r.logp is not None for r in self._active):
            return False
        expected = [r for r in self._active if r.last_step == self._step_no and r.logp is not None]
        end = time.monotonic() + self.gather_s
        while not self._closed and not all(r.wants or r.cancelled for r in expected):
            left = end - time.monotonic()
            if left <= 0:
                break
            self._cv.wait(left)
        return True

    def _reap_locked(self) -> None:
        gone = [r for r in self._active if r.cancelled]
        for req in gone:
            self._active.remove(req)
            self._finish_locked(req)
        if any(r.cancelled for r in self._waiting):
            self._waiting = deque(r for r in self._waiting if not r.cancelled)

    def _prefill(self, req: _Request) -> None:
        try:
            t0 = req.lm_input.size(1)
            rows, seq = self.lm.cache_shape()
            need = t0 + req.max_len
            if rows < self.max_batch_size or seq < need:
                grown = max(need, seq + seq // 2) if seq else need
                self.lm.grow_caches(self.max_batch_size, -(-grown // _SEQ_ALIGN) * _SEQ_ALIGN)
            device = req.lm_input.device
            row = torch.tensor([req.row], dtype=torch.int64, device=device)
            req.logp = self.lm.prefill(req.lm_input, rows=row)  # (1, V)
            req.pos = t0
            req.history = torch.full((1, max(req.sampling.win_size, 0)), -1, dtype=torch.int64, device=device)
            req.lm_input = req.lm_input[:, :0]  # the prompt is in the cache now
            self.stats.prefills += 1
        except Exception as e:
            logger.exception("batched LM %s: prefill failed", self.name)
            with self._cv:
                if req in self._active:
                    self._active.remove(req)
                self._finish_locked(req, e)

    def _sample_and_decode(self, ready: list[_Request]) -> None:
        eos = self.lm.eos_token
        try:
            picked = []
            for req in ready:  # the one Python loop over the batch this step
                assert req.logp is not None and req.history is not None
                if req.produced < req.min_len:
                    req.logp[:, eos] = -float("inf")
                picked.append(ras_sample(req.logp, req.history, req.sampling, req.generator))  # (1,)
            tokens = torch.cat(picked)  # (B,)
            ids = tokens.tolist()  # the step's one host sync
        except Exception as e:
            logger.exception("batched LM %s: sampling failed", self.name)
            with self._cv:
                for req in ready:
                    if req in self._active:
                        self._active.remove(req)
                    self._finish_locked(req, e)
            return
        self._step_no += 1
        going: list[int] = []
        with self._cv:
            for j, (req, token_id) in enumerate(zip(ready, ids, strict=True)):
                if req.cancelled:
                    continue  # reaped at the next step
                if token_id >= eos:  # eos, or one of the stop tokens after it (CosyVoice2 has three)
                    self._active.remove(req)
                    self._finish_locked(req)
                    continue
                req.out.put(token_id)
                req.last_step = self._step_no
                self.stats.tokens += 1
                win = req.sampling.win_size
                assert req.history is not None
                if win > 0:
                    req.history[:, req.produced % win] = tokens[j]
                req.produced += 1
                if req.produced >= req.max_len:
                    self._active.remove(req)
                    self._finish_locked(req)
                    continue
                going.append(j)
        if not going:
            return
        going.sort(key=lambda j: ready[j].row)
        batch = [ready[j] for j in going]
        device = tokens.device
        idx = torch.tensor(going, dtype=torch.int64, device=device)
        pos = torch.tensor([r.pos for r in batch], dtype=torch.int64, device=device)
        row_ids = [r.row for r in batch]
        # rows 0..B-1 (the usual case: the lowest rows are reused first) read the caches as views, not copies
        rows = None if row_ids == list(range(len(batch))) else torch.tensor(row_ids, device=device)
        kv_len = max(r.pos for r in batch) + 1
        try:
            logp = self.lm.decode_one_token(tokens[idx], pos, kv_len, rows)  # (B, V)
        except Exception as e:
            logger.exception("batched LM %s: decode failed", self.name)
            with self._cv:
                for req in batch:
                    if req in self._active:
                        self._active.remove(req)
                    self._finish_locked(req, e)
            return
        for j, req in enumerate(batch):
            req.logp = logp[j : j + 1]
            req.pos += 1
        s = self.stats
        s.steps += 1
        s.rows_decoded += len(batch)
        s.peak_rows = max(s.peak_rows, len(batch))
