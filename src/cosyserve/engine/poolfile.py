"""The pool config file's models and tenants, and the :class:`ModelPool` built from them.

The file's ``[pool]`` values are settings (declared in :mod:`cosyserve.core.settings` with their environment
variables, which win over the file; read by :meth:`~cosyserve.core.settings.Settings.load`). This module reads the
``[models.NAME]`` and ``[tenants.NAME]`` tables, with those settings as each model's defaults, and adds the models
given with ``--model`` (preloaded) with the very same defaults. Errors name the file, the table, the key and the
value.

Example::

    [pool]
    memory_budget = "75%"        # bytes (int), "4GiB", "512MB", or a percentage of the memory limit
    pressure_threshold = 0.8     # evict idle models when memory in use / limit goes above this
    lru_k = 2
    instances = 1                # default prewarmed instances per model (env MODEL_POOL_SIZE)
    batch_size = 4               # default requests per instance at once, LM batched (env COSYSERVE_BATCH_SIZE;
                                 # unset: the family's, 8 for CosyVoice2/3, 4 for CosyVoice-300M)
    queue_limit = 16             # default waiting requests per model
    idle_ttl_s = 600             # default idle TTL (omit: never)
    torch_threads = 2            # torch threads per request (unset: shared among the running requests)

    [models.sft]
    path = "bundles/cosyvoice-300m-sft"    # relative to this file
    policy = "preload"                     # or "lazy"
    pinned = true
    instances = 2
    load = { verify = "stamp" }            # this model's own loading settings (cosyserve.load options)
    voices = { alloy = "英文女", onyx = "中文男" }   # OpenAI voice names -> this model's voices (default rule:
                                           # cosyserve.engine.voicemap; the others keep it)

    [tenants.acme]
    models = ["sft"]
    max_models = 2
    max_memory = "2GiB"
    max_concurrent = 4

``MODEL_POOL_SIZE`` and ``COSYSERVE_BATCH_SIZE`` (or the same settings given as flags) also win over a model's own
``instances`` and ``batch_size``; the other settings are defaults that a model's own key overrides.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cosyserve.core.casts import Int, parse_size
from cosyserve.core.errors import SettingsError
from cosyserve.core.settings import ModelArg, Settings, parse_setting
from cosyserve.engine.entries import ModelSpec
from cosyserve.engine.pool import ModelPool
from cosyserve.engine.quotas import Tenant, TenantQuota
from cosyserve.engine.voicemap import OPENAI_VOICES, is_openai_voice
from cosyserve.system.pagecache import memory_limit_bytes

__all__ = [
    "LOAD_KEYS",
    "MODEL_KEYS",
    "PoolConfig",
    "TENANT_KEYS",
    "build_pool",
    "load_pool_config",
    "parse_bytes",
]

# a model's own keys; those that are also [pool] keys are parsed as those settings are
MODEL_KEYS = frozenset(
    {
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
        "runtime",
        "voices",
    }
)
TENANT_KEYS = frozenset({"models", "max_models", "max_memory", "max_concurrent"})
# the loading settings a model may set for itself in its `load` table (passed to cosyserve.load)
LOAD_KEYS = frozenset(
    {"strategy", "verify", "use_mmap", "threads", "warmup_tokens"}
    | {
        "llm_dtype",
        "flow_dtype",
        "hift_dtype",
        "llm_quantize",
        "llm_gemm",
        "flow_steps",
        "flow_context_seconds",
    }
    | {"chunk_policy", "first_hop_tokens"}
)
# load keys named as their setting where the RuntimeOptions field has another name
_LOAD_FIELD = {"first_hop_tokens": "first_hop"}
# settings that, given as a flag or variable, win over a model's own key too
_OVERRIDE_MODELS = ("instances", "batch_size")


@dataclass(frozen=True)
class PoolConfig:
    """What :func:`build_pool` needs: the models, the tenants and the pool-wide settings."""

    models: dict[str, ModelSpec] = field(default_factory=dict)
    tenants: dict[str, Tenant] = field(default_factory=dict)
    memory_budget: int | None = None
    pressure_threshold: float | None = 0.8
    lru_k: int = 2
    torch_threads: int | None = None
    housekeeping_interval_s: float = 1.0
    release_timeout_s: float = 30.0
    source: str = "<defaults>"


def parse_bytes(value: Any, where: str, limit: Callable[[], int] = memory_limit_bytes) -> int:
    """Bytes from an int, ``"4GiB"``/``"512MB"``/``"1.5G"``, or ``"60%"`` of ``limit()``.

    Args:
        value: the size as given.
        where: the file and key (or variable) it comes from, for errors.
        limit: the memory limit a percentage is of.
    Returns:
        Bytes.
    Raises:
        SettingsError: ``"{where} = {value!r}: ..."`` saying what is accepted.
    """
    try:
        size = parse_size(value)
    except ValueError as e:
        raise SettingsError(f"{where} = {value!r}: {e}") from None
    return int(limit() * float(size[:-1]) / 100) if isinstance(size, str) else size


class _Tables:
    """Reads one file's tables; every error starts with the file as given."""

    def __init__(self, source: str, limit: Callable[[], int]) -> None:
        self.source = source
        self.limit = limit

    def fail(self, where: str, msg: str) -> SettingsError:
        return SettingsError(f"{self.source}: {where}: {msg}")

    def table(self, value: Any, where: str, keys: frozenset[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(where, f"expected a table, got {value!r}")
        unknown = sorted(set(value) - keys)
        if unknown:
            raise self.fail(where, f"unknown key {unknown[0]!r}; expected one of {', '.join(sorted(keys))}")
        return value

    def setting(self, table: dict[str, Any], key: str, prefix: str) -> Any:
        """``table[key]`` parsed as the setting of that name is (the same type, range and choices)."""
        return parse_setting(key, table[key], f"{self.source}: {prefix}{key} = {table[key]!r}")

    def int_(self, table: dict[str, Any], key: str, where: str) -> int:
        try:
            return Int(1)(table[key])
        except ValueError as e:
            raise SettingsError(f"{self.source}: {where} {key} = {table[key]!r}: {e}") from None

    def bool_(self, table: dict[str, Any], key: str, where: str, default: bool) -> bool:
        value = table.get(key, default)
        if not isinstance(value, bool):
            raise SettingsError(f"{self.source}: {where} {key} = {value!r}: expected true or false")
        return value

    def voices(self, value: Any, where: str) -> dict[str, str]:
        """A model's ``voices`` table: OpenAI voice names (any case) -> a voice name of the model's."""
        table = self.table(value, where, frozenset(value) if isinstance(value, dict) else frozenset())
        out = {}
        for key, voice in table.items():
            if not is_openai_voice(key):
                raise self.fail(
                    where, f"{key!r} is not an OpenAI voice name; expected one of {', '.join(OPENAI_VOICES)}"
                )
            if not isinstance(voice, str) or not voice or voice != voice.strip():
                raise self.fail(where, f"{key} = {voice!r}: expected the name of one of the model's voices")
            out[key.lower()] = voice
        return out

    def bytes_(self, table: dict[str, Any], key: str, where: str) -> int:
        return parse_bytes(table[key], f"{self.source}: {where} {key}", self.limit)


def load_pool_config(
    settings: Settings, *, preload: Iterable[ModelArg] = (), limit: Callable[[], int] = memory_limit_bytes
) -> PoolConfig:
    """The pool's models and tenants from the settings' pool config file, plus ``preload`` models.

    Args:
        settings: the settings; their pool values are the defaults of every model, their ``pool_file`` holds
            the tables (none: no file).
        preload: models given on the command line (``--model``): preloaded, with the same defaults as the
            file's models.
        limit: the memory limit percentages are of (the cgroup's, else physical memory).
    Returns:
        A :class:`PoolConfig`.
    Raises:
        SettingsError: a bad table, key or value (named with its file, table and key), or a ``preload`` model
            whose name the file already uses.
    """
    pf = settings.pool_file
    r = _Tables(pf.source if pf is not None else "<defaults>", limit)
    budget = settings.memory_budget
    if isinstance(budget, str):  # a percentage of the memory limit
        budget = parse_bytes(budget, settings.where("memory_budget"), limit)
    overridden = {k for k in _OVERRIDE_MODELS if settings.origin(k) in ("flag", "env", "override")}

    def spec(name: str, m: dict[str, Any], path: str, policy: Any) -> ModelSpec:
        w = f"[models.{name}]"
        if policy not in ("preload", "lazy"):
            raise r.fail(w, f'policy = {policy!r}: expected "preload" or "lazy"')
        load = r.table(m.get("load", {}), f"{w} load", LOAD_KEYS)

        def own(key: str) -> Any:  # the model's own value, else the setting
            if key in m and key not in overridden:
                return r.setting(m, key, f"{w} ")
            return getattr(settings, key)

        return ModelSpec(
            name=name,
            path=path,
            policy=policy,
            pinned=r.bool_(m, "pinned", w, False),
            idle_ttl_s=own("idle_ttl_s"),
            instances=own("instances"),
            batch_size=own("batch_size"),
            queue_limit=own("queue_limit"),
            size_bytes=r.bytes_(m, "size_bytes", w) if "size_bytes" in m else None,
            warmup=r.bool_(m, "warmup", w, True),
            reload_warmup=r.bool_(m, "reload_warmup", w, False),
            load_options={_LOAD_FIELD.get(k, k): r.setting(load, k, f"{w} load.") for k in load},
            runtime=own("runtime"),
            voices=r.voices(m.get("voices", {}), f"{w} voices"),
        )

    models: dict[str, ModelSpec] = {}
    for name, m in (pf.models if pf is not None else {}).items():
        w = f"[models.{name}]"
        m = r.table(m, w, MODEL_KEYS)
        if not isinstance(m.get("path"), str) or not m["path"]:
            raise r.fail(w, f"path = {m.get('path')!r}: expected the bundle or model directory (a string)")
        mpath = Path(m["path"]).expanduser()
        if not mpath.is_absolute():
            mpath = pf.base / mpath  # type: ignore[union-attr]
        models[name] = spec(name, m, str(mpath), m.get("policy", "lazy"))
    for arg in preload:
        if arg.name in models:
            raise SettingsError(
                f"{settings.where('models')} {arg.name}={arg.source}: the pool config {r.source} already has a "
                f"model named {arg.name!r}; use NAME=PATH to serve it under another name"
            )
        models[arg.name] = spec(arg.name, {}, arg.source, "preload")

    tenants: dict[str, Tenant] = {}
    for name, t in (pf.tenants if pf is not None else {}).items():
        w = f"[tenants.{name}]"
        t = r.table(t, w, TENANT_KEYS)
        tm = t.get("models")
        if not isinstance(tm, list) or not all(isinstance(x, str) for x in tm) or not tm:
            raise r.fail(w, f"models = {tm!r}: expected a non-empty list of model names")
        for x in tm:
            if x not in models:
                raise r.fail(w, f"models: unknown model {x!r}; defined: {', '.join(models) or 'none'}")
        quota = TenantQuota(
            max_models=r.int_(t, "max_models", w) if "max_models" in t else None,
            max_memory_bytes=r.bytes_(t, "max_memory", w) if "max_memory" in t else None,
            max_concurrent=r.int_(t, "max_concurrent", w) if "max_concurrent" in t else None,
        )
        tenants[name] = Tenant(name, frozenset(tm), quota)
    return PoolConfig(
        models,
        tenants,
        budget,
        settings.pressure_threshold,
        settings.lru_k,
        settings.torch_threads,
        settings.housekeeping_interval_s,
        settings.release_timeout_s,
        r.source,
    )


def build_pool(cfg: PoolConfig, runtime_options: Any = None, **kwargs: Any) -> ModelPool:
    """A :class:`ModelPool` from a :class:`PoolConfig`.

    Args:
        cfg: the models, tenants and pool-wide settings.
        runtime_options: how every model loads and serves (a :class:`cosyserve.runtime.RuntimeOptions`, e.g.
            ``RuntimeOptions.from_settings(settings)``); the pool's ``torch_threads`` sets its ``worker_threads``.
        kwargs: more :class:`ModelPool` arguments (``load_model``, ``memory_probe``, ``clock``, ...).
    Returns:
        The pool (nothing loaded yet).
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
