"""The decode loop's bookkeeping: one row's state (:class:`Row`) and the loop's per-step record
(:class:`DecodeStats`)."""

from __future__ import annotations

import math
import queue
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from cosyserve.core.stop import ShouldStop
from cosyserve.runtime.lm import OneShot, Part, Streamed, StreamedText

__all__ = ["NEED_TEXT", "DONE", "DecodeStats", "Row"]


@dataclass
class DecodeStats:
    """The loop's per-step record: rows per decode step (a histogram by count), and totals."""

    steps: int = 0
    rows: int = 0
    prefills: int = 0  # rows admitted
    prefix_positions: int = 0  # prompt positions taken from a kept prefix (not prefilled)
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


NEED_TEXT = object()  # a streamed-text row asks its consumer for the next piece
DONE = object()


class Row:
    def __init__(
        self,
        spec: OneShot | Streamed,
        key: int,
        teacher: Iterator[int] | None,
        record: list | None = None,
        should_stop: ShouldStop | None = None,
    ) -> None:
        self.spec = spec
        self.key = key
        self.teacher = teacher
        self.record = record  # (log-probabilities, id) of each step, when asked
        self.should_stop = should_stop  # the request's stop signal, handed to the LM's runs
        self.text = None if isinstance(spec, OneShot) else iter(spec.text)
        self.out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # under the loop's condition
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
        self.state: StreamedText | None = None
        # the step whose input was the last extend, and that extend's parts and end position
        self.extend_step = 0
        self.extend_parts: list[Part] = []
        self.extend_end = 0
        self.recent: deque[int] = deque()  # the last read ids (a rollback rebuilds the history from them)
        self.last = -1  # the last id read

    def put(self, item: Any) -> None:
        """Hand ``item`` to the consumer (under the loop's lock)."""
        self.out.put(item)

    @property
    def lead(self) -> int:
        """Tokens sampled ahead of its consumer (read or not)."""
        return self.steps - self.read + self.delivered - self.taken

    def limit(self) -> float:
        """Steps the row may take."""
        spec = self.spec
        if isinstance(spec, OneShot):
            return spec.max_len
        cap = math.inf if spec.max_len is None else spec.max_len
        if spec.ratio is not None and self.state is not None:
            cap = min(cap, spec.ratio * max(self.state.words, 1))
        return cap


def flat_ids(piece: Any) -> list[Any]:
    """A piece of text ids as a list: a list, or a (1, n) / (n,) array."""
    return piece.reshape(-1).tolist() if hasattr(piece, "reshape") else list(piece)
