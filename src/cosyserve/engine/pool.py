"""Several models in one process under a memory budget: preload / lazy / idle TTL / pinned, LRU-K eviction.

Each model (:class:`~cosyserve.engine.entries.ModelSpec`, kept in an :class:`~cosyserve.engine.entries.Entry`)
gets an :class:`~cosyserve.engine.engine.Engine` when it is loaded and loses it when it is evicted; its
:class:`~cosyserve.engine.stats.ModelStats` and its opened bundle (manifest, config) stay, so a reload skips
conversion and checksum work and finds the weight pages in the page cache.

Rules, all applied under one pool lock (engine locks are only ever taken inside it, never the reverse):

- a request records a *use* of its model; lazy models load on first use and concurrent first requests share
  one load; a model that is READY is a hit, anything else a miss;
- a request of a tenant takes one of the tenant's ``max_concurrent`` slots before anything is loaded or queued
  (:class:`~cosyserve.engine.quotas.InFlight`, one count per tenant, held here);
- before a load, room is made (:mod:`cosyserve.engine.eviction`): within the requesting tenant's quota, then the
  memory budget, then under the pressure threshold;
- :meth:`ModelPool.maintain` (run periodically by :meth:`ModelPool.run_housekeeping`) releases models idle
  for longer than their TTL and evicts while memory pressure is above the threshold;
- a model whose load failed is not loaded again until its back-off ends (:data:`LOAD_BACKOFF_S`): requests in
  between get the failure at once (:class:`~cosyserve.core.errors.LoadFailedError`, with the wait), so a model that
  cannot load costs one load attempt a minute at most, whatever the request rate; a change of its files on disk
  ends the back-off early.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

from cosyserve.core.errors import LoadFailedError, OverloadedError, UnknownModelError
from cosyserve.core.request import SynthesisRequest
from cosyserve.engine.backoff import LOAD_BACKOFF_S, LoadFailure, LoadFailures
from cosyserve.engine.engine import RETRY_AFTER_BOUNDS_S, Engine
from cosyserve.engine.entries import Entry, ModelSpec, PoolEvent, VoiceList
from cosyserve.engine.eviction import evictable, lru_k_order, plan_room, pressure_victims
from cosyserve.engine.quotas import InFlight, Tenant, sole_owners
from cosyserve.engine.state import EngineState
from cosyserve.engine.streams import AudioStream, SyncAudioStream, shared
from cosyserve.system.pagecache import memory_usage

logger = logging.getLogger(__name__)

__all__ = [
    "LOAD_BACKOFF_S",
    "LoadFailure",
    "ModelPool",
    "ModelSpec",
    "PoolEvent",
    "VoiceList",
    "lru_k_order",
    "memory_usage",
]


def _no_release() -> None:
    pass


def _keeps_being_evicted(name: str) -> OverloadedError:
    return OverloadedError(f"model {name!r} keeps being evicted under memory pressure", retry_after=1.0)


class ModelPool:
    """Models by name, loaded and evicted under a memory budget.

    Args:
        specs: the models.
        memory_budget: bytes all resident models may hold (None: no budget).
        pressure_threshold: fraction of the memory limit in use above which idle models are evicted
            (None disables; default 0.8).
        lru_k: K of LRU-K.
        tenants: tenants with quotas (see :mod:`cosyserve.engine.quotas`).
        runtime_options: how every model loads and serves (a :class:`cosyserve.runtime.RuntimeOptions`; a
            spec's ``load_options`` and ``batch_size`` override it); default the runtime's defaults.
        load_model: ``(spec, reload) -> Runtime``; default :func:`cosyserve.runtime.load_runtime` on
            ``spec.path``.
        memory_probe: ``() -> (used, limit)``; default :func:`memory_usage`.
        clock: monotonic seconds (LRU-K history, TTL); tests inject a fake one.
        release_timeout_s: how long an evicted or closing model's in-flight requests may take.
        preloaded: runtimes already loaded, by model name (a prefork template's, in a forked worker): a model's
            first load takes them (as many as its ``instances``) instead of loading; a reload loads.
    """

    def __init__(
        self,
        specs: Iterable[ModelSpec],
        *,
        memory_budget: int | None = None,
        pressure_threshold: float | None = 0.8,
        lru_k: int = 2,
        tenants: Iterable[Tenant] = (),
        runtime_options: Any = None,
        load_model: Callable[[ModelSpec, bool], Any] | None = None,
        memory_probe: Callable[[], tuple[int, int]] | None = memory_usage,
        clock: Callable[[], float] = time.monotonic,
        release_timeout_s: float = 30.0,
        preloaded: dict[str, list[Any]] | None = None,
    ) -> None:
        if lru_k < 1:
            raise ValueError(f"lru_k must be >= 1, got {lru_k}")
        if pressure_threshold is not None and not (0.0 < pressure_threshold <= 1.0):
            raise ValueError(f"pressure_threshold must be in (0, 1], got {pressure_threshold}")
        self._entries: dict[str, Entry] = {}
        for spec in specs:
            if spec.name in self._entries:
                raise ValueError(f"model {spec.name!r} is listed twice")
            self._entries[spec.name] = Entry(spec, lru_k)
        self.memory_budget = memory_budget
        self.pressure_threshold = pressure_threshold
        self.lru_k = lru_k
        self.tenants: dict[str, Tenant] = {}
        self._in_flight = InFlight(self._tenant_retry_after)
        self._owner: dict[str, str] = {}
        self.runtime_options = runtime_options
        self._load_model = load_model or self._default_load_model
        self._preloaded = {name: list(runtimes) for name, runtimes in (preloaded or {}).items()}
        self._probe = memory_probe
        self.clock = clock
        self.release_timeout_s = release_timeout_s
        self._lock = threading.RLock()  # re-entrant: listeners and release callbacks may call back in
        self._seq = itertools.count()
        self._listeners: list[Callable[[PoolEvent], None]] = []
        self._housekeeping: asyncio.Task[None] | None = None
        self._failures = LoadFailures()  # by model: its last load, when it failed
        for t in tenants:
            self.add_tenant(t)

    # -- configuration ---------------------------------------------------------------------------------------

    def add_tenant(self, tenant: Tenant) -> None:
        """Register a tenant; a model listed by exactly one tenant counts against that tenant's quota."""
        for m in tenant.models:
            if m not in self._entries:
                raise ValueError(f"tenant {tenant.name!r} lists unknown model {m!r}")
        with self._lock:
            self.tenants[tenant.name] = tenant
            self._owner = sole_owners(self.tenants.values())

    def tenant_in_flight(self, tenant: str) -> int:
        """Requests of ``tenant`` in flight (waiting for a load, queued or running), across its models."""
        return self._in_flight.count(tenant)

    def visible(self, tenant: str | None) -> list[str]:
        """The models ``tenant`` may use (every model without a tenant, or for a tenant the pool does not know)."""
        if tenant is None or tenant not in self.tenants:
            return self.names
        return sorted(self.tenants[tenant].models)

    def add_listener(self, listener: Callable[[PoolEvent], None]) -> None:
        self._listeners.append(listener)

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def spec(self, name: str) -> ModelSpec:
        return self._entry(name).spec

    def voices(self, name: str, tenant: str | None = None) -> VoiceList | None:
        """What model ``name`` speaks with for ``tenant`` (None: the default tenant's registry), as every transport
        lists it (the HTTP voices list, Wyoming's ``info``); None while the model is not loaded."""
        eng = self._entry(name).engine
        runtime = eng.runtime if eng is not None else None
        if eng is None or runtime is None:
            return None
        return VoiceList(name, runtime.voices(tenant or "default"), eng.openai_voices())

    def engine(self, name: str) -> Engine | None:
        """The model's current engine (None when not loaded)."""
        return self._entry(name).engine

    def load_failure(self, name: str) -> LoadFailure | None:
        """Why the model's last load failed and when it may be tried again; None once a load succeeded."""
        self._entry(name)
        with self._lock:
            return self._failures.get(name)

    def _entry(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownModelError(
                f"unknown model {name!r}; this server has: {', '.join(self._entries) or 'none'}",
                param="model",
            ) from None

    def _emit(self, kind: str, model: str, detail: str = "") -> None:
        ev = PoolEvent(kind, model, time.time(), detail)
        logger.info("pool: %s %s %s", kind, model, detail)
        for listener in list(self._listeners):
            try:
                listener(ev)
            except Exception:
                logger.exception("pool listener %r failed", listener)

    # -- requests --------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _tenant_slot(
        self, name: str, request: SynthesisRequest, tenant: str | None
    ) -> Iterator[Callable[[], None]]:
        # one of the tenant's max_concurrent slots, taken before anything is loaded or queued and given back
        # if the request is not admitted; once admitted, the engine calls the release when the request ends
        self._entry(name)  # an unknown model is named as such before any tenant rule
        release = (
            _no_release
            if tenant is None
            else self._in_flight.take(self.tenants, tenant, name, request.request_id)
        )
        try:
            yield release
        except BaseException:
            release()
            raise

    def _tenant_retry_after(self, held: list[tuple[str, str]]) -> float:
        # when the first of the tenant's own requests is expected to end, on whichever model it runs
        ids: dict[str, set[str]] = {}
        for model, request_id in held:
            ids.setdefault(model, set()).add(request_id)
        with self._lock:
            waits = [
                e.engine.retry_after(ids[n])
                for n, e in self._entries.items()
                if n in ids and e.engine and e.ready
            ]
        return min(waits, default=RETRY_AFTER_BOUNDS_S[0])

    def _lookup(
        self, name: str, tenant: str | None
    ) -> tuple[Entry, concurrent.futures.Future[Engine] | None]:
        entry = self._entry(name)
        with self._lock:
            now = self.clock()
            entry.uses.append((now, next(self._seq)))
            hit = entry.ready
            entry.stats.record_lookup(hit)
            return entry, None if hit else self._ensure_loading_locked(entry, tenant)

    def _admit(
        self,
        entry: Entry,
        admit: Callable[[Engine, Callable[[], None]], Any],
        on_done: Callable[[], None] | None,
        release: Callable[[], None],
    ) -> Any:
        def done() -> None:
            try:
                with self._lock:
                    entry.idle_since = self.clock()
                if on_done is not None:
                    on_done()
            finally:
                release()

        with self._lock:
            if entry.ready:
                assert entry.engine is not None
                return admit(entry.engine, done)
        return None

    async def submit(
        self,
        name: str,
        request: SynthesisRequest,
        *,
        tenant: str | None = None,
        on_done: Callable[[], None] | None = None,
    ) -> AudioStream:
        """Admit ``request`` on model ``name`` (loading it first if needed) and return its audio stream.

        With ``tenant``, only the tenant's models are visible and the request takes one of its
        ``max_concurrent`` slots until it ends.

        Raises:
            UnknownModelError, ClientError, OverloadedError (queue, quota or memory budget), EngineDeadError.
        """
        with self._tenant_slot(name, request, tenant) as release:
            entry, fut = self._lookup(name, tenant)
            for _ in range(3):
                if fut is not None:
                    await shared(fut)
                stream = self._admit(entry, lambda e, done: e.synthesize(request, done), on_done, release)
                if stream is not None:
                    return stream
                with self._lock:  # evicted between its load and our admission: load it again
                    fut = self._ensure_loading_locked(entry, tenant)
        raise _keeps_being_evicted(name)

    def submit_sync(
        self,
        name: str,
        request: SynthesisRequest,
        *,
        tenant: str | None = None,
        on_done: Callable[[], None] | None = None,
        load_timeout: float | None = None,
    ) -> SyncAudioStream:
        """Blocking twin of :meth:`submit`."""
        with self._tenant_slot(name, request, tenant) as release:
            entry, fut = self._lookup(name, tenant)
            for _ in range(3):
                if fut is not None:
                    fut.result(load_timeout)
                stream = self._admit(
                    entry, lambda e, done: e.synthesize_sync(request, done), on_done, release
                )
                if stream is not None:
                    return stream
                with self._lock:
                    fut = self._ensure_loading_locked(entry, tenant)
        raise _keeps_being_evicted(name)

    # -- loading ---------------------------------------------------------------------------------------------

    def load_instances(self, name: str) -> list[Any]:
        """Load ``name``'s instances now, one after the other in the calling thread, outside the pool's
        bookkeeping (a prefork template: its workers' pools take them as ``preloaded``)."""
        spec = self._entry(name).spec
        return [self._load_model(spec, False) for _ in range(spec.instances)]

    def _take_or_load(self, spec: ModelSpec, reload: bool) -> Any:
        with self._lock:
            stock = self._preloaded.get(spec.name)
            if stock and not reload:
                return stock.pop(0)
        return self._load_model(spec, reload)

    def _default_load_model(self, spec: ModelSpec, reload: bool) -> Any:
        return spec.load(self.runtime_options, reload)

    def start_load(self, name: str) -> concurrent.futures.Future[Engine]:
        """Load ``name`` now if it is not resident (shared with concurrent requests); no use is recorded."""
        entry = self._entry(name)
        with self._lock:
            return self._ensure_loading_locked(entry, None)

    async def load(self, name: str) -> Engine:
        return await shared(self.start_load(name))

    def _ensure_loading_locked(self, entry: Entry, tenant: str | None) -> concurrent.futures.Future[Engine]:
        if entry.load_future is not None and not entry.load_future.done():
            return entry.load_future
        done: concurrent.futures.Future[Engine] = concurrent.futures.Future()
        if entry.ready:
            assert entry.engine is not None
            done.set_result(entry.engine)
            return done
        refused = self._failures.refusal(entry.name, entry.spec.path, self.clock())
        if refused is not None:
            entry.stats.record_reject("load_backoff")
            done.set_exception(refused)
            return done
        need = entry.estimate_bytes()
        own = [e for e in self._entries.values() if tenant is not None and self._owner.get(e.name) == tenant]
        plan = plan_room(
            entry,
            need,
            list(self._entries.values()),
            k=self.lru_k,
            own=own,
            tenant=tenant,
            quota=self.tenants[tenant].quota if tenant is not None and tenant in self.tenants else None,
            budget=self.memory_budget,
            pressure=self.pressure_threshold,
            probe=self._probe,
            busy_retry_after=self._busy_retry_after_locked,
        )
        for victim, reason in plan:
            self._begin_evict_locked(victim, reason)
        waits = [v.release_future for v, _ in plan if v.release_future is not None]
        if entry.release_future is not None and not entry.release_future.done():
            waits.append(entry.release_future)  # its previous engine is still being released
        reload = entry.loaded_once
        spec = entry.spec
        engine = Engine(
            spec.name,
            lambda: self._take_or_load(spec, reload),
            instances=spec.instances,
            queue_limit=spec.queue_limit,
            stats=entry.stats,
            clock=self.clock,
            voices=spec.voices,
            default_voice=getattr(self.runtime_options, "default_voice", None),
        )
        entry.engine = engine
        entry.bytes = None
        entry.reserved = need
        fut: concurrent.futures.Future[Engine] = concurrent.futures.Future()
        entry.load_future = fut
        threading.Thread(
            target=self._load_main,
            args=(entry, engine, fut, waits),
            name=f"cosyserve-pool-load-{spec.name}",
            daemon=True,
        ).start()
        return fut

    def _load_main(
        self,
        entry: Entry,
        engine: Engine,
        fut: concurrent.futures.Future[Engine],
        waits: list[concurrent.futures.Future[None]],
    ) -> None:
        error: BaseException | None = None
        self._emit("load_started", entry.name, "reload" if entry.loaded_once else "first")
        t0 = time.perf_counter()
        try:
            concurrent.futures.wait(waits)
            engine.load_sync()
            runtime = engine.runtime  # None when the engine was released as soon as it loaded (a close)
            size = int(runtime.mapped_bytes()) if runtime is not None else 0
        except BaseException as e:  # noqa: BLE001 - reported through the future
            error = e
        finally:
            seconds = time.perf_counter() - t0
            refused: LoadFailedError | None = None
            with self._lock:
                if error is None:
                    entry.bytes = entry.last_bytes = size
                    entry.loaded_once = True
                    entry.idle_since = self.clock()
                    self._failures.clear(entry.name)
                else:
                    if entry.engine is engine:
                        entry.engine = None
                    refused = self._failures.record(entry.name, entry.spec.path, error, self.clock())
            entry.stats.record_load(seconds, error is None)
            if refused is None:
                self._emit("loaded", entry.name, f"{seconds * 1e3:.0f} ms, {size} bytes")
                fut.set_result(engine)
            else:
                self._emit("load_failed", entry.name, f"{error!r}; back-off {refused.retry_after:.0f} s")
                fut.set_exception(refused)

    # -- eviction --------------------------------------------------------------------------------------------

    def _busy_retry_after_locked(self, entries: list[Entry]) -> float:
        # a busy model can be evicted once it has nothing in flight: the first of them expected to get there
        waits = [e.engine.idle_after() for e in entries if e.engine is not None and e.ready]
        return min(waits, default=RETRY_AFTER_BOUNDS_S[0])

    def _begin_evict_locked(self, entry: Entry, reason: str) -> bool:
        engine = entry.engine
        if engine is None or not engine.try_begin_drain():
            return False
        entry.retiring = engine
        entry.retiring_bytes = entry.bytes or 0
        entry.engine = None
        entry.bytes = None
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        entry.release_future = fut
        self._emit("evicting", entry.name, reason)

        def released(_: concurrent.futures.Future[None]) -> None:
            with self._lock:
                if entry.retiring is engine:
                    entry.retiring = None
                    entry.retiring_bytes = 0
            entry.stats.record_eviction(reason)
            self._emit("evicted", entry.name, reason)
            fut.set_result(None)

        engine.start_release(self.release_timeout_s).add_done_callback(released)
        return True

    def evict(self, name: str, reason: str = "manual") -> concurrent.futures.Future[None] | None:
        """Evict ``name`` now if it is resident and idle (pinned models too: an explicit call).

        Returns:
            A future done when its memory is released, or None if it was not evictable.
        """
        entry = self._entry(name)
        with self._lock:
            if not self._begin_evict_locked(entry, reason):
                return None
            return entry.release_future

    def maintain(self) -> list[str]:
        """Release models idle past their TTL, and evict while memory pressure is above the threshold.

        Returns:
            The names whose eviction started.
        """
        evicted: list[str] = []
        with self._lock:
            now = self.clock()
            for e in evictable(self._entries.values(), self.lru_k):
                ttl = e.spec.idle_ttl_s
                if ttl is not None and e.idle_since is not None and now - e.idle_since >= ttl:
                    if self._begin_evict_locked(e, "idle_ttl"):
                        evicted.append(e.name)
            if self.pressure_threshold is not None and self._probe is not None:
                used, limit = self._probe()
                for v in pressure_victims(
                    self._entries.values(), used, limit, self.pressure_threshold, self.lru_k
                ):
                    if self._begin_evict_locked(v, "pressure"):
                        evicted.append(v.name)
        return evicted

    async def run_housekeeping(self, interval_s: float = 1.0) -> None:
        """Call :meth:`maintain` every ``interval_s`` seconds until cancelled."""
        while True:
            try:
                self.maintain()
            except Exception:
                logger.exception("pool housekeeping failed")
            await asyncio.sleep(interval_s)

    # -- lifecycle -------------------------------------------------------------------------------------------

    def start_preload(self) -> list[concurrent.futures.Future[Engine]]:
        """Start loading every ``preload`` model (in parallel); returns their futures."""
        return [self.start_load(n) for n, e in self._entries.items() if e.spec.policy == "preload"]

    async def start(self, housekeeping_interval_s: float | None = 1.0) -> None:
        """Preload (in parallel; raises if one fails) and start housekeeping."""
        futs = self.start_preload()
        await asyncio.gather(*(shared(f) for f in futs))
        if housekeeping_interval_s is not None and self._housekeeping is None:
            self._housekeeping = asyncio.ensure_future(self.run_housekeeping(housekeeping_interval_s))

    def start_close(self, timeout: float | None = None) -> list[concurrent.futures.Future[None]]:
        """Drain and release every engine (in parallel)."""
        futs = []
        with self._lock:
            engines = [e.engine for e in self._entries.values() if e.engine is not None]
            engines += [e.retiring for e in self._entries.values() if e.retiring is not None]
        for eng in engines:
            if eng.state is EngineState.LOADING or eng.state is EngineState.NEW:
                with contextlib.suppress(Exception):
                    eng.start_load()
            futs.append(eng.start_release(self.release_timeout_s if timeout is None else timeout))
        return futs

    async def close(self, timeout: float | None = None) -> None:
        if self._housekeeping is not None:
            self._housekeeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._housekeeping
            self._housekeeping = None
        await asyncio.gather(*(shared(f) for f in self.start_close(timeout)))

    def close_sync(self, timeout: float | None = None) -> None:
        concurrent.futures.wait(self.start_close(timeout))

    @contextlib.asynccontextmanager
    async def lifespan(self, housekeeping_interval_s: float | None = 1.0) -> AsyncIterator[ModelPool]:
        """``async with pool.lifespan():`` preload, serve, then drain and release everything."""
        try:
            await self.start(housekeeping_interval_s)
            yield self
        finally:
            await self.close()

    # -- stats -----------------------------------------------------------------------------------------------

    def resident_bytes(self) -> int:
        with self._lock:
            return sum(e.held_bytes() for e in self._entries.values())

    def stats(self, rss: bool = False) -> dict[str, Any]:
        """Per model: state, bytes, in-flight, queue depth and the counters of its ModelStats; plus totals.

        Args:
            rss: also read the resident bytes of each model's mapped files from /proc/self/smaps (slower).
        """
        models: dict[str, Any] = {}
        with self._lock:
            items = [(n, e, e.engine) for n, e in self._entries.items()]
            held = {n: e.held_bytes() for n, e in self._entries.items()}
            failed = self._failures.models()
        for name, e, eng in items:
            models[name] = e.report(eng, held[name], name in failed, rss)
        out: dict[str, Any] = {
            "models": models,
            "memory_budget": self.memory_budget,
            "resident_bytes": sum(held.values()),
        }
        if self._probe is not None:
            used, limit = self._probe()
            out["memory_used"], out["memory_limit"] = used, limit
        return out
