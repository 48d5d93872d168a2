"""Start-up phase timing: one clock that the loader, the startup report and the server's metrics all read.

Phases are named spans in milliseconds since the process started. The process start is taken from the
``COSYSERVE_SPAWN_T0`` environment variable when a parent that spawned us set it (``time.time()`` just before
exec: exact), else from ``/proc/self/stat`` (clock-tick resolution, ~10 ms), else from the first import of
this module.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["PHASES", "PhaseClock", "process_start_time"]

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
