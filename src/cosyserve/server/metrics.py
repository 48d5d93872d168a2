"""Prometheus metrics: one registry per app, read from the pool and the phase clocks at scrape time.

Request-level numbers (latency, time to first audio, errors by kind) are recorded once per request by
:func:`cosyserve.server.synth` through :meth:`Metrics.observe_request`; model-level ones (state, loads,
evictions, queue depth, in flight, real-time factor) come from ``pool.stats()``; start-up phases come from the
same :class:`cosyserve.core.clock.PhaseClock` that ``cosyserve startup-report`` reads, so a report and
production show one code path's numbers.

With ``--workers N`` a scrape reaches one worker, yet must see the whole server: the request counters and
histograms use prometheus-client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, a private directory the
master makes, see :mod:`cosyserve.server.run`), summed over the workers; the pool's values, which each worker
holds for its own models, are published by every worker to that directory each second and shown per worker
with a ``pid`` label: a worker's model states, load times and start-up phases are its own (a sum of them would
mean nothing), and ``sum without (pid)`` gives the totals where they make sense (in flight, queue, engine
counters).

With API keys, a scrape names a model only when its key may use it (the open routes' one rule,
:meth:`cosyserve.server.app.ServerState.shown_models`): the series of the other models are summed into one
``model="(other)"`` series where a sum means something (requests, states, in flight, bytes, loads), and left out
where it does not (a median, a load's duration, start-up times). A scraper's key of a tenant that the pool
config does not list sees every model.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from cosyserve.core.clock import PHASES

__all__ = ["OTHER_MODELS", "Metrics"]

OTHER_MODELS = "(other)"  # the model label of the models a scrape may not name
# per-model values that do not add up over models: a hidden model's are left out, not summed
_NOT_ADDITIVE = frozenset(
    {
        "cosyserve_real_time_factor",
        "cosyserve_model_load_seconds",
        "cosyserve_startup_phase_seconds",
        "cosyserve_startup_point_seconds",
    }
)

_STATES = ("unloaded", "new", "loading", "ready", "draining", "released", "failed", "evicting")
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
_ROWS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def _rows_histogram(counts: dict[int, int]) -> tuple[list[tuple[str, float]], float]:
    # (cumulative buckets, sum) of an LM's rows per decode step, from its counts by rows
    buckets = [
        (str(float(le)), float(sum(n for rows, n in counts.items() if rows <= le))) for le in _ROWS_BUCKETS
    ]
    buckets.append(("+Inf", float(sum(counts.values()))))
    return buckets, float(sum(rows * n for rows, n in counts.items()))


class _PoolCollector:
    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def collect(self) -> Any:
        state = self.m.state
        stats = state.pool.stats()
        yield from self._models(stats)
        yield self._memory(stats)
        yield from self._startup()
        up = GaugeMetricFamily("cosyserve_ready", "1 when /health/ready says ready")
        up.add_metric([], 1.0 if state.ready() else 0.0)
        yield up

    def _models(self, stats: dict[str, Any]) -> Any:
        """Each model's families: its state, load, traffic and output."""
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
        lm_rows = HistogramMetricFamily(
            "cosyserve_lm_batch_rows", "rows decoded together in each LM decode step", labels=["model"]
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
            lm_rows.add_metric([name], *_rows_histogram(d["lm_batch_rows"]))
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
            lm_rows,
        )

    def _memory(self, stats: dict[str, Any]) -> GaugeMetricFamily:
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
        return mem

    def _startup(self) -> Any:
        """Each model's start-up phases and points, and the server's points."""
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
        for pt, ms in self.m.state.clock.as_dict()["points_ms"].items():
            points.add_metric(["server", pt], ms / 1e3)
        yield phases
        yield points


class _WorkerPools:
    """Every live worker's pool families, each sample labelled with the worker's ``pid`` (``--workers N``)."""

    PUBLISH_S = 1.0  # how stale another worker's pool values may be in a scrape

    def __init__(self, metrics: Metrics, path: str) -> None:
        self.path = path
        self.own = os.path.join(path, f"pool_{os.getpid()}.json")
        self.local = CollectorRegistry(auto_describe=False)
        self.local.register(_PoolCollector(metrics))

    def publish(self) -> None:
        fams = [
            [m.name, m.documentation, m.type, [[x.name, x.labels, x.value] for x in m.samples]]
            for m in self.local.collect()
        ]
        tmp = f"{self.own}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(fams, f)
        os.replace(tmp, self.own)  # a scraping worker never reads half a file

    def unpublish(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.own)

    async def publish_forever(self) -> None:
        try:
            while True:
                self.publish()
                await asyncio.sleep(self.PUBLISH_S)
        finally:
            self.unpublish()

    def collect(self) -> Any:
        self.publish()  # this worker's values as of now
        merged: dict[str, Metric] = {}
        for fn in sorted(glob.glob(os.path.join(self.path, "pool_*.json"))):
            pid = os.path.basename(fn)[len("pool_") : -len(".json")]
            if not _alive(pid):
                continue  # a worker that died without removing its file
            try:
                with open(fn, encoding="utf-8") as f:
                    fams = json.load(f)
            except (OSError, ValueError):
                continue  # gone between the listing and the read
            for name, doc, typ, samples in fams:
                m = merged.get(name)
                if m is None:
                    m = merged[name] = Metric(name, doc, typ)
                for sample, labels, value in samples:
                    m.add_sample(sample, {**labels, "pid": pid}, value)
        yield from merged.values()


class _Shown(Collector):
    """A registry's families as a caller who may see only ``names`` sees them (see the module's docstring)."""

    def __init__(self, registry: CollectorRegistry, names: set[str]) -> None:
        self.registry = registry
        self.names = names

    def _named(self, metric: str, model: str) -> bool:
        # metric: a Prometheus metric family's name
        return model in self.names or (metric == "cosyserve_startup_point_seconds" and model == "server")

    def collect(self) -> Any:
        for fam in self.registry.collect():
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            others: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
            for x in fam.samples:
                model = x.labels.get("model")
                if model is None or self._named(fam.name, model):
                    out.add_sample(x.name, x.labels, x.value, x.timestamp, x.exemplar, x.native_histogram)
                elif fam.name not in _NOT_ADDITIVE and not x.name.endswith("_created"):
                    key = (x.name, tuple(sorted({**x.labels, "model": OTHER_MODELS}.items())))
                    others[key] = others.get(key, 0.0) + x.value
            for (name, labels), value in others.items():
                out.add_sample(name, dict(labels), value)
            yield out


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def multiproc_dir(workers: int) -> str | None:
    """The shared metrics directory when this process is one of several workers, else None."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    return path if workers > 1 and path and os.path.isdir(path) else None


class Metrics:
    def __init__(self, state: Any) -> None:
        self.state = state
        self.registry = CollectorRegistry()  # what /metrics shows
        self._clocks: dict[str, Any] = {}
        self._lock = threading.Lock()
        path = multiproc_dir(state.config.workers)
        self.workers: _WorkerPools | None = None
        own: CollectorRegistry | None = self.registry
        if path is not None:
            from prometheus_client.multiprocess import MultiProcessCollector

            # the counters below write to the shared directory; the scrape reads every worker's files from there
            MultiProcessCollector(self.registry, path=path)
            own = None
        self.requests = Counter(
            "cosyserve_requests",
            "HTTP synthesis requests by outcome",
            ["route", "model", "status", "outcome"],
            registry=own,
        )
        self.latency = Histogram(
            "cosyserve_request_seconds",
            "request duration to the last byte",
            ["route", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=own,
        )
        self.ttfa = Histogram(
            "cosyserve_time_to_first_audio_seconds",
            "request start to its first audio chunk",
            ["route", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=own,
        )
        self.rtf = Histogram(
            "cosyserve_request_real_time_factor",
            "request duration / audio duration",
            ["model"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16),
            registry=own,
        )
        self.errors = Counter(
            "cosyserve_http_errors",
            "requests refused before synthesis (bad body, auth, limits, unknown model/voice), by status and code",
            ["route", "status", "code"],
            registry=own,
        )
        self.pool_events = Counter(
            "cosyserve_pool_events", "model pool events", ["model", "kind"], registry=own
        )
        if path is None:
            self.registry.register(_PoolCollector(self))
        else:
            self.workers = _WorkerPools(self, path)
            self.registry.register(self.workers)

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
        clock = eng.runtime.clock if eng is not None and eng.runtime is not None else None
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
        names = self.state.shown_models(request)
        source = self.registry if names is None else _Shown(self.registry, names)
        return Response(generate_latest(source), media_type="text/plain; version=0.0.4; charset=utf-8")
