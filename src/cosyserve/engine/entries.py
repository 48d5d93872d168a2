"""A pool's models: how one is configured (:class:`ModelSpec`), what the pool reports about it
(:class:`PoolEvent`), and the record the pool keeps of it (:class:`Entry`: stats, uses, engine while resident).

The rules that act on entries are :mod:`cosyserve.engine.pool` (loading, admission) and
:mod:`cosyserve.engine.eviction` (which to evict).
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from cosyserve.engine.engine import Engine
from cosyserve.engine.state import EngineState
from cosyserve.engine.stats import ModelStats

__all__ = ["Entry", "ModelSpec", "Policy", "PoolEvent"]

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
        batch_size: requests each instance serves at once, LM steps batched (``COSYSERVE_BATCH_SIZE``).
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
    batch_size: int = 4
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
