"""CosyVoice3's frontend and tokenizer, as its family builds them (:class:`~cosyserve.families.cosyvoice3.CosyVoice3`).

The reference's frontends are CosyVoice2's with CosyVoice3's tokenizer (280 more special tokens),
``speech_tokenizer_v3.onnx`` and the yaml's prompt mel (80 bins up to 12 kHz: ``fmax`` null): zero-shot,
cross-lingual and instruct2 trim the prompt to 2 mel frames per speech token (resample rate 24000); voice
conversion trims nothing (the prompt mel and tokens keep their own lengths, and the flow's output then starts with
the frames of the last prompt tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cosyserve.families import family_named

__all__ = ["build_frontend", "build_tokenizer"]


def build_tokenizer(model_dir: str | Path) -> Any:
    """The text tokenizer: ``CosyVoice-BlankEN``'s Qwen BPE with CosyVoice3's 280 special tokens."""
    factory = family_named("cosyvoice3").tokenizer(Path(model_dir))
    assert factory is not None
    return factory()


def build_frontend(model_dir: str | Path, config: Any, speakers: dict | None = None) -> Any:
    """The prompt frontend of an official CosyVoice3 directory (see :meth:`Family.frontend`)."""
    return family_named("cosyvoice3").frontend(Path(model_dir), config, speakers)
