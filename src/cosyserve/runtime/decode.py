"""The one decode loop: speech tokens of every LM, every runtime, one row or many, text given or still arriving.

An LM gives the loop what :class:`DecodeLM` declares (stop rules, sampling options, prompts and embeddings, an
extend of one row, a one-token step over a batch of rows each at its own position, its caches); the torch LMs
(:class:`~cosyserve.models.llm.SpeechLM`) and the lite :class:`~cosyserve.runtime.lite.lm.StepLM` implement it.
:class:`DecodeLoop` drives it for one-shot rows, rows whose text still arrives (the reference's bistream) and
teacher-forced rows (conformance, the quality gate). Rows join (their prompt extends a free cache row) and leave (a
stop id, their step limit, their consumer gone) between steps; every step samples every ready row
(:class:`~cosyserve.core.sampling.Sampler`: a row's draws depend on its key and token index only, not on its
neighbours) and runs one batched decode of the rows that go on.

No host synchronisation per step: the sampled ids stay on the device and are copied to the host into a ring of
buffers, read ``lag`` steps later (at once on the CPU); a stop is seen when read (the steps queued after it
dropped), a streamed-text row's fill rolls it back when read (position, token index and history put back).

Where it steps: on a GPU, in a thread of its own, ahead of its consumers; on the CPU, on demand, in the threads of
the consumers that wait for a token (one step at a time, serving every ready row with those requests' cores), so a
lone request runs LM and token2wav in one thread (a loop thread's OpenMP team beside a request's: 1.6x first audio).
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from cosyserve.core.sampling import Sampler
from cosyserve.core.stop import ShouldStop, Stopped, check
from cosyserve.runtime.lm import DecodeLM, OneShot, Part, Streamed, StreamedText
from cosyserve.runtime.readback import ReadBack
from cosyserve.runtime.rows import DONE, NEED_TEXT, DecodeStats, Row, flat_ids

logger = logging.getLogger(__name__)
__all__ = ["READ_AHEAD", "DecodeLoop", "DecodeStats"]

READ_AHEAD = 4  # steps a device may run past the ids read back (bounds the work queued past a stop)
RUN_AHEAD = 32  # tokens a row may be decoded ahead of its consumer
_SEQ_ALIGN = 256  # cache positions grow in multiples of this
_ALWAYS = 1 << 40  # a min_len no row reaches: its specials stay masked


class DecodeLoop:
    """The decode loop of one LM (see the module docstring).

    Args:
        lm: the LM; from now on only this loop touches its caches.
        max_rows: rows decoded together (cache rows); more requests wait (FIFO) for a free row.
        lag: steps an id may be read back late (None: 0 where the ids live in host memory, else
            :data:`READ_AHEAD`).
        ahead: tokens a row may be decoded ahead of its consumer.
        before_step: called in the stepping thread before every step with the rows it serves, and with 1 after a
            consumer's step (the torch runtime sets the thread's share of the cores there).
        threaded: run ahead in a thread of its own; False: step on demand, in the threads of the consumers that
            wait for a token, one at a time (None: a thread where ids are read back late, i.e. on a device).
        name: for the thread's name and logs.
    """

    def __init__(
        self,
        lm: DecodeLM,
        max_rows: int = 1,
        *,
        lag: int | None = None,
        ahead: int = RUN_AHEAD,
        before_step: Callable[[int], Any] | None = None,
        threaded: bool | None = None,
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
        self.ahead = ahead
        self.before_step = before_step
        self.threaded = self.lag > 0 if threaded is None else threaded
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
        self._reads = ReadBack(ops, self.lag, r)
        self._cv = threading.Condition()
        self._stepping = threading.Lock()  # consumer-driven: held by the consumer thread running a step
        self._busy = False  # consumer-driven: a consumer steps (the others wait on _cv for their items)
        self._waiting: deque[Row] = deque()
        self._active: list[Row] = []
        self._free = list(range(max_rows))  # a heap: the lowest rows are reused first
        self._thread: threading.Thread | None = None
        self._closed = False
        self._error: BaseException | None = None

    # --- consumer side ------------------------------------------------------------------------------------------

    def generate(
        self,
        spec: OneShot | Streamed,
        key: int,
        *,
        teacher: Iterable[int] | None = None,
        record: list[tuple[Any, int]] | None = None,
        should_stop: ShouldStop | None = None,
    ) -> Iterator[int]:
        """The speech tokens (ids < ``eos_token``) of one row, as they are read back.

        Args:
            spec: the row.
            key: the sampler key (:func:`cosyserve.core.sampling.row_key`).
            teacher: tokens to take instead of samples (a streamed-text row's forced fills take none).
            record: where each step's (log-probabilities before any mask, id) go, fills and stops included.
            should_stop: the request's stop signal, asked before the row joins, before each of its steps and after
                each token taken, and handed to the LM (which may end a prefill between layers, or a lite ONNX
                Runtime run, with it): the row then ends with :class:`Stopped`, its cache row freed.
        Raises:
            ValueError: a teacher token the row's phase does not accept, or too few of them.
            Stopped: ``should_stop`` ended the row's work.
        """
        if isinstance(spec, OneShot) and spec.max_len <= 0:
            return iter(())
        forced = None if teacher is None else iter(teacher)
        return self._consume(self._join(Row(spec, key, forced, record, should_stop)))

    def _join(self, row: Row) -> Row:
        with self._cv:
            if self._closed:
                raise RuntimeError(f"decode loop ({self.name}) is closed")
            self._waiting.append(row)
            if self.threaded and self._thread is None:
                name = f"cosyserve-lm-{self.name}"
                self._thread = threading.Thread(target=self._main, name=name, daemon=True)
                self._thread.start()
            self._cv.notify()
        return row

    def _next_item(self, row: Row) -> Any:
        if not row.out.empty():  # only its consumer takes from it
            return row.out.get_nowait()
        if not self.threaded:
            return self._drive(row)
        with self._cv:  # its consumer caught up: the row is back under its run-ahead bound
            self._cv.notify()
        return row.out.get()

    def _drive(self, row: Row) -> Any:
        # step here until the row has an item; while another consumer steps, wait for the item or that step's end
        while True:
            if not self._claim(row):
                return row.out.get_nowait()
            ran = self._step_here()  # its item, if the step gave one, is taken by the next claim
            with self._cv:
                if not ran and row.out.empty():
                    if row.slot >= 0 or self._closed or not self._waiting:
                        raise RuntimeError(f"decode loop ({self.name}): a row can make no progress")
                    self._cv.wait(0.05)  # a cache row held by rows whose consumers are busy: until one leaves

    def _consume(self, row: Row) -> Iterator[int]:
        try:
            while True:
                item = self._next_item(row)
                if item is NEED_TEXT:
                    assert row.text is not None
                    # this (the consumer's) thread waits for the text, not the loop
                    piece = next(row.text, None)
                    ids = None if piece is None else [int(t) for t in flat_ids(piece)]
                    with self._cv:
                        row.pieces.append(ids)
                        self._cv.notify()
                    continue
                if item is DONE:
                    return
                if isinstance(item, BaseException):
                    if isinstance(item, ValueError | Stopped):
                        raise item
                    raise RuntimeError(f"decode loop ({self.name}) failed: {item!r}") from item
                row.taken += 1
                yield item
                check(row.should_stop)  # a stopped request costs at most the token it took
        finally:
            with self._cv:
                if not row.finished:
                    row.cancelled = True
                    self._cv.notify()
            if not self.threaded:
                self._claim()
                self._step_here()  # frees the row now: the next run may need it

    def _claim(self, row: Row | None = None) -> bool:
        # wait until no consumer steps and claim the next step (True), or until ``row`` has an item (False)
        with self._cv:
            while self._busy and (row is None or row.out.empty()):
                self._cv.wait()
            if row is not None and not row.out.empty():
                return False
            self._busy = True
            return True

    def _step_here(self) -> bool:
        # _busy claimed: one step in this consumer's thread, then its own request's share of the cores (False: none ran)
        try:
            with self._stepping:
                return self._step() or self._flush()
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()
            if self.before_step is not None:
                self.before_step(1)

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the loop; rows still running get an error. Idempotent."""
        with self._cv:
            self._closed = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        if thread is None:  # consumer-driven: after the step running now, if any
            got = self._stepping.acquire(timeout=-1 if timeout is None else timeout)
            try:
                self._fail_all(RuntimeError(f"decode loop ({self.name}) was closed"))
            finally:
                if got:
                    self._stepping.release()

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
                            self._cv.wait(0.05 if self._reads else None)
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
        # something for a step to do: joiners, text, cancelled rows, or a row to sample
        pending = any(r.cancelled or r.pieces for r in self._active)
        return bool((self._waiting and self._free) or pending or self._eligible())

    def _eligible(self) -> list[Row]:
        return [r for r in self._active if r.ready and not (r.stalled or r.finished) and r.lead < self.ahead]

    def _put(self, row: Row, item: Any) -> None:
        with self._cv:
            row.put(item)
            if not self.threaded:
                self._cv.notify_all()  # its consumer may wait on _cv while another consumer steps

    def _finish_locked(self, row: Row, item: Any = DONE) -> None:
        if row.slot >= 0:
            heapq.heappush(self._free, row.slot)
            row.slot = -1
            if row in self._active:
                self._active.remove(row)
            self._cv.notify_all()  # a consumer-driven row may wait for this cache row
        if not row.finished:
            row.finished = True
            if not row.cancelled:
                self._put(row, item)

    def _step(self) -> bool:
        """Admit rows, take text, sample every ready row once, decode those that go on. False: nothing ran."""
        with self.ops.no_grad():
            return self._step_rows()

    def _step_rows(self) -> bool:
        with self._cv:
            rows = [*self._waiting, *self._active]
        # stopped rows end here (their signals asked outside the lock): a waiting one is never admitted, an
        # active one runs no further step
        stopped = [r for r in rows if r.should_stop is not None and not r.finished and r.should_stop()]
        with self._cv:
            for row in [r for r in self._active if r.cancelled]:
                self._finish_locked(row)
            for row in stopped:
                self._finish_locked(row, Stopped())
            self._waiting = deque(r for r in self._waiting if not r.cancelled and not r.finished)
            joiners = []
            while self._waiting and self._free:
                row = self._waiting.popleft()
                row.slot = heapq.heappop(self._free)
                self._active.append(row)
                joiners.append(row)
            texts = [(r, r.pieces.popleft()) for r in self._active if r.pieces]
        if self.before_step is not None:
            self.before_step(len(self._active))  # the rows it serves (their requests' consumers wait for it)
        for row in joiners:
            self._guard([row], self._admit, row)
        for row, ids in texts:
            self._guard([row], self._on_text, row, ids)
        ready = self._eligible()
        if not ready:
            return bool(joiners or texts) or self._flush()
        self._guard(ready, self._sample_and_decode, ready)
        return True

    def _guard(self, rows: list[Row], fn: Callable[..., Any], *args: Any) -> None:
        # a failure of one row's work (or of a batch's step) ends those rows with it; the loop goes on
        try:
            fn(*args)
        except Stopped as e:  # a row's run ended by its stop signal (the LM asks it): not a failure
            with self._cv:
                for row in rows:
                    self._finish_locked(row, e)
        except Exception as e:  # noqa: BLE001 - handed to the rows' consumers
            logger.exception("decode loop %s: a step failed", self.name)
            with self._cv:
                for row in rows:
                    self._finish_locked(row, e)

    # --- rows joining, text arriving ----------------------------------------------------------------------------

    def _set(self, row: Row, lo: int, hi: int, keep: int, min_len: int) -> None:
        s = row.slot
        self._lo[s], self._hi[s], self._keep[s], self._min_len[s] = lo, hi, keep, min_len

    def _admit(self, row: Row) -> None:
        rules, s = self.rules, row.slot
        self._keys[s], self._index[s] = row.key, 0
        if self.win:
            self._history[s] = -1
        self.stats.prefills += 1
        spec = row.spec
        if isinstance(spec, OneShot):
            self._set(row, rules.eos_token, rules.eos_token, -1, spec.min_len)
            self._prefill(row, spec)
            return
        if rules.fill is None:
            raise ValueError(f"decode loop ({self.name}): this LM takes no streamed text")
        row.state = StreamedText(rules, spec, rules.prompt_head(list(spec.prompt_text)))
        row.arriving = True
        self._set(row, rules.eos_token, rules.vocab - 1, rules.fill, _ALWAYS)
        self._ask_text(row)

    def _prefill(self, row: Row, spec: OneShot) -> None:
        # a prompt whose prefix (its voice's) a row ran before starts from that row's keys and values
        positions, prefix = spec.prompt.shape[1] + spec.max_len, spec.prefix
        kept = prefix.kept() if prefix is not None else None
        if kept is not None:
            self._reserve(row.slot + 1, positions)
            self.lm.load_prefix(kept.arrays, row.slot)
            row.pos = kept.positions
            self.stats.prefix_positions += kept.positions
        self._extend(row, spec.prompt[:, row.pos :], [], positions)
        if prefix is not None and kept is None:
            prefix.keep(self.lm, row.slot)  # for the next row with it

    def _ask_text(self, row: Row) -> None:
        row.stalled, row.ready = True, False
        self._put(row, NEED_TEXT)

    def _on_text(self, row: Row, ids: list[int] | None) -> None:
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

    def _extend(self, row: Row, x: Any, parts: list[Part], positions: int) -> None:
        if x is None:
            x = self.lm.embed(parts)
        start = row.pos
        end = start + x.shape[1]
        self._reserve(row.slot + 1, max(positions, end + 1))
        logits = self.lm.extend(x, row.slot, start, row.should_stop)  # (1, V)
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

    def _sample_and_decode(self, ready: list[Row]) -> None:
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
            if row.record is not None:  # its id goes in when read
                row.record.append([ops.clone(logits[j]), -1])
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
            token = known.get(j)
            if token is not None and token >= rules.eos_token:
                row.stalled = True  # a stop, or a fill: nothing to feed until it is read
            elif row.steps < row.limit():
                going.append(j)
            else:
                row.stalled = True
        self._reads.push(tokens, [(r, r.epoch, r.steps - 1) for r in ready])
        self._read()
        going = [j for j in going if not ready[j].finished and not ready[j].stalled]
        if going:
            picked = tokens if len(going) == len(ready) else tokens[ops.ints(going)]
            self._decode([ready[j] for j in going], picked)

    def _forced(self, row: Row) -> int | None:
        # the id of this step when the host decides it: a forced fill, or the teacher's token
        if row.arriving and row.state is not None and row.steps == row.state.next_fill:
            return self.rules.fill
        if row.teacher is None:
            return None
        try:
            return next(row.teacher)
        except StopIteration:
            raise ValueError("teacher_tokens ran out before the LM reached EOS") from None

    def _decode(self, rows: list[Row], tokens: Any) -> None:
        xp = self.ops.xp
        slots = [r.slot for r in rows]
        sl = self._index_of(slots)
        kv_len = max(r.pos for r in rows) + 1
        self._reserve(max(slots) + 1, kv_len)
        # a stop id (read later) has no embedding row
        fed = xp.where(tokens < self.rules.eos_token, tokens, 0)
        pos = self._pos[sl]
        stops = [r.should_stop for r in rows]
        watched = any(s is not None for s in stops)
        self._logits[sl] = self.lm.decode(
            fed, pos, kv_len, None if isinstance(sl, slice) else sl, stops if watched else None
        )
        self._pos[sl] = pos + 1
        for r in rows:
            r.pos += 1
            r.ready = True
        if watched:  # a row whose run its stop ended holds no log-probabilities: it ends here
            stopped = [r for r in rows if r.should_stop is not None and r.should_stop()]
            if stopped:
                with self._cv:
                    for r in stopped:
                        self._finish_locked(r, Stopped())
        self.stats.step(len(rows))
        if self.on_step is not None:
            self.on_step(len(rows))

    # --- reading the ids back -----------------------------------------------------------------------------------

    def _read(self) -> None:
        for ids, rows in self._reads.due():
            self._took(ids, rows)

    def _flush(self) -> bool:
        """Read every id still on its way (on a device, waiting for them); False: there was none."""
        if not self._reads:
            return False
        for ids, rows in self._reads.drain():
            self._took(ids, rows)
        return True

    def _took(self, ids: list[int], rows: list[tuple[Row, int, int]]) -> None:
        for (row, epoch, step), token in zip(rows, ids, strict=True):
            if row.finished or row.cancelled or epoch != row.epoch:
                continue  # a row gone, or put back past this step
            self._take(row, step, token)

    def _take(self, row: Row, step: int, token: int) -> None:
        rules = self.rules
        assert step == row.read, (step, row.read)
        row.read += 1
        if row.record is not None:
            row.record[step][1] = token
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
        self._put(row, token)
        if row.read >= row.limit():
            with self._cv:
                self._finish_locked(row)

    def _on_fill(self, row: Row, step: int, prev: int) -> None:
        state = row.state
        assert state is not None
        state.next_fill = step + self.rules.mix_ratio[1] + 1
        # the fill step's input: the last extend, or the speech token before it
        state.lm_input = row.extend_parts if step == row.extend_step else [("speech", [prev])]
        state.after_fill = True
        if row.steps > step + 1:  # it went on, speculating that the step was speech: put it back
            self.stats.rollbacks += 1
            row.epoch += 1
            if row.record is not None:
                del row.record[step + 1 :]
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
