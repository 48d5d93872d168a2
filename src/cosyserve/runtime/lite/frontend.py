"""The lite runtime's prompt frontend: a prompt recording's features in numpy, its ONNX models on ONNX Runtime.

What :class:`cosyserve.frontend.zeroshot.Frontend` computes for the prompt modes of every family, without torch:
the 16 kHz prompt's campplus embedding (from its mean-normalised Kaldi fbank), its speech tokens (whisper's
128-bin log-mel into the family's speech tokenizer: v1's 50 Hz, v2's and v3's 25 Hz) and the flow's prompt mel of
the 24 kHz prompt (the model's Matcha mel: CosyVoice-300M's 22.05 kHz one, as the reference computes it at this
commit, or the yaml's ``feat_extractor``), trimmed to the family's mel frames per token (CosyVoice2/3: 2). Entries
are the registry's numpy layout (the reference's spk2info keys).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from cosyserve.core.errors import BundleError
from cosyserve.frontend import features_np
from cosyserve.frontend.audio import load_wav_np
from cosyserve.frontend.features_np import MelSettings
from cosyserve.frontend.prompt import (
    AudioSource,
    OnnxModel,
    PromptAudio,
    PromptLimits,
    check_token_seconds,
    prompt_audio,
    prompt_entry,
    vc_input,
)

__all__ = ["LiteFrontend"]


def _ids(ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray([ids], dtype=np.int32).reshape(1, -1), np.asarray([len(ids)], dtype=np.int32)


class LiteFrontend:
    """Prompt features for zero_shot, cross_lingual, instruct2 and vc (see the module docstring).

    Args:
        campplus, speech_tokenizer: the ONNX files (the family's: :attr:`~cosyserve.families.base.Family.onnx_files`).
        check: called with a file before its session opens (the bundle's size and checksum check).
        tokenize: ``text -> ids`` (the model's tokenizer).
        limits: checks on prompt audio.
        mel: the prompt mel's settings (a :class:`~cosyserve.frontend.features_np.MelSettings` or its
            fields, as a bundle's manifest stores the yaml's ``feat_extractor``); None: CosyVoice-300M's.
        mel_per_token: the prompt mel's frames per speech token the flow takes
            (:attr:`~cosyserve.families.base.Family.prompt_mel_per_token`): zero-shot prompts are trimmed to exactly
            that ratio (CosyVoice2/3: 2); None keeps them as extracted (CosyVoice-300M). Voice conversion trims
            nothing, as in the reference.
    """

    def __init__(
        self,
        campplus: Path,
        speech_tokenizer: Path,
        tokenize: Callable[[str], list[int]],
        check: Callable[[Path], None] | None = None,
        limits: PromptLimits | None = None,
        *,
        mel: MelSettings | Mapping[str, Any] | None = None,
        mel_per_token: int | None = None,
    ) -> None:
        self.campplus = OnnxModel(campplus, check)
        self.speech_tokenizer = OnnxModel(speech_tokenizer, check)
        self.tokenize = tokenize
        self.limits = limits or PromptLimits()
        if mel is not None and not isinstance(mel, MelSettings):
            try:
                mel = MelSettings(**mel)
            except (TypeError, ValueError) as e:
                raise BundleError(
                    f"the prompt mel's settings (feat_extractor) {dict(mel)!r} are unusable: {e}"
                ) from e
        self.mel: Callable[[np.ndarray], np.ndarray] = mel or features_np.mel_spectrogram
        if mel_per_token is not None and mel_per_token < 1:
            raise ValueError(f"mel_per_token must be a positive integer or None, got {mel_per_token!r}")
        self.mel_per_token = mel_per_token

    @classmethod
    def for_family(
        cls,
        family: Any,
        config: Mapping[str, Any],
        onnx_paths: Mapping[str, Path | None],
        tokenize: Callable[[str], list[int]],
        check: Callable[[Path], None] | None = None,
        limits: PromptLimits | None = None,
    ) -> LiteFrontend:
        """The frontend of a model of ``family`` (a :class:`~cosyserve.families.base.Family`) whose config is
        ``config`` (a bundle's ``manifest.json`` ``config``, plain data: its ``feat_extractor`` gives the prompt mel)
        and whose ONNX files are at ``onnx_paths`` (file name -> path, for the family's
        :attr:`~cosyserve.families.base.Family.onnx_files`).

        Raises:
            BundleError: an ONNX file is missing, or a CosyVoice2/3 config has no (or an unusable) feat_extractor.
        """
        campplus, speech_tokenizer = (onnx_paths.get(name) for name in family.onnx_files)
        if campplus is None or speech_tokenizer is None:
            missing = [n for n in family.onnx_files if onnx_paths.get(n) is None]
            raise BundleError(f"the prompt modes need {' and '.join(missing)}, which this model lacks")
        mel = config.get("feat_extractor")
        if mel is None and family.prompt_mel_per_token is not None:
            # the 300M default would silently give a 24 kHz model the wrong mel
            raise BundleError(
                f"this {family.title} bundle's config has no feat_extractor (the prompt mel's settings): convert "
                "the model again with --runtime lite"
            )
        return cls(
            campplus,
            speech_tokenizer,
            tokenize,
            check,
            limits,
            mel=mel,
            mel_per_token=family.prompt_mel_per_token,
        )

    def load_sessions(self) -> None:
        self.campplus.session()
        self.speech_tokenizer.session()

    def prompt(
        self, wav: AudioSource | PromptAudio, what: str = "prompt audio", param: str = "prompt_wav"
    ) -> PromptAudio:
        return prompt_audio(wav, self.limits, what, param, loader=load_wav_np)

    def speech_tokens(self, speech_16k: np.ndarray) -> list[int]:
        """16 kHz waveform [1, N] (at most 30 s) -> speech token ids (the speech tokenizer's rate)."""
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
        return np.ascontiguousarray(self.mel(speech_24k).transpose(0, 2, 1))

    def prompt_features(self, prompt_text: str, wav: AudioSource | PromptAudio) -> dict[str, Any]:
        """The entry the reference's ``add_zero_shot_spk`` stores (numpy arrays, the registry's layout;
        :func:`cosyserve.frontend.prompt.prompt_entry`)."""
        prompt = self.prompt(wav)
        feat = self.speech_feat(prompt.speech_24k)
        tokens = _ids(self.speech_tokens(prompt.speech_16k))[0]
        embedding = self.embedding(prompt.speech_16k)
        return prompt_entry(_ids(self.tokenize(prompt_text)), feat, tokens, embedding, self.mel_per_token)

    def vc(
        self, source_wav: AudioSource | PromptAudio, prompt_wav: AudioSource | PromptAudio
    ) -> dict[str, Any]:
        """Voice conversion's inputs (:func:`cosyserve.frontend.prompt.vc_input`, the reference's ``frontend_vc``)."""
        prompt = self.prompt(prompt_wav)
        source = self.prompt(source_wav, "source audio", "source_wav")
        return vc_input(
            _ids(self.speech_tokens(source.speech_16k))[0],
            _ids(self.speech_tokens(prompt.speech_16k))[0],
            self.speech_feat(prompt.speech_24k),
            self.embedding(prompt.speech_16k),
        )

    # the torch Frontend's name for it, which the shared pipeline calls on either runtime's frontend
    frontend_vc = vc
