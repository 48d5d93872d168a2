"""Text clean-up and sentence splitting before tokenization.

This is the reference frontend's structure without the number/date normaliser (wetext), which a later issue
adds: markup-bearing text (``<|...|>``) passes untouched; Chinese text gets the reference's punctuation and
blank rules; the text is split at sentence punctuation into pieces of about 60-80 tokens (characters for
Chinese), short tails merged; pieces that are only punctuation are dropped.
"""

from __future__ import annotations

import re
from collections.abc import Callable

__all__ = ["contains_chinese", "normalize_and_split", "split_paragraph"]

_CJK = re.compile(r"[\u4e00-\u9fff]+")
_ZH_PUNCT = ("。", "？", "！", "；", "：", "、", ".", "?", "!", ";")
_EN_PUNCT = (".", "?", "!", ";", ":")


def contains_chinese(text: str) -> bool:
    return bool(_CJK.search(text))


def _is_only_punctuation(text: str) -> bool:
    import regex  # a tiktoken dependency; understands \p{...} classes

    return bool(regex.fullmatch(r"[\p{P}\p{S}]*", text))


def _replace_blank(text: str) -> str:
    # keep a space only between two non-space ASCII characters (words of embedded English)
    out = []
    for i, c in enumerate(text):
        if c == " ":
            prev = text[i - 1] if i > 0 else " "
            nxt = text[i + 1] if i + 1 < len(text) else " "
            if prev.isascii() and prev != " " and nxt.isascii() and nxt != " ":
                out.append(c)
        else:
            out.append(c)
    return "".join(out)


def _clean_zh(text: str) -> str:
    text = text.replace("\n", "")
    text = _replace_blank(text)
    text = text.replace("²", "平方").replace("³", "立方")
    text = text.replace(".", "。").replace(" - ", "，")
    for ch in ("（", "）", "【", "】", "`"):
        text = text.replace(ch, "")
    text = text.replace("——", " ")
    return re.sub(r"[，,、]+$", "。", text)


def split_paragraph(
    text: str,
    tokenize: Callable[[str], list[int]],
    lang: str = "zh",
    token_max_n: int = 80,
    token_min_n: int = 60,
    merge_len: int = 20,
    comma_split: bool = False,
) -> list[str]:
    """Split ``text`` at sentence punctuation into pieces of at most ~``token_max_n`` tokens.

    Length is measured in characters for ``lang="zh"`` and in tokenizer tokens otherwise; a piece is closed
    once adding the next sentence would pass ``token_max_n`` and it already holds more than ``token_min_n``; a
    last piece shorter than ``merge_len`` joins the one before.
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
        if i + 1 < len(text) and text[i + 1] in ('"', "”") and sentences:
            sentences[-1] += text[i + 1]  # a closing quote stays with its sentence
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


def normalize_and_split(text: str, tokenize: Callable[[str], list[int]]) -> list[str]:
    """Clean ``text`` and split it into synthesis pieces (see the module docstring)."""
    if "<|" in text and "|>" in text:
        return [text]
    text = text.strip()
    if not text:
        return []
    if contains_chinese(text):
        pieces = split_paragraph(_clean_zh(text), tokenize, "zh")
    else:
        pieces = split_paragraph(text, tokenize, "en")
    return [p for p in pieces if not _is_only_punctuation(p)]
