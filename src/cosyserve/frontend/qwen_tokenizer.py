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
theirs, the family's take the next free ids in list order. CosyVoice-300M tags such as ``<|en|>`` are plain text
here, as in the reference.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import unicodedata
from pathlib import Path

from cosyserve.core.errors import ModelDirError

__all__ = ["COSYVOICE2_SPECIALS", "COSYVOICE3_SPECIALS", "QwenTokenizer"]

_PAT_STR = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# the reference's CosyVoice2Tokenizer additions, in its order
COSYVOICE2_SPECIALS = (
    "<|endofprompt|>",
    "[breath]",
    "<strong>",
    "</strong>",
    "[noise]",
    "[laughter]",
    "[cough]",
    "[clucking]",
    "[accent]",
    "[quick_breath]",
    "<laughter>",
    "</laughter>",
    "[hissing]",
    "[sigh]",
    "[vocalized-noise]",
    "[lipsmack]",
    "[mn]",
)

# CosyVoice3's additions after CosyVoice2's, in the reference's order: English phones (ARPAbet, vowels with and
# without a stress digit), then pinyin initials and toned finals (NFC, precomposed tone marks)
_PHONES = """
AA AA0 AA1 AA2 AE AE0 AE1 AE2 AH AH0 AH1 AH2 AO AO0 AO1 AO2 AW AW0 AW1 AW2 AY AY0 AY1 AY2 B CH D DH EH EH0 EH1 EH2
ER ER0 ER1 ER2 EY EY0 EY1 EY2 F G HH IH IH0 IH1 IH2 IY IY0 IY1 IY2 JH K L M N NG OW OW0 OW1 OW2 OY OY0 OY1 OY2 P R S
SH T TH UH UH0 UH1 UH2 UW UW0 UW1 UW2 V W Y Z ZH
"""
_PINYIN = """
a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo iè ié iòng ióng iù iú iā
iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou p q r s sh t u uang ue un uo uà uài uàn uàng
uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng uē uě uī uō uǎ uǎi uǎn uǎng uǐ uǒ vè w x y z zh à ài àn àng ào á
ái án áng áo è èi èn èng èr é éi én éng ér ì ìn ìng í ín íng ò òng òu ó óng óu ù ùn ú ún ā āi ān āng āo ē ēi ēn
ēng ě ěi ěn ěng ěr ī īn īng ō ōng ōu ū ūn ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ
"""
COSYVOICE3_SPECIALS = (
    *COSYVOICE2_SPECIALS,
    "<|endofsystem|>",
    *(f"[{p}]" for p in _PHONES.split()),
    *(f"[{unicodedata.normalize('NFC', p)}]" for p in _PINYIN.split()),
)


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
    def from_dir(cls, path: str | Path, specials: tuple[str, ...] = COSYVOICE2_SPECIALS) -> QwenTokenizer:
        """Read ``vocab.json`` and ``tokenizer_config.json`` from a ``CosyVoice-BlankEN`` folder.

        Args:
            path: the folder.
            specials: the family's added special tokens, in the reference's order (:data:`COSYVOICE2_SPECIALS`,
                :data:`COSYVOICE3_SPECIALS`).
        Raises:
            ModelDirError: a missing or malformed file, named with what is wrong.
        """
        path = Path(path)
        return _load(str(path.resolve()), specials)

    @classmethod
    def check_dir(cls, path: str | Path, specials: tuple[str, ...] = COSYVOICE2_SPECIALS) -> None:
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


def _build(folder: Path, added: tuple[str, ...] = COSYVOICE2_SPECIALS) -> QwenTokenizer:
    vocab_path, config_path = folder / "vocab.json", folder / "tokenizer_config.json"
    try:
        vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelDirError(f"cannot read the Qwen vocabulary {vocab_path}: {e}") from e
    if not isinstance(vocab, dict) or not vocab:
        raise ModelDirError(f"{vocab_path}: expected a JSON object of token -> id")
    to_byte = _unicode_to_byte()
    ranks: dict[bytes, int] = {}
    for token, rank in vocab.items():
        try:
            key = bytes(to_byte[ch] for ch in token)
        except KeyError:
            raise ModelDirError(f"{vocab_path}: token {token!r} is not byte-level BPE text") from None
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ModelDirError(f"{vocab_path}: token {token!r} has id {rank!r}, not a non-negative integer")
        ranks[key] = rank
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
