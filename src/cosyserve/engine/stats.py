"""Counters and recent latencies of one model, shared by every engine the pool builds for it."""

from __future__ import annotations

import math
import threading
from collections import deque
from typing import Any

__all__ = ["ModelStats"]


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class ModelStats:
    """Counters and recent latencies of one model, updated only through these methods (one lock).

    The pool passes the same object to every engine it builds for the model, so loads and evictions
    (pool events) and requests (engine events) land in one place.
    """

    WINDOW = 1024

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self.loads = 0
        self.load_failures = 0
        self.evictions: dict[str, int] = {}
        self.hits = 0
        self.misses = 0
        self.first_load_s: float | None = None
        self.last_load_s: float | None = None
        self.requests = 0
        self.rejected: dict[str, int] = {}
        self.outcomes: dict[str, int] = {}
        self.audio_s = 0.0
        self.compute_s = 0.0
        self.ttfa_s: deque[float] = deque(maxlen=self.WINDOW)
        self.lm_rows: dict[int, int] = {}  # rows decoded together -> LM steps
        self.rtf: deque[float] = deque(maxlen=self.WINDOW)

    def record_load(self, seconds: float, ok: bool) -> None:
        with self._lock:
            if not ok:
                self.load_failures += 1
                return
            self.loads += 1
            if self.first_load_s is None:
                self.first_load_s = seconds
            self.last_load_s = seconds

    def record_eviction(self, reason: str) -> None:
        with self._lock:
            self.evictions[reason] = self.evictions.get(reason, 0) + 1

    def record_lookup(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1

    def record_admit(self) -> None:
        with self._lock:
            self.requests += 1

    def record_reject(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def record_first_audio(self, ttfa_s: float) -> None:
        with self._lock:
            self.ttfa_s.append(ttfa_s)

    def record_lm_step(self, rows: int) -> None:
        with self._lock:
            self.lm_rows[rows] = self.lm_rows.get(rows, 0) + 1

    def record_finish(self, outcome: str, audio_s: float, compute_s: float) -> None:
        with self._lock:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            self.audio_s += audio_s
            self.compute_s += compute_s
            if outcome == "ok" and audio_s > 0:
                self.rtf.append(compute_s / audio_s)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            ttfa = list(self.ttfa_s)
            rtf = list(self.rtf)
            return {
                "loads": self.loads,
                "load_failures": self.load_failures,
                "evictions": dict(self.evictions),
                "hits": self.hits,
                "misses": self.misses,
                "first_load_s": self.first_load_s,
                "last_load_s": self.last_load_s,
                "requests": self.requests,
                "rejected": dict(self.rejected),
                "outcomes": dict(self.outcomes),
                "audio_s": self.audio_s,
                "compute_s": self.compute_s,
                "ttfa_p50_s": _quantile(ttfa, 0.5),
                "ttfa_p99_s": _quantile(ttfa, 0.99),
                "rtf_p50": _quantile(rtf, 0.5),
                "rtf_mean": (sum(rtf) / len(rtf)) if rtf else None,
                "lm_batch_rows": dict(self.lm_rows),
            }
