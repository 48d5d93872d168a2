"""Text that arrives in pieces (an LLM's output as it is generated): where to cut it as it comes.

Two shapes, one per way a family speaks streamed text:

- :func:`finished_sentences` (CosyVoice-300M, whose LM takes a whole text): the text as chunks, each handed on as
  soon as it ends with a sentence end that more text has followed (or the stream ended), so every finished
  sentence is synthesized while the next one is still being written. A run of text longer than ``max_n`` units
  without a sentence end is handed on at a clause or word boundary, so audio never waits for punctuation that
  does not come. No chunk is longer than ``max_n`` units: the normaliser, which the caller runs on each chunk,
  never sees more (a long sentence is cut as :func:`~cosyserve.frontend.text.bound_pieces` cuts it).
- :func:`segments` (CosyVoice2/3, whose LM takes text as it arrives, the reference's bistream): the stream as
  consecutive sub-streams, each one LM run; a sub-stream ends at the first sentence end after it holds ``min_n``
  units, or after ``max_n`` units whatever comes, so that no LM run (and no flow pass over its tokens, which
  CosyVoice2/3 re-run on everything so far) grows with the length of the whole stream.

Units are as :func:`cosyserve.frontend.text.bound_pieces` counts them: characters of Chinese text, tokenizer
tokens otherwise. A sentence end is ``。！？；`` (anywhere), or ``. ! ? ;`` followed by a blank (so "3.14" and
"e.g." inside a sentence do not end it), or a line break.

The cost is linear in the text, whatever its pieces: a piece longer than :data:`WINDOW_CHARS` (one WebSocket
frame of a whole document) is read in windows of that size (:func:`windows`), each new piece is searched for a
sentence end and measured on its own, and the text held back (an unfinished sentence) is measured again only as it
grows by a fraction of itself, never per piece (:func:`segments` measures each piece once: what the LM runs on
is the sum of its pieces). Pure Python.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

from cosyserve.frontend.text import PIECE_MAX_N, bound_pieces, contains_chinese

__all__ = ["WINDOW_CHARS", "finished_sentences", "segments", "windows"]

# The most characters of streamed text taken in one step: a longer piece is read in windows of this size, cut at a
# blank where one is near the window's end. Enough for a piece of PIECE_MAX_N tokens of ordinary text (4-5
# characters a token), so that text sent in pieces of any size is cut where it would be in pieces of a few words.
WINDOW_CHARS = 1024

# the end of a sentence's text: where a chunk may be cut (just after the match)
_SENTENCE_END = re.compile(r"[。！？；]+[”’\"'）)]*|[.!?;]+[\"'”’)]*(?=\s)\s*|\n+")
_BLANKS = re.compile(r"\s+")
# a markup tag (<|endofprompt|>, [breath]) that a window's end would cut: it opens and is not closed by then
_OPEN_TAG = re.compile(r"(?:<\|[^|\s]{0,32}|\[[^\]\s]{0,32})$")


def windows(pieces: Iterable[str], size: int = WINDOW_CHARS) -> Iterator[str]:
    """``pieces``, each longer than ``size`` characters cut into consecutive parts of at most ``size``: after the
    last blank of a window's second half where there is one, else at the window's end (before a markup tag it
    would cut). Empty pieces are dropped; the parts, joined, are the pieces."""
    for piece in pieces:
        i, n = 0, len(piece)
        while n - i > size:
            window = piece[i : i + size]
            cut = 0
            for m in _BLANKS.finditer(window, size // 2):
                cut = m.end()
            if not cut:
                tag = _OPEN_TAG.search(window)
                cut = tag.start() if tag is not None and tag.start() > 0 else size
            yield window[:cut]
            i += cut
        if i < n:
            yield piece[i:] if i else piece


def _last_end(text: str, start: int = 0) -> int:
    # the index just after the last sentence end of `text` at or after `start` that more text follows (0: none)
    end = 0
    for m in _SENTENCE_END.finditer(text, start):
        if m.end() < len(text):
            end = m.end()
    return end


def _ends(text: str, after: int) -> Iterator[int]:
    # the indices just after the sentence ends of `text` that end at or after `after` (an end before it was seen
    # already) and that more text follows, less `after`
    for m in _SENTENCE_END.finditer(text):
        if after <= m.end() < len(text):
            yield m.end() - after


def _units(tokenize: Callable[[str], list[int]]) -> Callable[[str], int]:
    def length(text: str) -> int:
        return len(text) if contains_chinese(text) else len(tokenize(text))

    return length


def finished_sentences(
    pieces: Iterable[str], tokenize: Callable[[str], list[int]], max_n: int = PIECE_MAX_N
) -> Iterator[str]:
    """The text of ``pieces`` as chunks of at most ``max_n`` units that end with finished sentences (see the
    module docstring); their concatenation is the text."""
    buffer = ""
    measured = 0  # the buffer's length when it was last measured and found within max_n units
    for part in windows(pieces):
        start = max(0, len(buffer) - 4)  # a sentence end may span the joint ("?" then '" ')
        buffer += part
        cut = _last_end(buffer, start)
        if cut:
            yield from bound_pieces([buffer[:cut]], tokenize, max_n=max_n)
            buffer, measured = buffer[cut:], 0
        # no sentence end for a while: a buffer of more than max_n characters may hold more than max_n units
        # (a unit is a character or a token of one or more); measured again as it grows by a quarter
        if len(buffer) > max_n and len(buffer) > measured + measured // 4 + 32:
            parts = bound_pieces([buffer], tokenize, max_n=max_n)
            yield from parts[:-1]  # all but the last bounded part, which may still grow
            buffer = parts[-1]
            measured = len(buffer)
    if buffer:
        yield from bound_pieces([buffer], tokenize, max_n=max_n)


def segments(
    pieces: Iterable[str], tokenize: Callable[[str], list[int]], min_n: int = 60, max_n: int = PIECE_MAX_N
) -> Iterator[Iterator[str]]:
    """``pieces`` as consecutive sub-streams of pieces (see the module docstring): take each sub-stream to its
    end before asking for the next one. Their pieces, in order, are ``pieces`` (a piece may be split in two at
    a segment's end, and one longer than :data:`WINDOW_CHARS` is read in windows). A segment's units are the sum
    of its pieces' (each measured once, as it comes): the LM tokenizes each piece on its own, as the reference's
    bistream does."""
    length = _units(tokenize)
    source = windows(pieces)
    carry: list[str] = []  # text already read that belongs to the next segment
    done = False

    def segment() -> Iterator[str]:
        nonlocal done
        parts: list[str] = []  # the segment's pieces so far
        n = 0
        while True:
            if carry:
                piece = carry.pop()
            else:
                piece = next(source, None)
                if piece is None:
                    done = True
                    return
            keep: int | None = None  # where the segment ends in this piece (<= 0: before it)
            # the first sentence end after min_n units, the piece measured from one end to the next
            tail = parts[-1][-4:] if parts else ""  # a sentence end may span the joint ("?" then '" ')
            at = 0
            for end in _ends(tail + piece, len(tail)):
                n += length(piece[at:end])
                at = max(at, end)
                if n > max_n:
                    break
                if n >= min_n:
                    keep = end
                    break
            if keep is None:
                n += length(piece[at:])
                if n > max_n:
                    whole = "".join(parts) + piece
                    first = bound_pieces([whole], tokenize, max_n=max_n)[0]
                    # within max_n measured whole (its pieces' sum over-counts): the segment ends before this piece
                    keep = len(first) - (len(whole) - len(piece)) if len(first) < len(whole) else 0
            if keep is not None:
                if keep > 0:
                    yield piece[:keep]
                if piece[max(keep, 0) :]:
                    carry.append(piece[max(keep, 0) :])
                return
            parts.append(piece)
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
