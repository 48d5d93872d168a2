"""ONNX graphs whose numbers depend on the ONNX Runtime version: ``AveragePool(ceil_mode=1, count_include_pad=1)``.

CAM++ (``campplus.onnx``, the speaker embedding of every prompt-based mode) averages segments of 100 frames with
such nodes (speakerlab's ``avg_pool1d(kernel=stride=100, ceil_mode=True)``). The last, partial window lies partly
past the input: ONNX Runtime up to 1.28 divides its sum by the kernel size (the missing frames count as zero
padding), 1.29 and later by the number of real frames. The reference (and the conformance fixtures) ran on 1.18,
so on 1.29 every embedding differs from the reference's (up to ~1e-2 on real models).

:func:`rewrite_average_pools` gives each such node an explicit end padding and ``ceil_mode=0``: per spatial axis
with kernel k, stride s and pads (b, e), the end pad becomes ``e + s - 1``. That keeps the output length
(``floor((L + b + e + s - 1 - k) / s) + 1 == ceil((L + b + e - k) / s) + 1``) and puts every window inside the
padded input, so ``count_include_pad=1`` divides each by k on every ONNX Runtime version: 1.18's numbers. It is
exact for every input length when ``k - b - e <= s <= k - e`` (CAM++: b = e = 0, s = k), and ONNX Runtime
refuses a pad >= k; other nodes are left as they are, with a warning. The rewritten graph carries
:data:`MARK_KEY` in its ``metadata_props``.

``cosyserve convert`` writes the rewritten graph into the bundle; :class:`~cosyserve.frontend.prompt.OnnxModel`
rewrites a graph it opens in memory when the file is not rewritten yet and the ``onnx`` package is installed
(the ``torch`` extra brings it), and otherwise opens it as it is and warns once. :func:`scan` decides that from
the protobuf's framing alone (node headers and metadata), without reading the weights or importing ``onnx``.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "MARK_KEY",
    "MARK_VALUE",
    "OnnxScan",
    "copy_onnx",
    "rewrite_average_pools",
    "scan",
    "session_source",
]

logger = logging.getLogger(__name__)

MARK_KEY = "cosyserve.onnx_compat"
MARK_VALUE = "AveragePool ceil_mode as ONNX Runtime 1.18"

_warned = threading.Event()  # the "onnx is not installed" warning is logged once per process


@dataclass(frozen=True)
class OnnxScan:
    """What :func:`scan` read from an ONNX file.

    Args:
        sensitive: the number of ``AveragePool(ceil_mode=1, count_include_pad=1)`` nodes (main graph and
            subgraphs), whose numbers differ between ONNX Runtime versions.
        marked: the graph carries :data:`MARK_KEY` = :data:`MARK_VALUE` (rewritten by :func:`rewrite_average_pools`).
    """

    sensitive: int
    marked: bool

    @property
    def needs_rewrite(self) -> bool:
        return self.sensitive > 0 and not self.marked


# ---------------------------------------------------------------------------------------------------------------------
# the protobuf framing: ModelProto.graph (7) and .metadata_props (14); GraphProto.node (1); NodeProto.op_type (4),
# .attribute (5), .domain (7); AttributeProto.name (1), .i (3), .g (6), .graphs (11) (onnx/onnx.proto)


def _varint(buf: Any, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError(f"truncated or overlong varint at byte {pos}")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf: Any, pos: int, end: int) -> Iterator[tuple[int, int, Any]]:
    # (field number, wire type, value) of each field of the message buf[pos:end]: a varint's integer, a
    # length-delimited field's (start, stop) span (its payload is not read), None for the fixed-size ones
    while pos < end:
        key, pos = _varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos, end)
            yield field, wire, value
        elif wire == 2:
            size, pos = _varint(buf, pos, end)
            if pos + size > end:
                raise ValueError(
                    f"field {field} at byte {pos} runs {pos + size - end} bytes past its message"
                )
            yield field, wire, (pos, pos + size)
            pos += size
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
            yield field, wire, None
        else:
            raise ValueError(f"field {field}: wire type {wire} is not used by ONNX")
    if pos != end:
        raise ValueError(f"a field runs past its message at byte {end}")


def _graph_sensitive(buf: Any, start: int, end: int) -> int:
    return sum(
        _node_sensitive(buf, *span)
        for field, wire, span in _fields(buf, start, end)
        if field == 1 and wire == 2
    )


def _node_sensitive(buf: Any, start: int, end: int) -> int:
    op_type = domain = b""
    ints: dict[bytes, int] = {}
    count = 0
    for field, wire, span in _fields(buf, start, end):
        if wire != 2:
            continue
        if field == 4:
            op_type = bytes(buf[span[0] : span[1]])
        elif field == 7:
            domain = bytes(buf[span[0] : span[1]])
        elif field == 5:
            name, value = b"", None
            for afield, awire, avalue in _fields(buf, *span):
                if afield == 1 and awire == 2:
                    name = bytes(buf[avalue[0] : avalue[1]])
                elif afield == 3 and awire == 0:
                    value = avalue
                elif afield in (6, 11) and awire == 2:  # a subgraph (If, Loop, Scan)
                    count += _graph_sensitive(buf, *avalue)
            if value is not None:
                ints[name] = value
    if op_type == b"AveragePool" and domain in (b"", b"ai.onnx"):
        count += ints.get(b"ceil_mode") == 1 and ints.get(b"count_include_pad") == 1
    return count


def _entry(buf: Any, start: int, end: int) -> tuple[bytes, bytes]:
    key = value = b""
    for field, wire, span in _fields(buf, start, end):
        if wire == 2 and field in (1, 2):
            text = bytes(buf[span[0] : span[1]])
            key, value = (text, value) if field == 1 else (key, text)
    return key, value


def scan(path: str | os.PathLike[str]) -> OnnxScan:
    """Count an ONNX file's version-sensitive AveragePool nodes and read its mark, from the protobuf's framing
    (the weights are skipped, not read; ``onnx`` is not needed).

    Args:
        path: the ``.onnx`` file.
    Returns:
        The :class:`OnnxScan`.
    Raises:
        ValueError: the file is not a well-formed protobuf message.
        OSError: it cannot be read.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ValueError("the file is empty")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            sensitive, marked = 0, False
            for field, wire, span in _fields(buf, 0, size):
                if field == 7 and wire == 2:
                    sensitive += _graph_sensitive(buf, *span)
                elif field == 14 and wire == 2:
                    marked |= _entry(buf, *span) == (MARK_KEY.encode(), MARK_VALUE.encode())
    return OnnxScan(sensitive, marked)


# ---------------------------------------------------------------------------------------------------------------------
# the rewrite (needs the onnx package)


@functools.cache
def _onnx() -> Any:
    try:
        import onnx
    except ImportError:
        return None
    return onnx


def _graphs(graph: Any) -> Iterator[Any]:
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("g"):
                yield from _graphs(attr.g)
            for sub in attr.graphs:
                yield from _graphs(sub)


def _exact_end_pads(attrs: dict[str, Any]) -> list[int] | None:
    # the pads of the rewrite, or None where it would not be exact for every input length (see the docstring)
    kernel = list(attrs["kernel_shape"])
    nd = len(kernel)
    strides = list(attrs.get("strides", [1] * nd))
    pads = list(attrs.get("pads", [0] * (2 * nd)))
    auto_pad = attrs.get("auto_pad", b"NOTSET")
    if auto_pad not in (b"NOTSET", "NOTSET") or any(d != 1 for d in attrs.get("dilations", [1] * nd)):
        return None
    if len(strides) != nd or len(pads) != 2 * nd:
        return None
    for axis, (k, s) in enumerate(zip(kernel, strides, strict=True)):
        b, e = pads[axis], pads[nd + axis]
        if not k - b - e <= s <= k - e:
            return None
        pads[nd + axis] = e + s - 1
    return pads


def rewrite_average_pools(model: Any) -> int:
    """Make every ``AveragePool(ceil_mode=1, count_include_pad=1)`` of ``model`` compute ONNX Runtime 1.18's
    numbers on every version: ``ceil_mode=0`` and end pads ``e + stride - 1`` (see the module docstring), in place.
    Idempotent: a rewritten node has ``ceil_mode=0``. Marks the model (:data:`MARK_KEY`) when it rewrote a node.

    Args:
        model: an ``onnx.ModelProto``.
    Returns:
        The number of nodes rewritten.
    """
    from onnx import helper

    rewritten, left = 0, []
    for graph in _graphs(model.graph):
        for node in graph.node:
            if node.op_type != "AveragePool" or node.domain not in ("", "ai.onnx"):
                continue
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            if attrs.get("ceil_mode", 0) != 1 or attrs.get("count_include_pad", 0) != 1:
                continue
            pads = _exact_end_pads(attrs)
            if pads is None:
                left.append(node.name or node.output[0])
                continue
            keep = [a for a in node.attribute if a.name not in ("ceil_mode", "pads")]
            del node.attribute[:]
            node.attribute.extend(
                [*keep, helper.make_attribute("ceil_mode", 0), helper.make_attribute("pads", pads)]
            )
            rewritten += 1
    if left:
        logger.warning(
            "%d AveragePool node(s) with ceil_mode=1 cannot be rewritten exactly (dilations, auto_pad, or strides "
            "and pads outside kernel - pads <= stride <= kernel - end pad): %s; their last window follows this "
            "ONNX Runtime version's arithmetic, not 1.18's",
            len(left),
            ", ".join(left[:5]) + (" ..." if len(left) > 5 else ""),
        )
    if rewritten:
        for entry in [p for p in model.metadata_props if p.key == MARK_KEY]:
            model.metadata_props.remove(entry)
        model.metadata_props.add(key=MARK_KEY, value=MARK_VALUE)
    return rewritten


def _warn_no_onnx(path: Path, sensitive: int) -> None:
    if not _warned.is_set():
        _warned.set()
        logger.warning(
            "%s has %d AveragePool(ceil_mode=1) node(s) whose numbers changed in ONNX Runtime 1.29, and the 'onnx' "
            "package is not installed to rewrite them: speaker embeddings may differ from the reference's by up "
            "to ~1e-2 (pip install onnx, or convert the model with cosyserve convert)",
            path,
            sensitive,
        )


def session_source(path: str | os.PathLike[str]) -> str | bytes:
    """What to give ``onnxruntime.InferenceSession`` for the ONNX file ``path``: its path when it has nothing to
    rewrite (or is rewritten already), else the rewritten graph's bytes (the file is never written). Without the
    ``onnx`` package, the path, and a warning once per process.

    Raises:
        ValueError, OSError: the file is not a readable ONNX model (the caller reports it as it reports
            onnxruntime's own failure to load it).
    """
    path = Path(path)
    found = scan(path)
    if not found.needs_rewrite:
        return str(path)
    onnx = _onnx()
    if onnx is None:
        _warn_no_onnx(path, found.sensitive)
        return str(path)
    model = onnx.load(str(path))
    count = rewrite_average_pools(model)
    if count == 0:
        return str(path)
    logger.info(
        "%s: %d AveragePool node(s) rewritten in memory to ONNX Runtime 1.18's arithmetic", path.name, count
    )
    return bytes(model.SerializeToString())


def copy_onnx(src: Path, dst: Path) -> int:
    """Copy the ONNX file ``src`` to ``dst`` (conversion), rewritten when it has version-sensitive AveragePool
    nodes; without the ``onnx`` package it is copied as it is, with a warning.

    Returns:
        The number of nodes rewritten (0: a byte-for-byte copy).
    Raises:
        ValueError: ``src`` is not a well-formed ONNX file.
    """
    try:
        found = scan(src)
    except ValueError as e:
        raise ValueError(f"{src} is not an ONNX model: {e}") from e
    if found.needs_rewrite:
        onnx = _onnx()
        if onnx is None:
            logger.warning(
                "%s: copied unchanged: its %d AveragePool(ceil_mode=1) node(s) need the 'onnx' package (pip install "
                "onnx, or the 'torch' extra) to be rewritten to ONNX Runtime 1.18's arithmetic; speaker embeddings "
                "may differ from the reference's by up to ~1e-2",
                src.name,
                found.sensitive,
            )
        else:
            model = onnx.load(str(src))
            count = rewrite_average_pools(model)
            if count:
                onnx.save(model, str(dst))
                return count
    shutil.copyfile(src, dst)
    return 0
