"""Typed, checked reads of the environment variables cosyserve understands.

Every variable is read through one of these getters, which raise :class:`SettingsError` naming the variable,
the bad value and what is accepted: a typo in a deployment manifest fails the start instead of being ignored.

| variable | meaning | default |
|---|---|---|
| ``COSYSERVE_PRELOAD`` | load strategy: ``preload``/``lazy``/``prefetch``, or a boolean (true = preload) | preload |
| ``USE_MMAP_LOADING`` | map bundle weights (true) or copy them into private memory (false) | true |
| ``PREWARM_MODELS`` | run a warm-up synthesis before READY: boolean, or ``all`` / ``none`` | true |
| ``COSYSERVE_WARMUP_TOKENS`` | speech tokens the warm-up generates (its length) | 2 |
| ``COSYSERVE_VERIFY`` | bundle checksum policy: ``stamp``/``full``/``none`` | stamp |
| ``COSYSERVE_CACHE_DIR`` | where official dirs are converted to bundles | ~/.cache/cosyserve |
| ``COSYSERVE_REGISTRY_DIR`` | registered (zero-shot) voices; set it in deployments: caches get wiped | cache dir/speakers |
| ``COSYSERVE_THREADS`` | torch intra-op threads | torch's default |
| ``COSYSERVE_TEXT_TIER`` | the text tokenizer and wetext's normalisers: ``background`` (built after READY) or ``lazy`` (first request) | background |
| ``COSYSERVE_ZERO_SHOT_TIER`` | ONNX sessions of the zero-shot tier: ``lazy`` (first request that needs them) or ``background`` (created after READY) | lazy |
"""

from __future__ import annotations

import os
from pathlib import Path

from cosyserve.errors import SettingsError

__all__ = ["SettingsError", "cache_dir", "env_bool", "env_choice", "env_int", "load_strategy", "prewarm"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise SettingsError(f"{name}={raw!r}: expected a boolean (1/0, true/false, yes/no, on/off)")


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    v = raw.strip().lower()
    if v not in choices:
        raise SettingsError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
    return v


def env_int(name: str, default: int | None, minimum: int = 1) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        v = int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r}: expected an integer >= {minimum}") from None
    if v < minimum:
        raise SettingsError(f"{name}={raw!r}: expected an integer >= {minimum}")
    return v


def load_strategy(default: str = "preload") -> str:
    """``COSYSERVE_PRELOAD``: a strategy name, or a boolean (true = preload, false = lazy)."""
    raw = os.environ.get("COSYSERVE_PRELOAD")
    if raw is None or raw.strip() == "":
        return default
    v = raw.strip().lower()
    if v in ("preload", "lazy", "prefetch"):
        return v
    if v in _TRUE:
        return "preload"
    if v in _FALSE:
        return "lazy"
    raise SettingsError(f"COSYSERVE_PRELOAD={raw!r}: expected preload, lazy, prefetch or a boolean")


def prewarm(default: bool = True) -> bool:
    """``PREWARM_MODELS``: whether to warm up before READY (``all``/``none`` accepted as true/false)."""
    raw = os.environ.get("PREWARM_MODELS")
    if raw is not None and raw.strip().lower() in ("all", "none"):
        return raw.strip().lower() == "all"
    return env_bool("PREWARM_MODELS", default)


def cache_dir() -> Path:
    raw = os.environ.get("COSYSERVE_CACHE_DIR")
    if raw:
        return Path(raw).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cosyserve"
