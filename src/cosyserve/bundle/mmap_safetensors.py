"""Map a safetensors file into memory and view its tensors without copying.

The format is 8 bytes of little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}}``,
then the raw data. We map the whole file copy-on-write (``MAP_PRIVATE``: pages stay shared with the page cache
until written, which we never do) and build each tensor with ``torch.frombuffer`` on its byte range, so opening
a file costs microseconds whatever its size, and pages are read from disk only when a kernel touches them.
The header is checked against the file before any tensor is made: a truncated or inconsistent file is refused.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cosyserve.core.errors import BundleError
from cosyserve.system import pagecache

__all__ = ["DTYPES", "MappedFile", "TensorInfo", "read_header"]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


def read_header(
    path: Path, file_size: int | None = None
) -> tuple[dict[str, TensorInfo], dict[str, str], int]:
    """Parse and check a safetensors header. Returns (tensors, metadata, data start offset)."""
    size = os.path.getsize(path) if file_size is None else file_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise BundleError(f"{path}: truncated ({size} bytes): no safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise BundleError(
                f"{path}: header length {n} does not fit the file ({size} bytes): truncated or corrupt"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{path}: header is not valid JSON: corrupt file") from e
    if not isinstance(header, dict):
        raise BundleError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    start = 8 + n
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype, shape, (b, e) = (
                entry["dtype"],
                tuple(int(s) for s in entry["shape"]),
                entry["data_offsets"],
            )
        except (KeyError, TypeError, ValueError) as err:
            raise BundleError(f"{path}: tensor {name!r} has a malformed header entry") from err
        if dtype not in DTYPES:
            raise BundleError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * DTYPES[dtype].itemsize
        if not (0 <= b <= e) or e - b != nbytes:
            raise BundleError(
                f"{path}: tensor {name!r}: {e - b} bytes stored, {nbytes} expected for {dtype}{list(shape)}"
            )
        if start + e > size:
            raise BundleError(
                f"{path}: tensor {name!r} ends at byte {start + e}, past the end of the file ({size}): truncated"
            )
        tensors[name] = TensorInfo(dtype, shape, start + b, start + e)
    return tensors, metadata, start


class MappedFile:
    """One safetensors file mapped copy-on-write; tensors are zero-copy views of the mapping.

    The mapping lives as long as any tensor made from it (torch keeps the buffer alive).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.size = os.path.getsize(self.path)
        except OSError as e:
            raise BundleError(f"cannot open bundle file {self.path}: {e}") from e
        self.tensors, self.metadata, self.data_start = read_header(self.path, self.size)
        with open(self.path, "rb") as f:
            # ACCESS_COPY = MAP_PRIVATE|PROT_WRITE: torch.frombuffer wants a writable buffer; nothing writes to it,
            # so no page is ever copied and all of them stay shared with the page cache (and across fork).
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if self.size else None

    def tensor(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        dtype = DTYPES[info.dtype]
        numel = (info.end - info.begin) // dtype.itemsize
        if numel == 0:
            return torch.empty(info.shape, dtype=dtype)
        t = torch.frombuffer(self._mm, dtype=dtype, count=numel, offset=info.begin)
        return t.view(info.shape)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: self.tensor(name) for name in self.tensors}

    def advise(self, advice: int, begin: int = 0, length: int = 0) -> None:
        """``madvise`` on ``length`` bytes of the mapping from ``begin`` (0: to the end), e.g. ``mmap.MADV_WILLNEED``
        to start readahead (:func:`cosyserve.system.pagecache.madvise`)."""
        if self._mm is not None:
            pagecache.madvise(self._mm, advice, begin, begin + length if length else self.size)

    def spans(self, row_tables: Collection[str] = ()) -> list[tuple[int, int, bool]]:
        """The file as page-aligned ``(begin, end, mapped)`` spans: ``mapped`` False for the pages that lie wholly
        inside a tensor named in ``row_tables``, True for the rest."""
        page = mmap.PAGESIZE
        holes = sorted(
            (-(-info.begin // page) * page, info.end // page * page)
            for name, info in self.tensors.items()
            if name in row_tables
        )
        out: list[tuple[int, int, bool]] = []
        pos = 0
        for begin, end in holes:
            if end <= begin:
                continue
            if begin > pos:
                out.append((pos, begin, True))
            out.append((begin, end, False))
            pos = end
        if pos < self.size:
            out.append((pos, self.size, True))
        return out

    def populate(self, row_tables: Collection[str] = ()) -> None:
        """Map every page of the file into this process now, without copying (:func:`cosyserve.system.pagecache.populate`:
        page-cache hits become mapped pages, misses are read from disk, with the GIL released).

        Tensors named in ``row_tables`` (embedding tables, read a row at a time) are read into the page cache
        but not mapped: a request faults in the rows it uses (a minor fault per page), and the rows no request
        uses (most of a text vocabulary) cost no memory here."""
        if self._mm is None:
            return
        for begin, end, mapped in self.spans(row_tables):
            if mapped:
                pagecache.populate(self._mm, begin, end)
            else:
                self._cache(begin, end)

    def _cache(self, begin: int, end: int, block: int = 8 << 20) -> None:
        # read the pages of [begin, end) that are not in the page cache (the usual warm start reads nothing)
        assert self._mm is not None
        missing = pagecache.missing_ranges(pagecache.resident_map(self._mm, begin, end), begin, end)
        pagecache.read_ranges(((self.path, b, e) for b, e in missing), block=block)

    def touch(self, begin: int = 0, end: int | None = None) -> int:
        """Fault the pages of ``[begin, end)`` in (:func:`cosyserve.system.pagecache.touch`); returns bytes covered."""
        return 0 if self._mm is None else pagecache.touch(self._mm, begin, end)

    def info(self) -> dict[str, Any]:
        return {"path": str(self.path), "bytes": self.size, "tensors": len(self.tensors)}
