"""Prompt recordings and the zero-shot tier's ONNX sessions, without torch (both runtimes use them).

:func:`load_prompt` decodes and checks a prompt (:class:`PromptLimits`) and gives it at 16 kHz (speaker and
speech-token models) and 24 kHz (the flow's prompt mel) as torch tensors or, with the numpy loader, numpy arrays;
:class:`OnnxModel` is one onnxruntime session opened on first use.
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

from cosyserve.core.errors import AudioError, BundleError, ModeUnavailableError
from cosyserve.frontend.audio import decode_failure
from cosyserve.frontend.onnx_compat import session_source

__all__ = [
    "check_token_seconds",
    "instruct_input",
    "prompt_input",
    "sft_input",
    "CAMPPLUS_FILE",
    "FEAT_SR",
    "ONNX_FILES",
    "SPEAKER_SR",
    "SPEECH_TOKENIZER_FILE",
    "AudioSource",
    "OnnxModel",
    "PromptAudio",
    "PromptLimits",
    "load_prompt",
]

logger = logging.getLogger(__name__)

CAMPPLUS_FILE = "campplus.onnx"  # the speaker embedding model
SPEECH_TOKENIZER_FILE = "speech_tokenizer_v1.onnx"  # CosyVoice-300M's speech tokenizer (50 Hz)
ONNX_FILES = (CAMPPLUS_FILE, SPEECH_TOKENIZER_FILE)
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
        silence_peak: a prompt whose peak |sample| is below this (default -60 dBFS) is silent (a prompt with NaN or
            infinite samples is refused whatever the limits).
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

    speech_16k: Any  # [1, N16]: a torch tensor, or a numpy array where the loader gave one (the lite runtime)
    speech_24k: Any  # [1, N24]
    sample_rate: int  # of the file
    channels: int
    seconds: float


AudioSource = str | os.PathLike | bytes | bytearray | memoryview


def load_prompt(
    source: AudioSource,
    limits: PromptLimits | None = None,
    what: str = "prompt audio",
    *,
    loader: Callable[..., Any] | None = None,
) -> PromptAudio:
    """Decode and check a prompt recording.

    Args:
        source: a path or the encoded file's bytes (WAV, FLAC, OGG/Vorbis, ...).
        limits: the checks; default :class:`PromptLimits()`.
        what: how messages name the audio (``"prompt audio"``, ``"source audio"``).
        loader: ``(source, rate, min_sr=...) -> [1, N]`` waveform: :func:`cosyserve.frontend.audio.load_wav`
            (torch tensors, the default) or ``load_wav_np`` (numpy arrays).
    Returns:
        The :class:`PromptAudio`.
    Raises:
        AudioError: undecodable or empty data (:class:`AudioError` for the limits).
    """
    import soundfile

    if loader is None:
        from cosyserve.frontend.audio import load_wav as loader
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
    speech_16k = loader(src, SPEAKER_SR, min_sr=limits.min_sample_rate)  # [1, N16]
    # checked again on the decoded samples: some containers report no or a wrong frame count
    if speech_16k.shape[1] / SPEAKER_SR > limits.max_seconds:
        raise AudioError(
            f"{name} is {speech_16k.shape[1] / SPEAKER_SR:.2f} s long; prompts may be at most "
            f"{limits.max_seconds:g} s (trim it)"
        )
    if speech_16k.shape[1] < limits.min_seconds * SPEAKER_SR:
        raise AudioError(f"{name} decodes to {speech_16k.shape[1]} samples at 16 kHz; it is too short")
    magnitude = np.abs(np.asarray(speech_16k))
    _check_finite(magnitude, name)
    peak = float(magnitude.max())
    if peak < limits.silence_peak:
        raise AudioError(f"{name} is silent (peak level {peak:.2g}); record the voice louder")
    clipped = float((magnitude >= limits.clip_level).mean())
    if clipped > limits.max_clipped_fraction:
        raise AudioError(
            f"{name} is clipped ({clipped:.1%} of samples at full scale); record it at a lower level"
        )
    speech_24k = loader(src, FEAT_SR, min_sr=limits.min_sample_rate)  # [1, N24]
    _check_finite(speech_24k, name)
    return PromptAudio(speech_16k, speech_24k, info.samplerate, info.channels, seconds)


def prompt_audio(
    wav: AudioSource | PromptAudio,
    limits: PromptLimits,
    what: str = "prompt audio",
    param: str = "prompt_wav",
    *,
    loader: Callable[..., Any] | None = None,
) -> PromptAudio:
    """A request's recording decoded and checked (:func:`load_prompt`; one already analysed passes through); an
    :class:`AudioError` names ``param``, the request field that gave the audio (a server names it in its error)."""
    if isinstance(wav, PromptAudio):
        return wav
    try:
        return load_prompt(wav, limits, what, loader=loader)
    except AudioError as e:
        e.param = param
        raise


def _check_finite(wave: Any, name: str) -> None:
    # NaN passes every level check (each comparison is False) and becomes NaN features, NaN speaker embeddings and
    # silent output; a float file can hold NaN or infinity, and resampling spreads one such sample to its neighbours
    if not np.isfinite(np.asarray(wave)).all():
        raise AudioError(
            f"{name} is not finite: it has NaN or infinite samples; give a recording whose samples are all finite"
        )


# ---------------------------------------------------------------------------------------------------------------------
# onnxruntime sessions


class OnnxModel:
    """An onnxruntime CPU session for one model file, created on the first :meth:`run` (thread-safe).

    Session options as the reference: graph optimisation ORT_ENABLE_ALL, one intra-op thread. A graph whose
    numbers depend on the ONNX Runtime version (``campplus.onnx``'s ``AveragePool(ceil_mode=1)``) is rewritten in
    memory to the reference's arithmetic when the file is not rewritten yet
    (:func:`cosyserve.frontend.onnx_compat.session_source`).

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
            # the path, or the graph's bytes with its AveragePool(ceil_mode) nodes computing the reference's
            # numbers (ONNX Runtime 1.18's) where the file is not rewritten yet (a model dir's)
            source = session_source(self.path)
            session = onnxruntime.InferenceSession(
                source, sess_options=options, providers=["CPUExecutionProvider"]
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


def check_token_seconds(speech_16k: Any, limits: PromptLimits) -> None:
    """Refuse speech-token extraction from more than ``limits.max_seconds`` of 16 kHz audio (the reference's
    limit; [1, N] torch tensor or numpy array)."""
    seconds = speech_16k.shape[1] / SPEAKER_SR
    if seconds > limits.max_seconds:
        raise AudioError(
            f"cannot extract speech tokens from {seconds:.2f} s of audio; at most {limits.max_seconds:g} s"
        )


# ---------------------------------------------------------------------------------------------------------------------
# model inputs: the reference frontend's dicts, key for key, over torch tensors or numpy arrays alike

Ids = tuple[Any, Any]  # token ids [1, n] and their length [1]

_LLM_PROMPT_KEYS = (
    "prompt_text",
    "prompt_text_len",
    "llm_prompt_speech_token",
    "llm_prompt_speech_token_len",
)


def sft_input(text: Ids, embedding: Any) -> dict[str, Any]:
    """The model input of a pre-defined speaker (``embedding`` [1, 192]) saying ``text``: the speaker's
    embedding goes to both the LLM and the flow."""
    return {"text": text[0], "text_len": text[1], "llm_embedding": embedding, "flow_embedding": embedding}


def instruct_input(text: Ids, embedding: Any, instruction: Ids) -> dict[str, Any]:
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
    text: Ids, prompt: Mapping[str, Any], mode: Literal["zero_shot", "cross_lingual"]
) -> dict[str, Any]:
    """The model input of a cloned voice (``prompt``: :meth:`Frontend.prompt_features`, or a registered voice)
    saying ``text``. zero_shot gives the LLM the prompt's transcript and speech tokens; cross_lingual drops them
    (the LLM then speaks ``text`` in its own language with the prompt's timbre from the flow)."""
    model_input = dict(prompt)
    if mode == "cross_lingual":
        for key in _LLM_PROMPT_KEYS:
            model_input.pop(key, None)
    model_input["text"], model_input["text_len"] = text
    return model_input


def prompt_entry(
    text: Ids, feat: Any, tokens: Any, embedding: Any, mel_per_token: int | None
) -> dict[str, Any]:
    """The entry the reference's ``add_zero_shot_spk`` stores for a prompt recording, from its features (torch
    tensors or numpy arrays, either frontend's): the transcript's ids ``text``, the prompt mel ``feat``
    [1, F, 80], its speech tokens ``tokens`` [1, P] and campplus ``embedding`` [1, 192]. Where
    ``mel_per_token`` is set (the family's :attr:`~cosyserve.families.base.Family.prompt_mel_per_token`) mel and
    tokens are trimmed to exactly that many frames per token (the reference's ``frontend_zero_shot`` at
    ``resample_rate`` 24000)."""
    from cosyserve.core.sampling import array_ops

    r = mel_per_token
    if r is not None:
        n = min(feat.shape[1] // r, tokens.shape[1])
        feat, tokens = feat[:, : r * n], tokens[:, :n]
    ops = array_ops(feat)
    tokens_len = ops.asarray([tokens.shape[1]], "int32")
    return {
        "prompt_text": text[0],
        "prompt_text_len": text[1],
        "llm_prompt_speech_token": tokens,
        "llm_prompt_speech_token_len": tokens_len,
        "flow_prompt_speech_token": tokens,
        "flow_prompt_speech_token_len": tokens_len,
        "prompt_speech_feat": feat,
        "prompt_speech_feat_len": ops.asarray([feat.shape[1]], "int32"),
        "llm_embedding": embedding,
        "flow_embedding": embedding,
    }


def vc_input(source_tokens: Any, prompt_tokens: Any, feat: Any, embedding: Any) -> dict[str, Any]:
    """Voice conversion's model input (the reference's ``frontend_vc``) from either frontend's features: the
    source's speech tokens [1, S], the prompt's tokens [1, P], mel [1, F, 80] and embedding [1, 192], each with its
    ``_len``. Nothing is trimmed: with 25 Hz tokens F is 2P, 2P - 1 or 2P - 2, and the causal flow's output then
    starts with the 2P - F frames of the last prompt tokens, as the reference's does."""
    from cosyserve.core.sampling import array_ops

    ops = array_ops(feat)
    return {
        "source_speech_token": source_tokens,
        "source_speech_token_len": ops.asarray([source_tokens.shape[1]], "int32"),
        "flow_prompt_speech_token": prompt_tokens,
        "flow_prompt_speech_token_len": ops.asarray([prompt_tokens.shape[1]], "int32"),
        "prompt_speech_feat": feat,
        "prompt_speech_feat_len": ops.asarray([feat.shape[1]], "int32"),
        "flow_embedding": embedding,
    }
