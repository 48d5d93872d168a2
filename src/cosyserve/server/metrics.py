"""Prometheus metrics: one registry per app, read from the pool and the phase clocks at scrape time.

Request-level numbers (latency, time to first audio, errors by kind) are recorded once per request by
:func:`cosyserve.server.synth` through :meth:`Metrics.observe_request`; model-level ones (state, loads,
evictions, queue depth, in flight, real-time factor) come from ``pool.stats()``; start-up phases come from the
same :class:`cosyserve.startup.PhaseClock` that ``cosyserve startup-report`` reads, so a report and
production show one code path's numbers.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.requests import Request
from starlette.responses import Response

from cosyserve.startup import PHASES

__all__ = ["Metrics"]

_STATES = ("unloaded", "new", "loading", "ready", "draining", "released", "failed", "evicting")
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)


class _PoolCollector:
    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def collect(self) -> Any:
        state = self.m.state
        stats = state.pool.stats()
        st = GaugeMetricFamily(
            "cosyserve_model_state", "1 for the state each model is in", labels=["model", "state"]
        )
        inflight = GaugeMetricFamily(
            "cosyserve_in_flight_requests", "requests admitted, not finished", labels=["model"]
        )
        queue = GaugeMetricFamily("cosyserve_queue_depth", "requests waiting for a worker", labels=["model"])
        mapped = GaugeMetricFamily(
            "cosyserve_model_mapped_bytes", "bundle bytes a resident model maps", labels=["model"]
        )
        loads = CounterMetricFamily("cosyserve_model_loads", "completed model loads", labels=["model"])
        evictions = CounterMetricFamily(
            "cosyserve_model_evictions", "model evictions", labels=["model", "reason"]
        )
        hits = CounterMetricFamily(
            "cosyserve_model_lookups",
            "requests that found the model resident or not",
            labels=["model", "result"],
        )
        rejected = CounterMetricFamily(
            "cosyserve_engine_rejected", "requests refused at admission", labels=["model", "reason"]
        )
        finished = CounterMetricFamily(
            "cosyserve_engine_requests",
            "requests the engine finished, by outcome (ok, cancelled, deadline, client_error, error)",
            labels=["model", "outcome"],
        )
        audio = CounterMetricFamily("cosyserve_audio_seconds", "seconds of audio produced", labels=["model"])
        compute = CounterMetricFamily(
            "cosyserve_compute_seconds", "worker seconds spent synthesizing", labels=["model"]
        )
        rtf = GaugeMetricFamily(
            "cosyserve_real_time_factor", "median compute/audio of recent requests", labels=["model"]
        )
        load_s = GaugeMetricFamily(
            "cosyserve_model_load_seconds",
            "duration of the first and the last load",
            labels=["model", "which"],
        )
        for name, d in stats["models"].items():
            for s in _STATES:
                st.add_metric([name, s], 1.0 if d["state"] == s else 0.0)
            inflight.add_metric([name], d["in_flight"])
            queue.add_metric([name], d["queue_depth"])
            mapped.add_metric([name], d["mapped_bytes"])
            loads.add_metric([name], d["loads"])
            for reason, n in d["evictions"].items():
                evictions.add_metric([name, reason], n)
            hits.add_metric([name, "hit"], d["hits"])
            hits.add_metric([name, "miss"], d["misses"])
            for reason, n in d["rejected"].items():
                rejected.add_metric([name, reason], n)
            for outcome, n in d["outcomes"].items():
                finished.add_metric([name, outcome], n)
            audio.add_metric([name], d["audio_s"])
            compute.add_metric([name], d["compute_s"])
            if d["rtf_p50"] is not None:
                rtf.add_metric([name], d["rtf_p50"])
            for which in ("first", "last"):
                v = d.get(f"{which}_load_s")
                if v is not None:
                    load_s.add_metric([name, which], v)
        yield from (
            st,
            inflight,
            queue,
            mapped,
            loads,
            evictions,
            hits,
            rejected,
            finished,
            audio,
            compute,
            rtf,
            load_s,
        )
        mem = GaugeMetricFamily(
            "cosyserve_memory_bytes", "memory: used, limit, budget, resident models", labels=["kind"]
        )
        for kind, key in (
            ("used", "memory_used"),
            ("limit", "memory_limit"),
            ("budget", "memory_budget"),
            ("models", "resident_bytes"),
        ):
            if stats.get(key) is not None:
                mem.add_metric([kind], stats[key])
        yield mem
        phases = GaugeMetricFamily(
            "cosyserve_startup_phase_seconds",
            "duration of each start-up phase of each model's first load (as in cosyserve startup-report)",
            labels=["model", "phase"],
        )
        points = GaugeMetricFamily(
            "cosyserve_startup_point_seconds",
            "seconds from process start to a start-up point",
            labels=["model", "point"],
        )
        for model, clock in self.m.model_clocks().items():
            d = clock.as_dict()
            for ph in PHASES:
                if ph in d["phases_ms"]:
                    phases.add_metric([model, ph], d["phases_ms"][ph] / 1e3)
            for pt, ms in d["points_ms"].items():
                points.add_metric([model, pt], ms / 1e3)
        for pt, ms in state.clock.as_dict()["points_ms"].items():
            points.add_metric(["server", pt], ms / 1e3)
        yield phases
        yield points
        up = GaugeMetricFamily("cosyserve_ready", "1 when /health/ready says ready")
        up.add_metric([], 1.0 if state.ready() else 0.0)
        yield up


class Metrics:
    def __init__(self, state: Any) -> None:
        self.state = state
        self.registry = CollectorRegistry()
        self._clocks: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.requests = Counter(
            "cosyserve_requests",
            "HTTP synthesis requests by outcome",
            ["route", "model", "status", "outcome"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "cosyserve_request_seconds",
            "request duration to the last byte",
            ["route", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttfa = Histogram(
            "cosyserve_time_to_first_audio_seconds",
            "request start to its first audio chunk",
            ["route", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.rtf = Histogram(
            "cosyserve_request_real_time_factor",
            "request duration / audio duration",
            ["model"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16),
            registry=self.registry,
        )
        self.errors = Counter(
            "cosyserve_http_errors",
            "requests refused before synthesis (bad body, auth, limits, unknown model/voice), by status and code",
            ["route", "status", "code"],
            registry=self.registry,
        )
        self.pool_events = Counter(
            "cosyserve_pool_events", "model pool events", ["model", "kind"], registry=self.registry
        )
        self.registry.register(_PoolCollector(self))

    def observe_request(
        self,
        route: str,
        model: str,
        status: int,
        outcome: str,
        ttfa_s: float | None,
        total_s: float,
        audio_s: float,
    ) -> None:
        self.requests.labels(route, model, str(status), outcome).inc()
        self.latency.labels(route, model).observe(total_s)
        if ttfa_s is not None:
            self.ttfa.labels(route, model).observe(ttfa_s)
        if audio_s > 0 and outcome == "ok":
            self.rtf.labels(model).observe(total_s / audio_s)

    def observe_error(self, route: str, status: int, code: str) -> None:
        self.errors.labels(route, str(status), code).inc()

    def on_pool_event(self, ev: Any) -> None:
        self.pool_events.labels(ev.model, ev.kind).inc()
        if ev.kind == "loaded":
            self._keep_clock(ev.model)

    def on_ready(self, ms: float) -> None:
        for name in self.state.model_names:  # a preload model's clock, in case its event came before us
            self._keep_clock(name)

    def _keep_clock(self, name: str) -> None:
        eng = self.state.pool.engine(name)
        clock = getattr(getattr(eng, "resident_hint", None), "clock", None)
        if clock is not None:
            with self._lock:
                self._clocks.setdefault(name, clock)  # the first load is the start-up

    def model_clocks(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._clocks)

    def startup_report(self) -> dict[str, Any]:
        """The start-up timings as JSON (the web page draws its waterfall from this)."""
        out: dict[str, Any] = {"server": self.state.clock.as_dict(), "models": {}}
        for name, clock in self.model_clocks().items():
            out["models"][name] = clock.as_dict()
        return out

    async def endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4; charset=utf-8")
