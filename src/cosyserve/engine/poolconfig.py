"""The pool's configuration: one TOML file plus environment overrides, validated with errors that name the
file, the key and the value.

Example::

    [pool]
    memory_budget = "75%"        # bytes (int), "4GiB", "512MB", or a percentage of the memory limit
    pressure_threshold = 0.8     # evict idle models when memory in use / limit goes above this
    lru_k = 2
    instances = 1                # default prewarmed instances per model (env MODEL_POOL_SIZE)
    batch_size = 1               # default requests per instance at once, LM batched (env COSYSERVE_BATCH_SIZE)
    queue_limit = 16             # default waiting requests per model
    idle_ttl_s = 600             # default idle TTL (omit: never)
    torch_threads = 1            # torch threads per worker

    [models.sft]
    path = "bundles/cosyvoice-300m-sft"    # relative to this file
    policy = "preload"                     # or "lazy"
    pinned = true
    instances = 2
    load = { verify = "stamp" }            # extra cosyserve.load options

    [tenants.acme]
    models = ["sft"]
    max_models = 2
    max_memory = "2GiB"
    max_concurrent = 4

Environment overrides (win over the file): ``COSYSERVE_POOL_CONFIG`` (the file, when none is given),
``MODEL_POOL_SIZE`` (pool.instances), ``COSYSERVE_BATCH_SIZE`` (pool.batch_size), ``COSYSERVE_MEMORY_BUDGET``,
``COSYSERVE_MEMORY_PRESSURE``, ``COSYSERVE_LRU_K``, ``COSYSERVE_QUEUE_LIMIT``, ``COSYSERVE_IDLE_TTL``,
``COSYSERVE_WORKER_THREADS``.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cosyserve.engine.pool import ModelPool, ModelSpec, memory_limit_bytes
from cosyserve.engine.quotas import Tenant, TenantQuota

__all__ = ["PoolConfig", "PoolConfigError", "build_pool", "load_pool_config", "parse_bytes"]


class PoolConfigError(ValueError):
    """A pool configuration value cosyserve cannot use; the message names the file (or variable) and key."""


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Any, where: str, limit: Callable[[], int] = memory_limit_bytes) -> int:
    """Bytes from an int, ``"4GiB"``/``"512MB"``/``"1.5G"``, or ``"60%"`` of ``limit()``.

    Raises:
        PoolConfigError: naming ``where`` and the value.
    """
    if isinstance(value, bool):
        raise PoolConfigError(f'{where} = {value!r}: expected bytes (e.g. 4294967296, "4GiB" or "60%")')
    if isinstance(value, int):
        if value < 1:
            raise PoolConfigError(f"{where} = {value!r}: must be > 0")
        return value
    if isinstance(value, str):
        v = value.strip()
        if v.endswith("%"):
            try:
                pct = float(v[:-1])
            except ValueError:
                pct = -1.0
            if not 0 < pct <= 100:
                raise PoolConfigError(f"{where} = {value!r}: a percentage must be in (0, 100]")
            return int(limit() * pct / 100)
        m = _SIZE.match(v)
        if m and m.group(2).lower() in _UNITS:
            n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
            if n >= 1:
                return n
    raise PoolConfigError(
        f'{where} = {value!r}: expected bytes as an integer, a size like "4GiB" / "512MB", '
        f'or a percentage of the memory limit like "60%"'
    )


@dataclass(frozen=True)
class PoolConfig:
    models: dict[str, ModelSpec] = field(default_factory=dict)
    tenants: dict[str, Tenant] = field(default_factory=dict)
    memory_budget: int | None = None
    pressure_threshold: float | None = 0.8
    lru_k: int = 2
    torch_threads: int | None = 1
    housekeeping_interval_s: float = 1.0
    release_timeout_s: float = 30.0
    source: str = "<defaults>"


_POOL_KEYS = {
    "memory_budget",
    "pressure_threshold",
    "lru_k",
    "instances",
    "batch_size",
    "queue_limit",
    "idle_ttl_s",
    "torch_threads",
    "housekeeping_interval_s",
    "release_timeout_s",
}
_MODEL_KEYS = {
    "path",
    "policy",
    "pinned",
    "idle_ttl_s",
    "instances",
    "batch_size",
    "queue_limit",
    "size_bytes",
    "warmup",
    "reload_warmup",
    "load",
}
_TENANT_KEYS = {"models", "max_models", "max_memory", "max_concurrent"}
_LOAD_KEYS = {"strategy", "verify", "use_mmap", "threads", "warmup_tokens"}


class _Reader:
    def __init__(self, source: str, limit: Callable[[], int]) -> None:
        self.source = source
        self.limit = limit

    def fail(self, where: str, msg: str) -> PoolConfigError:
        return PoolConfigError(f"{self.source}: {where}: {msg}")

    def table(self, value: Any, where: str, keys: set[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(where, f"expected a table, got {value!r}")
        unknown = sorted(set(value) - keys)
        if unknown:
            raise self.fail(where, f"unknown key {unknown[0]!r}; expected one of {', '.join(sorted(keys))}")
        return value

    def int_(self, value: Any, where: str, minimum: int = 1) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(where, f"{value!r}: expected an integer >= {minimum}")
        return value

    def float_(self, value: Any, where: str, lo: float, hi: float | None = None) -> float:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or value <= lo
            or (hi and value > hi)
        ):
            rng = f"in ({lo}, {hi}]" if hi else f"> {lo}"
            raise self.fail(where, f"{value!r}: expected a number {rng}")
        return float(value)

    def bool_(self, value: Any, where: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(where, f"{value!r}: expected true or false")
        return value

    def bytes_(self, value: Any, where: str) -> int:
        try:
            return parse_bytes(value, where, self.limit)
        except PoolConfigError as e:
            raise PoolConfigError(f"{self.source}: {e}") from None


def _env(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name)
    return raw if raw is not None and raw.strip() != "" else None


def load_pool_config(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    limit: Callable[[], int] = memory_limit_bytes,
) -> PoolConfig:
    """Read the pool configuration from ``path`` (or ``COSYSERVE_POOL_CONFIG``), then apply env overrides.

    Returns:
        A :class:`PoolConfig` (no models if there is no file).
    Raises:
        PoolConfigError: a missing or malformed file, an unknown key, or a bad value (named with its file/key
            or environment variable).
    """
    env = os.environ if env is None else env
    if path is None and _env(env, "COSYSERVE_POOL_CONFIG"):
        path = env["COSYSERVE_POOL_CONFIG"]
    raw: dict[str, Any] = {}
    base = Path.cwd()
    source = "<defaults>"
    if path is not None:
        p = Path(path)
        source = str(p)
        try:
            raw = tomllib.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise PoolConfigError(f"pool config file not found: {p}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise PoolConfigError(f"cannot read pool config {p}: {e}") from e
        except tomllib.TOMLDecodeError as e:
            raise PoolConfigError(f"{p}: not valid TOML: {e}") from e
        base = p.resolve().parent
    r = _Reader(source, limit)
    r.table(raw, "top level", {"pool", "models", "tenants"})
    pool = r.table(raw.get("pool", {}), "[pool]", _POOL_KEYS)

    # environment overrides, read with the variable's name in every error
    overrides: dict[str, tuple[str, Any]] = {}
    for var, key, cast in (
        ("MODEL_POOL_SIZE", "instances", int),
        ("COSYSERVE_BATCH_SIZE", "batch_size", int),
        ("COSYSERVE_MEMORY_BUDGET", "memory_budget", None),
        ("COSYSERVE_MEMORY_PRESSURE", "pressure_threshold", float),
        ("COSYSERVE_LRU_K", "lru_k", int),
        ("COSYSERVE_QUEUE_LIMIT", "queue_limit", int),
        ("COSYSERVE_IDLE_TTL", "idle_ttl_s", float),
        ("COSYSERVE_WORKER_THREADS", "torch_threads", int),
    ):
        v = _env(env, var)
        if v is None:
            continue
        if cast is None:
            overrides[key] = (var, v.strip())
            continue
        try:
            overrides[key] = (var, cast(v))
        except ValueError:
            raise PoolConfigError(
                f"{var}={v!r}: expected {'an integer' if cast is int else 'a number'}"
            ) from None
    pool = dict(pool)
    env_reader = {}
    for key, (var, value) in overrides.items():
        pool[key] = value
        env_reader[key] = _Reader(f"environment {var}", limit)

    def rd(key: str) -> _Reader:
        return env_reader.get(key, r)

    budget = None
    if "memory_budget" in pool:
        budget = rd("memory_budget").bytes_(pool["memory_budget"], "[pool] memory_budget")
    threshold = 0.8
    if "pressure_threshold" in pool:
        threshold = rd("pressure_threshold").float_(
            pool["pressure_threshold"], "[pool] pressure_threshold", 0.0, 1.0
        )
    lru_k = rd("lru_k").int_(pool.get("lru_k", 2), "[pool] lru_k")
    d_instances = rd("instances").int_(pool.get("instances", 1), "[pool] instances")
    d_batch = rd("batch_size").int_(pool.get("batch_size", 1), "[pool] batch_size")
    d_queue = rd("queue_limit").int_(pool.get("queue_limit", 16), "[pool] queue_limit", minimum=0)
    d_ttl = None
    if "idle_ttl_s" in pool:
        d_ttl = rd("idle_ttl_s").float_(pool["idle_ttl_s"], "[pool] idle_ttl_s", 0.0)
    threads = rd("torch_threads").int_(pool.get("torch_threads", 1), "[pool] torch_threads")
    hk = r.float_(pool.get("housekeeping_interval_s", 1.0), "[pool] housekeeping_interval_s", 0.0)
    rel = r.float_(pool.get("release_timeout_s", 30.0), "[pool] release_timeout_s", 0.0)

    models: dict[str, ModelSpec] = {}
    mtab = raw.get("models", {})
    if not isinstance(mtab, dict):
        raise r.fail("[models]", f"expected a table of models, got {mtab!r}")
    for name, m in mtab.items():
        w = f"[models.{name}]"
        m = r.table(m, w, _MODEL_KEYS)
        if "path" not in m or not isinstance(m["path"], str) or not m["path"]:
            raise r.fail(w, f"path = {m.get('path')!r}: expected the bundle or model directory (a string)")
        mpath = Path(m["path"]).expanduser()
        if not mpath.is_absolute():
            mpath = base / mpath
        policy = m.get("policy", "lazy")
        if policy not in ("preload", "lazy"):
            raise r.fail(w, f'policy = {policy!r}: expected "preload" or "lazy"')
        load = r.table(m.get("load", {}), f"{w} load", _LOAD_KEYS)
        models[name] = ModelSpec(
            name=name,
            path=str(mpath),
            policy=policy,
            pinned=r.bool_(m.get("pinned", False), f"{w} pinned"),
            idle_ttl_s=r.float_(m["idle_ttl_s"], f"{w} idle_ttl_s", 0.0) if "idle_ttl_s" in m else d_ttl,
            instances=(
                r.int_(m["instances"], f"{w} instances")
                if "instances" in m and "instances" not in overrides
                else d_instances
            ),
            batch_size=(
                r.int_(m["batch_size"], f"{w} batch_size")
                if "batch_size" in m and "batch_size" not in overrides
                else d_batch
            ),
            queue_limit=r.int_(m["queue_limit"], f"{w} queue_limit", 0) if "queue_limit" in m else d_queue,
            size_bytes=r.bytes_(m["size_bytes"], f"{w} size_bytes") if "size_bytes" in m else None,
            warmup=r.bool_(m.get("warmup", True), f"{w} warmup"),
            reload_warmup=r.bool_(m.get("reload_warmup", False), f"{w} reload_warmup"),
            load_options=dict(load),
        )

    tenants: dict[str, Tenant] = {}
    ttab = raw.get("tenants", {})
    if not isinstance(ttab, dict):
        raise r.fail("[tenants]", f"expected a table of tenants, got {ttab!r}")
    for name, t in ttab.items():
        w = f"[tenants.{name}]"
        t = r.table(t, w, _TENANT_KEYS)
        tm = t.get("models")
        if not isinstance(tm, list) or not all(isinstance(x, str) for x in tm) or not tm:
            raise r.fail(w, f"models = {tm!r}: expected a non-empty list of model names")
        for x in tm:
            if x not in models:
                raise r.fail(w, f"models: unknown model {x!r}; defined: {', '.join(models) or 'none'}")
        quota = TenantQuota(
            max_models=r.int_(t["max_models"], f"{w} max_models") if "max_models" in t else None,
            max_memory_bytes=r.bytes_(t["max_memory"], f"{w} max_memory") if "max_memory" in t else None,
            max_concurrent=r.int_(t["max_concurrent"], f"{w} max_concurrent")
            if "max_concurrent" in t
            else None,
        )
        tenants[name] = Tenant(name, frozenset(tm), quota)
    return PoolConfig(models, tenants, budget, threshold, lru_k, threads, hk, rel, source)


def build_pool(cfg: PoolConfig, runtime_options: Any = None, **kwargs: Any) -> ModelPool:
    """A :class:`ModelPool` from a :class:`PoolConfig` (``kwargs`` go to the pool: loader, probe, clock...).

    ``runtime_options`` (a :class:`cosyserve.runtime.RuntimeOptions`) are how every model loads; the pool
    config's ``torch_threads`` sets their ``worker_threads``.
    """
    import dataclasses

    from cosyserve.runtime import RuntimeOptions

    options = dataclasses.replace(runtime_options or RuntimeOptions(), worker_threads=cfg.torch_threads)
    return ModelPool(
        cfg.models.values(),
        memory_budget=cfg.memory_budget,
        pressure_threshold=cfg.pressure_threshold,
        lru_k=cfg.lru_k,
        tenants=cfg.tenants.values(),
        runtime_options=options,
        release_timeout_s=cfg.release_timeout_s,
        **kwargs,
    )
