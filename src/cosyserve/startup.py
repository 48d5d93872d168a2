"""Start-up phase timing: one clock that the loader, the startup report and the server's metrics all read.

Phases are named spans in milliseconds since the process started. The process start is taken from the
``COSYSERVE_SPAWN_T0`` environment variable when a parent that spawned us set it (``time.time()`` just before
exec: exact), else from ``/proc/self/stat`` (clock-tick resolution, ~10 ms), else from the first import of
this module.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "PHASES",
    "PhaseClock",
    "collect_frozen",
    "gc_held",
    "hold_gc",
    "process_start_time",
    "release_gc",
]

# the phases of a start, in order; "ready" and "first_audio" are points measured from process start
PHASES = (
    "interpreter",
    "imports",
    "manifest",
    "construct",
    "map_assign",
    "verify",  # waiting for checksums still running after construction (files not verified before)
    "first_touch",
    "warmup",
    "ready",
    "first_audio",
    "text_tier",  # after READY, in the background (tokenizer, wetext), unless COSYSERVE_TEXT_TIER=lazy
    "warmup_token2wav",  # after READY, in the background: the flow's and the vocoder's warm-up
    "zero_shot_tier",  # after READY, in the background, when COSYSERVE_ZERO_SHOT_TIER=background
)

_MODULE_T0 = time.time()


def _proc_start_time() -> float | None:
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read().decode()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except OSError:
        return None
    # field 22 (starttime, clock ticks since boot) comes after the parenthesised command name
    fields = stat[stat.rindex(")") + 2 :].split()
    ticks = int(fields[19])
    hz = os.sysconf("SC_CLK_TCK")
    return time.time() - uptime + ticks / hz


def process_start_time() -> float:
    """Wall-clock time (``time.time()``) at which this process was started."""
    env = os.environ.get("COSYSERVE_SPAWN_T0")
    if env:
        try:
            return float(env)
        except ValueError:
            raise ValueError(f"COSYSERVE_SPAWN_T0 must be a float timestamp, got {env!r}") from None
    start = _proc_start_time()
    return start if start is not None and start <= _MODULE_T0 else _MODULE_T0


class PhaseClock:
    """Records phase durations (ms), when each phase first started and points in time (both ms since process
    start); thread-safe. A phase that runs in several threads or several times sums its durations."""

    def __init__(self, t0: float | None = None) -> None:
        self.t0 = process_start_time() if t0 is None else t0
        self.durations: dict[str, float] = {}
        self.starts: dict[str, float] = {}
        self.points: dict[str, float] = {}
        self._lock = threading.Lock()

    def now_ms(self) -> float:
        return (time.time() - self.t0) * 1e3

    def add(self, phase: str, ms: float, start_ms: float | None = None) -> None:
        """Add ``ms`` to ``phase``, a span that ends now (or that began at ``start_ms`` since process start)."""
        start = self.now_ms() - ms if start_ms is None else start_ms
        with self._lock:
            self.durations[phase] = self.durations.get(phase, 0.0) + ms
            self.starts[phase] = min(self.starts.get(phase, start), start)

    def mark(self, point: str) -> float:
        """Record that ``point`` (e.g. ``ready``) happened now; returns ms since process start."""
        ms = self.now_ms()
        with self._lock:
            self.points[point] = ms
        return ms

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start, t = self.now_ms(), time.perf_counter()
        try:
            yield
        finally:
            self.add(name, (time.perf_counter() - t) * 1e3, start)

    def as_dict(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {
                "phases_ms": dict(self.durations),
                "starts_ms": dict(self.starts),
                "points_ms": dict(self.points),
            }


# -- the cyclic garbage collector during a start -----------------------------------------------------------
# A start allocates a few hundred thousand long-lived objects (torch's modules, then ours); each one pushes the
# collector towards a full pass over all of them: ~80 ms of `import torch` and about half of module construction
# here. So a start holds the collector off, and when the last hold goes, freezes what the start built
# (gc.freeze: never scanned again, which also keeps later passes short on the request path) and turns it back on.

_gc_lock = threading.Lock()
_gc_holds = 0
_gc_was_enabled = False


def hold_gc() -> None:
    """Pause the cyclic garbage collector until the matching :func:`release_gc` (holds nest)."""
    global _gc_holds, _gc_was_enabled
    with _gc_lock:
        if _gc_holds == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_holds += 1


def release_gc() -> None:
    """Drop one hold; the last one freezes the objects alive now and re-enables the collector if it was on.
    A release without a hold does nothing (the server releases on READY whether or not the CLI held)."""
    global _gc_holds
    with _gc_lock:
        if _gc_holds == 0:
            return
        _gc_holds -= 1
        if _gc_holds == 0:
            gc.freeze()
            if _gc_was_enabled:
                gc.enable()


@contextmanager
def gc_held() -> Iterator[None]:
    hold_gc()
    try:
        yield
    finally:
        release_gc()


def collect_frozen() -> None:
    """Collect garbage among frozen objects (after a model is released): a frozen cycle is otherwise never
    freed. One full pass (~0.1 s with torch loaded), then the survivors are frozen again."""
    with _gc_lock:
        if gc.get_freeze_count() == 0 or _gc_holds:
            return
        gc.unfreeze()
        gc.collect()
        gc.freeze()
