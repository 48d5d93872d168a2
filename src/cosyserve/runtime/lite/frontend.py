"""The lite runtime's prompt frontend: a prompt recording's features in numpy, its ONNX models on ONNX Runtime.

What :class:`cosyserve.frontend.zeroshot.Frontend` computes for CosyVoice-300M's prompt modes, without torch:
the 16 kHz prompt's campplus embedding (from its mean-normalised Kaldi fbank), its 50 Hz speech tokens (from
whisper's 128-bin log-mel) and the flow's prompt mel of the 24 kHz prompt (the 22.05 kHz model's Matcha mel, as
the reference computes it at this commit). Entries are the registry's numpy layout (the reference's spk2info keys).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from cosyserve.core.errors import AudioError
from cosyserve.frontend import features_np
from cosyserve.frontend.audio import load_wav_np
from cosyserve.frontend.prompt import (
    AudioSource,
    OnnxModel,
    PromptAudio,
    PromptLimits,
    check_token_seconds,
    load_prompt,
)

__all__ = ["LiteFrontend"]


def _ids(ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray([ids], dtype=np.int32).reshape(1, -1), np.asarray([len(ids)], dtype=np.int32)


class LiteFrontend:
    """Prompt features for zero_shot, cross_lingual and vc (see the module docstring).

    Args:
        campplus, speech_tokenizer: the ONNX files.
        check: called with a file before its session opens (the bundle's size and checksum check).
        tokenize: ``text -> ids`` (the model's tokenizer).
        limits: checks on prompt audio.
    """

    def __init__(
        self,
        campplus: Path,
        speech_tokenizer: Path,
        tokenize: Callable[[str], list[int]],
        check: Callable[[Path], None] | None = None,
        limits: PromptLimits | None = None,
    ) -> None:
        self.campplus = OnnxModel(campplus, check)
        self.speech_tokenizer = OnnxModel(speech_tokenizer, check)
        self.tokenize = tokenize
        self.limits = limits or PromptLimits()

    def load_sessions(self) -> None:
        self.campplus.session()
        self.speech_tokenizer.session()

    def prompt(
        self, wav: AudioSource | PromptAudio, what: str = "prompt audio", param: str = "prompt_wav"
    ) -> PromptAudio:
        if isinstance(wav, PromptAudio):
            return wav
        try:
            return load_prompt(wav, self.limits, what, loader=load_wav_np)
        except AudioError as e:
            e.param = param
            raise

    def speech_tokens(self, speech_16k: np.ndarray) -> list[int]:
        """16 kHz waveform [1, N] (at most 30 s) -> 50 Hz speech token ids."""
        check_token_seconds(speech_16k, self.limits)
        feat = features_np.whisper_log_mel(speech_16k, n_mels=128)  # [1, 128, frames]
        tokens = self.speech_tokenizer.run(feat, np.array([feat.shape[2]], dtype=np.int32))
        return [int(t) for t in np.asarray(tokens).reshape(-1)]

    def embedding(self, speech_16k: np.ndarray) -> np.ndarray:
        """16 kHz waveform [1, N] -> campplus embedding float32 [1, 192]."""
        feat = features_np.speaker_fbank(speech_16k)  # [frames, 80]
        return np.ascontiguousarray(self.campplus.run(feat[None]), dtype=np.float32).reshape(1, -1)

    def speech_feat(self, speech_24k: np.ndarray) -> np.ndarray:
        """24 kHz waveform [1, N] -> the flow's prompt mel [1, F, 80]."""
        return np.ascontiguousarray(features_np.mel_spectrogram(speech_24k).transpose(0, 2, 1))

    def prompt_features(self, prompt_text: str, wav: AudioSource | PromptAudio) -> dict[str, Any]:
        """The entry the reference's ``add_zero_shot_spk`` stores (numpy arrays, the registry's layout)."""
        prompt = self.prompt(wav)
        text, text_len = _ids(self.tokenize(prompt_text))
        feat = self.speech_feat(prompt.speech_24k)
        tokens, tokens_len = _ids(self.speech_tokens(prompt.speech_16k))
        embedding = self.embedding(prompt.speech_16k)
        return {
            "prompt_text": text,
            "prompt_text_len": text_len,
            "llm_prompt_speech_token": tokens,
            "llm_prompt_speech_token_len": tokens_len,
            "flow_prompt_speech_token": tokens,
            "flow_prompt_speech_token_len": tokens_len,
            "prompt_speech_feat": feat,
            "prompt_speech_feat_len": np.asarray([feat.shape[1]], dtype=np.int32),
            "llm_embedding": embedding,
            "flow_embedding": embedding,
        }

    def vc(self, source_wav: AudioSource, prompt_wav: AudioSource) -> dict[str, Any]:
        """Voice conversion's inputs: the source's speech tokens, the prompt's tokens, mel and embedding."""
        prompt = self.prompt(prompt_wav)
        source = self.prompt(source_wav, "source audio", "source_wav")
        feat = self.speech_feat(prompt.speech_24k)
        return {
            "source_speech_token": _ids(self.speech_tokens(source.speech_16k))[0],
            "flow_prompt_speech_token": _ids(self.speech_tokens(prompt.speech_16k))[0],
            "prompt_speech_feat": feat,
            "flow_embedding": self.embedding(prompt.speech_16k),
        }
