"""Stopping a request's model work between bounded pieces of it (pure Python: every layer and runtime uses it).

A request's stop signal is a ``should_stop()`` callable (the engine's: cancelled, client gone, deadline passed,
shutting down). Work that runs longer than a speech token (a flow's Euler steps, a vocoder's upsampling stages,
an ONNX run) asks it between its pieces through :func:`check`, which raises :class:`Stopped`; the runtime that
started the work catches it and ends the request's audio there. So no piece of work outlasts a stop by more
than one bounded piece, whatever the length of the text.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["ShouldStop", "Stopped", "check", "latched"]

ShouldStop = Callable[[], bool]


class Stopped(Exception):
    """Raised inside a request's model work once its stop signal says so. Control flow, not an error: the
    runtime that started the work catches it (the engine reports why the request stopped)."""


def check(should_stop: ShouldStop | None) -> None:
    """Raise :class:`Stopped` when ``should_stop`` (None: never) says the request's work should end now."""
    if should_stop is not None and should_stop():
        raise Stopped


def latched(should_stop: ShouldStop) -> ShouldStop:
    """``should_stop`` asked until it first says True, then True without asking it again (thread-safe): the
    signal of one request's work that several threads watch (its consumer, the decode loop, the ONNX Runtime
    terminate watcher), asked once more by none of them after the stop."""
    lock = threading.Lock()
    stopped = False

    def latch() -> bool:
        nonlocal stopped
        with lock:
            if not stopped and should_stop():
                stopped = True
            return stopped

    return latch
