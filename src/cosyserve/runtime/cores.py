"""The process's CPU threads, shared among the requests that compute at once.

torch's intra-op thread count is a per-thread setting (OpenMP's ``nthreads`` ICV): a runtime that serves several
requests from several threads must choose it for each. A fixed count is wrong one way or the other: one thread per
request leaves a core idle while one request runs alone (its first audio takes ~1.7x as long on two cores), and
all cores per request oversubscribes the machine as soon as two run (their OpenMP teams spin against each other).
:class:`CoreShare` counts the requests that run and gives each ``max(1, cores // running)`` threads, set again
by every thread before each piece of work (a decode step, a chunk), so a request that runs alone gets every core
and concurrent ones split them. :class:`Running` is the count alone (no torch: the lite runtime's upgrades wait
for no request running).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["CoreShare", "Running"]


class Running:
    """The requests that run, each counted from its first chunk asked for to its end or close; and a wait for none."""

    def __init__(self) -> None:
        self.running = 0
        self._cv = threading.Condition()

    def enter(self) -> None:
        with self._cv:
            self.running += 1

    def leave(self) -> None:
        with self._cv:
            self.running = max(0, self.running - 1)
            self._cv.notify_all()

    def track(self, chunks: Iterator[Any], resume: Callable[[], Any] | None = None) -> Iterator[Any]:
        """``chunks`` (a request's audio generator) counted while it runs, ``resume`` called in the iterating thread
        each time it resumes; closing this closes ``chunks``."""
        self.enter()
        try:
            while True:
                if resume is not None:
                    resume()
                try:
                    chunk = next(chunks)
                except StopIteration:
                    return
                yield chunk
        finally:
            self.leave()
            close = getattr(chunks, "close", None)
            if close is not None:
                close()

    def wait_idle(self, timeout: float) -> bool:
        """Until no request runs (True) or ``timeout`` seconds passed (False)."""
        with self._cv:
            return self._cv.wait_for(lambda: self.running == 0, timeout)


class CoreShare(Running):
    """``cores`` threads shared by the requests it counts running.

    Args:
        cores: the threads to share (the process's torch threads, or the ``threads`` setting).
    """

    def __init__(self, cores: int) -> None:
        if cores < 1:
            raise ValueError(f"cores must be >= 1, got {cores}")
        super().__init__()
        self.cores = cores

    def threads(self) -> int:
        """Threads one request may use now."""
        return max(1, self.cores // max(1, self.running))

    def apply(self, serves: int = 1) -> int:
        """Set the calling thread's torch threads to the share of ``serves`` requests (:meth:`threads` for its
        own; a decode step that serves every running request's row gets every core), only when it changes."""
        # at least its own request's share: a step that frees the last row serves none, yet its thread goes on
        # with its request (a share of 1 there ran a one-shot request's whole token2wav on one core: 1.4x)
        import torch

        n = max(1, min(self.cores, self.cores * max(1, serves) // max(1, self.running)))
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n

    def share(self, chunks: Iterator[object]) -> Iterator[object]:
        """``chunks`` (a request's audio generator, run in this thread) counted as running from its first chunk
        asked for to its end or close, with this thread's threads re-applied each time it resumes."""
        return self.track(chunks, self.apply)
