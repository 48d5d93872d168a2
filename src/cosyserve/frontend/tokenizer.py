"""The text tokenizer CosyVoice-300M uses: whisper's multilingual BPE with its special tokens, via tiktoken.

The vocabulary file ships inside this package (``assets/multilingual.tiktoken``, MIT, from openai-whisper; see
``assets/LICENSE.multilingual.tiktoken``), so users get it without installing openai-whisper, whose install pulls
triton. The special tokens are laid out after the 50257 BPE ranks in whisper's order: end of text, start of
transcript, 100 language tags, task and control tokens, then 1501 timestamps: 51866 ids in all, the
``text_token_size`` of the CosyVoice-300M LLM.
"""

from __future__ import annotations

import binascii
import threading
from functools import lru_cache
from pathlib import Path

__all__ = ["LANGUAGES", "Tokenizer", "get_tokenizer"]

# whisper's language codes in its table order; the first `num_languages` become <|xx|> special tokens.
LANGUAGES = (
    "en zh de es ru ko fr ja pt tr pl ca nl ar sv it id hi fi vi he uk el ms cs ro da hu ta no th ur hr bg lt la "
    "mi ml cy sk te fa lv bn sr az sl kn et mk br eu is hy ne mn bs kk sq sw gl mr pa si km sn yo so af oc ka be "
    "tg sd gu am yi lo uz fo ht ps tk nn mt sa lb my bo tl mg as tt haw ln ha ba jw su yue"
).split()

_PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _read_ranks(path: Path | None) -> dict[bytes, int]:
    if path is None:
        data = (Path(__file__).parent / "assets" / "multilingual.tiktoken").read_bytes()
    else:
        data = Path(path).read_bytes()
    # "<base64 token> <rank>" per line; split + map keeps the 50k-entry parse in C (twice as fast as per line)
    fields = data.split()
    if len(fields) % 2:
        raise ValueError(f"{path or 'multilingual.tiktoken'}: malformed vocabulary (odd number of fields)")
    try:
        ranks = dict(zip(map(binascii.a2b_base64, fields[0::2]), map(int, fields[1::2]), strict=True))
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{path or 'multilingual.tiktoken'}: malformed vocabulary: {e}") from e
    return ranks


class Tokenizer:
    """Encode text to token ids (and back) exactly as ``whisper.tokenizer.get_tokenizer(multilingual=True)``."""

    def __init__(self, num_languages: int = 100, vocab_path: Path | None = None) -> None:
        import tiktoken

        if not 1 <= num_languages <= len(LANGUAGES):
            raise ValueError(f"num_languages must be in 1..{len(LANGUAGES)}, got {num_languages}")
        ranks = _read_ranks(vocab_path)
        specials = [
            "<|endoftext|>",
            "<|startoftranscript|>",
            *[f"<|{lang}|>" for lang in LANGUAGES[:num_languages]],
            "<|translate|>",
            "<|transcribe|>",
            "<|startoflm|>",
            "<|startofprev|>",
            "<|nospeech|>",
            "<|notimestamps|>",
            *[f"<|{i * 0.02:.2f}|>" for i in range(1501)],
        ]
        n_vocab = len(ranks)
        special_tokens = {tok: n_vocab + i for i, tok in enumerate(specials)}
        self.encoding = tiktoken.Encoding(
            name="multilingual",
            explicit_n_vocab=n_vocab + len(specials),
            pat_str=_PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=special_tokens,
        )
        self.vocab_size = n_vocab + len(specials)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|zh|>``) become their special ids."""
        return self.encoding.encode(text, allowed_special="all")

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)


_build_lock = threading.Lock()


def get_tokenizer(num_languages: int = 100) -> Tokenizer:
    """The shared tokenizer instance, built once even when several threads ask first (building it parses the
    50k-entry vocabulary)."""
    with _build_lock:
        return _shared(num_languages)


@lru_cache(maxsize=4)
def _shared(num_languages: int) -> Tokenizer:
    return Tokenizer(num_languages)
