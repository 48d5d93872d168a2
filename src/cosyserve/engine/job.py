"""A request inside the engine (:class:`Job`): its sink, its cancellation and deadline, and the bound on the audio
its worker may get ahead of its consumer (:data:`BUFFER_SECONDS`)."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from cosyserve.core.errors import DeadlineExceededError, InternalError
from cosyserve.core.request import SynthesisRequest

__all__ = ["BUFFER_SECONDS", "Job", "check_finite"]

# The most audio a request's worker gets ahead of its consumer, in seconds: a client that stops reading (a full
# socket, a paused player) holds its worker there, its memory bounded, until it reads on, its deadline passes or
# it is cut off (the WebSocket's idle timeout, a disconnect)
BUFFER_SECONDS = 20.0

_NONFINITE_AUDIO = "synthesis made audio with NaN or infinite samples (not encoded)"


def check_finite(chunk: np.ndarray) -> None:
    """Raise :class:`InternalError` when ``chunk`` holds NaN or infinite samples (audio never to be encoded)."""
    if not np.isfinite(chunk).all():
        raise InternalError(_NONFINITE_AUDIO, public=_NONFINITE_AUDIO)


class Job:
    """A request inside the engine: its sink, cancellation flag and timings."""

    def __init__(
        self, request: SynthesisRequest, sink: Callable[[Any], None], clock: Callable[[], float]
    ) -> None:
        self.request = request
        self.sink = sink
        self.clock = clock
        self.submitted = clock()
        self.started: float | None = None
        self.first_audio: float | None = None
        self.samples = 0
        self.cancel_reason: BaseException | None = None
        self.future: concurrent.futures.Future[None] | None = None
        self.finished = False
        self.on_done: list[Callable[[], None]] = []
        self.pending = 0  # samples given to the sink and not yet taken by the consumer
        # the most pending samples before the worker waits (None: no bound)
        self.buffer_limit: int | None = None
        self._room = threading.Condition()

    def cancel(self, reason: BaseException) -> None:
        # first reason wins; the worker reads it at the next token/chunk
        if self.cancel_reason is None:
            self.cancel_reason = reason
        with self._room:
            self._room.notify_all()  # a worker waiting for its consumer to read stops waiting

    def taken(self, samples: int) -> None:
        """The consumer took a chunk of ``samples``: room for the worker to go on."""
        with self._room:
            self.pending -= samples
            self._room.notify_all()

    def wait_for_room(self) -> None:
        """Block the worker while more than :attr:`buffer_limit` samples wait for the consumer (until it reads,
        or the request is stopped: cancelled or past its deadline)."""
        limit = self.buffer_limit
        if limit is None:
            return
        with self._room:
            while self.pending > limit and not self.should_stop():
                d = self.request.deadline
                self._room.wait(1.0 if d is None else max(0.0, min(1.0, d - self.clock())))

    def should_stop(self) -> bool:
        """Whether the request was cancelled or its deadline passed (asked by the runtime after every token)."""
        if self.cancel_reason is None:
            d = self.request.deadline
            if d is not None and self.clock() >= d:
                self.cancel(DeadlineExceededError(f"request {self.request.request_id}: deadline passed"))
        return self.cancel_reason is not None
