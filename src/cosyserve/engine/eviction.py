"""Which resident models to evict: LRU-K order, room for a load (tenant quota, memory budget, pressure), TTL.

Pure planning over the pool's entries (the pool holds its lock while it asks, and carries the plan out):

- the victim is chosen by LRU-K (K=2 by default): the model whose K-th most recent use is oldest; models with
  fewer than K uses count as infinitely old; ties go to the older last use. Models that are pinned, loading,
  or have requests in flight are never victims. A tenant's own idle models are evicted before anyone else's;
- room for a load is made first within the requesting tenant's quota (its own models only), then within the
  memory budget (hard: :class:`MemoryBudgetError` when it cannot fit), then under the pressure threshold (soft:
  logged when nothing more can be evicted).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from cosyserve.core.errors import MemoryBudgetError, QuotaExceededError
from cosyserve.engine.quotas import TenantQuota

__all__ = ["Candidate", "evictable", "lru_k_order", "plan_room", "pressure_victims"]

logger = logging.getLogger(__name__)


class Candidate(Protocol):
    """What planning reads of a pool entry."""

    name: str
    pinned: bool
    uses: Iterable[tuple[float, int]]

    @property
    def idle(self) -> bool:
        """READY with nothing in flight."""
        ...

    def held_bytes(self) -> int: ...


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


def evictable(entries: Iterable[Any], k: int, exclude: Any = None) -> list[Any]:
    """The idle, unpinned entries of ``entries`` (not ``exclude``), best victim first (LRU-K)."""
    out = [e for e in entries if e is not exclude and not e.pinned and e.idle]
    by_name = {e.name: e for e in out}
    return [by_name[n] for n in lru_k_order({e.name: list(e.uses) for e in out}, k)]


def plan_room(
    entry: Any,
    need: int,
    entries: list[Any],
    *,
    k: int,
    own: list[Any] = (),  # type: ignore[assignment]
    tenant: str | None = None,
    quota: TenantQuota | None = None,
    budget: int | None = None,
    pressure: float | None = None,
    probe: Callable[[], tuple[int, int]] | None = None,
    busy_retry_after: Callable[[list[Any]], float] = lambda entries: 1.0,
) -> list[tuple[Any, str]]:
    """The entries to evict, with their reasons, so that ``entry`` (needing ``need`` bytes) can load.

    Args:
        entry: the entry to load.
        need: its expected bytes.
        entries: every entry of the pool.
        k: K of LRU-K.
        own: the entries ``tenant`` alone lists (what its quota counts).
        tenant, quota: the requesting tenant and its quota (None: no tenant).
        budget: bytes all resident models may hold (None: none).
        pressure: fraction of the memory limit above which idle models are evicted (None: off).
        probe: ``() -> (used, limit)`` bytes of memory.
        busy_retry_after: seconds until one of the given (busy) entries could be evicted.
    Returns:
        ``[(victim, reason)]``: reason ``tenant_quota`` for the tenant's own models, else ``memory``.
    Raises:
        QuotaExceededError: the tenant's quota cannot be met (its other models are busy or pinned).
        MemoryBudgetError: the budget cannot be met (every other model is pinned, loading or busy).
    """
    victims: list[Any] = []
    if quota is not None:
        counted = entry in own

        def over_quota() -> bool:
            held = [e for e in own if e is not entry and e not in victims and e.held_bytes() > 0]
            if quota.max_models is not None and counted and len(held) + 1 > quota.max_models:
                return True
            b = sum(e.held_bytes() for e in held) + (need if counted else 0)
            return quota.max_memory_bytes is not None and b > quota.max_memory_bytes

        while over_quota():
            cands = [e for e in evictable(own, k, entry) if e not in victims]
            if not cands:
                raise QuotaExceededError(
                    f"tenant {tenant!r}: loading {entry.name!r} would exceed its quota "
                    f"({quota.describe()}) and its other models are busy or pinned",
                    retry_after=busy_retry_after(list(own)),
                )
            victims.append(cands[0])
    held_total = sum(e.held_bytes() for e in entries if e is not entry)

    def freed() -> int:
        return sum(v.held_bytes() for v in victims)

    def candidates() -> list[Any]:
        # the requesting tenant's own idle models go first, then everyone's, each group by LRU-K
        seen: list[Any] = []
        for e in evictable(own, k, entry) + evictable(entries, k, entry):
            if e not in victims and e not in seen:
                seen.append(e)
        return seen

    if budget is not None:
        while held_total - freed() + need > budget:
            cands = candidates()
            if not cands:
                busy = [e.name for e in entries if e.held_bytes() and e is not entry]
                raise MemoryBudgetError(
                    f"model {entry.name!r} needs {need} bytes; the budget is {budget} "
                    f"and {held_total - freed()} are held by models that are pinned, loading or busy "
                    f"({', '.join(busy)})",
                    retry_after=busy_retry_after(entries),
                )
            victims.append(cands[0])
    if pressure is not None and probe is not None:
        used, limit = probe()
        while used - freed() + need > pressure * limit:
            cands = candidates()
            if not cands:
                logger.warning(
                    "memory pressure: %d of %d bytes in use (threshold %.0f%%) and nothing evictable; "
                    "loading %s anyway",
                    used,
                    limit,
                    pressure * 100,
                    entry.name,
                )
                break
            victims.append(cands[0])
    return [(v, "tenant_quota" if v in own else "memory") for v in victims]


def pressure_victims(entries: Iterable[Any], used: int, limit: int, threshold: float, k: int) -> list[Any]:
    """Idle entries to evict, best first, until ``used`` less what they hold is under ``threshold * limit``."""
    out: list[Any] = []
    freed = 0
    for e in evictable(entries, k):
        if used - freed <= threshold * limit:
            break
        out.append(e)
        freed += e.held_bytes()
    return out
