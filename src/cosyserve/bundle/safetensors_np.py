"""A safetensors file read with numpy alone (no torch): its tensors as read-only arrays over one mapping of the file
(no copy) and its metadata. The lite runtime reads its tables and speakers with it, and a lite model's stored voice
states (:mod:`cosyserve.voices.voicestates`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from cosyserve.core.errors import BundleError

__all__ = ["map_safetensors", "safetensors_metadata"]

_NP_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}
_FIX = "convert again with --runtime lite"


def _header(path: Path, fix: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise BundleError(f"{path}: cannot read it as safetensors ({e}); {fix}") from e
    if not isinstance(header, dict):
        raise BundleError(f"{path}: its safetensors header is not a JSON object; {fix}")
    header["__size__"] = 8 + n
    return header


def safetensors_metadata(path: Path, fix: str = _FIX) -> dict[str, str]:
    """A safetensors file's string metadata (its header's ``__metadata__``; empty without one)."""
    return dict(_header(path, fix).get("__metadata__") or {})


def map_safetensors(path: Path, fix: str = _FIX) -> dict[str, np.ndarray]:
    """A safetensors file's tensors as read-only numpy arrays over one mapping of the file (no copy).

    Args:
        path: the file.
        fix: what a message about a file that does not read as safetensors tells the user to do.
    Raises:
        BundleError: the file is unreadable, or a tensor does not fit its header or has a dtype numpy lacks.
    """
    header = _header(path, fix)
    base = header.pop("__size__")
    header.pop("__metadata__", None)
    try:
        mm = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:
        raise BundleError(f"{path}: cannot read it as safetensors ({e}); {fix}") from e
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if info.get("dtype") not in _NP_DTYPES:
            raise BundleError(
                f"{path}: tensor {name!r} has dtype {info.get('dtype')!r}, not one of numpy's; {fix}"
            )
        dtype = np.dtype(_NP_DTYPES[info["dtype"]])
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - begin != dtype.itemsize * int(np.prod(shape, dtype=np.int64)) or base + end > mm.size:
            raise BundleError(f"{path}: tensor {name!r} does not fit its header; {fix}")
        out[name] = np.ndarray(shape, dtype=dtype, buffer=mm, offset=base + begin)
    return out
