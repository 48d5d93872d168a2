"""Ending an ONNX Runtime run that a stopped request is waiting on.

One ORT ``run`` of a long graph (the flow's estimator step or the vocoder over a long piece) can take seconds, and
it holds no Python code where a stop check could go. ORT can end a run from another thread: its
``RunOptions.terminate``. :func:`run` registers each run that has a stop signal with one watcher thread per
process, which asks every registered signal every :data:`POLL_S` seconds and sets ``terminate`` on the runs whose
request stopped; ORT then ends the run early with an error, which :func:`run` turns into
:class:`cosyserve.stop.Stopped`. The thread exists only while runs with a signal are in flight (and is made
again in a forked child), so a fork template starts none.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from cosyserve.stop import ShouldStop, Stopped

__all__ = ["POLL_S", "run"]

POLL_S = 0.05

_lock = threading.Lock()
_wake = threading.Condition(_lock)
_runs: dict[int, tuple[Any, ShouldStop]] = {}  # id of its RunOptions -> (RunOptions, the run's stop signal)
_watcher: tuple[int, threading.Thread] | None = None  # (pid, thread): a forked child starts its own


def run(session: Any, feeds: dict[str, Any], should_stop: ShouldStop | None) -> list[Any]:
    """``session.run(None, feeds)``, ended early by :class:`~cosyserve.stop.Stopped` once ``should_stop`` says
    so (within about :data:`POLL_S` seconds and the time ORT takes to reach its next kernel)."""
    if should_stop is None:
        return session.run(None, feeds)  # type: ignore[no-any-return]
    import onnxruntime as ort

    options = ort.RunOptions()
    key = id(options)
    with _lock:
        _runs[key] = (options, should_stop)
        _ensure_watcher()
        _wake.notify()
    try:
        return session.run(None, feeds, options)  # type: ignore[no-any-return]
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
