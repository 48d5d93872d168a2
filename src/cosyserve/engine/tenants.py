"""Tenants: each sees its own models through a :class:`TenantView` of the shared pool, within a quota.

Isolation rules (the pool enforces the memory ones, the view the request one):

- ``max_concurrent``: a tenant's requests in flight (queued or running) across its models; one more fails at
  once with :class:`QuotaExceededError` before it reaches an engine queue, so a flooding tenant fills its own
  slots, not the shared queues;
- ``max_models`` / ``max_memory_bytes``: resident models (and their bytes) that the tenant alone lists; a
  load past the quota evicts the tenant's own idle models (LRU-K), never another tenant's; if all of them
  are busy or pinned the load fails with :class:`QuotaExceededError`;
- a model listed by several tenants is shared: it counts against no tenant's quota, only the pool budget;
- the shared memory budget is applied after the quota, by LRU-K, the requesting tenant's own idle models first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cosyserve.engine.engine import AudioStream, SyncAudioStream, SynthesisRequest
from cosyserve.engine.errors import QuotaExceededError, UnknownModelError

if TYPE_CHECKING:
    from cosyserve.engine.pool import ModelPool

__all__ = ["Tenant", "TenantQuota", "TenantView"]


@dataclass(frozen=True)
class TenantQuota:
    """Limits of one tenant; None means unlimited."""

    max_models: int | None = None
    max_memory_bytes: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_models", "max_memory_bytes", "max_concurrent"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {v}")

    def describe(self) -> str:
        parts = [
            f"{k}={v}"
            for k, v in (
                ("max_models", self.max_models),
                ("max_memory_bytes", self.max_memory_bytes),
                ("max_concurrent", self.max_concurrent),
            )
            if v is not None
        ]
        return ", ".join(parts) or "unlimited"


@dataclass(frozen=True)
class Tenant:
    name: str
    models: frozenset[str]
    quota: TenantQuota = TenantQuota()


class TenantView:
    """The pool as one tenant sees it: only its models, its concurrency slots.

    Build it with :meth:`ModelPool.view`.
    """

    def __init__(self, pool: ModelPool, tenant: Tenant) -> None:
        self.pool = pool
        self.tenant = tenant
        self._lock = threading.Lock()
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def models(self) -> list[str]:
        return sorted(self.tenant.models)

    def _acquire(self, model: str) -> Callable[[], None]:
        if model not in self.tenant.models:
            raise UnknownModelError(f"unknown model {model!r} for tenant {self.tenant.name!r}")
        limit = self.tenant.quota.max_concurrent
        with self._lock:
            if limit is not None and self._in_flight >= limit:
                eng = self.pool.engine(model)
                raise QuotaExceededError(
                    f"tenant {self.tenant.name!r}: {self._in_flight} requests in flight "
                    f"(max_concurrent={limit})",
                    retry_after=eng.retry_after() if eng is not None else 1.0,
                )
            self._in_flight += 1
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                with self._lock:
                    self._in_flight -= 1

        return release

    async def submit(self, model: str, request: SynthesisRequest) -> AudioStream:
        """As :meth:`ModelPool.submit`, within this tenant's models and quota."""
        release = self._acquire(model)
        try:
            return await self.pool.submit(model, request, tenant=self.tenant.name, on_done=release)
        except BaseException:
            release()
            raise

    def submit_sync(
        self, model: str, request: SynthesisRequest, load_timeout: float | None = None
    ) -> SyncAudioStream:
        release = self._acquire(model)
        try:
            return self.pool.submit_sync(
                model, request, tenant=self.tenant.name, on_done=release, load_timeout=load_timeout
            )
        except BaseException:
            release()
            raise
