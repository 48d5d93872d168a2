"""Tenant isolation (quotas on concurrency, models, memory) and the pool config file (TOML + env)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from cosyserve.core.errors import OverloadedError, QuotaExceededError, SettingsError, UnknownModelError
from cosyserve.core.request import SynthesisRequest
from cosyserve.core.settings import ModelArg, Settings
from cosyserve.engine.pool import ModelPool, ModelSpec
from cosyserve.engine.poolfile import build_pool, load_pool_config, parse_bytes
from cosyserve.engine.quotas import Tenant, TenantQuota
from cosyserve.server.errors import status_of
from fake_runtime import FakeRuntime
from server_util import wait_until


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class As:
    """The pool as one tenant uses it: every request carries the tenant."""

    def __init__(self, pool: ModelPool, tenant: str) -> None:
        self.pool, self.tenant = pool, tenant

    def submit_sync(self, model: str, request: SynthesisRequest, **kw: Any) -> Any:
        return self.pool.submit_sync(model, request, tenant=self.tenant, **kw)

    @property
    def in_flight(self) -> int:
        return self.pool.tenant_in_flight(self.tenant)


def req() -> SynthesisRequest:
    return SynthesisRequest("hi", "alice")


def make(
    specs: list[ModelSpec], tenants: list[Tenant], **kw: Any
) -> tuple[ModelPool, threading.Event, Clock]:
    hold = threading.Event()
    hold.set()
    clock = Clock()
    pool = ModelPool(
        specs,
        tenants=tenants,
        load_model=lambda s, r: FakeRuntime(1, 100, hold=hold, size=s.size_bytes or 0),
        memory_probe=None,
        clock=clock,
        **kw,
    )
    return pool, hold, clock


def use(view: Any, model: str, clock: Clock, at: float) -> None:
    clock.t = at
    assert len(list(view.submit_sync(model, req(), load_timeout=5))) == 1


def settle(pool: ModelPool) -> None:
    wait_until(lambda: all(e.retiring is None for e in pool._entries.values()), "the evictions finished")


def resident(pool: ModelPool) -> list[str]:
    return sorted(n for n in pool.names if pool.engine(n) is not None)


def test_a_flooding_tenant_fills_its_own_slots_not_the_others() -> None:
    specs = [ModelSpec("shared", size_bytes=10, queue_limit=8)]
    tenants = [
        Tenant("a", frozenset({"shared"}), TenantQuota(max_concurrent=2)),
        Tenant("b", frozenset({"shared"}), TenantQuota(max_concurrent=2)),
    ]
    pool, hold, _ = make(specs, tenants)
    a, b = As(pool, "a"), As(pool, "b")
    hold.clear()
    held = [a.submit_sync("shared", req(), load_timeout=5) for _ in range(2)]
    for _ in range(5):
        with pytest.raises(QuotaExceededError, match="tenant 'a'") as info:
            a.submit_sync("shared", req())
        assert info.value.retry_after > 0 and status_of(info.value) == 429
    other = b.submit_sync("shared", req())  # b's slots are untouched by a's flood
    assert a.in_flight == 2 and b.in_flight == 1
    hold.set()
    for s in [*held, other]:
        assert len(list(s)) == 1
    assert a.in_flight == 0 and b.in_flight == 0
    assert len(list(a.submit_sync("shared", req()))) == 1  # a's slots are back
    pool.close_sync()


def test_requests_of_one_tenant_share_its_concurrency_count() -> None:
    """The server handles each request apart: if each counted for itself, max_concurrent would never bite.
    The count is the pool's, one per tenant, across its models; a request the engine refuses gives its slot
    back."""
    specs = [ModelSpec("m", size_bytes=1, queue_limit=0), ModelSpec("n", size_bytes=1, queue_limit=8)]
    pool, hold, _ = make(specs, [Tenant("a", frozenset({"m", "n"}), TenantQuota(max_concurrent=2))])
    hold.clear()
    first = As(pool, "a").submit_sync("m", req(), load_timeout=5)
    assert As(pool, "a").in_flight == 1, "the tenant's count must hold the request admitted before"
    with pytest.raises(OverloadedError) as info:  # m's one slot is busy and it has no queue
        As(pool, "a").submit_sync("m", req())
    assert not isinstance(info.value, QuotaExceededError), info.value
    assert pool.tenant_in_flight("a") == 1, "a request the engine refused must give its tenant slot back"
    second = As(pool, "a").submit_sync("n", req(), load_timeout=5)
    with pytest.raises(QuotaExceededError, match="max_concurrent=2"):
        As(pool, "a").submit_sync("n", req())  # n has room; the tenant has not
    hold.set()
    assert len(list(first)) == len(list(second)) == 1
    wait_until(lambda: pool.tenant_in_flight("a") == 0)
    assert len(list(As(pool, "a").submit_sync("n", req()))) == 1
    pool.close_sync()


def test_tenant_sees_only_its_models() -> None:
    pool, _, _ = make(
        [ModelSpec("x", size_bytes=1), ModelSpec("y", size_bytes=1)], [Tenant("a", frozenset({"x"}))]
    )
    with pytest.raises(UnknownModelError, match="for tenant 'a'"):
        As(pool, "a").submit_sync("y", req())
    with pytest.raises(UnknownModelError, match="unknown tenant"):
        As(pool, "nobody").submit_sync("x", req())
    pool.close_sync()


def test_memory_quota_evicts_only_the_tenants_own_models() -> None:
    """b1 is the global LRU-K victim (one old use), but a's quota is full: a's own LRU-K victim goes."""
    specs = [ModelSpec(n, size_bytes=100) for n in ("a1", "a2", "a3", "b1")]
    tenants = [
        Tenant("a", frozenset({"a1", "a2", "a3"}), TenantQuota(max_memory_bytes=250)),
        Tenant("b", frozenset({"b1"})),
    ]
    pool, _, clock = make(specs, tenants)
    a, b = As(pool, "a"), As(pool, "b")
    use(b, "b1", clock, 0)
    use(a, "a1", clock, 1)
    use(a, "a1", clock, 2)
    use(a, "a2", clock, 3)
    use(a, "a3", clock, 4)  # a holds 200; +100 > 250: a2 (one use) goes, never b1
    settle(pool)
    assert resident(pool) == ["a1", "a3", "b1"]
    assert pool.stats()["models"]["a2"]["evictions"] == {"tenant_quota": 1}
    pool.close_sync()


def test_model_count_quota_and_busy_models() -> None:
    specs = [ModelSpec(n, size_bytes=10) for n in ("a1", "a2", "b1")]
    tenants = [
        Tenant("a", frozenset({"a1", "a2"}), TenantQuota(max_models=1)),
        Tenant("b", frozenset({"b1"})),
    ]
    pool, hold, clock = make(specs, tenants)
    a = As(pool, "a")
    use(As(pool, "b"), "b1", clock, 0)
    hold.clear()
    busy = a.submit_sync("a1", req(), load_timeout=5)
    with pytest.raises(QuotaExceededError, match="quota"):
        a.submit_sync("a2", req())  # its only model slot is busy: refused, b1 untouched
    assert resident(pool) == ["a1", "b1"] and a.in_flight == 1
    hold.set()
    list(busy)
    use(a, "a2", clock, 1)
    settle(pool)
    assert resident(pool) == ["a2", "b1"]
    pool.close_sync()


def test_shared_budget_takes_the_requesting_tenants_idle_models_first() -> None:
    specs = [ModelSpec(n, size_bytes=100) for n in ("a1", "a2", "b1")]
    tenants = [Tenant("a", frozenset({"a1", "a2"})), Tenant("b", frozenset({"b1"}))]
    pool, _, clock = make(specs, tenants, memory_budget=200)
    a = As(pool, "a")
    use(As(pool, "b"), "b1", clock, 0)  # global LRU-K would pick b1 (one use, oldest)
    use(a, "a1", clock, 1)
    use(a, "a2", clock, 2)
    settle(pool)
    assert resident(pool) == ["a2", "b1"]
    pool.close_sync()


# -- configuration --------------------------------------------------------------------------------------------

GOOD = """
[pool]
memory_budget = "1GiB"
pressure_threshold = 0.9
instances = 2

[models.sft]
path = "bundles/sft"
policy = "preload"
pinned = true
load = { verify = "none" }

[models.inst]
path = "/abs/inst"
instances = 3
idle_ttl_s = 60
size_bytes = "200MB"

[tenants.acme]
models = ["sft"]
max_memory = "512MiB"
max_concurrent = 4
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "pool.toml"
    p.write_text(text)
    return p


def pool_config(path: Path | None = None, env: dict[str, str] | None = None, **kwargs: Any) -> Any:
    return load_pool_config(Settings.load(env=env or {}, file=path), **kwargs)


def test_config_reads_file_and_env_overrides(tmp_path: Path) -> None:
    p = write(tmp_path, GOOD)
    cfg = pool_config(p)
    assert cfg.memory_budget == 1024**3 and cfg.pressure_threshold == 0.9
    sft, inst = cfg.models["sft"], cfg.models["inst"]
    assert sft.path == str(tmp_path / "bundles/sft") and sft.policy == "preload" and sft.pinned
    assert sft.instances == 2 and inst.instances == 3 and inst.idle_ttl_s == 60
    assert inst.size_bytes == 200_000_000 and dict(sft.load_options) == {"verify": "none"}
    assert cfg.tenants["acme"].quota == TenantQuota(None, 512 * 1024**2, 4)
    env = {"MODEL_POOL_SIZE": "4", "COSYSERVE_MEMORY_BUDGET": "50%", "COSYSERVE_POOL_CONFIG": str(p)}
    cfg = pool_config(env=env, limit=lambda: 1000)
    assert cfg.memory_budget == 500
    assert cfg.models["sft"].instances == 4 and cfg.models["inst"].instances == 4, "env wins over the file"
    pool = build_pool(cfg, memory_probe=None)
    assert pool.names == ["sft", "inst"] and pool.memory_budget == 500 and "acme" in pool.tenants


@pytest.mark.parametrize(
    "text, match",
    [
        ("[models.a]\npath='x'\npolcy='lazy'\n", r"pool.toml: \[models.a\]: unknown key 'polcy'"),
        ("[models.a]\npath='x'\npolicy='eager'\n", r"\[models.a\]: policy = 'eager'"),
        ("[models.a]\n", r"\[models.a\]: path = None"),
        ("[pool]\nmemory_budget='lots'\n", r"pool.toml: \[pool\] memory_budget = 'lots'"),
        (
            "[pool]\npressure_threshold=1.5\n",
            r"pool.toml: \[pool\] pressure_threshold = 1.5: expected a number in",
        ),
        ("[pool]\nlru_k=0\n", r"pool.toml: \[pool\] lru_k = 0: expected an integer >= 1"),
        (
            "[models.a]\npath='x'\ninstances=0\n",
            r"pool.toml: \[models.a\] instances = 0: expected an integer >= 1",
        ),
        (
            "[models.a]\npath='x'\nload={verify='most'}\n",
            r"\[models.a\] load.verify = 'most': expected one of",
        ),
        ("[models.a]\npath='x'\n[tenants.t]\nmodels=['b']\n", r"\[tenants.t\]: models: unknown model 'b'"),
        ("[models.a]\npath='x'\npinned='yes'\n", r"pinned = 'yes': expected true or false"),
        ("[pool\n", r"not valid TOML"),
    ],
)
def test_config_errors_name_file_key_and_value(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(SettingsError, match=match):
        pool_config(write(tmp_path, text))


def test_config_env_errors_name_the_variable(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="MODEL_POOL_SIZE='two'"):
        pool_config(env={"MODEL_POOL_SIZE": "two"})
    with pytest.raises(SettingsError, match="^COSYSERVE_MEMORY_BUDGET='12 parsecs': expected bytes"):
        pool_config(env={"COSYSERVE_MEMORY_BUDGET": "12 parsecs"})
    with pytest.raises(SettingsError, match="not found"):
        pool_config(env={"COSYSERVE_POOL_CONFIG": str(tmp_path / "missing.toml")})
    assert pool_config().models == {}


def test_models_given_with_model_take_the_pool_configs_defaults(tmp_path: Path) -> None:
    """If this fails, `serve --config pool.toml --model m=DIR` gives m the built-in batch_size, instances and
    queue_limit (or whatever the environment says) instead of the pool config's [pool] defaults, which every model
    of the file takes."""
    from cosyserve.server.app import ServerState

    f = write(tmp_path, "[pool]\nbatch_size = 3\ninstances = 2\nqueue_limit = 5\n[models.a]\npath = 'a'\n")
    state = ServerState(Settings.load(flags={"models": ["m=/nowhere/m"]}, env={}, file=f))
    spec = {n: state.pool._entries[n].spec for n in ("a", "m")}
    assert (spec["m"].batch_size, spec["m"].instances, spec["m"].queue_limit) == (3, 2, 5)
    assert (spec["a"].batch_size, spec["a"].instances, spec["a"].queue_limit) == (3, 2, 5)
    assert spec["m"].policy == "preload" and spec["m"].path == "/nowhere/m"
    env = {"COSYSERVE_BATCH_SIZE": "4"}  # the environment still wins over the file, for both
    state = ServerState(Settings.load(flags={"models": ["m=/nowhere/m"]}, env=env, file=f))
    assert {n: state.pool._entries[n].spec.batch_size for n in ("a", "m")} == {"a": 4, "m": 4}


def test_model_and_pool_config_model_of_the_same_name_is_an_error(tmp_path: Path) -> None:
    f = write(tmp_path, "[models.a]\npath = 'a'\n")
    settings = Settings.load(env={}, file=f)
    with pytest.raises(
        SettingsError, match=r"--model a=/x: the pool config \S+ already has a model named 'a'"
    ):
        load_pool_config(settings, preload=[ModelArg("a", "/x")])


def test_parse_bytes() -> None:
    assert parse_bytes(5, "k") == 5
    assert parse_bytes("1.5G", "k") == 1_500_000_000
    assert parse_bytes("2KiB", "k") == 2048
    assert parse_bytes("25%", "k", limit=lambda: 400) == 100
    for bad in ("0%", "-1", "x", True, 0):
        with pytest.raises(SettingsError, match="k = "):
            parse_bytes(bad, "k")


def test_settings_doc_pool_config_example_is_complete_and_loads(tmp_path: Path) -> None:
    """If this fails, docs/settings.md's pool config example no longer loads (a key renamed or a value form
    changed), or a key the loader accepts is missing from it: that page is where users learn the TOML format."""
    import re
    import tomllib

    from cosyserve.core.settings import declared
    from cosyserve.engine import poolfile

    readme = (Path(__file__).resolve().parents[1] / "docs" / "settings.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```toml\n(.*?)```", readme, re.S)
    assert len(blocks) == 1, "expected one ```toml example in docs/settings.md"
    f = tmp_path / "pool.toml"
    f.write_text(blocks[0], encoding="utf-8")
    cfg = pool_config(f, limit=lambda: 8 << 30)
    assert cfg.models["sft"].path == str(tmp_path / "bundles" / "cosyvoice-300m-sft")
    assert cfg.tenants["acme"].quota.max_concurrent == 4 and cfg.memory_budget == 6 << 30
    raw = tomllib.loads(blocks[0])
    pool_keys = {s.key for s in declared() if s.key}
    assert set(raw["pool"]) == pool_keys
    assert set().union(*(set(m) for m in raw["models"].values())) == poolfile.MODEL_KEYS
    assert set().union(*(set(t) for t in raw["tenants"].values())) == poolfile.TENANT_KEYS
    for keys in (pool_keys, poolfile.MODEL_KEYS, poolfile.TENANT_KEYS):
        for key in keys:
            assert f"`{key}`" in readme, f"docs/settings.md does not list the pool config key {key!r}"


def test_a_models_load_table_takes_the_chunk_policy(tmp_path: Path) -> None:
    """If this fails, a pool file cannot give one model the reference chunks and another a longer first hop (the
    setting's name, first_hop_tokens, must reach RuntimeOptions as first_hop), or a bad hop is taken silently."""
    from cosyserve.runtime import RuntimeOptions

    text = "[models.a]\npath='x'\nload={chunk_policy='reference'}\n[models.b]\npath='y'\nload={first_hop_tokens=30}\n"
    cfg = pool_config(write(tmp_path, text))
    assert dict(cfg.models["a"].load_options) == {"chunk_policy": "reference"}
    assert dict(cfg.models["b"].load_options) == {"first_hop": 30}
    assert RuntimeOptions(**cfg.models["b"].load_options).first_hop == 30
    with pytest.raises(SettingsError, match=r"\[models.a\] load.chunk_policy = 'fastest'"):
        pool_config(write(tmp_path, "[models.a]\npath='x'\nload={chunk_policy='fastest'}\n"))
