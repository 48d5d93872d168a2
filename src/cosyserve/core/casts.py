"""Casts of setting values: a raw value (a string from a flag or variable, a TOML value, a Python value) -> the
typed value, or ``ValueError`` saying what is accepted. The caller (:func:`cosyserve.core.settings.parse_setting`)
puts where the value came from in front of that message.

A cast is any callable; these are small classes (not dataclasses: each dataclass costs a millisecond at import,
and the CLI imports this module). Casting an already-cast value gives it back unchanged, so a value may pass
through a cast twice (the pool file's per-model ``load`` table, then :func:`cosyserve.load`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cosyserve.core.errors import SettingsError

__all__ = [
    "ApiKeys",
    "Bool",
    "Choice",
    "Device",
    "Float",
    "Folder",
    "Int",
    "LEVELS",
    "ListenUri",
    "LogLevel",
    "Models",
    "NAME",
    "Name",
    "Origins",
    "Size",
    "Text",
    "parse_api_keys",
    "parse_size",
    "split_uri",
]

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # model and tenant names
LEVELS = ("critical", "error", "warning", "info", "debug")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class Int:
    """An integer in ``[lo, hi]`` (``hi`` None: no upper bound)."""

    def __init__(self, lo: int, hi: int | None = None) -> None:
        self.lo, self.hi = lo, hi

    def __call__(self, raw: Any) -> int:
        if self.hi is None:
            expected = out_of_range = f"expected an integer >= {self.lo}"
        else:
            expected = f"expected an integer between {self.lo} and {self.hi}"
            out_of_range = f"must be between {self.lo} and {self.hi}"
        if isinstance(raw, bool) or not isinstance(raw, int | str):
            raise ValueError(expected)
        try:
            v = int(raw)
        except ValueError:
            raise ValueError(expected) from None
        if v < self.lo or (self.hi is not None and v > self.hi):
            raise ValueError(out_of_range)
        return v


class Float:
    """A number in ``[lo, hi]``, or ``(lo, hi]`` with ``open_lo`` (``hi`` None: no upper bound)."""

    def __init__(self, lo: float, hi: float | None = None, *, open_lo: bool = False) -> None:
        self.lo, self.hi, self.open_lo = lo, hi, open_lo

    def __call__(self, raw: Any) -> float:
        if self.open_lo:
            rng = f"in ({self.lo:g}, {self.hi:g}]" if self.hi is not None else f"> {self.lo:g}"
            expected = out_of_range = f"expected a number {rng}"
        elif self.hi is not None:
            expected = f"expected a number between {self.lo:g} and {self.hi:g}"
            out_of_range = f"must be between {self.lo:g} and {self.hi:g}"
        else:
            expected = out_of_range = f"expected a number >= {self.lo:g}"
        if isinstance(raw, bool) or not isinstance(raw, int | float | str):
            raise ValueError(expected)
        try:
            v = float(raw)
        except ValueError:
            raise ValueError(expected) from None
        low_ok = v > self.lo if self.open_lo else v >= self.lo
        if not (low_ok and (self.hi is None or v <= self.hi)):
            raise ValueError(out_of_range)
        return v


class Bool:
    """1/0, true/false, yes/no, on/off (any case), and ``words`` (word -> value)."""

    def __init__(self, words: Mapping[str, bool] | None = None) -> None:
        self.words = dict(words or {})

    def __call__(self, raw: Any) -> bool:
        if isinstance(raw, bool):
            return raw
        v = str(raw).strip().lower()
        if v in self.words:
            return self.words[v]
        if v in _TRUE or v in _FALSE:
            return v in _TRUE
        more = "".join(f", {w}" for w in self.words)
        raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off{more})")


class Choice:
    """One of ``choices`` (any case); with ``booleans`` (what true and false mean) a boolean too."""

    def __init__(self, *choices: str, booleans: tuple[str, str] | None = None) -> None:
        self.choices, self.booleans = choices, booleans

    def __call__(self, raw: Any) -> str:
        v = str(raw).strip().lower()
        if v in self.choices:
            return v
        if self.booleans is not None and (isinstance(raw, bool) or v in _TRUE or v in _FALSE):
            return self.booleans[0] if raw is True or v in _TRUE else self.booleans[1]
        names = ", ".join(self.choices)
        raise ValueError(f"expected one of {names}" + (" or a boolean" if self.booleans else ""))


class Device:
    """A torch device name: ``cpu``, ``cuda`` or ``cuda:N`` (any case), given back in lower case. Only the name is
    checked here; whether the machine has that device is checked once at start (:mod:`cosyserve.system.device`)."""

    def __call__(self, raw: Any) -> str:
        v = str(raw).strip().lower()
        if v in ("cpu", "cuda"):
            return v
        kind, sep, index = v.partition(":")
        if kind == "cuda" and sep and index.isdigit() and index.isascii():
            return f"cuda:{int(index)}"
        raise ValueError("expected cpu, cuda or cuda:N (N: a GPU's index, 0 for the first)")


class Text:
    """A non-empty string, stripped; with ``exact``, a name taken as given: blanks at either end are refused, not
    trimmed (a voice named " x" is not "x")."""

    def __init__(self, exact: bool = False) -> None:
        self.exact = exact

    def __call__(self, raw: Any) -> str:
        v = str(raw).strip()
        if not v:
            raise ValueError("expected a non-empty value")
        if self.exact and v != str(raw):
            raise ValueError("has blanks at its start or end: names are taken exactly as given, remove them")
        return v


class Folder:
    """A folder path (``~`` expanded); blank is refused: it would mean the working directory."""

    def __call__(self, raw: Any) -> Path:
        if not str(raw).strip():
            raise ValueError("set but empty: unset it or give a folder")
        return Path(str(raw).strip()).expanduser()


class LogLevel:
    """A logging level name, lower case: one of ``choices``, or (none given) any name :mod:`logging` knows."""

    def __init__(self, *choices: str) -> None:
        self.choices = choices

    def __call__(self, raw: Any) -> str:
        v = str(raw).strip().lower()
        names = self.choices or tuple(n.lower() for n in logging.getLevelNamesMapping())
        if v not in names:
            raise ValueError(f"unknown level; expected one of {', '.join(self.choices or LEVELS)}")
        return v


class Models:
    """One model (a string) or several (a list): a tuple of non-empty strings."""

    def __call__(self, raw: Any) -> tuple[str, ...]:
        out = tuple(str(m).strip() for m in ([raw] if isinstance(raw, str) else raw))
        if not all(out):
            raise ValueError("empty value; give a bundle, a model dir or NAME=PATH")
        return out


class Origins:
    """Comma-separated CORS origins (``scheme://host[:port]`` or ``*``) -> a tuple."""

    def __call__(self, raw: Any) -> tuple[str, ...]:
        items = raw.split(",") if isinstance(raw, str) else list(raw)
        origins = tuple(str(o).strip() for o in items if str(o).strip())
        for o in origins:
            if o != "*" and not re.match(r"^https?://[^/\s]+$", o):
                raise ValueError(f"{o!r} is not an origin (scheme://host[:port], or *)")
        return origins


class Name:
    """A model or tenant name (:data:`NAME`: a letter or digit, then letters, digits, ``.``, ``_``, ``-``; at most
    64)."""

    def __call__(self, raw: Any) -> str:
        v = str(raw).strip()
        if not NAME.match(v):
            raise ValueError(
                "expected a name of letters, digits, '.', '_' and '-' (at most 64, a letter or digit first)"
            )
        return v


def split_uri(uri: str) -> tuple[str, str, int]:
    """A listening URI as the ``wyoming`` package's servers take it: ``tcp://HOST:PORT`` -> ``("tcp", HOST, PORT)``
    (an IPv6 host in brackets), ``unix://PATH`` -> ``("unix", PATH, 0)``.

    Raises:
        ValueError: another scheme, a tcp URI without its host or port (0 to 65535), a unix URI without a path.
    """
    from urllib.parse import urlsplit

    scheme, sep, rest = uri.partition("://")
    if not sep or scheme.lower() not in ("tcp", "unix"):
        raise ValueError("expected tcp://HOST:PORT or unix://PATH")
    if scheme.lower() == "unix":
        if not rest.strip():
            raise ValueError("expected unix://PATH (a socket file's path)")
        return "unix", rest, 0
    try:
        parts = urlsplit(f"tcp://{rest}")
        port = parts.port
    except ValueError:
        raise ValueError("expected tcp://HOST:PORT with a port from 0 to 65535") from None
    if not parts.hostname or port is None or parts.path not in ("", "/") or parts.query or parts.username:
        raise ValueError("expected tcp://HOST:PORT (e.g. tcp://0.0.0.0:10200)")
    return "tcp", parts.hostname, port


class ListenUri:
    """A listening URI (:func:`split_uri`), kept as given."""

    def __call__(self, raw: Any) -> str:
        v = str(raw).strip()
        split_uri(v)
        return v


class ApiKeys:
    """``key=tenant`` pairs (see :func:`parse_api_keys`) -> {key: tenant}; a mapping is taken as it is."""

    def __call__(self, raw: Any) -> dict[str, str]:
        return dict(raw) if isinstance(raw, Mapping) else _api_keys(str(raw))


class Size:
    """A memory size (see :func:`parse_size`)."""

    def __call__(self, raw: Any) -> int | str:
        return parse_size(raw)


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


def parse_size(value: Any) -> int | str:
    """A memory size: bytes (an int, or ``"4GiB"``/``"512MB"``/``"1.5G"``), or a share of the memory limit.

    Args:
        value: an int, a string with a unit, or a percentage like ``"60%"``.
    Returns:
        The bytes (int), or the percentage as a string like ``"60%"`` (resolved against the memory limit by the
        pool-file reader, :func:`cosyserve.engine.poolfile.parse_bytes`).
    Raises:
        ValueError: saying what is accepted.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError("must be > 0")
        return value
    if isinstance(value, str):
        v = value.strip()
        if v.endswith("%"):
            try:
                pct = float(v[:-1])
            except ValueError:
                pct = -1.0
            if not 0 < pct <= 100:
                raise ValueError("a percentage must be in (0, 100]")
            return f"{pct:g}%"
        m = _SIZE.match(v)
        if m and m.group(2).lower() in _UNITS:
            n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
            if n >= 1:
                return n
    raise ValueError(
        'expected bytes as an integer, a size like "4GiB" / "512MB", or a percentage of the memory limit like "60%"'
    )


def _api_keys(text: str) -> dict[str, str]:
    keys: dict[str, str] = {}
    for n, raw in enumerate(re.split(r"[,\n]", text), 1):
        item = raw.split("#", 1)[0].strip()
        if not item:
            continue
        key, sep, tenant = item.partition("=")
        key, tenant = key.strip(), tenant.strip()
        if not sep or not key or not tenant:
            raise ValueError(f"entry {n} {item[:8]!r}...: expected KEY=TENANT")
        if len(key) < 8:
            raise ValueError(f"entry {n}: API keys must be at least 8 characters")
        if not NAME.match(tenant):
            raise ValueError(f"entry {n}: tenant {tenant!r} is not a valid name")
        if key in keys:
            raise ValueError(f"entry {n}: the same key is listed twice")
        keys[key] = tenant
    return keys


def parse_api_keys(text: str, where: str) -> dict[str, str]:
    """``key=tenant`` pairs separated by commas or newlines (``#`` starts a comment) -> {key: tenant}.

    Args:
        text: the pairs.
        where: the file or variable they come from, for errors (which never repeat a whole key).
    Returns:
        key -> tenant.
    Raises:
        SettingsError: a malformed entry, a key under 8 characters, a bad tenant name or a repeated key.
    """
    try:
        return _api_keys(text)
    except ValueError as e:
        raise SettingsError(f"{where}: {e}") from None
