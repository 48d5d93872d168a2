"""Several models in one process under a memory budget: preload / lazy / idle TTL / pinned, LRU-K eviction.

Each model (:class:`ModelSpec`) gets an :class:`~cosyserve.engine.engine.Engine` when it is loaded and loses it
when it is evicted; its :class:`~cosyserve.engine.engine.ModelStats` and its opened bundle (manifest, config)
stay, so a reload skips conversion and checksum work and finds the weight pages in the page cache.

Rules, all applied under one pool lock (engine locks are only ever taken inside it, never the reverse):

- a request records a *use* of its model; lazy models load on first use and concurrent first requests share
  one load; a model that is READY is a hit, anything else a miss;
- before a load, room is made: first within the requesting tenant's quota (its own models only), then within
  the memory budget, then under the pressure threshold (process or cgroup memory in use / limit);
- the victim is chosen by LRU-K (K=2 by default): the model whose K-th most recent use is oldest; models with
  fewer than K uses count as infinitely old; ties go to the older last use. Models that are pinned, loading,
  or have requests in flight are never victims. A tenant's own idle models are evicted before anyone else's;
- :meth:`ModelPool.maintain` (run periodically by :meth:`ModelPool.run_housekeeping`) releases models idle
  for longer than their TTL and evicts while memory pressure is above the threshold.

The budget is hard (a load that cannot fit raises :class:`MemoryBudgetError`); pressure is a soft signal
(logged when nothing more can be evicted).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from cosyserve.engine.engine import (
    RETRY_AFTER_BOUNDS_S,
    AudioStream,
    Engine,
    EngineState,
    ModelStats,
    SyncAudioStream,
    SynthesisRequest,
    shared,
)
from cosyserve.errors import MemoryBudgetError, OverloadedError, QuotaExceededError, UnknownModelError
from cosyserve.pagecache import memory_limit_bytes, memory_usage, rss_of_files

if TYPE_CHECKING:
    from cosyserve.engine.tenants import Tenant, TenantView

logger = logging.getLogger(__name__)

__all__ = [
    "ModelPool",
    "ModelSpec",
    "PoolEvent",
    "lru_k_order",
    "memory_limit_bytes",
    "memory_usage",
    "rss_of_files",
]

Policy = Literal["preload", "lazy"]


@dataclass(frozen=True)
class ModelSpec:
    """One model of the pool.

    Args:
        name: the name requests use.
        path: bundle or official model dir (default loader); fakes may leave it None.
        policy: ``preload`` (loaded by :meth:`ModelPool.start`, in parallel) or ``lazy`` (on first request).
        pinned: never evicted (neither TTL nor pressure nor budget).
        idle_ttl_s: release after this many idle seconds (None: never).
        instances: prewarmed instances (``MODEL_POOL_SIZE``), each with its own worker.
        batch_size: requests each instance serves at once, LM steps batched (``COSYSERVE_BATCH_SIZE``).
        queue_limit: requests allowed to wait per model before :class:`OverloadedError`.
        size_bytes: memory estimate used before the first load (default: the bundle's file sizes).
        warmup: warm-up synthesis on the first load.
        reload_warmup: warm-up on reloads after eviction (off: kernels are warm, pages are cached).
        load_options: extra keyword arguments for :func:`cosyserve.load` (strategy, verify, use_mmap, ...).
    """

    name: str
    path: str | None = None
    policy: Policy = "lazy"
    pinned: bool = False
    idle_ttl_s: float | None = None
    instances: int = 1
    batch_size: int = 1
    queue_limit: int = 16
    size_bytes: int | None = None
    warmup: bool = True
    reload_warmup: bool = False
    load_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.policy not in ("preload", "lazy"):
            raise ValueError(f"model {self.name!r}: policy must be preload or lazy, got {self.policy!r}")
        if self.instances < 1:
            raise ValueError(f"model {self.name!r}: instances must be >= 1, got {self.instances}")
        if self.batch_size < 1:
            raise ValueError(f"model {self.name!r}: batch_size must be >= 1, got {self.batch_size}")
        if self.idle_ttl_s is not None and self.idle_ttl_s <= 0:
            raise ValueError(f"model {self.name!r}: idle_ttl_s must be > 0, got {self.idle_ttl_s}")


@dataclass(frozen=True)
class PoolEvent:
    """``kind`` is load_started / loaded / load_failed / evicting / evicted; ``detail`` the reason or error."""

    kind: str
    model: str
    at: float
    detail: str = ""


# -- LRU-K ----------------------------------------------------------------------------------------------------


def lru_k_order(histories: Mapping[str, Iterable[tuple[float, int]]], k: int) -> list[str]:
    """Names ordered from best victim to worst by LRU-K.

    Args:
        histories: name -> its most recent uses as (time, sequence number), any order (the K latest are used).
        k: K (>= 1).
    Returns:
        Names sorted by backward K-distance: the oldest K-th most recent use first; names with fewer than K
        uses first of all (infinitely old); ties broken by the older last use, then by name.
    """

    def key(name: str) -> tuple[float, int, float, int, str]:
        uses = sorted(histories[name])[-k:]
        kth = uses[0] if len(uses) >= k else (float("-inf"), -1)
        last = uses[-1] if uses else (float("-inf"), -1)
        return (kth[0], kth[1], last[0], last[1], name)

    return sorted(histories, key=key)


# -- the pool -------------------------------------------------------------------------------------------------


def _no_release() -> None:
    pass


def _keeps_being_evicted(name: str) -> OverloadedError:
    return OverloadedError(f"model {name!r} keeps being evicted under memory pressure", retry_after=1.0)


class _Entry:
    def __init__(self, spec: ModelSpec, k: int) -> None:
        self.spec = spec
        self.stats = ModelStats(spec.name)
        self.engine: Engine | None = None
        self.uses: deque[tuple[float, int]] = deque(maxlen=k)
        self.idle_since: float | None = None
        self.bytes: int | None = None  # measured for the current engine
        self.last_bytes: int | None = None  # measured at the last load (the next load's estimate)
        self.reserved = 0
        self.load_future: concurrent.futures.Future[Engine] | None = None
        self.retiring: Engine | None = None
        self.retiring_bytes = 0
        self.release_future: concurrent.futures.Future[None] | None = None
        self.loaded_once = False
        self.bundle: Any = None

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.state is EngineState.READY

    def held_bytes(self) -> int:
        held = self.retiring_bytes
        if self.engine is not None and self.engine.state in (EngineState.LOADING, EngineState.READY):
            held += self.bytes if self.bytes is not None else self.reserved
        return held


def _default_model_bytes(model: Any) -> int:
    parts = getattr(model, "_parts", None)
    if parts is not None and hasattr(parts, "mapped_bytes"):
        return int(parts.mapped_bytes())
    return int(getattr(model, "resident_bytes", 0))


class ModelPool:
    """Models by name, loaded and evicted under a memory budget.

    Args:
        specs: the models.
        memory_budget: bytes all resident models may hold (None: no budget).
        pressure_threshold: fraction of the memory limit in use above which idle models are evicted
            (None disables; default 0.8).
        lru_k: K of LRU-K.
        tenants: tenants with quotas (see :mod:`cosyserve.engine.tenants`).
        load_model: ``(spec, reload) -> model``; default :func:`cosyserve.load` on ``spec.path``.
        model_bytes: bytes a loaded model holds; default its mapped bundle bytes.
        memory_probe: ``() -> (used, limit)``; default :func:`memory_usage`.
        clock: monotonic seconds (LRU-K history, TTL); tests inject a fake one.
        torch_threads: torch threads per engine worker.
        release_timeout_s: how long an evicted or closing model's in-flight requests may take.
    """

    def __init__(
        self,
        specs: Iterable[ModelSpec],
        *,
        memory_budget: int | None = None,
        pressure_threshold: float | None = 0.8,
        lru_k: int = 2,
        tenants: Iterable[Tenant] = (),
        load_model: Callable[[ModelSpec, bool], Any] | None = None,
        model_bytes: Callable[[Any], int] = _default_model_bytes,
        memory_probe: Callable[[], tuple[int, int]] | None = memory_usage,
        clock: Callable[[], float] = time.monotonic,
        torch_threads: int | None = 1,
        release_timeout_s: float = 30.0,
    ) -> None:
        if lru_k < 1:
            raise ValueError(f"lru_k must be >= 1, got {lru_k}")
        if pressure_threshold is not None and not (0.0 < pressure_threshold <= 1.0):
            raise ValueError(f"pressure_threshold must be in (0, 1], got {pressure_threshold}")
        self._entries: dict[str, _Entry] = {}
        for spec in specs:
            if spec.name in self._entries:
                raise ValueError(f"model {spec.name!r} is listed twice")
            self._entries[spec.name] = _Entry(spec, lru_k)
        self.memory_budget = memory_budget
        self.pressure_threshold = pressure_threshold
        self.lru_k = lru_k
        self.tenants: dict[str, Tenant] = {}
        # each tenant's requests in flight (token -> (model, request id)), what its max_concurrent counts: held
        # here, one per tenant, so that every view and every request of a tenant shares one count
        self._tenant_requests: dict[str, dict[int, tuple[str, str]]] = {}
        self._owner: dict[str, str] = {}
        self._load_model = load_model or self._default_load_model
        self._model_bytes = model_bytes
        self._probe = memory_probe
        self.clock = clock
        self.torch_threads = torch_threads
        self.release_timeout_s = release_timeout_s
        self._lock = threading.RLock()  # re-entrant: listeners and release callbacks may call back in
        self._seq = itertools.count()
        self._listeners: list[Callable[[PoolEvent], None]] = []
        self._housekeeping: asyncio.Task[None] | None = None
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
            self._tenant_requests.setdefault(tenant.name, {})
            listed: dict[str, list[str]] = {}
            for t in self.tenants.values():
                for m in t.models:
                    listed.setdefault(m, []).append(t.name)
            self._owner = {m: ts[0] for m, ts in listed.items() if len(ts) == 1}

    def view(self, tenant: str) -> TenantView:
        """The pool as ``tenant`` sees it (its models, its quota)."""
        from cosyserve.engine.tenants import TenantView

        if tenant not in self.tenants:
            raise UnknownModelError(f"unknown tenant {tenant!r}")
        return TenantView(self, self.tenants[tenant])

    def tenant_in_flight(self, tenant: str) -> int:
        """Requests of ``tenant`` in flight (waiting for a load, queued or running), across its models."""
        with self._lock:
            return len(self._tenant_requests[tenant])

    def add_listener(self, listener: Callable[[PoolEvent], None]) -> None:
        self._listeners.append(listener)

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def engine(self, name: str) -> Engine | None:
        """The model's current engine (None when not loaded)."""
        return self._entry(name).engine

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownModelError(
                f"unknown model {name!r}; this server has: {', '.join(self._entries) or 'none'}"
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
        release = self._take_tenant_slot(name, request, tenant)
        try:
            yield release
        except BaseException:
            release()
            raise

    def _take_tenant_slot(
        self, name: str, request: SynthesisRequest, tenant: str | None
    ) -> Callable[[], None]:
        # the release is idempotent
        if tenant is None:
            return _no_release
        t = self.tenants.get(tenant)
        if t is None:
            raise UnknownModelError(f"unknown tenant {tenant!r}")
        if name not in t.models:
            raise UnknownModelError(f"unknown model {name!r} for tenant {tenant!r}")
        limit = t.quota.max_concurrent
        with self._lock:
            held = self._tenant_requests[tenant]
            if limit is not None and len(held) >= limit:
                raise QuotaExceededError(
                    f"tenant {tenant!r}: {len(held)} requests in flight (max_concurrent={limit})",
                    retry_after=self._tenant_retry_after_locked(held.values()),
                )
            token = next(self._seq)
            held[token] = (name, request.request_id)

        def release() -> None:
            with self._lock:
                held.pop(token, None)

        return release

    def _tenant_retry_after_locked(self, held: Iterable[tuple[str, str]]) -> float:
        # when the first of the tenant's own requests is expected to end, on whichever model it runs
        ids: dict[str, set[str]] = {}
        for model, request_id in held:
            ids.setdefault(model, set()).add(request_id)
        waits = [
            e.engine.retry_after(ids[n])
            for n, e in self._entries.items()
            if n in ids and e.engine and e.ready
        ]
        return min(waits, default=RETRY_AFTER_BOUNDS_S[0])

    def _lookup(
        self, name: str, tenant: str | None
    ) -> tuple[_Entry, concurrent.futures.Future[Engine] | None]:
        entry = self._entry(name)
        with self._lock:
            now = self.clock()
            entry.uses.append((now, next(self._seq)))
            hit = entry.ready
            entry.stats.record_lookup(hit)
            return entry, None if hit else self._ensure_loading_locked(entry, tenant)

    def _admit(
        self,
        entry: _Entry,
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

    def _default_load_model(self, spec: ModelSpec, reload: bool) -> Any:
        import cosyserve

        if spec.path is None:
            raise ValueError(f"model {spec.name!r} has no path")
        opts = dict(spec.load_options)
        opts.setdefault("warmup", spec.reload_warmup if reload else spec.warmup)
        return cosyserve.load(spec.path, **opts)

    def _estimate_locked(self, entry: _Entry) -> int:
        if entry.last_bytes is not None:
            return entry.last_bytes
        if entry.spec.size_bytes is not None:
            return entry.spec.size_bytes
        if entry.spec.path is not None and entry.bundle is None:
            from cosyserve.bundle.loader import is_bundle, open_bundle
            from cosyserve.errors import BundleError

            if is_bundle(entry.spec.path):
                try:
                    entry.bundle = open_bundle(entry.spec.path)
                except BundleError:
                    return 0  # the load reports it
        if entry.bundle is not None:
            m = entry.bundle.manifest
            comps = list(m.get("components", {}).values()) + [m.get("speakers", {})]
            return sum(int(c.get("bytes", 0)) for c in comps)
        return 0

    def start_load(self, name: str) -> concurrent.futures.Future[Engine]:
        """Load ``name`` now if it is not resident (shared with concurrent requests); no use is recorded."""
        entry = self._entry(name)
        with self._lock:
            return self._ensure_loading_locked(entry, None)

    async def load(self, name: str) -> Engine:
        return await shared(self.start_load(name))

    def _ensure_loading_locked(self, entry: _Entry, tenant: str | None) -> concurrent.futures.Future[Engine]:
        if entry.load_future is not None and not entry.load_future.done():
            return entry.load_future
        if entry.ready:
            assert entry.engine is not None
            done: concurrent.futures.Future[Engine] = concurrent.futures.Future()
            done.set_result(entry.engine)
            return done
        need = self._estimate_locked(entry)
        victims = self._plan_room_locked(entry, need, tenant)
        waits = [v.release_future for v in victims if v.release_future is not None]
        if entry.release_future is not None and not entry.release_future.done():
            waits.append(entry.release_future)  # its previous engine is still being released
        reload = entry.loaded_once
        spec = entry.spec
        engine = Engine(
            spec.name,
            lambda: self._load_model(spec, reload),
            instances=spec.instances,
            batch_size=spec.batch_size,
            queue_limit=spec.queue_limit,
            torch_threads=self.torch_threads,
            stats=entry.stats,
            clock=self.clock,
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
        entry: _Entry,
        engine: Engine,
        fut: concurrent.futures.Future[Engine],
        waits: list[concurrent.futures.Future[None]],
    ) -> None:
        error: BaseException | None = None
        self._emit("load_started", entry.spec.name, "reload" if entry.loaded_once else "first")
        t0 = time.perf_counter()
        try:
            concurrent.futures.wait(waits)
            engine.load_sync()
            size = self._model_bytes(engine.resident_hint)
        except BaseException as e:  # noqa: BLE001 - reported through the future
            error = e
        finally:
            seconds = time.perf_counter() - t0
            with self._lock:
                if error is None:
                    entry.bytes = entry.last_bytes = size
                    entry.loaded_once = True
                    entry.idle_since = self.clock()
                    if entry.bundle is None:
                        entry.bundle = getattr(engine.resident_hint, "bundle", None)
                elif entry.engine is engine:
                    entry.engine = None
            entry.stats.record_load(seconds, error is None)
            if error is None:
                self._emit("loaded", entry.spec.name, f"{seconds * 1e3:.0f} ms, {size} bytes")
                fut.set_result(engine)
            else:
                self._emit("load_failed", entry.spec.name, repr(error))
                fut.set_exception(error)

    # -- eviction --------------------------------------------------------------------------------------------

    def _evictable_locked(self, entries: Iterable[_Entry], exclude: _Entry | None) -> list[_Entry]:
        out = []
        for e in entries:
            if e is exclude or e.spec.pinned or not e.ready:
                continue
            assert e.engine is not None
            if e.engine.in_flight == 0:
                out.append(e)
        order = lru_k_order({e.spec.name: list(e.uses) for e in out}, self.lru_k)
        by_name = {e.spec.name: e for e in out}
        return [by_name[n] for n in order]

    def _plan_room_locked(self, entry: _Entry, need: int, tenant: str | None) -> list[_Entry]:
        victims: list[_Entry] = []
        own: list[_Entry] = []
        if tenant is not None:
            t = self.tenants[tenant]
            own = [e for e in self._entries.values() if self._owner.get(e.spec.name) == tenant]
            counted = entry in own
            q = t.quota

            def over_quota() -> bool:
                held = [e for e in own if e is not entry and e not in victims and e.held_bytes() > 0]
                if q.max_models is not None and counted and len(held) + 1 > q.max_models:
                    return True
                b = sum(e.held_bytes() for e in held) + (need if counted else 0)
                return q.max_memory_bytes is not None and b > q.max_memory_bytes

            while over_quota():
                cands = [e for e in self._evictable_locked(own, entry) if e not in victims]
                if not cands:
                    raise QuotaExceededError(
                        f"tenant {tenant!r}: loading {entry.spec.name!r} would exceed its quota "
                        f"({q.describe()}) and its other models are busy or pinned",
                        retry_after=self._busy_retry_after_locked(own),
                    )
                victims.append(cands[0])
        held_total = sum(e.held_bytes() for e in self._entries.values() if e is not entry)

        def freed() -> int:
            return sum(v.held_bytes() for v in victims)

        def candidates() -> list[_Entry]:
            # the requesting tenant's own idle models go first, then everyone's, each group by LRU-K
            ordered = self._evictable_locked(own, entry) + self._evictable_locked(
                self._entries.values(), entry
            )
            seen: list[_Entry] = []
            for e in ordered:
                if e not in victims and e not in seen:
                    seen.append(e)
            return seen

        if self.memory_budget is not None:
            while held_total - freed() + need > self.memory_budget:
                cands = candidates()
                if not cands:
                    busy = [e.spec.name for e in self._entries.values() if e.held_bytes() and e is not entry]
                    raise MemoryBudgetError(
                        f"model {entry.spec.name!r} needs {need} bytes; the budget is {self.memory_budget} "
                        f"and {held_total - freed()} are held by models that are pinned, loading or busy "
                        f"({', '.join(busy)})",
                        retry_after=self._busy_retry_after_locked(list(self._entries.values())),
                    )
                victims.append(cands[0])
        if self.pressure_threshold is not None and self._probe is not None:
            used, limit = self._probe()
            while used - freed() + need > self.pressure_threshold * limit:
                cands = candidates()
                if not cands:
                    logger.warning(
                        "memory pressure: %d of %d bytes in use (threshold %.0f%%) and nothing evictable; "
                        "loading %s anyway",
                        used,
                        limit,
                        self.pressure_threshold * 100,
                        entry.spec.name,
                    )
                    break
                victims.append(cands[0])
        for v in victims:
            self._begin_evict_locked(v, "tenant_quota" if v in own else "memory")
        return victims

    def _busy_retry_after_locked(self, entries: list[_Entry]) -> float:
        # a busy model can be evicted once it has nothing in flight: the first of them expected to get there
        waits = [e.engine.idle_after() for e in entries if e.engine is not None and e.ready]
        return min(waits, default=RETRY_AFTER_BOUNDS_S[0])

    def _begin_evict_locked(self, entry: _Entry, reason: str) -> bool:
        engine = entry.engine
        if engine is None or not engine.try_begin_drain():
            return False
        entry.retiring = engine
        entry.retiring_bytes = entry.bytes or 0
        entry.engine = None
        entry.bytes = None
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        entry.release_future = fut
        self._emit("evicting", entry.spec.name, reason)

        def released(_: concurrent.futures.Future[None]) -> None:
            with self._lock:
                if entry.retiring is engine:
                    entry.retiring = None
                    entry.retiring_bytes = 0
            entry.stats.record_eviction(reason)
            self._emit("evicted", entry.spec.name, reason)
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
            for e in self._evictable_locked(self._entries.values(), None):
                ttl = e.spec.idle_ttl_s
                if ttl is not None and e.idle_since is not None and now - e.idle_since >= ttl:
                    if self._begin_evict_locked(e, "idle_ttl"):
                        evicted.append(e.spec.name)
            if self.pressure_threshold is not None and self._probe is not None:
                used, limit = self._probe()
                freed = 0
                cands = self._evictable_locked(self._entries.values(), None)
                while used - freed > self.pressure_threshold * limit and cands:
                    v = cands.pop(0)
                    size = v.held_bytes()
                    if self._begin_evict_locked(v, "pressure"):
                        evicted.append(v.spec.name)
                        freed += size
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
        for name, e, eng in items:
            d: dict[str, Any] = {
                "state": eng.state.value if eng is not None else ("evicting" if e.retiring else "unloaded"),
                "policy": e.spec.policy,
                "pinned": e.spec.pinned,
                "instances": e.spec.instances,
                "mapped_bytes": held[name],
                "in_flight": eng.in_flight if eng is not None else 0,
                "queue_depth": eng.queue_depth if eng is not None else 0,
                "uses": len(e.uses),
            }
            if rss:
                parts = getattr(eng.resident_hint, "_parts", None) if eng is not None else None
                files = [f.path for f in getattr(parts, "files", {}).values()] if parts is not None else []
                d["rss_bytes"] = rss_of_files(files)
            d.update(e.stats.snapshot())
            models[name] = d
        out: dict[str, Any] = {
            "models": models,
            "memory_budget": self.memory_budget,
            "resident_bytes": sum(held.values()),
        }
        if self._probe is not None:
            used, limit = self._probe()
            out["memory_used"], out["memory_limit"] = used, limit
        return out
