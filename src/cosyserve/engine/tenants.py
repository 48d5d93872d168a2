"""Tenants: each sees its own models through a :class:`TenantView` of the shared pool, within a quota.

Isolation rules, all enforced by the pool (which holds each tenant's count of requests in flight):

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

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cosyserve.engine.engine import AudioStream, SyncAudioStream, SynthesisRequest

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
    """The pool as one tenant sees it: only its models, within its quota.

    Build it with :meth:`ModelPool.view`. A view holds no count of its own: the pool keeps one per tenant,
    so every view of a tenant (one per HTTP request, say) shares the tenant's ``max_concurrent``.
    """

    def __init__(self, pool: ModelPool, tenant: Tenant) -> None:
        self.pool = pool
        self.tenant = tenant

    @property
    def in_flight(self) -> int:
        return self.pool.tenant_in_flight(self.tenant.name)

    @property
    def models(self) -> list[str]:
        return sorted(self.tenant.models)

    async def submit(self, model: str, request: SynthesisRequest) -> AudioStream:
        """As :meth:`ModelPool.submit`, within this tenant's models and quota."""
        return await self.pool.submit(model, request, tenant=self.tenant.name)

    def submit_sync(
        self, model: str, request: SynthesisRequest, load_timeout: float | None = None
    ) -> SyncAudioStream:
        return self.pool.submit_sync(model, request, tenant=self.tenant.name, load_timeout=load_timeout)
