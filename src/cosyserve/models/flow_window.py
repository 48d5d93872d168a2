"""A streamed flow's bounded context (``flow_context_seconds``): the rules the torch runtime's
:class:`~cosyserve.models.flow_stream.FlowStream` and the lite runtime's
:class:`~cosyserve.runtime.lite.flowstream.LiteFlowStream` share, so that both keep and drop the same frames and
take the same calls through their stream (see :mod:`cosyserve.models.flow_stream` for what a bounded stream is).
Plain integers; nothing here imports torch or numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["dropped", "kept_after", "takes_chunk"]


def takes_chunk(bounded: bool, streaming: bool, finalize: bool) -> bool:
    """Whether a flow call goes through its stream: a streamed call that does not finalize, or any call of a
    bounded stream (its last call too: chunk-causal, no lookahead; it no longer holds every frame that full
    attention would read)."""
    return streaming and not finalize or bounded


def kept_after(kept: int, frames: int, granularity: int, lookahead: int) -> int:
    """The frames final once a stream's call over its first ``frames`` is done, when it keeps ``kept``: its whole
    attention chunks (of ``granularity`` frames), or with no lookahead (a bounded stream's last call) none of its
    own."""
    return frames // granularity * granularity if lookahead else kept


def dropped(spans: Sequence[int], prompt: int, context: int) -> tuple[int, int]:
    """``(first, n)``: the kept segments a bounded stream drops after a call, given each kept segment's frames
    (``spans``, oldest first), the prompt's frames (the segments that start within them are never dropped) and the
    ``context`` frames of generated speech it attends to (0: unbounded, none dropped). The oldest segments of
    generated speech go while the ones after them still hold ``context`` frames."""
    if not context:
        return 0, 0
    pinned, end = 0, 0
    while pinned < len(spans) and end < prompt:
        end += spans[pinned]
        pinned += 1
    left, n = sum(spans[pinned:]), 0
    while pinned + n < len(spans) and left - spans[pinned + n] >= context:
        left -= spans[pinned + n]
        n += 1
    return pinned, n
