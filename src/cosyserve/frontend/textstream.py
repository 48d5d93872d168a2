"""Text that arrives in pieces (an LLM's output as it is generated): where to cut it as it comes.

Two shapes, one per way a family speaks streamed text:

- :func:`finished_sentences` (CosyVoice-300M, whose LM takes a whole text): the text as chunks, each handed on as
  soon as it ends with a sentence end that more text has followed (or the stream ended), so every finished
  sentence is synthesized while the next one is still being written. A run of text longer than ``max_n`` units
  without a sentence end is handed on at a clause or word boundary, so audio never waits for punctuation that
  does not come.
- :func:`segments` (CosyVoice2/3, whose LM takes text as it arrives, the reference's bistream): the stream as
  consecutive sub-streams, each one LM run; a sub-stream ends at the first sentence end after it holds ``min_n``
  units, or after ``max_n`` units whatever comes, so that no LM run (and no flow pass over its tokens, which
  CosyVoice2/3 re-run on everything so far) grows with the length of the whole stream.

Units are as :func:`cosyserve.frontend.text.bound_pieces` counts them: characters of Chinese text, tokenizer
tokens otherwise. A sentence end is ``。！？；`` (anywhere), or ``. ! ? ;`` followed by a blank (so "3.14" and
"e.g." inside a sentence do not end it), or a line break. Pure Python.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

from cosyserve.frontend.text import PIECE_MAX_N, bound_pieces, contains_chinese

__all__ = ["finished_sentences", "segments"]

# the end of a sentence's text: where a chunk may be cut (just after the match)
_SENTENCE_END = re.compile(r"[。！？；]+[”’\"'）)]*|[.!?;]+[\"'”’)]*(?=\s)\s*|\n+")


def _last_end(text: str) -> int:
    # the index just after the last sentence end of `text` that more text follows (0: none)
    end = 0
    for m in _SENTENCE_END.finditer(text):
        if m.end() < len(text):
            end = m.end()
    return end


def _first_end(text: str, start: int) -> int:
    # the index just after the first sentence end at or after `start` that more text follows (0: none)
    for m in _SENTENCE_END.finditer(text, start):
        if m.end() < len(text):
            return m.end()
    return 0


def _units(tokenize: Callable[[str], list[int]]) -> Callable[[str], int]:
    def length(text: str) -> int:
        return len(text) if contains_chinese(text) else len(tokenize(text))

    return length


def finished_sentences(
    pieces: Iterable[str], tokenize: Callable[[str], list[int]], max_n: int = PIECE_MAX_N
) -> Iterator[str]:
    """The text of ``pieces`` as chunks that end with finished sentences (see the module docstring); their
    concatenation is the text."""
    length = _units(tokenize)
    buffer = ""
    for piece in pieces:
        buffer += piece
        cut = _last_end(buffer)
        if cut:
            yield buffer[:cut]
            buffer = buffer[cut:]
        if length(buffer) > max_n:
            # no sentence end for too long: hand on all but the last bounded part (it may still grow)
            parts = bound_pieces([buffer], tokenize, max_n=max_n)
            if len(parts) > 1:
                head = "".join(parts[:-1])
                yield head
                buffer = buffer[len(head) :]
    if buffer:
        yield buffer


def segments(
    pieces: Iterable[str], tokenize: Callable[[str], list[int]], min_n: int = 60, max_n: int = PIECE_MAX_N
) -> Iterator[Iterator[str]]:
    """``pieces`` as consecutive sub-streams of pieces (see the module docstring): take each sub-stream to its
    end before asking for the next one. Their pieces, in order, are ``pieces`` (a piece may be split in two at
    a segment's end)."""
    length = _units(tokenize)
    source = iter(pieces)
    carry: list[str] = []  # text already read that belongs to the next segment
    done = False

    def segment() -> Iterator[str]:
        nonlocal done
        text = ""
        while True:
            if carry:
                piece = carry.pop(0)
            else:
                piece = next(source, None)
                if piece is None:
                    done = True
                    return
            start = max(0, len(text) - 4)  # a sentence end may span the joint ("?" then '" ')
            text += piece
            n = length(text)
            cut = _first_end(text, start) if n >= min_n else 0
            if not cut and n > max_n:
                parts = bound_pieces([text], tokenize, max_n=max_n)
                cut = len(parts[0]) if len(parts) > 1 else 0
            if cut:
                keep = cut - (len(text) - len(piece))  # the part of this piece that stays in the segment
                if keep > 0:
                    yield piece[:keep]
                if piece[keep:]:
                    carry.append(piece[max(keep, 0) :])
                return
            yield piece

    while not done:
        seg = segment()
        first = next(seg, None)
        if first is None:
            return
        yield _chain(first, seg)


def _chain(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest
