"""The one decode loop: speech tokens of every LM, every runtime, one row or many, text given or still arriving.

An LM gives the loop what :class:`DecodeLM` declares (its stop rules and sampling options, prompts and
embeddings, an extend of one row and a one-token step over a batch of rows, each at its own position, and its
caches); the torch LMs (:class:`~cosyserve.models.llm.SpeechLM` and its subclasses) and the lite runtime's
:class:`~cosyserve.lite.models.LiteLM` implement it. :class:`DecodeLoop` drives it for

- a one-shot row (:class:`OneShot`, the reference's ``inference``): a prompt, ``min_len`` (before it id
  ``eos_token`` is masked), ``max_len``;
- a streamed-text row (:class:`Streamed`, the reference's ``inference_bistream``): the prompt split after its head
  (CosyVoice3: ``<|endofprompt|>``), prompt speech interleaved 15 : 5 with the text, a fill token forced 15 steps
  after the last one (or sampled), after which the row waits for 5 more text tokens; when the text ends, the rest
  of it and ``task_id`` follow and the row runs to the real EOS; every special id but the one each phase accepts
  is masked; at most ``ratio`` steps per text token received;
- a teacher-forced row (either kind): the given tokens instead of samples, every step's log-probabilities kept
  (conformance's ``llm_logprobs`` / ``llm_bistream_logprobs`` kinds, the quality gate).

Rows join (their prompt extends a free cache row) and leave (a stop id, their step limit, their consumer gone)
between steps; every step samples every row that is ready (:class:`~cosyserve.sampling.Sampler`: its draws are a
function of the row's key and token index, so a row's tokens do not depend on its neighbours or on when its ids
are read) and runs one batched decode of the rows that go on.

No host synchronisation per step: the sampled ids stay on the device (a row that goes on is fed its own id, a stop
id as 0) and are copied to the host into a ring of buffers, read ``lag`` steps later (a GPU: at once on the CPU and
for numpy). A stop is seen when read and the steps queued after it are dropped; a streamed-text row that sampled a
fill is rolled back when the fill is read (its position, token index and history put back): it went on speculating
that the step was speech.

The loop runs in one thread per model (it alone touches the LM's caches) or, for a one-off run
(:func:`generate`, :func:`teacher_forced`, warm-ups), in the caller's thread. A consumer (a request's worker) gets
its row's tokens from its own queue; a streamed-text row asks its consumer for text, and the consumer reads its text
iterator and hands the ids over (the loop never waits for a request's text). Closing the consumer's generator frees
its row at the next step. On the CPU the loop steps on demand (when a consumer waits for a token), so a lone request
alternates with its own token2wav as an unbatched one does; on a GPU it runs ahead.
"""

from __future__ import annotations

import heapq
import logging
import math
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from cosyserve.sampling import ArrayOps, Sampler, SamplingConfig, StopRules

logger = logging.getLogger(__name__)

__all__ = [
    "READ_AHEAD",
    "DecodeLM",
    "DecodeLoop",
    "DecodeStats",
    "OneShot",
    "Streamed",
    "TeacherForced",
    "generate",
    "length_limits",
    "one_shot",
    "teacher_forced",
    "warm_up",
]

READ_AHEAD = 4  # steps a device may run past the ids read back (bounds the work queued past a stop)
RUN_AHEAD = 32  # tokens a row may be decoded ahead of its consumer
_SEQ_ALIGN = 256  # cache positions grow in multiples of this
_ALWAYS = 1 << 40  # a min_len no row reaches: its specials stay masked

# a piece of an LM input, embedded by the LM: ("text", ids), ("speech", ids) or ("special", [id])
Part = tuple[str, list[int]]


class DecodeLM(Protocol):
    """What a backend LM provides to the decode loop."""

    @property
    def rules(self) -> StopRules: ...

    @property
    def sampling(self) -> SamplingConfig: ...

    @property
    def ops(self) -> ArrayOps:
        """The array namespace and device its log-probabilities and ids live in."""
        ...

    def prompt(self, model_input: Mapping[str, Any]) -> tuple[Any, int]:
        """A one-shot prompt (1, T0, C) from the reference frontend's model-input dict (``text``, ``prompt_text``,
        ``llm_prompt_speech_token``, ``llm_embedding``; absent keys empty), and the text's length in tokens."""
        ...

    def embed(self, parts: list[Part]) -> Any:
        """(1, T, C) the embeddings of ``parts`` in order."""
        ...

    def prompt_head(self, prompt_ids: list[int]) -> int:
        """How many prompt text ids start a streamed-text row's input with sos (CosyVoice3: up to
        ``<|endofprompt|>``, which it requires)."""
        ...

    def reserve(self, rows: int, positions: int) -> None:
        """Caches for at least ``rows`` rows of ``positions`` each, keeping what every row holds."""
        ...

    def release(self) -> None:
        """Drop the caches."""
        ...

    def extend(self, x: Any, row: int, start: int) -> Any:
        """Run ``x`` (1, T, C) into cache row ``row`` from position ``start``; (1, V) float32 log-probabilities
        of the next token."""
        ...

    def decode(self, tokens: Any, pos: Any, kv_len: int, rows: Any | None) -> Any:
        """One step of B rows: feed ``tokens`` (B,) int64 at positions ``pos`` (B,) of cache rows ``rows`` (B,),
        or rows 0..B-1 when None; ``kv_len`` > every position. (B, V) float32 log-probabilities."""
        ...


@dataclass
class OneShot:
    """A row whose text is known: the reference's ``inference``."""

    prompt: Any  # (1, T0, C)
    min_len: int  # no eos_token before this many tokens
    max_len: int  # at most this many tokens


@dataclass
class Streamed:
    """A row whose text arrives in pieces: the reference's ``inference_bistream``."""

    text: Iterable[Any]  # pieces of text ids (anything whose items int() reads), in arrival order
    prompt_text: list[int]
    prompt_speech: list[int]
    max_len: int | None = None  # at most this many steps, fills included
    ratio: float | None = 20.0  # at most this many steps per text token received (the reference: no limit)


@dataclass
class TeacherForced:
    """A teacher-forced run: ``logprobs`` (steps, V) of every step (before any mask), ``step_tokens`` the id of
    every step (fills included), ``tokens`` the speech tokens it yielded."""

    logprobs: Any
    step_tokens: list[int]
    tokens: list[int]


def length_limits(text_len: int, min_ratio: float = 2.0, max_ratio: float = 20.0) -> tuple[int, int]:
    """(min_len, max_len) of a one-shot row for ``text_len`` text tokens (without prompt), truncated as the
    reference computes them."""
    return int(text_len * min_ratio), int(text_len * max_ratio)


def one_shot(
    lm: DecodeLM,
    model_input: Mapping[str, Any],
    *,
    max_tokens: int | None = None,
    min_ratio: float = 2.0,
    max_ratio: float = 20.0,
) -> OneShot:
    """The one-shot row of a model-input dict; ``max_tokens`` caps ``max_len`` (and ``min_len`` with it)."""
    prompt, text_len = lm.prompt(model_input)
    min_len, max_len = length_limits(text_len, min_ratio, max_ratio)
    if max_tokens is not None:
        max_len = min(max_len, max_tokens)
        min_len = min(min_len, max_len)
    return OneShot(prompt, min_len, max_len)


@dataclass
class DecodeStats:
    """The loop's per-step record: rows per decode step (a histogram by count), and totals."""

    steps: int = 0
    rows: int = 0
    prefills: int = 0  # rows admitted
    tokens: int = 0  # speech tokens handed out
    peak_rows: int = 0
    rollbacks: int = 0  # streamed-text rows put back after a fill read late
    rows_hist: dict[int, int] = field(default_factory=dict)  # rows in a step -> steps

    def step(self, n: int) -> None:
        self.steps += 1
        self.rows += n
        self.peak_rows = max(self.peak_rows, n)
        self.rows_hist[n] = self.rows_hist.get(n, 0) + 1

    @property
    def mean_rows(self) -> float:
        return self.rows / self.steps if self.steps else 0.0


_NEED_TEXT = object()  # a streamed-text row asks its consumer for the next piece
_DONE = object()


class _Text:
    """A streamed-text row's text state: the reference's bistream loop, one piece at a time."""

    def __init__(self, rules: StopRules, spec: Streamed, head: int) -> None:
        n_speech = rules.mix_ratio[1]
        self.rules = rules
        self.lm_input: list[Part] = [("special", [rules.sos]), ("text", spec.prompt_text[:head])]
        self.cache = list(spec.prompt_text[head:])  # text ids waiting (the prompt's, after its head, first)
        self.pst = list(spec.prompt_speech)
        s = len(self.pst)
        self.next_fill = (s // n_speech + 1) * n_speech - s
        self.words = len(spec.prompt_text) - head  # text tokens received
        self.started = False  # the LM has decoded
        self.after_fill = False

    def piece(self, ids: list[int]) -> list[Part] | None:
        """The input to decode from once ``ids`` arrived, or None: wait for more text."""
        n_text, n_speech = self.rules.mix_ratio
        self.words += len(ids)
        self.cache += ids
        while self.pst and len(self.cache) >= n_text:
            self.lm_input += [("text", self.cache[:n_text]), ("speech", self.pst[:n_speech])]
            self.cache, self.pst = self.cache[n_text:], self.pst[n_speech:]
        if self.pst:
            return None
        if self.after_fill or (not self.started and sum(len(p[1]) for p in self.lm_input) == 1):
            if len(self.cache) < n_text:
                return None
            chunk: Part = ("text", self.cache[:n_text])
            self.lm_input = [chunk] if self.after_fill else self.lm_input + [chunk]
            self.cache = self.cache[n_text:]
        self.started, self.after_fill = True, False
        return self.lm_input

    def end(self) -> list[Part]:
        # the input of the step that produced the last fill is fed a second time, as the reference does
        return self.lm_input + [("text", self.cache), ("special", [self.rules.task_id])]


class _Row:
    def __init__(self, spec: OneShot | Streamed, key: int, teacher: Iterator[int] | None) -> None:
        self.spec = spec
        self.key = key
        self.teacher = teacher
        self.text = None if isinstance(spec, OneShot) else iter(spec.text)
        self.out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # under the loop's condition
        self.wants = False  # the consumer waits for an item
        self.cancelled = False
        self.finished = False
        self.pieces: deque[list[int] | None] = deque()  # text handed over (None: the end), not yet taken
        self.taken = 0  # tokens the consumer took
        self.delivered = 0  # tokens put on its queue
        # loop thread only
        self.slot = -1
        self.epoch = 0  # bumped by a rollback: reads of older steps are dropped
        self.steps = 0  # ids sampled (the row's token index)
        self.read = 0  # ids read back
        self.pos = 0  # next cache position
        self.ready = False  # its log-probabilities for step ``steps`` are in the loop's buffer
        self.stalled = False  # it waits for text, or for the read of a step it cannot go past
        self.arriving = False  # streamed text: still arriving
        self.state: _Text | None = None
        self.extend_step = (
            0  # the step whose input was the last extend, and that extend's parts and end position
        )
        self.extend_parts: list[Part] = []
        self.extend_end = 0
        self.recent: deque[int] = deque()  # the last read ids (a rollback rebuilds the history from them)
        self.last = -1  # the last id read
        self.record: list[Any] = []  # teacher-forced: each step's log-probabilities
        self.step_ids: list[int] = []

    def limit(self) -> float:
        """Steps the row may take."""
        spec = self.spec
        if isinstance(spec, OneShot):
            return spec.max_len
        cap = math.inf if spec.max_len is None else spec.max_len
        if spec.ratio is not None and self.state is not None:
            cap = min(cap, spec.ratio * max(self.state.words, 1))
        return cap


class DecodeLoop:
    """The decode loop of one LM (see the module docstring).

    Args:
        lm: the LM; from now on only this loop touches its caches.
        max_rows: rows decoded together (cache rows); more requests wait (FIFO) for a free row.
        lag: steps an id may be read back late (None: 0 where the ids live in host memory, else
            :data:`READ_AHEAD`).
        demand: step only while some consumer waits for a token (None: where ``lag`` is 0, i.e. on the CPU, where
            the loop and the consumers share the cores); otherwise the loop runs ahead.
        ahead: tokens a row may be decoded ahead of its consumer.
        before_step: called in the loop's thread before every step (the torch runtime sets the thread's share of
            the cores there).
        threaded: run in a thread of its own (serving); False: each consumer drives it in its own thread
            (one-off runs, one consumer at a time).
        name: for the thread's name and logs.
    """

    def __init__(
        self,
        lm: DecodeLM,
        max_rows: int = 1,
        *,
        lag: int | None = None,
        demand: bool | None = None,
        ahead: int = RUN_AHEAD,
        before_step: Callable[[], Any] | None = None,
        threaded: bool = True,
        name: str = "lm",
    ) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.lm = lm
        self.rules = lm.rules
        self.ops = ops = lm.ops
        self.max_rows = max_rows
        self.lag = (0 if ops.host else READ_AHEAD) if lag is None else lag
        if self.lag < 0 or ahead < 1:
            raise ValueError(f"lag must be >= 0 and ahead >= 1, got {self.lag} and {ahead}")
        self.demand = self.lag == 0 if demand is None else demand
        self.ahead = ahead
        self.before_step = before_step
        self.threaded = threaded
        self.name = name
        self.stats = DecodeStats()
        self.on_step: Callable[[int], None] | None = None  # told the rows of every decode step
        cfg = lm.sampling
        v = self.rules.vocab
        self.sampler = Sampler(cfg, v, ops)
        self.win = max(cfg.win_size, 0)
        r = max_rows
        self._keys, self._index, self._min_len = ops.full((r,), 0), ops.full((r,), 0), ops.full((r,), 0)
        self._lo, self._hi, self._keep = ops.full((r,), v), ops.full((r,), v), ops.full((r,), -1)
        self._pos = ops.full((r,), 0)
        self._history = ops.full((r, self.win), -1)
        self._logits: Any = None  # (R, V) each row's log-probabilities of its next step
        self._cols = ops.arange(v)[None]
        self._cap = (0, 0)  # (rows, positions) reserved
        # ids on their way to the host: a ring of buffers, (lag + 2, R) int64
        self._events = ops.torch and not ops.host
        self._ring_next = 0
        self._ring_host: Any = None
        if ops.torch:  # in host memory (pinned for a device's copies); read through one numpy view
            self._ring = ops.xp.full((self.lag + 2, r), -1, dtype=ops.xp.int64, pin_memory=self._events)
            self._ring_host = self._ring.numpy()
        else:
            self._ring = ops.full((self.lag + 2, r), -1)
        self._pending: deque[tuple[int, Any, list[tuple[_Row, int, int]]]] = deque()
        self._cv = threading.Condition()
        self._waiting: deque[_Row] = deque()
        self._active: list[_Row] = []
        self._free = list(range(max_rows))  # a heap: the lowest rows are reused first
        self._thread: threading.Thread | None = None
        self._closed = False
        self._error: BaseException | None = None

    # --- consumer side ------------------------------------------------------------------------------------------

    def generate(
        self, spec: OneShot | Streamed, key: int, *, teacher: Iterable[int] | None = None
    ) -> Iterator[int]:
        """The speech tokens (ids < ``eos_token``) of one row, as they are read back.

        Args:
            spec: the row.
            key: the sampler key (:func:`cosyserve.sampling.row_key`).
            teacher: tokens to take instead of samples (a streamed-text row's forced fills take none).
        Raises:
            ValueError: a teacher token the row's phase does not accept, or too few of them.
        """
        if isinstance(spec, OneShot) and spec.max_len <= 0:
            return iter(())
        return self._consume(self._join(spec, key, teacher))

    def _join(self, spec: OneShot | Streamed, key: int, teacher: Iterable[int] | None) -> _Row:
        row = _Row(spec, key, None if teacher is None else iter(teacher))
        with self._cv:
            if self._closed:
                raise RuntimeError(f"decode loop ({self.name}) is closed")
            self._waiting.append(row)
            if self.threaded and self._thread is None:
                self._thread = threading.Thread(
                    target=self._main, name=f"cosyserve-lm-{self.name}", daemon=True
                )
                self._thread.start()
            self._cv.notify()
        return row

    def _next_item(self, row: _Row) -> Any:
        if not self.threaded:
            while row.out.empty():
                if not self._step():  # nothing could run: the reads left, or a stall that no step can end
                    if not self._flush() and row.out.empty():
                        raise RuntimeError(f"decode loop ({self.name}): a row can make no progress")
            return row.out.get_nowait()
        try:
            return row.out.get_nowait()
        except queue.Empty:
            pass
        with self._cv:
            row.wants = True
            self._cv.notify()
        item = row.out.get()
        row.wants = False
        return item

    def _consume(self, row: _Row) -> Iterator[int]:
        try:
            while True:
                item = self._next_item(row)
                if item is _NEED_TEXT:
                    assert row.text is not None
                    piece = next(
                        row.text, None
                    )  # this (the consumer's) thread waits for the text, not the loop
                    ids = None if piece is None else [int(t) for t in _flat(piece)]
                    with self._cv:
                        row.pieces.append(ids)
                        self._cv.notify()
                    continue
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    if isinstance(item, ValueError):
                        raise item
                    raise RuntimeError(f"decode loop ({self.name}) failed: {item!r}") from item
                row.taken += 1
                yield item
        finally:
            with self._cv:
                if not row.finished:
                    row.cancelled = True
                    self._cv.notify()
            if not self.threaded:
                self._step()  # frees the row now: the next one-off run may need it

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the loop; rows still running get an error. Idempotent."""
        with self._cv:
            self._closed = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        if thread is None:
            self._fail_all(RuntimeError(f"decode loop ({self.name}) was closed"))

    @property
    def active(self) -> int:
        """Rows holding a cache row now."""
        return len(self._active)

    # --- the loop -----------------------------------------------------------------------------------------------

    def _main(self) -> None:
        error: BaseException = RuntimeError(f"decode loop ({self.name}) was closed while decoding")
        try:
            while not self._closed:
                if not self._step():
                    with self._cv:
                        if not self._closed and not self._runnable_locked():
                            self._cv.wait(0.05 if self._pending else None)
        except BaseException as e:  # noqa: BLE001 - handed to every row below
            logger.exception("decode loop %s failed", self.name)
            error = e
        finally:
            self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        with self._cv:
            self._closed = True
            rows = list(self._waiting) + self._active
            self._waiting.clear()
            for row in rows:
                self._finish_locked(row, error)

    def _runnable_locked(self) -> bool:
        # something for a step to do: joiners, text, cancelled rows, or a row to sample (on demand: and a consumer
        # waiting)
        if (self._waiting and self._free) or any(r.cancelled or r.pieces for r in self._active):
            return True
        rows = self._eligible()
        return bool(rows) and (not self.demand or not self.threaded or any(r.wants for r in self._active))

    def _eligible(self) -> list[_Row]:
        return [
            r
            for r in self._active
            if r.ready
            and not r.stalled
            and not r.finished
            and r.steps - r.read + r.delivered - r.taken < self.ahead
        ]

    def _finish_locked(self, row: _Row, item: Any = _DONE) -> None:
        if row.slot >= 0:
            heapq.heappush(self._free, row.slot)
            row.slot = -1
            if row in self._active:
                self._active.remove(row)
        if not row.finished:
            row.finished = True
            if not row.cancelled:
                row.out.put(item)

    def _step(self) -> bool:
        """Admit rows, take text, sample every ready row once, decode those that go on. False: nothing ran."""
        with self.ops.no_grad():
            return self._step_rows()

    def _step_rows(self) -> bool:
        with self._cv:
            for row in [r for r in self._active if r.cancelled]:
                self._finish_locked(row)
            self._waiting = deque(r for r in self._waiting if not r.cancelled)
            joiners = []
            while self._waiting and self._free:
                row = self._waiting.popleft()
                row.slot = heapq.heappop(self._free)
                self._active.append(row)
                joiners.append(row)
            texts = [(r, r.pieces.popleft()) for r in self._active if r.pieces]
            if self.threaded and self.demand and not joiners and not texts:
                if not any(r.wants for r in self._active):
                    return False
        if self.before_step is not None:
            self.before_step()
        for row in joiners:
            self._guard([row], self._admit, row)
        for row, ids in texts:
            self._guard([row], self._on_text, row, ids)
        ready = self._eligible()
        if not ready:
            return bool(joiners or texts) or self._flush()
        self._guard(ready, self._sample_and_decode, ready)
        return True

    def _guard(self, rows: list[_Row], fn: Callable[..., Any], *args: Any) -> None:
        # a failure of one row's work (or of a batch's step) ends those rows with it; the loop goes on
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - handed to the rows' consumers
            logger.exception("decode loop %s: a step failed", self.name)
            with self._cv:
                for row in rows:
                    self._finish_locked(row, e)

    # --- rows joining, text arriving ----------------------------------------------------------------------------

    def _set(self, row: _Row, lo: int, hi: int, keep: int, min_len: int) -> None:
        s = row.slot
        self._lo[s], self._hi[s], self._keep[s], self._min_len[s] = lo, hi, keep, min_len

    def _admit(self, row: _Row) -> None:
        rules, s = self.rules, row.slot
        self._keys[s], self._index[s] = row.key, 0
        if self.win:
            self._history[s] = -1
        self.stats.prefills += 1
        spec = row.spec
        if isinstance(spec, OneShot):
            self._set(row, rules.eos_token, rules.eos_token, -1, spec.min_len)
            self._extend(row, spec.prompt, [], spec.prompt.shape[1] + spec.max_len)
            return
        if rules.fill is None:
            raise ValueError(f"decode loop ({self.name}): this LM takes no streamed text")
        row.state = _Text(rules, spec, self.lm.prompt_head(list(spec.prompt_text)))
        row.arriving = True
        self._set(row, rules.eos_token, rules.vocab - 1, rules.fill, _ALWAYS)
        self._ask_text(row)

    def _ask_text(self, row: _Row) -> None:
        row.stalled, row.ready = True, False
        row.out.put(_NEED_TEXT)

    def _on_text(self, row: _Row, ids: list[int] | None) -> None:
        state = row.state
        assert state is not None
        if ids is None:  # the end of the text: the rest of it, task_id, and on to the real EOS
            row.arriving = False
            self._set(row, self.rules.eos_token, self.rules.vocab - 1, self.rules.eos, _ALWAYS)
            parts = state.end()
        else:
            parts = state.piece(ids)
            if parts is None:
                self._ask_text(row)
                return
        if row.steps >= row.limit():
            with self._cv:
                self._finish_locked(row)
            return
        self._extend(row, None, parts, 0)

    def _extend(self, row: _Row, x: Any, parts: list[Part], positions: int) -> None:
        if x is None:
            x = self.lm.embed(parts)
        start = row.pos
        end = start + x.shape[1]
        self._reserve(row.slot + 1, max(positions, end + 1))
        logits = self.lm.extend(x, row.slot, start)  # (1, V)
        if self._logits is None:
            self._logits = self.ops.xp.zeros((self.max_rows, logits.shape[1]), dtype=logits.dtype)
            if self.ops.torch:
                self._logits = self._logits.to(logits.device)
        self._logits[row.slot] = logits[0]
        row.pos = end
        self._pos[row.slot] = end
        row.extend_step, row.extend_parts, row.extend_end = row.steps, parts, end
        row.ready, row.stalled = True, False

    def _reserve(self, rows: int, positions: int) -> None:
        have_rows, have_pos = self._cap
        if rows <= have_rows and positions <= have_pos:
            return
        pos = max(positions, have_pos + have_pos // 2) if positions > have_pos else have_pos
        self._cap = (max(rows, have_rows), -(-pos // _SEQ_ALIGN) * _SEQ_ALIGN)
        self.lm.reserve(*self._cap)

    # --- a step ------------------------------------------------------------------------------------------------

    def _index_of(self, slots: list[int]) -> Any:
        # rows 0..B-1 (the usual case: the lowest rows are reused first) are read and written as views
        return slice(0, len(slots)) if slots == list(range(len(slots))) else self.ops.ints(slots)

    def _sample_and_decode(self, ready: list[_Row]) -> None:
        ops, xp, rules = self.ops, self.ops.xp, self.rules
        ready.sort(key=lambda r: r.slot)
        slots = [r.slot for r in ready]
        sl = self._index_of(slots)
        logits = self._logits[sl]  # (B, V)
        index = self._index[sl]
        lo = xp.where(index < self._min_len[sl], self._lo[sl], rules.vocab)
        masked = (self._cols >= lo[:, None]) & (self._cols <= self._hi[sl][:, None])
        masked &= self._cols != self._keep[sl][:, None]
        tokens = self.sampler(xp.where(masked, -math.inf, logits), self._keys[sl], index, self._history[sl])
        # what the host knows of this step's ids already: teacher tokens and forced fills
        known: dict[int, int] = {}
        for j, row in enumerate(ready):
            forced = self._forced(row)
            if forced is not None:
                known[j] = forced
            if row.teacher is not None:
                row.record.append(ops.clone(logits[j]))
        if known:
            at = list(known)
            tokens[ops.ints(at)] = ops.ints([known[j] for j in at])
        if self.win:
            at = ops.arange(len(slots)) if isinstance(sl, slice) else sl  # pairwise (row, column) indexing
            self._history[at, index % self.win] = tokens
        self._index[sl] = index + 1
        going: list[int] = []
        for j, row in enumerate(ready):
            row.steps += 1
            row.ready = False
            if row.teacher is not None:
                row.step_ids.append(known[j])
            token = known.get(j)
            if token is not None and token >= rules.eos_token:
                row.stalled = True  # a stop, or a fill: nothing to feed until it is read
            elif row.steps < row.limit():
                going.append(j)
            else:
                row.stalled = True
        self._push_reads(ready, tokens)
        self._read()
        going = [j for j in going if not ready[j].finished and not ready[j].stalled]
        if going:
            self._decode(
                [ready[j] for j in going], tokens if len(going) == len(ready) else tokens[ops.ints(going)]
            )

    def _forced(self, row: _Row) -> int | None:
        # the id of this step when the host decides it: a forced fill, or the teacher's token
        if row.arriving and row.state is not None and row.steps == row.state.next_fill:
            return self.rules.fill
        if row.teacher is None:
            return None
        try:
            return next(row.teacher)
        except StopIteration:
            raise ValueError("teacher_tokens ran out before the LM reached EOS") from None

    def _decode(self, rows: list[_Row], tokens: Any) -> None:
        xp = self.ops.xp
        slots = [r.slot for r in rows]
        sl = self._index_of(slots)
        kv_len = max(r.pos for r in rows) + 1
        self._reserve(max(slots) + 1, kv_len)
        fed = xp.where(
            tokens < self.rules.eos_token, tokens, 0
        )  # a stop id (read later) has no embedding row
        pos = self._pos[sl]
        self._logits[sl] = self.lm.decode(fed, pos, kv_len, None if isinstance(sl, slice) else sl)
        self._pos[sl] = pos + 1
        for r in rows:
            r.pos += 1
            r.ready = True
        self.stats.step(len(rows))
        if self.on_step is not None:
            self.on_step(len(rows))

    # --- reading the ids back -----------------------------------------------------------------------------------

    def _push_reads(self, rows: list[_Row], tokens: Any) -> None:
        k = self._ring_next
        self._ring_next = (k + 1) % self._ring.shape[0]
        event = None
        if self.ops.torch:
            self._ring[k, : len(rows)].copy_(tokens, non_blocking=self._events)
            if self._events:
                event = self.ops.xp.cuda.Event()
                event.record()
        else:
            self._ring[k, : len(rows)] = tokens
        self._pending.append((k, event, [(r, r.epoch, r.steps - 1) for r in rows]))

    def _read(self) -> None:
        while self._pending:
            event = self._pending[0][1]
            if len(self._pending) <= self.lag and (event is None or not event.query()):
                return
            self._read_one()

    def _flush(self) -> bool:
        """Read every id still on its way (on a device, waiting for them); False: there was none."""
        if not self._pending:
            return False
        while self._pending:
            self._read_one()
        return True

    def _read_one(self) -> None:
        k, event, rows = self._pending.popleft()
        if event is not None:
            event.synchronize()
        ids = (self._ring_host if self._ring_host is not None else self._ring)[k, : len(rows)].tolist()
        for (row, epoch, step), token in zip(rows, ids, strict=True):
            if row.finished or row.cancelled or epoch != row.epoch:
                continue
            self._take(row, step, int(token))

    def _take(self, row: _Row, step: int, token: int) -> None:
        rules = self.rules
        assert step == row.read, (step, row.read)
        row.read += 1
        prev, row.last = row.last, token
        if self.win:
            row.recent.append(token)
            if len(row.recent) > self.win:
                row.recent.popleft()
        if token >= rules.eos_token:
            if isinstance(row.spec, OneShot):
                with self._cv:
                    self._finish_locked(row)
                return
            if row.arriving and token == rules.fill:
                self._on_fill(row, step, prev)
                return
            with self._cv:
                if row.arriving or token != rules.eos:
                    when = "while text was still arriving" if row.arriving else "after the text ended"
                    self._finish_locked(row, ValueError(f"the LM picked special id {token} {when}"))
                else:
                    self._finish_locked(row)
            return
        self.stats.tokens += 1
        row.delivered += 1
        row.out.put(token)
        if row.read >= row.limit():
            with self._cv:
                self._finish_locked(row)

    def _on_fill(self, row: _Row, step: int, prev: int) -> None:
        state = row.state
        assert state is not None
        state.next_fill = step + self.rules.mix_ratio[1] + 1
        # the fill step's input: the last extend, or the speech token before it
        state.lm_input = row.extend_parts if step == row.extend_step else [("speech", [prev])]
        state.after_fill = True
        if row.steps > step + 1:  # it went on, speculating that the step was speech: put it back
            self.stats.rollbacks += 1
            row.epoch += 1
            row.steps = step + 1
            row.pos = row.extend_end + (step - row.extend_step)
            s = row.slot
            self._pos[s], self._index[s] = row.pos, row.steps
            if self.win:
                ring = [-1] * self.win
                for j, t in zip(range(row.steps - len(row.recent), row.steps), row.recent, strict=True):
                    ring[j % self.win] = t
                self._history[s] = self.ops.ints(ring)
        if row.read >= row.limit():
            with self._cv:
                self._finish_locked(row)
            return
        self._ask_text(row)


def _flat(piece: Any) -> list[Any]:
    # a piece of text ids: a list, or a (1, n) / (n,) array
    return piece.reshape(-1).tolist() if hasattr(piece, "reshape") else list(piece)


def generate(lm: DecodeLM, spec: OneShot | Streamed, key: int, *, lag: int | None = None) -> Iterator[int]:
    """One row's speech tokens, decoded in the caller's thread (a one-off loop over ``lm``)."""
    return DecodeLoop(lm, 1, lag=lag, threaded=False, name="one-off").generate(spec, key)


def teacher_forced(lm: DecodeLM, spec: OneShot | Streamed, tokens: Iterable[int]) -> TeacherForced:
    """Run ``spec`` with ``tokens`` in place of samples (one-shot: one per step; streamed text: one per step that
    is not a forced fill) and keep every step's log-probabilities.

    Raises:
        ValueError: streamed text: a token the phase does not accept (a special id other than fill while the text
            arrives, other than EOS after), or too few tokens.
    """
    loop = DecodeLoop(lm, 1, lag=0, threaded=False, name="teacher-forced")
    teacher = [int(t) for t in tokens]
    if isinstance(spec, OneShot):
        spec = OneShot(spec.prompt, 0, len(teacher))
    row = loop._join(spec, 0, teacher)
    out = list(loop._consume(row)) if teacher or not isinstance(spec, OneShot) else []
    xp = lm.ops.xp
    logprobs = xp.stack(row.record) if row.record else xp.zeros((0, lm.rules.vocab), dtype=xp.float32)
    return TeacherForced(logprobs, row.step_ids, out)


def warm_up(lm: DecodeLM, model_input: Mapping[str, Any], n_tokens: int) -> list[int]:
    """Decode exactly ``n_tokens`` tokens (no early EOS) for ``model_input`` in the caller's thread: prefill,
    decode steps and sampling run once; the caches are released after."""
    text_len = max(lm.prompt(model_input)[1], 1)
    ratio = max(n_tokens, 1) / text_len
    try:
        return list(generate(lm, one_shot(lm, model_input, min_ratio=ratio, max_ratio=ratio), 0))
    finally:
        lm.release()
