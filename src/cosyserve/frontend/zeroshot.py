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

import io
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from cosyserve.bundle.official import CAMPPLUS_FILE, SPEECH_TOKENIZER_FILE
from cosyserve.errors import AudioError, BundleError, ClientError, ModeUnavailableError, UnknownVoiceError
from cosyserve.frontend.audio import decode_failure, load_wav
from cosyserve.frontend.features import mel_spectrogram, speaker_fbank, whisper_log_mel

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

PROMPT_MODES = ("zero_shot", "cross_lingual", "vc")  # the modes that need both ONNX models

SPEAKER_SR = 16000  # campplus and the speech tokenizer
FEAT_SR = 24000  # the reference's _extract_speech_feat resamples the prompt to 24 kHz at this commit


@dataclass(frozen=True)
class PromptLimits:
    """What a prompt recording must satisfy.

    Args:
        max_seconds: longest prompt; the reference refuses speech-token extraction above 30 s.
        min_seconds: shortest prompt; below ~25 ms there is not one fbank frame.
        max_channels: mono or stereo; more suggests a file that is not a voice recording.
        max_bytes: largest encoded file.
        min_sample_rate: lowest source rate (the reference refuses to resample from below 16 kHz).
        silence_peak: a prompt whose peak |sample| is below this (default -60 dBFS) is silent.
        clip_level: |sample| at or above this counts as clipped ...
        max_clipped_fraction: ... and a prompt with more than this fraction of clipped samples is refused.
    """

    max_seconds: float = 30.0
    min_seconds: float = 0.1
    max_channels: int = 2
    max_bytes: int = 64 * 2**20
    min_sample_rate: int = 16000
    silence_peak: float = 1e-3
    clip_level: float = 0.99
    max_clipped_fraction: float = 0.01


@dataclass(frozen=True)
class PromptAudio:
    """A checked prompt: the channel mean at 16 kHz (speaker/token models) and at 24 kHz (flow features)."""

    speech_16k: torch.Tensor  # [1, N16]
    speech_24k: torch.Tensor  # [1, N24]
    sample_rate: int  # of the file
    channels: int
    seconds: float


AudioSource = str | os.PathLike | bytes | bytearray | memoryview


def load_prompt(
    source: AudioSource, limits: PromptLimits | None = None, what: str = "prompt audio"
) -> PromptAudio:
    """Decode and check a prompt recording.

    Args:
        source: a path or the encoded file's bytes (WAV, FLAC, OGG/Vorbis, ...).
        limits: the checks; default :class:`PromptLimits()`.
        what: how messages name the audio (``"prompt audio"``, ``"source audio"``).
    Returns:
        The :class:`PromptAudio`.
    Raises:
        AudioError: undecodable or empty data (:class:`AudioError` for the limits).
    """
    import soundfile

    limits = limits or PromptLimits()
    if isinstance(source, bytes | bytearray | memoryview):
        data = bytes(source)
        if not data:
            raise AudioError(f"{what} is empty (0 bytes)")
        name = f"{what} ({len(data)} bytes)"
        size = len(data)
    else:
        path = os.fspath(source)
        name = f"{what} '{path}'"
        if not os.path.isfile(path):
            raise AudioError(f"{name} does not exist or is not a regular file")
        size = os.path.getsize(path)
        data = None
    if size > limits.max_bytes:
        raise AudioError(f"{name} is {size} bytes; at most {limits.max_bytes} bytes are accepted")
    try:
        info = soundfile.info(io.BytesIO(data) if data is not None else path)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as e:
        raise AudioError(f"cannot decode {name}: {decode_failure(e)}") from e
    if info.frames == 0 or info.channels == 0:
        raise AudioError(f"{name} contains no samples")
    if info.channels > limits.max_channels:
        raise AudioError(
            f"{name} has {info.channels} channels; give a mono or stereo recording (at most {limits.max_channels})"
        )
    if info.samplerate < limits.min_sample_rate:
        raise AudioError(
            f"{name} has sample rate {info.samplerate} Hz; record prompts at >= {limits.min_sample_rate} Hz"
        )
    seconds = info.frames / info.samplerate
    if seconds > limits.max_seconds:
        raise AudioError(
            f"{name} is {seconds:.2f} s long; prompts may be at most {limits.max_seconds:g} s (trim it)"
        )
    if seconds < limits.min_seconds:
        raise AudioError(f"{name} is {seconds * 1e3:.0f} ms long; give at least {limits.min_seconds:g} s")

    src = data if data is not None else path
    speech_16k = load_wav(src, SPEAKER_SR, min_sr=limits.min_sample_rate)  # [1, N16]
    # checked again on the decoded samples: some containers report no or a wrong frame count
    if speech_16k.shape[1] / SPEAKER_SR > limits.max_seconds:
        raise AudioError(
            f"{name} is {speech_16k.shape[1] / SPEAKER_SR:.2f} s long; prompts may be at most "
            f"{limits.max_seconds:g} s (trim it)"
        )
    if speech_16k.shape[1] < limits.min_seconds * SPEAKER_SR:
        raise AudioError(f"{name} decodes to {speech_16k.shape[1]} samples at 16 kHz; it is too short")
    magnitude = speech_16k.abs()
    peak = float(magnitude.max())
    if peak < limits.silence_peak:
        raise AudioError(f"{name} is silent (peak level {peak:.2g}); record the voice louder")
    clipped = float((magnitude >= limits.clip_level).float().mean())
    if clipped > limits.max_clipped_fraction:
        raise AudioError(
            f"{name} is clipped ({clipped:.1%} of samples at full scale); record it at a lower level"
        )
    speech_24k = load_wav(src, FEAT_SR, min_sr=limits.min_sample_rate)  # [1, N24]
    return PromptAudio(speech_16k, speech_24k, info.samplerate, info.channels, seconds)


# ---------------------------------------------------------------------------------------------------------------------
# onnxruntime sessions


class OnnxModel:
    """An onnxruntime CPU session for one model file, created on the first :meth:`run` (thread-safe).

    Session options as the reference: graph optimisation ORT_ENABLE_ALL, one intra-op thread.

    Args:
        path: the ``.onnx`` file.
        check: called with ``path`` before the session opens it (a bundle checks size and checksum); raises
            when the file must not be used.
    """

    def __init__(self, path: Path, check: Callable[[Path], None] | None = None) -> None:
        self.path = Path(path)
        self.check = check
        self._lock = threading.Lock()
        self._session: Any = None
        self.load_seconds: float | None = None

    @property
    def loaded(self) -> bool:
        return self._session is not None

    def session(self) -> Any:
        if self._session is None:
            with self._lock:
                if self._session is None:
                    self._session = self._create()
        return self._session

    def _create(self) -> Any:
        if not self.path.is_file():
            raise ModeUnavailableError(f"missing {self.path}")
        try:
            import onnxruntime
        except ImportError as e:
            raise RuntimeError(
                f"running {self.path.name} needs the 'onnxruntime' package (pip install onnxruntime)"
            ) from e
        if self.check is not None:
            self.check(self.path)
        t0 = time.perf_counter()
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = 1
        try:
            session = onnxruntime.InferenceSession(
                str(self.path), sess_options=options, providers=["CPUExecutionProvider"]
            )
        except Exception as e:  # noqa: BLE001 - onnxruntime raises its own unrelated exception types
            raise BundleError(
                f"cannot load ONNX model {self.path}: {e}",
                public=f"the model's {self.path.name} cannot be loaded (damaged or not an ONNX model)",
            ) from e
        self.load_seconds = time.perf_counter() - t0
        logger.info("loaded %s in %.0f ms", self.path.name, self.load_seconds * 1e3)
        return session

    def run(self, *arrays: np.ndarray) -> np.ndarray:
        """Feed ``arrays`` to the model's inputs in order; returns the first output."""
        session = self.session()
        names = [i.name for i in session.get_inputs()]
        if len(names) != len(arrays):
            raise RuntimeError(
                f"{self.path.name} takes {len(names)} inputs ({', '.join(names)}), got {len(arrays)}"
            )
        return session.run(None, dict(zip(names, arrays, strict=True)))[0]


# ---------------------------------------------------------------------------------------------------------------------
# the frontend


def _ids(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.tensor([ids], dtype=torch.int32)  # [1, n]
    return tokens, torch.tensor([tokens.shape[1]], dtype=torch.int32)


Ids = tuple[torch.Tensor, torch.Tensor]  # token ids int32 [1, n] and their length int32 [1]
_LLM_PROMPT_KEYS = (
    "prompt_text",
    "prompt_text_len",
    "llm_prompt_speech_token",
    "llm_prompt_speech_token_len",
)


def sft_input(text: Ids, embedding: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model input of a pre-defined speaker (``embedding`` [1, 192]) saying ``text``: the speaker's
    embedding goes to both the LLM and the flow."""
    return {"text": text[0], "text_len": text[1], "llm_embedding": embedding, "flow_embedding": embedding}


def instruct_input(text: Ids, embedding: torch.Tensor, instruction: Ids) -> dict[str, torch.Tensor]:
    """sft with a style instruction as the LLM's prompt text; the reference keeps the speaker out of the LM
    (no ``llm_embedding``: "information leakage"), so the embedding goes to the flow only."""
    return {
        "text": text[0],
        "text_len": text[1],
        "flow_embedding": embedding,
        "prompt_text": instruction[0],
        "prompt_text_len": instruction[1],
    }


def prompt_input(
    text: Ids, prompt: Mapping[str, torch.Tensor], mode: Literal["zero_shot", "cross_lingual"]
) -> dict[str, torch.Tensor]:
    """The model input of a cloned voice (``prompt``: :meth:`Frontend.prompt_features`, or a registered voice)
    saying ``text``. zero_shot gives the LLM the prompt's transcript and speech tokens; cross_lingual drops them
    (the LLM then speaks ``text`` in its own language with the prompt's timbre from the flow)."""
    model_input = dict(prompt)
    if mode == "cross_lingual":
        for key in _LLM_PROMPT_KEYS:
            model_input.pop(key, None)
    model_input["text"], model_input["text_len"] = text
    return model_input


def instruct2_input(
    text: Ids, prompt: Mapping[str, torch.Tensor], instruction: Ids
) -> dict[str, torch.Tensor]:
    """CosyVoice2's instruct2: a cloned voice (``prompt``) saying ``text`` in the style ``instruction`` asks for
    (the reference's ``frontend_instruct2``): the instruction is the LLM's prompt text, the LLM gets no prompt
    speech tokens, the flow keeps the prompt's tokens, mel and embedding."""
    model_input = dict(prompt)
    model_input.pop("llm_prompt_speech_token", None)
    model_input.pop("llm_prompt_speech_token_len", None)
    model_input["prompt_text"], model_input["prompt_text_len"] = instruction
    model_input["text"], model_input["text_len"] = text
    return model_input


class Frontend:
    """Builds the model input dicts of the reference frontend, key for key.

    Args:
        model_dir: the official model dir (``campplus.onnx``, ``speech_tokenizer_v1.onnx`` are optional).
        speakers: spk2info (speaker id -> ``{"embedding": [1, 192], ...}``); default none.
        tokenizer: has ``encode(text) -> list[int]``; default the whisper multilingual tokenizer.
        feat_extractor: waveform [1, N] -> mel [1, 80, frames]; default the CosyVoice-300M yaml's
            ``mel_spectrogram`` (n_fft 1024, hop 256, 80 mels, 22050 Hz filterbank, fmax 8000).
        limits: checks on prompt audio.
    """

    def __init__(
        self,
        model_dir: str | Path,
        speakers: dict[str, dict[str, torch.Tensor]] | None = None,
        *,
        tokenizer: Any = None,
        feat_extractor: Callable[[torch.Tensor], torch.Tensor] | None = None,
        limits: PromptLimits | None = None,
    ) -> None:
        if tokenizer is None:
            from cosyserve.frontend.tokenizer import get_tokenizer

            tokenizer = get_tokenizer()
        self.model_dir = Path(model_dir)
        self.speakers = speakers if speakers is not None else {}
        self.tokenizer = tokenizer
        self.feat_extractor = feat_extractor or mel_spectrogram
        self.limits = limits or PromptLimits()
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
        if speech_16k.shape[1] / SPEAKER_SR > self.limits.max_seconds:
            raise AudioError(
                f"cannot extract speech tokens from {speech_16k.shape[1] / SPEAKER_SR:.2f} s of audio; "
                f"at most {self.limits.max_seconds:g} s"
            )
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
        if isinstance(prompt_wav, PromptAudio):
            return prompt_wav
        try:
            return load_prompt(prompt_wav, self.limits, what)
        except AudioError as e:
            e.param = param  # the request field that gave this audio (a server names it in its error)
            raise

    # --- modes ------------------------------------------------------------------------------------------------------

    def speaker_embedding(self, spk_id: str) -> torch.Tensor:
        if spk_id not in self.speakers:
            known = ", ".join(sorted(self.speakers)) or "none (this model dir has no spk2info.pt)"
            raise UnknownVoiceError(f"unknown speaker {spk_id!r}; known speakers: {known}")
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
        resample_rate: int = 22050,
        zero_shot_spk_id: str = "",
    ) -> dict[str, torch.Tensor]:
        """Voice cloning from a prompt recording and its transcript.

        Returns ``prompt_text(_len)``, ``llm_prompt_speech_token(_len)`` = ``flow_prompt_speech_token(_len)``,
        ``prompt_speech_feat(_len)``, ``llm_embedding`` = ``flow_embedding``, ``text(_len)``. With a
        ``zero_shot_spk_id`` (a saved prompt in ``speakers``) the saved entry is used instead of a recording.
        ``resample_rate`` 24000 (CosyVoice2) trims features and tokens to exactly 2 frames per token.
        """
        if zero_shot_spk_id:
            if zero_shot_spk_id not in self.speakers:
                raise UnknownVoiceError(f"unknown saved speaker {zero_shot_spk_id!r}")
            entry = self.speakers[zero_shot_spk_id]
        else:
            entry = self.prompt_features(prompt_text, prompt_wav, resample_rate)
        return prompt_input(self.extract_text_token(tts_text), entry, "zero_shot")

    def prompt_features(
        self, prompt_text: str, prompt_wav: AudioSource | PromptAudio, resample_rate: int = 22050
    ) -> dict[str, torch.Tensor]:
        """The zero-shot prompt features of a recording and its transcript: the entry the reference's
        ``add_zero_shot_spk`` stores (``frontend_zero_shot``'s dict without ``text``/``text_len``).

        Raises:
            ModeUnavailableError: the model has no ONNX models; AudioError: unusable audio.
        """
        self.require("zero_shot")
        with torch.inference_mode():
            prompt = self._prompt(prompt_wav)
            prompt_ids, prompt_len = self.extract_text_token(prompt_text)
            feat, feat_len = self.extract_speech_feat(prompt.speech_24k)
            tokens, tokens_len = self.extract_speech_token(prompt.speech_16k)
            if resample_rate == 24000:
                n = min(feat.shape[1] // 2, tokens.shape[1])
                feat, feat_len = feat[:, : 2 * n], torch.tensor([2 * n], dtype=torch.int32)
                tokens, tokens_len = tokens[:, :n], torch.tensor([n], dtype=torch.int32)
            embedding = self.extract_spk_embedding(prompt.speech_16k)
        return {
            "prompt_text": prompt_ids,
            "prompt_text_len": prompt_len,
            "llm_prompt_speech_token": tokens,
            "llm_prompt_speech_token_len": tokens_len,
            "flow_prompt_speech_token": tokens,
            "flow_prompt_speech_token_len": tokens_len,
            "prompt_speech_feat": feat,
            "prompt_speech_feat_len": feat_len,
            "llm_embedding": embedding,
            "flow_embedding": embedding,
        }

    def frontend_cross_lingual(
        self,
        tts_text: str,
        prompt_wav: AudioSource | PromptAudio,
        resample_rate: int = 22050,
        zero_shot_spk_id: str = "",
    ) -> dict[str, torch.Tensor]:
        """The zero-shot dict without the LLM prompt (no prompt text, no LLM prompt speech tokens)."""
        if zero_shot_spk_id:
            if zero_shot_spk_id not in self.speakers:
                raise UnknownVoiceError(f"unknown saved speaker {zero_shot_spk_id!r}")
            entry = self.speakers[zero_shot_spk_id]
        else:
            self.require("cross_lingual")
            entry = self.prompt_features("", prompt_wav, resample_rate)
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
        resample_rate: int = 22050,
    ) -> dict[str, torch.Tensor]:
        """Voice conversion: the source's speech tokens spoken with the prompt's voice.

        Returns ``source_speech_token(_len)``, ``flow_prompt_speech_token(_len)``, ``prompt_speech_feat(_len)``,
        ``flow_embedding``.
        """
        self.require("vc")
        prompt = self._prompt(prompt_wav)
        source = self._prompt(source_wav, "source audio", "source_wav")
        prompt_tokens, prompt_tokens_len = self.extract_speech_token(prompt.speech_16k)
        feat, feat_len = self.extract_speech_feat(prompt.speech_24k)
        embedding = self.extract_spk_embedding(prompt.speech_16k)
        source_tokens, source_tokens_len = self.extract_speech_token(source.speech_16k)
        return {
            "source_speech_token": source_tokens,
            "source_speech_token_len": source_tokens_len,
            "flow_prompt_speech_token": prompt_tokens,
            "flow_prompt_speech_token_len": prompt_tokens_len,
            "prompt_speech_feat": feat,
            "prompt_speech_feat_len": feat_len,
            "flow_embedding": embedding,
        }
