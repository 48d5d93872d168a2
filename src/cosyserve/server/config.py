"""What `cosyserve serve` runs with: one frozen dataclass built from flags, then the environment.

Every value from outside is checked here, before anything is loaded or any port is opened; a bad one raises
:class:`ServerConfigError` naming the flag or variable, the value and what is accepted.

| variable | meaning | default |
|---|---|---|
| ``COSYSERVE_HOST`` / ``COSYSERVE_PORT`` | where to listen | 127.0.0.1 / 8000 |
| ``COSYSERVE_WORKERS`` | server processes (each loads its models) | 1 |
| ``COSYSERVE_POOL_CONFIG`` | pool config file (TOML: models, tenants, budget) | none |
| ``COSYSERVE_API_KEYS`` | ``key=tenant,key2=tenant2``; when set, requests need ``Authorization: Bearer KEY`` | none |
| ``COSYSERVE_API_KEYS_FILE`` | the same as a file, one ``key=tenant`` per line (``#`` comments) | none |
| ``COSYSERVE_CORS_ORIGINS`` | comma-separated origins allowed by CORS (``*`` for any); off when unset | off |
| ``COSYSERVE_MAX_TEXT_CHARS`` | longest ``input`` / ``tts_text`` accepted | 4096 |
| ``COSYSERVE_MAX_UPLOAD_BYTES`` | largest uploaded prompt/source audio | 16 MiB |
| ``COSYSERVE_REQUEST_TIMEOUT`` | seconds a request may take before it is stopped | 300 |
| ``COSYSERVE_DRAIN_DELAY`` | seconds the port stays open after SIGTERM, answering 503, before it closes | 5 |
| ``COSYSERVE_SHUTDOWN_GRACE`` | seconds in-flight streams get to finish once the port closes; then they are cut | 30 |
| ``COSYSERVE_DEFAULT_VOICE`` | speaker used for OpenAI voice names (alloy, ...) the model does not have | first speaker |

Model-pool variables (``MODEL_POOL_SIZE``, ``COSYSERVE_MEMORY_BUDGET``, ...) are read by
:func:`cosyserve.engine.poolconfig.load_pool_config`, the load variables (``USE_MMAP_LOADING``,
``PREWARM_MODELS``, ``COSYSERVE_PRELOAD``, ...) by :mod:`cosyserve.settings`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cosyserve.hub import is_hub_id

__all__ = ["ModelArg", "ServerConfig", "ServerConfigError", "is_hub_id", "parse_api_keys", "parse_model_arg"]

DEMO_MODEL = "demo"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class ServerConfigError(ValueError):
    """A flag, variable or file value `cosyserve serve` cannot use."""


@dataclass(frozen=True)
class ModelArg:
    """One ``--model``: served as ``name``, from ``source`` (bundle, official dir or hub id)."""

    name: str
    source: str


def parse_model_arg(value: str, where: str = "--model") -> ModelArg:
    """``PATH``, ``HUB/ID`` or ``NAME=SOURCE``; the name defaults to the last path component."""
    value = value.strip()
    if not value:
        raise ServerConfigError(f"{where}: empty value; give a bundle, a model dir or NAME=PATH")
    name, sep, source = value.partition("=")
    if not sep:
        source = value
        name = Path(value.rstrip("/")).name or value
    name, source = name.strip(), source.strip()
    if not _NAME.match(name):
        raise ServerConfigError(
            f"{where}={value!r}: model name {name!r} must be 1-64 letters, digits, '.', '_' or '-'"
        )
    if not source:
        raise ServerConfigError(f"{where}={value!r}: no path after '='")
    return ModelArg(name, source)


def parse_api_keys(text: str, where: str) -> dict[str, str]:
    """``key=tenant`` pairs separated by commas or newlines (``#`` starts a comment) -> {key: tenant}."""
    keys: dict[str, str] = {}
    for n, raw in enumerate(re.split(r"[,\n]", text), 1):
        item = raw.split("#", 1)[0].strip()
        if not item:
            continue
        key, sep, tenant = item.partition("=")
        key, tenant = key.strip(), tenant.strip()
        if not sep or not key or not tenant:
            raise ServerConfigError(f"{where}: entry {n} {item[:8]!r}...: expected KEY=TENANT")
        if len(key) < 8:
            raise ServerConfigError(f"{where}: entry {n}: API keys must be at least 8 characters")
        if not _NAME.match(tenant):
            raise ServerConfigError(f"{where}: entry {n}: tenant {tenant!r} is not a valid name")
        if key in keys:
            raise ServerConfigError(f"{where}: entry {n}: the same key is listed twice")
        keys[key] = tenant
    return keys


@dataclass(frozen=True)
class ServerConfig:
    """Everything `cosyserve serve` needs; build with :meth:`from_args` (flags, then environment)."""

    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    models: tuple[ModelArg, ...] = ()
    pool_config: str | None = None
    api_keys: Mapping[str, str] = field(default_factory=dict)
    cors_origins: tuple[str, ...] = ()
    max_text_chars: int = 4096
    max_upload_bytes: int = 16 << 20
    max_body_bytes: int = 1 << 20
    request_timeout_s: float = 300.0
    drain_delay_s: float = 5.0
    shutdown_grace_s: float = 30.0
    default_voice: str | None = None
    log_level: str = "info"

    @property
    def demo(self) -> bool:
        """No model was given: serve the tiny random-weight demo model."""
        return not self.models and self.pool_config is None

    @classmethod
    def from_args(
        cls,
        *,
        host: str | None = None,
        port: int | None = None,
        workers: int | None = None,
        models: list[str] | None = None,
        pool_config: str | None = None,
        api_keys_file: str | None = None,
        cors_origins: str | None = None,
        max_text_chars: int | None = None,
        max_upload_bytes: int | None = None,
        request_timeout_s: float | None = None,
        drain_delay_s: float | None = None,
        shutdown_grace_s: float | None = None,
        default_voice: str | None = None,
        log_level: str = "info",
        env: Mapping[str, str] | None = None,
    ) -> ServerConfig:
        """Flags win over environment variables; each value is checked and named in errors."""
        env = os.environ if env is None else env

        def pick(flag_value: object, var: str) -> tuple[object, str]:
            """The value and where it came from, for errors: the flag (``--port``) or the variable."""
            if flag_value is not None:
                return flag_value, "--" + var.removeprefix("COSYSERVE_").lower().replace("_", "-")
            raw = env.get(var)
            return (raw if raw is not None and raw.strip() else None), var

        def num(flag_value: object, var: str, cast: type, lo: float, hi: float, default: float) -> float:
            v, where = pick(flag_value, var)
            if v is None:
                return default
            given = f"{where} {v}" if where.startswith("--") else f"{where}={v!r}"
            try:
                x = cast(v)
            except (TypeError, ValueError):
                raise ServerConfigError(
                    f"{given}: expected a{'n integer' if cast is int else ' number'}"
                ) from None
            if not (lo <= x <= hi):
                raise ServerConfigError(f"{given}: must be between {lo:g} and {hi:g}")
            return x

        h, _ = pick(host, "COSYSERVE_HOST")
        model_args = tuple(parse_model_arg(m) for m in (models or []))
        names = [m.name for m in model_args]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ServerConfigError(
                f"--model: name {sorted(dup)[0]!r} given twice; use NAME=PATH to rename one"
            )
        pc, _ = pick(pool_config, "COSYSERVE_POOL_CONFIG")
        keys: dict[str, str] = {}
        kf, kf_where = pick(api_keys_file, "COSYSERVE_API_KEYS_FILE")
        if kf is not None:
            try:
                keys.update(parse_api_keys(Path(str(kf)).read_text(encoding="utf-8"), f"{kf_where} {kf}"))
            except OSError as e:
                raise ServerConfigError(f"{kf_where}: cannot read API keys file {kf}: {e}") from e
        raw_keys = env.get("COSYSERVE_API_KEYS")
        if raw_keys and raw_keys.strip():
            keys.update(parse_api_keys(raw_keys, "COSYSERVE_API_KEYS"))
        co, co_where = pick(cors_origins, "COSYSERVE_CORS_ORIGINS")
        origins = tuple(o.strip() for o in str(co).split(",") if o.strip()) if co is not None else ()
        for o in origins:
            if o != "*" and not re.match(r"^https?://[^/\s]+$", o):
                raise ServerConfigError(f"{co_where}: {o!r} is not an origin (scheme://host[:port], or *)")
        dv, _ = pick(default_voice, "COSYSERVE_DEFAULT_VOICE")
        if log_level not in ("critical", "error", "warning", "info", "debug"):
            raise ServerConfigError(f"--log-level {log_level!r}: expected critical/error/warning/info/debug")
        return cls(
            host=str(h) if h is not None else "127.0.0.1",
            port=int(num(port, "COSYSERVE_PORT", int, 0, 65535, 8000)),
            workers=int(num(workers, "COSYSERVE_WORKERS", int, 1, 64, 1)),
            models=model_args,
            pool_config=str(pc) if pc is not None else None,
            api_keys=keys,
            cors_origins=origins,
            max_text_chars=int(num(max_text_chars, "COSYSERVE_MAX_TEXT_CHARS", int, 1, 1_000_000, 4096)),
            max_upload_bytes=int(
                num(max_upload_bytes, "COSYSERVE_MAX_UPLOAD_BYTES", int, 1024, 1 << 30, 16 << 20)
            ),
            request_timeout_s=num(request_timeout_s, "COSYSERVE_REQUEST_TIMEOUT", float, 0.1, 86400, 300.0),
            drain_delay_s=num(drain_delay_s, "COSYSERVE_DRAIN_DELAY", float, 0, 3600, 5.0),
            shutdown_grace_s=num(shutdown_grace_s, "COSYSERVE_SHUTDOWN_GRACE", float, 0, 3600, 30.0),
            default_voice=str(dv) if dv is not None else None,
            log_level=log_level,
        )
