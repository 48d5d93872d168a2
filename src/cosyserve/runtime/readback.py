"""Sampled ids on their way back to the host: the decode loop reads them ``lag`` steps late on a device, where a
read is a synchronisation, and at once where they live in host memory (the CPU, numpy)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from cosyserve.core.sampling import ArrayOps

__all__ = ["ReadBack"]


class ReadBack:
    """A ring of ``lag + 2`` host buffers of ``width`` ids: each step's ids are copied into the next one (on a
    device: a non-blocking copy into pinned memory and an event after it) and read, as Python ints, once ``lag``
    later steps are queued or the copy is done. Every read goes through one numpy view of the ring, made here.

    Args:
        ops: where the ids live.
        lag: steps an id may wait (0: read at once).
        width: the most ids of one step (the loop's rows).
    """

    def __init__(self, ops: ArrayOps, lag: int, width: int) -> None:
        self.ops = ops
        self.lag = lag
        self._events = ops.torch and not ops.host
        self._next = 0
        if ops.torch:  # in host memory (pinned for a device's copies)
            self._ring = ops.xp.full((lag + 2, width), -1, dtype=ops.xp.int64, pin_memory=self._events)
            self._view = self._ring.numpy()
        else:
            self._ring = self._view = ops.full((lag + 2, width), -1)
        self._pending: deque[tuple[int, Any, Any]] = (
            deque()
        )  # (ring row, the copy's event, what the ids are of)

    def __len__(self) -> int:
        return len(self._pending)

    def push(self, ids: Any, of: Any) -> None:
        """Send a step's ``ids`` (B,) on their way; ``of`` comes back with them."""
        k = self._next
        self._next = (k + 1) % self._ring.shape[0]
        event = None
        if self.ops.torch:
            self._ring[k, : ids.shape[0]].copy_(ids, non_blocking=self._events)
            if self._events:
                event = self.ops.xp.cuda.Event()
                event.record()
        else:
            self._ring[k, : ids.shape[0]] = ids
        self._pending.append((k, event, of))

    def due(self) -> Iterator[tuple[list[int], Any]]:
        """The steps whose ids may be read now, oldest first: (ids, ``of``)."""
        while self._pending:
            event = self._pending[0][1]
            if len(self._pending) <= self.lag and (event is None or not event.query()):
                return
            yield self._pop()

    def drain(self) -> Iterator[tuple[list[int], Any]]:
        """Every step still on its way (on a device, waiting for their copies)."""
        while self._pending:
            yield self._pop()

    def _pop(self) -> tuple[list[int], Any]:
        k, event, of = self._pending.popleft()
        if event is not None:
            event.synchronize()
        return self._view[k, : len(of)].tolist(), of
