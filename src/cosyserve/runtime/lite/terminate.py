"""Ending an ONNX Runtime run that a stopped request is waiting on.

One ORT ``run`` of a long graph (the flow's estimator step or the vocoder over a long piece) can take seconds, and
it holds no Python code where a stop check could go. ORT can end a run from another thread: its
``RunOptions.terminate``. :func:`run` registers each run that has a stop signal with one watcher thread per
process, which asks every registered signal every :data:`POLL_S` seconds and sets ``terminate`` on the runs whose
request stopped; ORT then ends the run early with an error, which :func:`run` turns into
:class:`cosyserve.core.stop.Stopped`. The thread exists only while runs with a signal are in flight (and is made
again in a forked child), so a fork template starts none.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

from cosyserve.core.stop import ShouldStop, Stopped

__all__ = ["POLL_S", "run", "run_bound"]

POLL_S = 0.05

_lock = threading.Lock()
_wake = threading.Condition(_lock)
_runs: dict[int, tuple[Any, ShouldStop]] = {}  # id of its RunOptions -> (RunOptions, the run's stop signal)
_watcher: tuple[int, threading.Thread] | None = None  # (pid, thread): a forked child starts its own


def run(session: Any, feeds: dict[str, Any], should_stop: ShouldStop | None) -> list[Any]:
    """``session.run(None, feeds)``, ended early by :class:`~cosyserve.core.stop.Stopped` once ``should_stop`` says
    so (within about :data:`POLL_S` seconds and the time ORT takes to reach its next kernel)."""
    if should_stop is None:
        return session.run(None, feeds)  # type: ignore[no-any-return]
    with _watched(should_stop) as options:
        return session.run(None, feeds, options)  # type: ignore[no-any-return]


def run_bound(session: Any, binding: Any, should_stop: ShouldStop | None) -> None:
    """``session.run_with_iobinding(binding)`` (its outputs in the buffers bound to it), ended early as
    :func:`run` ends a run."""
    if should_stop is None:
        session.run_with_iobinding(binding)
        return
    with _watched(should_stop) as options:
        session.run_with_iobinding(binding, options)


@contextlib.contextmanager
def _watched(should_stop: ShouldStop) -> Iterator[Any]:
    # RunOptions for one run, registered with the watcher meanwhile; ORT's error for a terminated run becomes
    # Stopped. A signal already set terminates at once: ORT then returns before its first kernel.
    import onnxruntime as ort

    options = ort.RunOptions()
    if should_stop():
        options.terminate = True
    key = id(options)
    with _lock:
        idle = not _runs
        _runs[key] = (options, should_stop)
        _ensure_watcher()
        if idle:  # else it polls within POLL_S anyway: no wake-up per run (an LM step is one)
            _wake.notify()
    try:
        yield options
    except Exception:
        if options.terminate:  # ORT's error for a terminated run: the request stopped
            raise Stopped from None
        raise
    finally:
        with _lock:
            del _runs[key]


def _ensure_watcher() -> None:
    # under _lock
    global _watcher
    pid = os.getpid()
    if _watcher is None or _watcher[0] != pid or not _watcher[1].is_alive():
        thread = threading.Thread(target=_watch, name="cosyserve-ort-terminate", daemon=True)
        _watcher = (pid, thread)
        thread.start()


def _watch() -> None:
    global _watcher
    with _lock:
        while True:
            if not _runs:
                # nothing to watch: leave (the next run starts a new watcher), after a grace period that spares
                # a thread start per run of a request that runs graph after graph
                _wake.wait(1.0)
                if not _runs:
                    _watcher = None
                    return
            runs = list(_runs.values())
            _lock.release()
            try:
                for options, should_stop in runs:
                    if not options.terminate and should_stop():
                        options.terminate = True
            finally:
                _lock.acquire()
            _wake.wait(POLL_S)
