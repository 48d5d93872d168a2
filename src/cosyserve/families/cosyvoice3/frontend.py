"""CosyVoice3's frontend: CosyVoice2's (:class:`~cosyserve.frontend.zeroshot.Frontend`) with CosyVoice3's tokenizer,
``speech_tokenizer_v3.onnx`` and the yaml's prompt mel (80 bins up to 12 kHz: ``fmax`` null).

The reference's frontends are otherwise CosyVoice2's: zero-shot, cross-lingual and instruct2 trim the prompt to
2 mel frames per speech token (resample rate 24000); voice conversion trims nothing (the prompt mel and tokens keep
their own lengths, and the flow's output then starts with the frames of the last prompt tokens). The frontend adds
no ``<|endofprompt|>``: the texts must carry it (see :class:`~cosyserve.models.cosyvoice3_lm.CosyVoice3LM`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cosyserve.errors import ModelConfigError
from cosyserve.frontend.prompt import OnnxModel
from cosyserve.frontend.qwen_tokenizer import COSYVOICE3_SPECIALS, QwenTokenizer
from cosyserve.frontend.zeroshot import Frontend
from cosyserve.modelconfig import QWEN_DIR

__all__ = ["SPEECH_TOKENIZER_FILE", "build_frontend", "build_tokenizer"]

SPEECH_TOKENIZER_FILE = "speech_tokenizer_v3.onnx"  # 25 Hz FSQ tokens (6561 codes)


def build_tokenizer(model_dir: str | Path) -> QwenTokenizer:
    """The text tokenizer: ``CosyVoice-BlankEN``'s Qwen BPE with CosyVoice3's 280 special tokens."""
    return QwenTokenizer.from_dir(Path(model_dir) / QWEN_DIR, COSYVOICE3_SPECIALS)


def build_frontend(model_dir: str | Path, config: Any, speakers: dict | None = None) -> Frontend:
    """The frontend of an official CosyVoice3 directory.

    Args:
        model_dir: the directory (``CosyVoice-BlankEN/``, ``campplus.onnx``, ``speech_tokenizer_v3.onnx``).
        config: its :class:`~cosyserve.modelconfig.ModelConfig` (the prompt mel comes from ``feat_extractor``).
        speakers: spk2info, default none.
    """
    if config.feat_extractor is None:
        raise ModelConfigError(
            f"{config.source}: no feat_extractor (the prompt mel); a CosyVoice3 yaml has one"
        )
    frontend = Frontend(
        model_dir, speakers, tokenizer=build_tokenizer(model_dir), feat_extractor=config.feat_extractor
    )
    frontend.speech_tokenizer = OnnxModel(Path(model_dir) / SPEECH_TOKENIZER_FILE)
    return frontend
