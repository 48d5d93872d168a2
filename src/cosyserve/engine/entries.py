"""A pool's models: how one is configured (:class:`ModelSpec`), what the pool reports about it
(:class:`PoolEvent`), and the record the pool keeps of it (:class:`Entry`: stats, uses, engine while resident).

The rules that act on entries are :mod:`cosyserve.engine.pool` (loading, admission) and
:mod:`cosyserve.engine.eviction` (which to evict).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from cosyserve.engine.engine import Engine
from cosyserve.engine.state import EngineState
from cosyserve.engine.stats import ModelStats
from cosyserve.system.pagecache import rss_of_files

__all__ = ["Entry", "ModelSpec", "Policy", "PoolEvent", "VoiceList"]

Policy = Literal["preload", "lazy"]


@dataclass(frozen=True)
class ModelSpec:
    """One model of the pool.

    Args:
        name: the name requests use.
        path: bundle or official model dir (default loader); fakes may leave it None.
        policy: ``preload`` (loaded by :meth:`~cosyserve.engine.pool.ModelPool.start`, in parallel) or ``lazy``
            (on first request).
        pinned: never evicted (neither TTL nor pressure nor budget).
        idle_ttl_s: release after this many idle seconds (None: never).
        instances: prewarmed instances (``MODEL_POOL_SIZE``), each with its own worker.
        batch_size: requests each instance serves at once, LM steps batched (``COSYSERVE_BATCH_SIZE``; None: the
            model family's).
        runtime: the runtime that runs it (a key of :data:`cosyserve.runtime.RUNTIMES`).
        queue_limit: requests allowed to wait per model before :class:`OverloadedError`.
        size_bytes: memory estimate used before the first load (default: the bundle's file sizes).
        warmup: warm-up synthesis on the first load.
        reload_warmup: warm-up on reloads after eviction (off: kernels are warm, pages are cached).
        load_options: fields of :class:`cosyserve.runtime.RuntimeOptions` for this model (strategy, verify,
            use_mmap, ...), over the pool's ``runtime_options``.
        voices: OpenAI voice name -> this model's voice, over the default rule
            (:func:`cosyserve.engine.voicemap.openai_voice_map`).
    """

    name: str
    path: str | None = None
    policy: Policy = "lazy"
    pinned: bool = False
    idle_ttl_s: float | None = None
    instances: int = 1
    batch_size: int | None = None
    queue_limit: int = 16
    size_bytes: int | None = None
    warmup: bool = True
    reload_warmup: bool = False
    runtime: str = "torch"
    load_options: Mapping[str, Any] = field(default_factory=dict)
    voices: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.policy not in ("preload", "lazy"):
            raise ValueError(f"model {self.name!r}: policy must be preload or lazy, got {self.policy!r}")
        if self.instances < 1:
            raise ValueError(f"model {self.name!r}: instances must be >= 1, got {self.instances}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"model {self.name!r}: batch_size must be >= 1, got {self.batch_size}")
        if self.idle_ttl_s is not None and self.idle_ttl_s <= 0:
            raise ValueError(f"model {self.name!r}: idle_ttl_s must be > 0, got {self.idle_ttl_s}")

    def load(self, runtime_options: Any, reload: bool) -> Any:
        """Its runtime, loaded as the pool's ``runtime_options`` (None: the runtime's defaults) and its own fields
        say (a pool's default loader)."""
        from cosyserve.core.clock import PhaseClock
        from cosyserve.runtime import RuntimeOptions, load_runtime

        if self.path is None:
            raise ValueError(f"model {self.name!r} has no path")
        base = runtime_options or RuntimeOptions()
        warmup = self.reload_warmup if reload else self.warmup
        own = {"batch_size": self.batch_size} if self.batch_size is not None else {}  # None: the family's
        options = replace(base, **{"warmup": warmup and base.warmup, **own, **self.load_options})
        # a first load's phases count from process start (the server's start-up report); a reload's from now
        clock = PhaseClock(t0=time.time()) if reload else PhaseClock()
        return load_runtime(self.path, options, runtime=self.runtime, clock=clock)


@dataclass(frozen=True)
class PoolEvent:
    """``kind`` is load_started / loaded / load_failed / evicting / evicted; ``detail`` the reason or error."""

    kind: str
    model: str
    at: float
    detail: str = ""


@dataclass(frozen=True)
class VoiceList:
    """A loaded model's voices for a tenant (:meth:`ModelPool.voices`).

    Attributes:
        model: the model's name.
        voices: its pre-defined speakers, then the tenant's registered voices (:class:`cosyserve.runtime.Voice`);
            :func:`cosyserve.engine.voicemap.language_of` tells what a name states of its language.
        openai: each OpenAI voice name -> the voice it speaks with on this model (None: the model has no voice
            of its own, and the request needs a registered one).
    """

    model: str
    voices: list[Any]
    openai: dict[str, str | None]


class Entry:
    """One model of the pool: its spec, stats and uses, and its engine while resident."""

    def __init__(self, spec: ModelSpec, k: int) -> None:
        self.spec = spec
        self.name = spec.name
        self.pinned = spec.pinned
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

    @property
    def idle(self) -> bool:
        return self.ready and self.engine is not None and self.engine.in_flight == 0

    def held_bytes(self) -> int:
        held = self.retiring_bytes
        if self.engine is not None and self.engine.state in (EngineState.LOADING, EngineState.READY):
            held += self.bytes if self.bytes is not None else self.reserved
        return held

    def estimate_bytes(self) -> int:
        """The bytes a load of it is expected to hold: the last load's, else the spec's estimate, else its bundle's
        components' (0: unknown)."""
        if self.last_bytes is not None:
            return self.last_bytes
        if self.spec.size_bytes is not None:
            return self.spec.size_bytes
        if self.spec.path is not None and self.bundle is None:
            from cosyserve.bundle.loader import is_bundle, open_bundle
            from cosyserve.core.errors import BundleError

            if is_bundle(self.spec.path):
                try:
                    self.bundle = open_bundle(self.spec.path)
                except BundleError:
                    return 0  # the load reports it
        if self.bundle is not None:
            m = self.bundle.manifest
            comps = list(m.get("components", {}).values()) + [m.get("speakers", {})]
            return sum(int(c.get("bytes", 0)) for c in comps)
        return 0

    def report(self, engine: Engine | None, held: int, failed: bool, rss: bool) -> dict[str, Any]:
        """Its line of :meth:`cosyserve.engine.pool.ModelPool.stats` (``engine``, ``held`` bytes and whether its
        last load ``failed`` as the pool read them under its lock; ``rss``: also its mapped files' resident bytes)."""
        idle = "evicting" if self.retiring else ("failed" if failed else "unloaded")
        d: dict[str, Any] = {
            "state": engine.state.value if engine is not None else idle,
            "policy": self.spec.policy,
            "pinned": self.spec.pinned,
            "instances": self.spec.instances,
            "mapped_bytes": held,
            "in_flight": engine.in_flight if engine is not None else 0,
            "queue_depth": engine.queue_depth if engine is not None else 0,
            "uses": len(self.uses),
        }
        if rss:
            files = engine.runtime.mapped_files() if engine is not None and engine.runtime is not None else []
            d["rss_bytes"] = rss_of_files(files)
        d.update(self.stats.snapshot())
        return d
