"""Model inputs for every CosyVoice-300M mode: the reference's ``CosyVoiceFrontEnd.frontend_*``.

SFT and instruct need only the tokenizer and ``spk2info``. Zero-shot, cross-lingual and voice conversion
also read a prompt recording and run two ONNX models from the model dir with onnxruntime:

- ``campplus.onnx``: speaker embedding from the 16 kHz prompt's mean-normalised Kaldi fbank,
  ``[1, frames, 80]`` float32 -> ``[1, 192]``.
- ``speech_tokenizer_v1.onnx``: 50 Hz speech tokens from the 16 kHz prompt's 128-bin whisper log-mel,
  ``feats [1, 128, frames]`` float32 and ``feats_length [1]`` int32 -> ids ``[1, ceil(frames / 2)]``.

The prompt's flow features are the yaml's mel extractor on the prompt resampled to 24 kHz (hard-coded so in
the reference at this commit, even for the 22.05 kHz model).

The ONNX sessions are created on first use (one load shared by concurrent first callers) or by
:meth:`Frontend.load_sessions` (e.g. in the background after the server is ready); importing this module or
serving SFT never imports onnxruntime. A model dir without the ONNX files serves SFT and instruct; asking
it for a prompt-based mode raises :class:`ModeUnavailableError` naming the missing file.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cosyserve.core.errors import ClientError, ModeUnavailableError, UnknownVoiceError, shown
from cosyserve.core.modes import PROMPT_MODES  # the modes that need both ONNX models
from cosyserve.frontend.features import mel_spectrogram, speaker_fbank, whisper_log_mel
from cosyserve.frontend.prompt import (  # noqa: F401 - the builders are re-exported
    CAMPPLUS_FILE,
    SPEECH_TOKENIZER_FILE,
    AudioSource,
    OnnxModel,
    PromptAudio,
    PromptLimits,
    check_token_seconds,
    instruct_input,
    load_prompt,
    prompt_audio,
    prompt_entry,
    prompt_input,
    sft_input,
    vc_input,
)

__all__ = [
    "PROMPT_MODES",
    "Frontend",
    "Ids",
    "OnnxModel",
    "PromptAudio",
    "PromptLimits",
    "instruct_input",
    "load_prompt",
    "prompt_input",
    "sft_input",
]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------------------
# the frontend


def _ids(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.tensor([ids], dtype=torch.int32)  # [1, n]
    return tokens, torch.tensor([tokens.shape[1]], dtype=torch.int32)


Ids = tuple[torch.Tensor, torch.Tensor]  # token ids int32 [1, n] and their length int32 [1]


class Frontend:
    """Builds the model input dicts of the reference frontend, key for key.

    Args:
        model_dir: the official model dir (``campplus.onnx``, ``speech_tokenizer_v1.onnx`` are optional).
        speakers: spk2info (speaker id -> ``{"embedding": [1, 192], ...}``); default none.
        tokenizer: has ``encode(text) -> list[int]``; default the whisper multilingual tokenizer.
        feat_extractor: waveform [1, N] -> mel [1, 80, frames]; default the CosyVoice-300M yaml's
            ``mel_spectrogram`` (n_fft 1024, hop 256, 80 mels, 22050 Hz filterbank, fmax 8000).
        limits: checks on prompt audio.
        mel_per_token: the prompt mel's frames per speech token the flow takes (its family's
            :attr:`~cosyserve.families.base.Family.prompt_mel_per_token`): the prompt's mel and tokens are trimmed to
            exactly that ratio (CosyVoice2/3: 2); None keeps them as extracted (CosyVoice-300M).
    """

    def __init__(
        self,
        model_dir: str | Path,
        speakers: dict[str, dict[str, torch.Tensor]] | None = None,
        *,
        tokenizer: Any = None,
        feat_extractor: Callable[[torch.Tensor], torch.Tensor] | None = None,
        limits: PromptLimits | None = None,
        mel_per_token: int | None = None,
    ) -> None:
        if tokenizer is None:
            from cosyserve.frontend.tokenizer import get_tokenizer

            tokenizer = get_tokenizer()
        self.model_dir = Path(model_dir)
        self.speakers = speakers if speakers is not None else {}
        self.tokenizer = tokenizer
        self.feat_extractor = feat_extractor or mel_spectrogram
        self.limits = limits or PromptLimits()
        self.mel_per_token = mel_per_token
        self.campplus = OnnxModel(self.model_dir / CAMPPLUS_FILE)
        self.speech_tokenizer = OnnxModel(self.model_dir / SPEECH_TOKENIZER_FILE)

    # --- availability -------------------------------------------------------------------------------------------

    def missing_files(self) -> list[str]:
        """The ONNX files the prompt-based modes need that the model dir lacks."""
        return [m.path.name for m in (self.campplus, self.speech_tokenizer) if not m.path.is_file()]

    def unavailable_modes(self) -> dict[str, str]:
        """mode -> why it cannot run (empty when every mode can)."""
        missing = self.missing_files()
        if not missing:
            return {}
        why = f"model dir {self.model_dir} has no {' or '.join(missing)}"
        return dict.fromkeys(PROMPT_MODES, why)

    def require(self, mode: str) -> None:
        """Raise :class:`ModeUnavailableError` when ``mode`` cannot run on this model dir."""
        why = self.unavailable_modes().get(mode)
        if why is not None:
            raise ModeUnavailableError(
                f"{mode} synthesis is unavailable: {why} (copy it from the official model to enable {mode})"
            )

    def load_sessions(self) -> None:
        """Create both ONNX sessions now (e.g. in the background after startup); idempotent."""
        self.require("zero_shot")
        self.campplus.session()
        self.speech_tokenizer.session()

    # --- extractors -----------------------------------------------------------------------------------------------

    def extract_text_token(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``text`` -> (ids int32 [1, n], length int32 [1])."""
        return _ids(self.tokenizer.encode(text))

    @torch.inference_mode()
    def extract_speech_token(self, speech_16k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """16 kHz waveform [1, N] (at most 30 s) -> (speech tokens int32 [1, S], length int32 [1])."""
        check_token_seconds(speech_16k, self.limits)
        feat = whisper_log_mel(speech_16k, n_mels=128)  # [1, 128, frames]
        lengths = np.array([feat.shape[2]], dtype=np.int32)
        tokens = self.speech_tokenizer.run(feat.numpy(), lengths)  # [1, ceil(frames / 2)] int64
        return _ids(tokens.reshape(-1).tolist())

    @torch.inference_mode()
    def extract_spk_embedding(self, speech_16k: torch.Tensor) -> torch.Tensor:
        """16 kHz waveform [1, N] -> campplus speaker embedding float32 [1, 192]."""
        feat = speaker_fbank(speech_16k)  # [frames, 80]
        embedding = self.campplus.run(feat.unsqueeze(0).numpy())  # [1, 192]
        return torch.from_numpy(np.ascontiguousarray(embedding, dtype=np.float32).reshape(1, -1))

    @torch.inference_mode()
    def extract_speech_feat(self, speech_24k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """24 kHz waveform [1, N] -> (flow prompt mel float32 [1, F, 80], length int32 [1])."""
        feat = self.feat_extractor(speech_24k)  # [1, 80, F]
        feat = feat.transpose(1, 2).contiguous()  # [1, F, 80]
        return feat, torch.tensor([feat.shape[1]], dtype=torch.int32)

    def _prompt(
        self, prompt_wav: AudioSource | PromptAudio, what: str = "prompt audio", param: str = "prompt_wav"
    ) -> PromptAudio:
        return prompt_audio(prompt_wav, self.limits, what, param)

    # --- modes ------------------------------------------------------------------------------------------------------

    def speaker_embedding(self, spk_id: str) -> torch.Tensor:
        if spk_id not in self.speakers:
            known = ", ".join(sorted(self.speakers)) or "none (this model dir has no spk2info.pt)"
            raise UnknownVoiceError(f"unknown speaker {shown(spk_id)}; known speakers: {known}")
        return self.speakers[spk_id]["embedding"]

    def frontend_sft(
        self, tts_text: str, spk_id: str | None = None, *, embedding: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """Pre-defined speaker: ``text``, ``text_len``, ``llm_embedding``, ``flow_embedding`` ([1, 192]).

        Give ``spk_id`` (a key of ``speakers``) or an ``embedding`` [1, 192].
        """
        if (spk_id is None) == (embedding is None):
            raise ClientError("give exactly one of spk_id and embedding")
        emb = self.speaker_embedding(spk_id) if spk_id is not None else embedding
        assert emb is not None
        return sft_input(self.extract_text_token(tts_text), emb)

    def frontend_zero_shot(
        self,
        tts_text: str,
        prompt_text: str,
        prompt_wav: AudioSource | PromptAudio,
        zero_shot_spk_id: str = "",
    ) -> dict[str, torch.Tensor]:
        """Voice cloning from a prompt recording and its transcript.

        Returns ``prompt_text(_len)``, ``llm_prompt_speech_token(_len)`` = ``flow_prompt_speech_token(_len)``,
        ``prompt_speech_feat(_len)``, ``llm_embedding`` = ``flow_embedding``, ``text(_len)``. With a
        ``zero_shot_spk_id`` (a saved prompt in ``speakers``) the saved entry is used instead of a recording. (The
        reference's ``resample_rate`` argument is this frontend's ``mel_per_token``, which the family sets.)
        """
        if zero_shot_spk_id:
            if zero_shot_spk_id not in self.speakers:
                raise UnknownVoiceError(f"unknown saved speaker {shown(zero_shot_spk_id)}")
            entry = self.speakers[zero_shot_spk_id]
        else:
            entry = self.prompt_features(prompt_text, prompt_wav)
        return prompt_input(self.extract_text_token(tts_text), entry, "zero_shot")

    def prompt_features(
        self, prompt_text: str, prompt_wav: AudioSource | PromptAudio
    ) -> dict[str, torch.Tensor]:
        """The zero-shot prompt features of a recording and its transcript: the entry the reference's
        ``add_zero_shot_spk`` stores (``frontend_zero_shot``'s dict without ``text``/``text_len``).

        Raises:
            ModeUnavailableError: the model has no ONNX models; AudioError: unusable audio.
        """
        self.require("zero_shot")
        with torch.inference_mode():
            prompt = self._prompt(prompt_wav)
            feat, _ = self.extract_speech_feat(prompt.speech_24k)
            tokens, _ = self.extract_speech_token(prompt.speech_16k)
            embedding = self.extract_spk_embedding(prompt.speech_16k)
            return prompt_entry(
                self.extract_text_token(prompt_text), feat, tokens, embedding, self.mel_per_token
            )

    def frontend_cross_lingual(
        self,
        tts_text: str,
        prompt_wav: AudioSource | PromptAudio,
        zero_shot_spk_id: str = "",
    ) -> dict[str, torch.Tensor]:
        """The zero-shot dict without the LLM prompt (no prompt text, no LLM prompt speech tokens)."""
        if zero_shot_spk_id:
            if zero_shot_spk_id not in self.speakers:
                raise UnknownVoiceError(f"unknown saved speaker {shown(zero_shot_spk_id)}")
            entry = self.speakers[zero_shot_spk_id]
        else:
            self.require("cross_lingual")
            entry = self.prompt_features("", prompt_wav)
        return prompt_input(self.extract_text_token(tts_text), entry, "cross_lingual")

    def frontend_instruct(
        self,
        tts_text: str,
        spk_id: str | None = None,
        instruct_text: str = "",
        *,
        embedding: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Pre-defined speaker with a style instruction: ``text(_len)``, ``flow_embedding`` (no LLM embedding:
        the reference drops it to keep the speaker out of the LM), ``prompt_text(_len)`` = the instruction."""
        if (spk_id is None) == (embedding is None):
            raise ClientError("give exactly one of spk_id and embedding")
        emb = self.speaker_embedding(spk_id) if spk_id is not None else embedding
        assert emb is not None
        return instruct_input(self.extract_text_token(tts_text), emb, self.extract_text_token(instruct_text))

    def frontend_vc(
        self,
        source_wav: AudioSource | PromptAudio,
        prompt_wav: AudioSource | PromptAudio,
    ) -> dict[str, torch.Tensor]:
        """Voice conversion: the source's speech tokens spoken with the prompt's voice.

        Returns ``source_speech_token(_len)``, ``flow_prompt_speech_token(_len)``, ``prompt_speech_feat(_len)``,
        ``flow_embedding``. Unlike :meth:`prompt_features`, nothing is trimmed (the reference's
        ``frontend_vc``, whatever ``mel_per_token``): the prompt's mel (F frames) and speech tokens (P) keep their
        extracted lengths, so with CosyVoice2's 25 Hz tokens F is 2P, 2P - 1 or 2P - 2, and the causal flow's
        output then starts with the 2P - F frames of the last prompt tokens, as the reference's does.
        """
        self.require("vc")
        prompt = self._prompt(prompt_wav)
        source = self._prompt(source_wav, "source audio", "source_wav")
        prompt_tokens, _ = self.extract_speech_token(prompt.speech_16k)
        feat, _ = self.extract_speech_feat(prompt.speech_24k)
        embedding = self.extract_spk_embedding(prompt.speech_16k)
        source_tokens, _ = self.extract_speech_token(source.speech_16k)
        return vc_input(source_tokens, prompt_tokens, feat, embedding)
