"""How long until a slot of an engine frees, from how long its recent requests held theirs: the Retry-After of a
refusal, and when a busy model could be evicted.

A request is expected to hold its slot as long as its text's length says at the recent requests' seconds per
character (a text of unknown length, streamed: the median of recent requests). Why per character: requests are not
alike. Expected from the median of recent requests whatever their length, a burst of one-sentence requests after a
few long texts was told the long texts' time (Retry-After 47 s where each took a second).

:class:`ServiceTimes` locks nothing: the engine asks it under its lock.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Collection, Iterable

from cosyserve.core.request import SynthesisRequest
from cosyserve.engine.job import Job

__all__ = ["RETRY_AFTER_BOUNDS_S", "ServiceTimes", "bounded"]

# Retry-After's range. At least 1 s: the header counts whole seconds, and retrying at once only hits the full
# queue again. At most 60 s: the median of a few recent requests says little about the next minute (one long
# text is not the next one), and a client that comes back early costs one cheap refusal with a fresh estimate,
# while one told to wait too long idles as slots free.
RETRY_AFTER_BOUNDS_S = (1.0, 60.0)


def bounded(seconds: float) -> float:
    """``seconds`` within :data:`RETRY_AFTER_BOUNDS_S`."""
    lo, hi = RETRY_AFTER_BOUNDS_S
    return min(hi, max(lo, seconds))


class ServiceTimes:
    """The wall seconds (engine clock) each recent request held its slot, start to end, and per character of its
    text (where it had a length): what the estimates predict from.

    Args:
        default_service_s: the guess before any request has finished.
    """

    def __init__(self, default_service_s: float = 1.0) -> None:
        self.default_service_s = default_service_s
        self._service_s: deque[float] = deque(maxlen=32)
        self._char_s: deque[float] = deque(maxlen=32)

    def record(self, request: SynthesisRequest, held: float) -> None:
        """``request`` finished (not cancelled, no error) after holding its slot ``held`` seconds."""
        self._service_s.append(held)
        if isinstance(request.text, str) and request.text:
            self._char_s.append(held / len(request.text))

    def duration(self, request: SynthesisRequest) -> float:
        # how long a request is expected to hold its slot: its text's length at the recent seconds per character,
        # else (streamed text; no request of known length finished yet) the median of recent requests
        chars = len(request.text) if isinstance(request.text, str) else 0
        if chars and self._char_s:
            return statistics.median(self._char_s) * chars
        return statistics.median(self._service_s) if self._service_s else self.default_service_s

    def expected(
        self, jobs: Iterable[Job], now: float
    ) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
        """(request id, expected seconds left) of each running request, (request id, expected seconds) of each
        queued one."""
        running, queued = [], []
        for job in jobs:
            rid, duration = job.request.request_id, self.duration(job.request)
            if job.started is None:
                queued.append((rid, duration))
            else:  # a cancelled request ends at its next token
                running.append((rid, 0.0 if job.cancel_reason else max(0.0, duration - (now - job.started))))
        return running, queued

    def retry_after(self, jobs: Iterable[Job], now: float, request_ids: Collection[str] = ()) -> float:
        """Seconds until a slot is likely free (see :meth:`cosyserve.engine.engine.Engine.retry_after`)."""
        running, queued = self.expected(jobs, now)
        first_free = min((left for _, left in running), default=0.0)  # none running: a slot is free now
        if not request_ids:
            return bounded(first_free)
        mine = [left for rid, left in running if rid in request_ids]
        if mine:
            return bounded(min(mine))
        waiting = [d for rid, d in queued if rid in request_ids]
        return bounded(first_free + min(waiting, default=self.default_service_s))

    def idle_after(self, jobs: Iterable[Job], now: float, slots: int) -> float:
        """Seconds until every request in ``jobs`` is likely done, ``slots`` of them at a time."""
        running, queued = self.expected(jobs, now)
        last = max((left for _, left in running), default=0.0)
        return bounded(last + sum(d for _, d in queued) / slots)
