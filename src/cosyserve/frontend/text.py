"""Text normalisation and sentence splitting: the reference's ``CosyVoiceFrontEnd.text_normalize``.

Text that carries markup (both ``<|`` and ``|>``) passes untouched. Otherwise, after stripping:

- Chinese (any CJK ideograph): wetext's zh normaliser (``remove_erhua=False``) spells numbers, dates, money;
  then newlines go, blanks between non-ASCII characters go, ``²``/``³`` become 平方/立方, ``.`` becomes ``。``,
  `` - `` becomes ``，``, brackets and backticks go, trailing commas become ``。``; pieces are measured in
  characters.
- Everything else: wetext's en normaliser, then any digits left are spelled by inflect; pieces are measured
  in tokenizer tokens.

Then the text is split at sentence punctuation into pieces of about 60-80 (tokens or characters), a short
tail (< 20) merged into the piece before, and pieces with nothing to speak (no letter or digit) dropped.

Unlike the reference, no piece is longer than :data:`PIECE_MAX_N` (160) units: a piece is what one LM run, and
without streaming one flow and one vocoder pass, work on, so a sentence longer than that (text without
punctuation, a list of clauses) is cut at clause punctuation, then between words, then between characters
(:func:`bound_pieces`). Text the reference splits into pieces of at most 160 units is split the same here.

wetext reads all its FSTs (tens of MB) when imported, so it is imported on the first call that needs it,
never by importing this module; one load is shared by concurrent first callers. The strings match the
reference run with wetext 0.1.8 (whose FSTs ship in its wheel and load offline).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = [
    "PIECE_MAX_N",
    "bound_pieces",
    "load_normalizers",
    "contains_chinese",
    "nothing_to_speak",
    "normalize_and_split",
    "normalizers_loaded",
    "remove_bracket",
    "replace_blank",
    "replace_corner_mark",
    "spell_out_number",
    "split_paragraph",
    "text_normalize",
]

logger = logging.getLogger(__name__)

TOKEN_MAX_N = 80
TOKEN_MIN_N = 60
MERGE_LEN = 20
# the longest piece (tokens, or characters of Chinese text): twice the reference's target, so that its pieces of
# normal text are kept as they are, while one run of text without sentence punctuation cannot make one LM run
# (and its flow and vocoder passes) as long as the whole text
PIECE_MAX_N = 2 * TOKEN_MAX_N

_CJK = re.compile(r"[\u4e00-\u9fff]+")
_ZH_PUNCT = ("。", "？", "！", "；", "：", "、", ".", "?", "!", ";")
_EN_PUNCT = (".", "?", "!", ";", ":")
_CLOSING_QUOTES = ('"', "”")
_TRAILING_COMMAS = re.compile(r"[，,、]+$")
_SPECIAL_TOKEN = re.compile(r"<\|[^|<>\s]*\|>")  # <|endofprompt|>, <|en|>: markup the LM reads, never spoken


def contains_chinese(text: str) -> bool:
    return bool(_CJK.search(text))


def nothing_to_speak(text: str) -> bool:
    """True when ``text`` has no letter (L*) and no digit (N*) outside the models' special tokens
    (``<|endofprompt|>``, ``<|en|>``, ...): only punctuation, symbols, blanks, invisible characters such as
    zero-width spaces and joiners, or markup. The reference drops pieces of only punctuation (P*) and symbols
    (S*); a piece of zero-width characters or of markup alone has nothing to speak either (the LLM would get only
    noise)."""
    import regex  # a tiktoken dependency; understands \p{...} classes

    return regex.search(r"[\p{L}\p{N}]", _SPECIAL_TOKEN.sub("", text)) is None


def replace_blank(text: str) -> str:
    """Drop spaces except those between two non-space ASCII characters (words of embedded English)."""
    out = []
    for i, c in enumerate(text):
        if c == " ":
            # the reference reads text[i - 1] (so text[-1] at i == 0) and text[i + 1] (past the end: dropped)
            nxt = text[i + 1] if i + 1 < len(text) else " "
            prev = text[i - 1]
            if nxt.isascii() and nxt != " " and prev.isascii() and prev != " ":
                out.append(c)
        else:
            out.append(c)
    return "".join(out)


def replace_corner_mark(text: str) -> str:
    return text.replace("²", "平方").replace("³", "立方")


def remove_bracket(text: str) -> str:
    for ch in ("（", "）", "【", "】", "`"):
        text = text.replace(ch, "")
    return text.replace("——", " ")


# ---------------------------------------------------------------------------------------------------------------------
# lazily loaded normalisers

_load_lock = threading.Lock()
_use_lock = threading.Lock()  # inflect keeps per-call state on the engine; wetext is serialised with it
_normalizers: tuple[Any, Any] | None = None
_inflect: Any = None
_load_seconds: float | None = None


def normalizers_loaded() -> bool:
    """Whether wetext's normalisers have been created (they are, on the first :func:`text_normalize` call)."""
    return _normalizers is not None


def _get_normalizers() -> tuple[Any, Any]:
    global _normalizers, _load_seconds
    if _normalizers is None:
        with _load_lock:
            if _normalizers is None:
                t0 = time.perf_counter()
                try:
                    from wetext import Normalizer
                except ImportError as e:
                    raise RuntimeError(
                        "text normalisation needs the 'wetext' package (pip install wetext==0.1.8)"
                    ) from e
                # zh, en: both with language "auto", constructed as the reference does
                pair = (Normalizer(remove_erhua=False), Normalizer())
                _load_seconds = time.perf_counter() - t0
                logger.info("loaded wetext text normalisers in %.0f ms", _load_seconds * 1e3)
                _normalizers = pair
    return _normalizers


def load_normalizers() -> float:
    """Create wetext's normalisers now (e.g. in a background thread after READY); returns the seconds it took
    (0 if they already existed). inflect, the number speller, stays lazy: importing it costs more than a whole
    start, and it is needed only for digits that wetext leaves."""
    existed = _normalizers is not None
    _get_normalizers()
    return 0.0 if existed else float(_load_seconds or 0.0)


def _get_inflect() -> Any:
    global _inflect
    if _inflect is None:
        with _load_lock:
            if _inflect is None:
                import inflect

                _inflect = inflect.engine()
    return _inflect


def spell_out_number(text: str, engine: Any = None) -> str:
    """Replace every run of digits (``str.isdigit``) with inflect's ``number_to_words`` of it.

    Args:
        text: any text.
        engine: an ``inflect.engine()``; default a shared one (calls on it are serialised).
    """
    if not any(c.isdigit() for c in text):
        return text
    engine = engine if engine is not None else _get_inflect()
    out: list[str] = []
    start: int | None = None
    with _use_lock:
        for i, c in enumerate(text):
            if c.isdigit():
                if start is None:
                    start = i
                continue
            if start is not None:
                out.append(engine.number_to_words(text[start:i]))
                start = None
            out.append(c)
        if start is not None:
            out.append(engine.number_to_words(text[start:]))
    return "".join(out)


# ---------------------------------------------------------------------------------------------------------------------
# splitting


def split_paragraph(
    text: str,
    tokenize: Callable[[str], list[int]],
    lang: str = "zh",
    token_max_n: int = TOKEN_MAX_N,
    token_min_n: int = TOKEN_MIN_N,
    merge_len: int = MERGE_LEN,
    comma_split: bool = False,
) -> list[str]:
    """Split ``text`` at sentence punctuation into pieces of at most ~``token_max_n`` units.

    Units are characters for ``lang="zh"`` and tokenizer tokens otherwise. A sentence ends at a punctuation
    mark (a closing quote right after it stays with it); text without final punctuation gets ``。``/``.``.
    A piece is closed once adding the next sentence would pass ``token_max_n`` and it already holds more than
    ``token_min_n``; a last piece shorter than ``merge_len`` joins the one before.

    Args:
        text: normalised text.
        tokenize: text -> token ids (only called for ``lang != "zh"``).
        lang: ``"zh"`` or anything else (treated as English).
        comma_split: also end sentences at ``，`` and ``,``.
    Returns:
        The pieces, in order; their concatenation is ``text`` (plus the added final punctuation).
    """
    if not text:
        return []

    def length(s: str) -> int:
        return len(s) if lang == "zh" else len(tokenize(s))

    punct = list(_ZH_PUNCT if lang == "zh" else _EN_PUNCT)
    if comma_split:
        punct += ["，", ","]
    if text[-1] not in punct:
        text += "。" if lang == "zh" else "."

    sentences: list[str] = []
    start = 0
    for i, c in enumerate(text):
        if c not in punct:
            continue
        if i > start:
            sentences.append(text[start : i + 1])
        if i + 1 < len(text) and text[i + 1] in _CLOSING_QUOTES and sentences:
            sentences[-1] += text[i + 1]
            start = i + 2
        else:
            start = i + 1

    pieces: list[str] = []
    current = ""
    for s in sentences:
        if length(current + s) > token_max_n and length(current) > token_min_n:
            pieces.append(current)
            current = ""
        current += s
    if current:
        if length(current) < merge_len and pieces:
            pieces[-1] += current
        else:
            pieces.append(current)
    return pieces


# ---------------------------------------------------------------------------------------------------------------------
# the text frontend


def _default_tokenize(text: str) -> list[int]:
    from cosyserve.frontend.tokenizer import get_tokenizer

    return get_tokenizer().encode(text)


def _wetext(normalizer: Any, text: str) -> str:
    """``normalizer.normalize(text)``, or ``text`` unchanged where wetext fails on it (its token parser asserts
    on some inputs, e.g. "4/"): odd text is spoken as written rather than failing the request."""
    with _use_lock:
        try:
            return str(normalizer.normalize(text))
        except Exception as e:  # noqa: BLE001 - a third-party grammar; the raw text is a safe fallback
            logger.warning(
                "text normaliser failed on %r (%s: %s); using the text as written",
                text[:80],
                type(e).__name__,
                e,
            )
            return text


def _normalize_zh(text: str) -> str:
    zh, _ = _get_normalizers()
    text = _wetext(zh, text)
    text = text.replace("\n", "")
    text = replace_blank(text)
    text = replace_corner_mark(text)
    text = text.replace(".", "。").replace(" - ", "，")
    text = remove_bracket(text)
    return _TRAILING_COMMAS.sub("。", text)


def _normalize_en(text: str) -> str:
    _, en = _get_normalizers()
    text = _wetext(en, text)
    return spell_out_number(text)


def text_normalize(
    text: str, split: bool = True, *, tokenize: Callable[[str], list[int]] | None = None
) -> list[str] | str:
    """Normalise ``text`` for synthesis and (by default) split it into pieces, as the reference frontend does.

    Args:
        text: user text. With both ``<|`` and ``|>`` in it, it is returned unchanged (``text``, or ``[text]`` cut
            by :func:`bound_pieces` when it is longer than a piece may be; none when it is markup alone).
        split: return the list of pieces (True) or the whole normalised string (False).
        tokenize: text -> token ids for measuring English pieces; default the whisper tokenizer.
    Returns:
        The pieces (pieces with :func:`nothing_to_speak` dropped; empty for blank text), or the normalised string.
        The reference returns ``['']`` for ``''`` and fails on blank text; here blank text gives ``[]``.
    """
    tokenize = tokenize or _default_tokenize
    if "<|" in text and "|>" in text:
        if not split:
            return text
        return [p for p in bound_pieces([text], tokenize) if not nothing_to_speak(p)]
    text = text.strip()
    if not text:
        return [] if split else ""
    if contains_chinese(text):
        text = _normalize_zh(text)
        lang = "zh"
    else:
        text = _normalize_en(text)
        lang = "en"
    if not split:
        return text
    pieces = split_paragraph(text, tokenize, lang, TOKEN_MAX_N, TOKEN_MIN_N, MERGE_LEN, comma_split=False)
    pieces = bound_pieces(pieces, tokenize, lang)
    return [p for p in pieces if not nothing_to_speak(p)]


# where a piece that is too long is cut, coarsest first: after clause punctuation, after blanks (between words),
# between characters; markup tags (<|endofprompt|>, [breath], [laughter]) are never cut
_CLAUSE = re.compile(r"[^，,、；;：:…—]*[，,、；;：:…—]+\s*|[^，,、；;：:…—]+")
_WORD = re.compile(r"\S+\s*|\s+")
_CHAR = re.compile(r"<\|[^|\s]{1,32}\|>|\[[^\]\s]{1,32}\]|.", re.S)


def bound_pieces(
    pieces: list[str],
    tokenize: Callable[[str], list[int]],
    lang: str | None = None,
    max_n: int = PIECE_MAX_N,
) -> list[str]:
    """Cut every piece longer than ``max_n`` units into pieces of at most ``max_n``, keeping the others.

    Units are characters for ``lang="zh"`` and tokenizer tokens otherwise (as :func:`split_paragraph`; None:
    ``zh`` when the piece holds Chinese). A long piece is cut after clause punctuation (，,、；;：: … —) into
    parts packed greedily up to ``max_n``; a clause still too long is cut between words, a word between
    characters. Concatenated, the result is the input.
    """
    out: list[str] = []
    for piece in pieces:
        zh = contains_chinese(piece) if lang is None else lang == "zh"

        def length(s: str, zh: bool = zh) -> int:
            return len(s) if zh else len(tokenize(s))

        out.extend([piece] if length(piece) <= max_n else _cut(piece, length, max_n, (_CLAUSE, _WORD, _CHAR)))
    return out


def _cut(
    text: str, length: Callable[[str], int], max_n: int, levels: tuple[re.Pattern[str], ...]
) -> list[str]:
    # the parts of `text` at the coarsest level, a part too long cut at the next level, then packed. A part of
    # at most max_n / 4 characters fits unmeasured: no character is more than 4 tokens (its UTF-8 bytes).
    parts: list[str] = []
    for part in levels[0].findall(text):
        if len(levels) > 1 and 4 * len(part) > max_n and length(part) > max_n:
            parts.extend(_cut(part, length, max_n, levels[1:]))
        else:
            parts.append(part)
    return _pack(parts, length, max_n)


def _pack(parts: list[str], length: Callable[[str], int], max_n: int) -> list[str]:
    # joins runs of parts into pieces of at most max_n units, each as long as a search over the next parts finds
    # (doubling, then halving: a few measurements per piece, not one per part, so a long run of characters is cut
    # in milliseconds); each part alone fits
    pieces: list[str] = []
    i = 0
    while i < len(parts):
        lo, step = i + 1, 1  # parts[i:lo] fits
        hi = len(parts)  # parts[i:hi + 1] does not fit, or hi is the end
        while lo < hi:
            mid = min(hi, lo + step)
            if length("".join(parts[i:mid])) <= max_n:
                lo, step = mid, 2 * step
            else:
                hi, step = mid - 1, 1
        pieces.append("".join(parts[i:lo]))
        i = lo
    return pieces


def normalize_and_split(text: str, tokenize: Callable[[str], list[int]]) -> list[str]:
    """Normalise ``text`` and split it into synthesis pieces (:func:`text_normalize` with ``split=True``)."""
    pieces = text_normalize(text, split=True, tokenize=tokenize)
    assert isinstance(pieces, list)
    return pieces
