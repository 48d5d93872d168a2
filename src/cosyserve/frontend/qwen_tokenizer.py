"""CosyVoice2's and CosyVoice3's text tokenizer: the model directory's Qwen2 byte-level BPE with the family's
special tokens.

The reference builds ``AutoTokenizer.from_pretrained(<model>/CosyVoice-BlankEN)`` and adds ``<|endofprompt|>`` and
the family's tags as special tokens (CosyVoice2: paralinguistic tags; CosyVoice3 adds ``<|endofsystem|>``, 84
ARPAbet phone tokens and 176 pinyin tokens). Here the same vocabulary runs on tiktoken: ``vocab.json`` maps each
token (GPT-2's printable stand-ins for bytes) to its id, and in Qwen's vocabulary the ids are the BPE merge ranks
(the merges were made in id order), so the id table is tiktoken's ``mergeable_ranks`` as it is and ``merges.txt``
is not needed. The special tokens match anywhere in the raw text, exactly, before anything else (as the Hugging
Face tokenizer matches its added tokens); each stretch between them is NFC-normalised and split by Qwen2's pattern
(single digits). So a pinyin tag written with a decomposed tone mark is plain text, not the special token. Ids:
the added tokens of ``tokenizer_config.json`` (Qwen's ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``) keep
theirs, the family's take the next free ids in list order (each family supplies its table:
:attr:`cosyserve.families.cosyvoice2.CosyVoice2.specials`). CosyVoice-300M tags such as ``<|en|>`` are plain text
here, as in the reference.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import unicodedata
from pathlib import Path
from typing import Any

from cosyserve.core.errors import ModelDirError

__all__ = ["QwenTokenizer"]

_PAT_STR = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    # GPT-2's bytes_to_unicode, inverted: the printable stand-in of each byte -> the byte
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


class QwenTokenizer:
    """Encode text to ids as the reference's CosyVoice2 frontend does (``tokenizer([text])['input_ids'][0]``)."""

    def __init__(self, ranks: dict[bytes, int], specials: dict[str, int], name: str = "qwen") -> None:
        import tiktoken

        self.special_ids = dict(specials)
        self.vocab_size = max([*ranks.values(), *specials.values()]) + 1
        self.encoding = tiktoken.Encoding(
            name=name, pat_str=_PAT_STR, mergeable_ranks=ranks, special_tokens=self.special_ids
        )
        # longest first: the leftmost match is the longest special token starting there
        alternatives = "|".join(re.escape(t) for t in sorted(self.special_ids, key=len, reverse=True))
        self._specials = re.compile(f"({alternatives})")

    @classmethod
    def from_dir(cls, path: str | Path, specials: tuple[str, ...]) -> QwenTokenizer:
        """Read ``vocab.json`` and ``tokenizer_config.json`` from a ``CosyVoice-BlankEN`` folder.

        Args:
            path: the folder.
            specials: the family's added special tokens, in the reference's order (its family's ``specials``).
        Raises:
            ModelDirError: a missing or malformed file, named with what is wrong.
        """
        path = Path(path)
        return _load(str(path.resolve()), specials)

    @classmethod
    def check_dir(cls, path: str | Path, specials: tuple[str, ...]) -> None:
        """Build the tokenizer of a ``CosyVoice-BlankEN`` folder once, to refuse bad files now, without keeping
        it (the converter's check: the served bundle builds its own from its copies).

        Raises:
            ModelDirError: as :meth:`from_dir`.
        """
        _build(Path(path).resolve(), specials)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: special tokens written in the raw text become their ids, every stretch between
        them is NFC-normalised and BPE-encoded."""
        ids: list[int] = []
        for i, piece in enumerate(self._specials.split(text)):
            if i % 2:
                ids.append(self.special_ids[piece])
            elif piece:
                ids += self.encoding.encode_ordinary(unicodedata.normalize("NFC", piece))
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)


_lock = threading.Lock()


def _load(path: str, specials: tuple[str, ...]) -> QwenTokenizer:
    with _lock:
        return _load_cached(path, specials)


@functools.lru_cache(maxsize=4)
def _load_cached(path: str, specials: tuple[str, ...]) -> QwenTokenizer:
    return _build(Path(path), specials)


def _byte_ranks(vocab: dict[str, Any], where: Path) -> dict[bytes, int]:
    """The vocabulary's tokens as bytes (each character a byte's printable stand-in) -> their ids. All tokens at
    once through numpy (the full-size vocabulary's 151k tokens: ~50 ms, ~120 with a generator per token)."""
    import itertools

    import numpy as np

    to_byte = _unicode_to_byte()
    lut = np.full(max(map(ord, to_byte)) + 1, -1, np.int16)
    for ch, b in to_byte.items():
        lut[ord(ch)] = b
    joined = "".join(vocab)
    codes = np.frombuffer(joined.encode("utf-32-le", "surrogatepass"), np.uint32)
    wrong = codes >= lut.size
    wrong[~wrong] = lut[codes[~wrong]] < 0
    if wrong.any():
        ch = joined[int(np.argmax(wrong))]
        token = next(t for t in vocab if ch in t)
        raise ModelDirError(f"{where}: token {token!r} is not byte-level BPE text")
    raw = lut[codes].astype(np.uint8).tobytes()
    for token, rank in vocab.items():
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ModelDirError(f"{where}: token {token!r} has id {rank!r}, not a non-negative integer")
    ends = list(itertools.accumulate(map(len, vocab), initial=0))
    keys = [raw[a:b] for a, b in itertools.pairwise(ends)]
    return dict(zip(keys, vocab.values(), strict=True))


def _build(folder: Path, added: tuple[str, ...]) -> QwenTokenizer:
    vocab_path, config_path = folder / "vocab.json", folder / "tokenizer_config.json"
    try:
        vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelDirError(f"cannot read the Qwen vocabulary {vocab_path}: {e}") from e
    if not isinstance(vocab, dict) or not vocab:
        raise ModelDirError(f"{vocab_path}: expected a JSON object of token -> id")
    ranks = _byte_ranks(vocab, vocab_path)
    if len(set(ranks.values())) != len(ranks) or max(ranks.values()) != len(ranks) - 1:
        raise ModelDirError(f"{vocab_path}: the ids must be 0..{len(ranks) - 1}, each once")
    specials: dict[str, int] = {}
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        for key, entry in config.get("added_tokens_decoder", {}).items():
            specials[str(entry["content"])] = int(key)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelDirError(f"cannot read the added tokens of {config_path}: {e}") from e
    # the family's tokens take the next free ids, in order (len(tokenizer) grows by one per new token)
    next_id = max([*ranks.values(), *specials.values()]) + 1
    for token in added:
        if token not in specials:
            specials[token] = next_id
            next_id += 1
    try:
        return QwenTokenizer(ranks, specials, name=f"qwen:{folder}")
    except ValueError as e:
        raise ModelDirError(f"{folder}: cannot build the tokenizer: {e}") from e
