"""ModelPool: lazy/preload loading, LRU-K victims, budget, pressure, TTL, stats; fakes with a fake clock.

One test loads the tiny real model, evicts it and reloads it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest

from cosyserve.core.errors import MemoryBudgetError, UnknownModelError
from cosyserve.core.request import SynthesisRequest
from cosyserve.engine.pool import ModelPool, ModelSpec, PoolEvent, lru_k_order
from cosyserve.engine.state import EngineState
from fake_runtime import FakeRuntime
from proc_util import run_python
from server_util import WAIT_S, wait_until


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeLoader:
    """Counts loads per model (and whether they were reloads); ``delay`` makes loads slow."""

    def __init__(self, delay: float = 0.0, hold: threading.Event | None = None) -> None:
        self.calls: list[tuple[str, bool]] = []
        self.delay = delay
        self.hold = hold
        self._lock = threading.Lock()

    def __call__(self, spec: ModelSpec, reload: bool) -> FakeRuntime:
        with self._lock:
            self.calls.append((spec.name, reload))
        time.sleep(self.delay)
        return FakeRuntime(1, 100, hold=self.hold, size=spec.size_bytes or 0)


def make_pool(specs: list[ModelSpec], **kw: Any) -> tuple[ModelPool, FakeLoader, Clock]:
    loader = kw.pop("loader", None) or FakeLoader()
    clock = Clock()
    kw.setdefault("memory_probe", None)
    pool = ModelPool(specs, load_model=loader, clock=clock, **kw)
    return pool, loader, clock


def spec(name: str, size: int = 100, **kw: Any) -> ModelSpec:
    return ModelSpec(name, size_bytes=size, **kw)


def use(pool: ModelPool, name: str, clock: Clock | None = None, at: float | None = None) -> None:
    """One complete request to ``name`` (at fake time ``at``)."""
    if clock is not None and at is not None:
        clock.t = at
    chunks = list(pool.submit_sync(name, SynthesisRequest("hi", "alice"), load_timeout=5))
    assert len(chunks) == 1


def settle(pool: ModelPool) -> None:
    """Wait for evictions in progress to finish releasing."""
    wait_until(lambda: all(e.retiring is None for e in pool._entries.values()), "the evictions finished")


def resident(pool: ModelPool) -> list[str]:
    return sorted(n for n in pool.names if pool.engine(n) is not None)


# -- LRU-K ----------------------------------------------------------------------------------------------------


def test_lru_k_order_scripted() -> None:
    # a used at 1 and 5, b at 2 and 3, c once at 4
    h = {"a": [(1, 0), (5, 4)], "b": [(2, 1), (3, 2)], "c": [(4, 3)]}
    assert lru_k_order(h, 2) == ["c", "a", "b"], (
        "fewer than K uses = infinitely old; then oldest 2nd-last use"
    )
    assert lru_k_order(h, 1) == ["b", "c", "a"], "K=1 is plain LRU"
    # ties among models with < K uses go to the older last use
    assert lru_k_order({"x": [(7, 1)], "y": [(3, 0)], "z": []}, 2) == ["z", "y", "x"]
    # only the K most recent uses count
    assert lru_k_order({"a": [(1, 0), (8, 4), (9, 5)], "b": [(3, 2), (4, 3)]}, 2) == ["b", "a"]


def test_pool_evicts_the_lru_k_victim_not_the_lru_one() -> None:
    """a is used twice, then b once (a scan): LRU would evict a (older last use); LRU-K evicts b."""
    pool, _, clock = make_pool([spec("a"), spec("b"), spec("c")], memory_budget=250)
    use(pool, "a", clock, 1)
    use(pool, "a", clock, 2)
    use(pool, "b", clock, 3)
    use(pool, "c", clock, 4)
    settle(pool)
    assert resident(pool) == ["a", "c"]
    assert pool.stats()["models"]["b"]["evictions"] == {"memory": 1}
    # b comes back (its history survived eviction: 3, 5); c has one use (< K) so it goes, not a
    use(pool, "b", clock, 5)
    settle(pool)
    assert resident(pool) == ["a", "b"]
    pool.close_sync()


def test_never_evicts_pinned_or_busy_models() -> None:
    hold = threading.Event()
    pool, _, clock = make_pool(
        [spec("p", pinned=True), spec("a"), spec("b")],
        memory_budget=250,
        loader=FakeLoader(hold=hold),
    )
    hold.set()
    use(pool, "p", clock, 1)
    use(pool, "a", clock, 2)
    hold.clear()
    busy = pool.submit_sync("a", SynthesisRequest("hi", "alice"))  # a has a request in flight
    with pytest.raises(MemoryBudgetError) as info:
        pool.submit_sync("b", SynthesisRequest("hi", "alice"))
    assert info.value.retry_after > 0
    assert resident(pool) == ["a", "p"]
    hold.set()
    assert len(list(busy)) == 1
    use(pool, "b", clock, 3)  # a is idle now: it goes, p (pinned) stays
    settle(pool)
    assert resident(pool) == ["b", "p"]
    pool.close_sync()


def test_lazy_concurrent_first_requests_share_one_load() -> None:
    loader = FakeLoader(delay=0.05)
    pool, _, _ = make_pool([spec("a")], loader=loader)

    async def main() -> list[int]:
        async def one() -> int:
            stream = await pool.submit("a", SynthesisRequest("hi", "alice"))
            return len([c async for c in stream])

        return await asyncio.gather(*(one() for _ in range(10)))

    assert asyncio.run(main()) == [1] * 10
    assert loader.calls == [("a", False)], "concurrent first requests must share one load"
    s = pool.stats()["models"]["a"]
    assert s["misses"] == 10 and s["hits"] == 0 and s["loads"] == 1
    use(pool, "a")
    assert pool.stats()["models"]["a"]["hits"] == 1
    pool.close_sync()


class MeetingLoader(FakeLoader):
    """Each load waits for the other one to be under way: loads that ran one after the other never meet, and
    the first one's wait ends in BrokenBarrierError (a failed load) instead."""

    def __init__(self) -> None:
        super().__init__()
        self.both = threading.Barrier(2)

    def __call__(self, spec: ModelSpec, reload: bool) -> FakeRuntime:
        self.both.wait(WAIT_S)
        return super().__call__(spec, reload)


def test_preload_in_parallel_and_unknown_model() -> None:
    pool, _, _ = make_pool(
        [spec("a", policy="preload"), spec("b", policy="preload"), spec("c")], loader=MeetingLoader()
    )
    events: list[PoolEvent] = []
    pool.add_listener(events.append)
    asyncio.run(pool.start(housekeeping_interval_s=None))
    assert resident(pool) == ["a", "b"], f"the preloads did not run in parallel: {events}"
    assert sorted(e.model for e in events if e.kind == "loaded") == ["a", "b"]
    with pytest.raises(UnknownModelError, match="unknown model 'zz'"):
        pool.submit_sync("zz", SynthesisRequest("hi", "alice"))
    pool.close_sync()
    assert all(pool.engine(n) is None or pool.engine(n).state is EngineState.RELEASED for n in pool.names)


def test_idle_ttl_release_and_cheap_reload_keeps_stats() -> None:
    pool, loader, clock = make_pool([spec("a", idle_ttl_s=10), spec("p", idle_ttl_s=10, pinned=True)])
    use(pool, "a", clock, 0)
    use(pool, "p", clock, 0)
    clock.t = 9.9
    assert pool.maintain() == []
    clock.t = 10.0
    assert pool.maintain() == ["a"], "a was idle for its TTL; p is pinned"
    settle(pool)
    assert resident(pool) == ["p"]
    use(pool, "a", clock, 11)
    assert loader.calls == [("a", False), ("p", False), ("a", True)], "the second load is a reload"
    s = pool.stats()["models"]["a"]
    assert s["loads"] == 2 and s["evictions"] == {"idle_ttl": 1} and s["misses"] == 2
    pool.close_sync()


def test_ttl_counts_from_the_end_of_the_last_request() -> None:
    hold = threading.Event()
    pool, _, clock = make_pool([spec("a", idle_ttl_s=10)], loader=FakeLoader(hold=hold))
    hold.set()
    use(pool, "a", clock, 0)
    hold.clear()
    stream = pool.submit_sync("a", SynthesisRequest("hi", "alice"))
    clock.t = 20
    assert pool.maintain() == [], "a model with a request in flight is never idle"
    clock.t = 25
    hold.set()
    list(stream)
    clock.t = 34
    assert pool.maintain() == []
    clock.t = 35
    assert pool.maintain() == ["a"]
    pool.close_sync()


def test_memory_pressure_evicts_by_lru_k() -> None:
    usage = [500, 1000]
    pool, _, clock = make_pool(
        [spec("a"), spec("b"), spec("p", pinned=True)],
        memory_probe=lambda: (usage[0], usage[1]),
        pressure_threshold=0.8,
    )
    use(pool, "a", clock, 1)
    use(pool, "a", clock, 2)
    use(pool, "b", clock, 3)
    use(pool, "p", clock, 4)
    assert pool.maintain() == []
    usage[0] = 850  # above 80%: evict one 100-byte model -> 750
    assert pool.maintain() == ["b"]
    settle(pool)
    usage[0] = 990  # nothing but a (and pinned p) left: a goes, p stays
    assert pool.maintain() == ["a"]
    settle(pool)
    assert resident(pool) == ["p"]
    # a load that would cross the threshold evicts first
    usage[0] = 300
    use(pool, "a", clock, 5)
    usage[0] = 750
    use(pool, "b", clock, 6)  # 750 + 100 > 800: a goes before b loads
    settle(pool)
    assert resident(pool) == ["b", "p"]
    assert pool.stats()["models"]["a"]["evictions"] == {"pressure": 1, "memory": 1}
    pool.close_sync()


def test_instances_per_model() -> None:
    loader = FakeLoader()
    pool, _, _ = make_pool([spec("a", instances=3)], loader=loader)
    use(pool, "a")
    eng = pool.engine("a")
    assert eng is not None and eng.instances == 3
    assert loader.calls == [("a", False)] * 3
    pool.close_sync()


def test_failed_load_is_reported_and_retried() -> None:
    attempts = []

    def flaky(spec: ModelSpec, reload: bool) -> FakeRuntime:
        attempts.append(1)
        if len(attempts) == 1:
            raise OSError("disk hiccup")
        return FakeRuntime(1, 100, size=10)

    pool, _, clock = make_pool([spec("a")], loader=flaky)
    with pytest.raises(Exception, match="disk hiccup"):
        use(pool, "a")
    clock.t += 1.0  # the back-off after a first failure (test_server_honesty tests it)
    use(pool, "a")
    s = pool.stats()["models"]["a"]
    assert s["load_failures"] == 1 and s["loads"] == 1
    pool.close_sync()


def test_stats_shape() -> None:
    pool, _, clock = make_pool([spec("a", size=123)], memory_budget=1000)
    use(pool, "a", clock, 1)
    st = pool.stats()
    a = st["models"]["a"]
    assert st["resident_bytes"] == 123 and a["mapped_bytes"] == 123 and a["state"] == "ready"
    for key in ("in_flight", "queue_depth", "loads", "evictions", "hits", "misses", "ttfa_p50_s", "rtf_p50"):
        assert key in a
    pool.close_sync()


# -- real model -----------------------------------------------------------------------------------------------


def test_real_model_reload_after_eviction(tiny_model_dir: Any, tmp_path: Any) -> None:
    from cosyserve.bundle.convert import convert

    bundle = tmp_path / "tiny"
    convert(tiny_model_dir, bundle)
    pool = ModelPool([ModelSpec("tiny", path=str(bundle))], memory_probe=None)
    e = pool.start_load("tiny").result(120)
    spk = e.runtime.speakers()[0]
    st = pool.stats(rss=True)["models"]["tiny"]
    assert st["mapped_bytes"] > 0 and st["rss_bytes"] > 0
    first = np.concatenate(list(pool.submit_sync("tiny", SynthesisRequest("Hi.", spk, seed=1))))
    pool.evict("tiny").result(30)
    assert pool.engine("tiny") is None
    assert pool._entries["tiny"].bundle is not None, "an evicted model keeps its opened bundle"
    pool.start_load("tiny").result(120)
    again = np.concatenate(list(pool.submit_sync("tiny", SynthesisRequest("Hi.", spk, seed=1))))
    np.testing.assert_array_equal(again, first)
    s = pool.stats()["models"]["tiny"]
    print(f"tiny model: first load {s['first_load_s'] * 1e3:.0f} ms, reload {s['last_load_s'] * 1e3:.0f} ms")
    assert s["loads"] == 2 and s["evictions"] == {"manual": 1}
    pool.close_sync()


def test_eviction_frees_the_model(tiny_model_dir: Any, tmp_path: Any) -> None:
    """If this fails, an evicted model stays in memory with its weights mapped: cosyserve.load freezes what it
    builds for the garbage collector, so the model's reference cycles (the batching LM's among them) are freed
    only by a collection that looks at frozen objects, which the release must run. (In a fresh process, as a
    server loads: inside the test process other collections and imports hide it.)"""
    from cosyserve.bundle.convert import convert

    bundle = convert(tiny_model_dir, tmp_path / "tiny")
    code = f"""
import gc, weakref
from cosyserve.core.request import SynthesisRequest
from cosyserve.engine.pool import ModelPool, ModelSpec
def main():
    pool = ModelPool([ModelSpec("tiny", path={str(bundle)!r}, batch_size=2)], memory_probe=None)
    gc.disable()  # no collection by chance: only the release's own
    e = pool.start_load("tiny").result(120)
    llm = weakref.ref(e.runtime.pipeline.llm)
    list(pool.submit_sync("tiny", SynthesisRequest("Hi.", e.runtime.speakers()[0], seed=1)))
    del e
    pool.evict("tiny").result(30)
    assert llm() is None, "the evicted model is still alive"
main()
"""
    r = run_python(code)
    assert r.returncode == 0, r.stderr[-2000:]
