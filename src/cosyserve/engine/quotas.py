"""Tenants and their quotas, and the per-tenant counts of requests in flight (owned by the pool).

Isolation rules, all enforced by the pool:

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

import itertools
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from cosyserve.core.errors import QuotaExceededError, UnknownModelError

__all__ = ["InFlight", "Tenant", "TenantQuota", "sole_owners"]


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


def sole_owners(tenants: Iterable[Tenant]) -> dict[str, str]:
    """model -> the tenant that alone lists it (a model listed by several tenants is shared: it is nobody's)."""
    listed: dict[str, list[str]] = {}
    for t in tenants:
        for m in t.models:
            listed.setdefault(m, []).append(t.name)
    return {m: ts[0] for m, ts in listed.items() if len(ts) == 1}


class InFlight:
    """Each tenant's requests in flight (waiting for a load, queued or running), what ``max_concurrent`` counts.

    One count per tenant, shared by all its requests whichever route or model they use. :meth:`take` checks the
    quota and the tenant's right to the model, and returns the release (idempotent) that ends the request's
    share.

    Args:
        retry_after: ``[(model, request id), ...] -> seconds`` until the first of those requests is expected to
            end (the refusal's Retry-After).
    """

    def __init__(self, retry_after: Callable[[list[tuple[str, str]]], float]) -> None:
        self._retry_after = retry_after
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._held: dict[str, dict[int, tuple[str, str]]] = {}

    def count(self, tenant: str) -> int:
        with self._lock:
            return len(self._held.get(tenant, {}))

    def take(
        self, tenants: Mapping[str, Tenant], tenant: str, model: str, request_id: str
    ) -> Callable[[], None]:
        """One of ``tenant``'s slots for ``request_id`` on ``model``.

        Raises:
            UnknownModelError: no such tenant, or the tenant does not list ``model``.
            QuotaExceededError: the tenant has ``max_concurrent`` requests in flight already.
        """
        t = tenants.get(tenant)
        if t is None:
            raise UnknownModelError(f"unknown tenant {tenant!r}")
        if model not in t.models:
            raise UnknownModelError(f"unknown model {model!r} for tenant {tenant!r}", param="model")
        limit = t.quota.max_concurrent
        with self._lock:
            held = self._held.setdefault(tenant, {})
            if limit is not None and len(held) >= limit:
                mine = list(held.values())
                n = len(held)
            else:
                token = next(self._seq)
                held[token] = (model, request_id)
                mine = None
        if mine is not None:
            raise QuotaExceededError(
                f"tenant {tenant!r}: {n} requests in flight (max_concurrent={limit})",
                retry_after=self._retry_after(mine),
            )

        def release() -> None:
            with self._lock:
                held.pop(token, None)

        return release
