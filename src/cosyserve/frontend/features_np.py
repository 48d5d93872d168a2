"""The prompt features in numpy alone, for a runtime without torch (the lite runtime of ONNX Runtime + numpy).

The same computations as :mod:`cosyserve.frontend.features` (the torch versions the torch runtime uses, equal to
the reference's): Matcha-TTS's mel spectrogram (the flow's prompt mel, one function for every family, its settings
a model's :class:`MelSettings`), whisper's log-mel (the input of every speech tokenizer, v1 to v3) and
Kaldi's fbank (the speaker embedding's). The slaney filterbank is shared (it is numpy already); the STFT is framed
and transformed with ``numpy.fft.rfft``. Importing this module imports numpy only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from cosyserve.frontend.melbank import slaney_mel_filterbank

__all__ = ["MelSettings", "kaldi_fbank", "mel_spectrogram", "speaker_fbank", "whisper_log_mel"]

WHISPER_SAMPLE_RATE, WHISPER_N_FFT, WHISPER_HOP_LENGTH = 16000, 400, 160


def _hann(size: int) -> np.ndarray:
    # periodic Hann (torch.hann_window(periodic=True)), in float64 then rounded as torch's float32 window
    n = np.arange(size)
    return (0.5 - 0.5 * np.cos(2 * np.pi * n / size)).astype(np.float32)


def _stft(y: np.ndarray, n_fft: int, hop: int, window: np.ndarray) -> np.ndarray:
    """One-sided STFT of a 1-D signal without centering: [n_fft // 2 + 1, frames] complex."""
    frames = 1 + (y.shape[-1] - n_fft) // hop
    if frames < 1:
        raise ValueError(f"need at least {n_fft} samples for one STFT frame, got {y.shape[-1]}")
    idx = np.arange(n_fft)[None, :] + hop * np.arange(frames)[:, None]
    return np.fft.rfft(y[idx] * window, axis=-1).T


def _check(speech: np.ndarray, min_samples: int, what: str) -> np.ndarray:
    speech = np.asarray(speech, dtype=np.float32)
    if speech.ndim != 2 or speech.shape[0] != 1:
        raise ValueError(f"{what} expects speech of shape [1, N], got {tuple(speech.shape)}")
    if speech.shape[1] < min_samples:
        raise ValueError(
            f"{what} needs at least {min_samples} samples of audio, got {speech.shape[1]}; the prompt is too short"
        )
    return speech


def mel_spectrogram(
    speech: np.ndarray,
    *,
    n_fft: int = 1024,
    num_mels: int = 80,
    sampling_rate: int = 22050,
    hop_size: int = 256,
    win_size: int = 1024,
    fmin: float = 0,
    fmax: float | None = 8000,
    center: bool = False,
) -> np.ndarray:
    """Matcha-TTS's log-magnitude mel, as :func:`cosyserve.frontend.features.mel_spectrogram` computes it with
    torch: reflect-pad ``(n_fft - hop_size) // 2`` each side, STFT (periodic Hann of ``win_size`` centred in
    ``n_fft``; ``center`` reflect-pads ``n_fft // 2`` more, as torch.stft does), magnitude
    ``sqrt(re^2 + im^2 + 1e-9)``, slaney filterbank (``fmax`` None: the Nyquist rate), ``log(clamp(x, 1e-5))``.
    The defaults are CosyVoice-300M's (22.05 kHz); a CosyVoice2/3 model's come from its yaml (:class:`MelSettings`).

    Args:
        speech: float32 waveform [1, N] at ``sampling_rate``.

    Returns:
        float32 [1, num_mels, frames] (``N // hop_size`` frames when ``center`` is False and hop divides n_fft).
    """
    if not 0 < win_size <= n_fft or not 0 < hop_size:
        raise ValueError(
            f"mel_spectrogram: win_size {win_size} must be in 1..n_fft ({n_fft}) and hop_size {hop_size} positive"
        )
    pad = int((n_fft - hop_size) / 2)
    speech = _check(speech, pad + 1, "mel_spectrogram")
    y = np.pad(speech[0], (pad, pad), mode="reflect")
    if center:
        y = np.pad(y, (n_fft // 2, n_fft // 2), mode="reflect")
    left = (n_fft - win_size) // 2  # torch.stft centres a shorter window in the frame
    window = np.pad(_hann(win_size), (left, n_fft - win_size - left))
    spec = _stft(y, n_fft, hop_size, window)
    magnitude = np.sqrt(spec.real**2 + spec.imag**2 + 1e-9)
    mel = slaney_mel_filterbank(sampling_rate, n_fft, num_mels, float(fmin), fmax) @ magnitude
    return np.log(np.maximum(mel, 1e-5)).astype(np.float32)[None]


@dataclass(frozen=True)
class MelSettings:
    """A model's prompt mel settings: its yaml's ``feat_extractor`` (``matcha.utils.audio.mel_spectrogram``'s
    arguments; a bundle's manifest stores them as plain data), checked. Calling it computes that mel in numpy:
    float32 [1, N] at ``sampling_rate`` -> [1, num_mels, frames] (:func:`mel_spectrogram`). The torch runtime's
    :class:`cosyserve.frontend.features.MelSpectrogramConfig` is the same settings computing in torch."""

    n_fft: int
    num_mels: int
    sampling_rate: int
    hop_size: int
    win_size: int
    fmin: float = 0
    fmax: float | None = None
    center: bool = False

    def __post_init__(self) -> None:
        if min(self.n_fft, self.num_mels, self.sampling_rate, self.hop_size, self.win_size) <= 0:
            raise ValueError(
                "feat_extractor n_fft, num_mels, sampling_rate, hop_size and win_size must be > 0"
            )
        if self.win_size > self.n_fft or self.hop_size > self.n_fft:
            raise ValueError(f"feat_extractor win_size and hop_size must not exceed n_fft={self.n_fft}")

    def __call__(self, speech: Any) -> Any:
        return mel_spectrogram(speech, **asdict(self))


def whisper_log_mel(speech: np.ndarray, n_mels: int = 128) -> np.ndarray:
    """Whisper's log-mel: float32 [1, n_mels, N // 160] from float32 [1, N] at 16 kHz."""
    if n_mels not in (80, 128):
        raise ValueError(f"whisper_log_mel supports n_mels 80 or 128, got {n_mels}")
    speech = _check(speech, WHISPER_N_FFT // 2 + 1, "whisper_log_mel")
    pad = WHISPER_N_FFT // 2
    y = np.pad(speech[0], (pad, pad), mode="reflect")  # torch.stft's center=True
    spec = _stft(y, WHISPER_N_FFT, WHISPER_HOP_LENGTH, _hann(WHISPER_N_FFT))[:, :-1]
    power = spec.real**2 + spec.imag**2
    mel = slaney_mel_filterbank(WHISPER_SAMPLE_RATE, WHISPER_N_FFT, n_mels, 0.0, None) @ power
    log_spec = np.log10(np.maximum(mel, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)[None]


# torchaudio.compliance.kaldi.fbank with its defaults, as cosyserve.frontend.features.kaldi_fbank computes it
_PREEMPHASIS = np.float32(0.97)
_KALDI_LOW_FREQ = 20.0
_FLOAT32_EPS = np.finfo(np.float32).eps


def _kaldi_mel_banks(num_bins: int, padded_window: int, sample_freq: float) -> np.ndarray:
    # torchaudio's get_mel_banks in float32 (vtln_warp 1.0), plus the zero Nyquist column: [num_bins, n_fft/2 + 1]
    def mel_scale(f: np.ndarray | float) -> np.ndarray:
        return (
            np.float32(1127.0) * np.log(np.float32(1.0) + np.asarray(f, np.float32) / np.float32(700.0))
        ).astype(np.float32)

    mel_low = float(1127.0 * np.log(1.0 + _KALDI_LOW_FREQ / 700.0))
    mel_high = float(1127.0 * np.log(1.0 + 0.5 * sample_freq / 700.0))
    delta = (mel_high - mel_low) / (num_bins + 1)
    bins = np.arange(num_bins)[:, None]
    left = (mel_low + bins * delta).astype(np.float32)
    center = (mel_low + (bins + 1.0) * delta).astype(np.float32)
    right = (mel_low + (bins + 2.0) * delta).astype(np.float32)
    fft_freqs = np.float32(sample_freq / padded_window) * np.arange(padded_window // 2, dtype=np.float32)
    mel = mel_scale(fft_freqs)[None, :]
    up = (mel - left) / (center - left)
    down = (right - mel) / (right - center)
    banks = np.maximum(np.minimum(up, down), np.float32(0.0)).astype(np.float32)
    return np.pad(banks, ((0, 0), (0, 1)))


def kaldi_fbank(speech: np.ndarray, *, num_mel_bins: int = 80, sample_frequency: float = 16000) -> np.ndarray:
    """Kaldi log mel filterbank (dither 0, povey window, preemphasis 0.97, DC removal, 25/10 ms frames):
    float32 [1, N] -> [frames, num_mel_bins]."""
    shift = int(sample_frequency * 10.0 * 0.001)
    size = int(sample_frequency * 25.0 * 0.001)
    padded = 2 ** (size - 1).bit_length()
    speech = _check(speech, size, "kaldi_fbank")
    n = 1 + (speech.shape[1] - size) // shift
    idx = np.arange(size)[None, :] + shift * np.arange(n)[:, None]
    frames = speech[0][idx]  # [m, size]
    frames = frames - frames.mean(axis=1, keepdims=True, dtype=np.float32)
    previous = np.concatenate([frames[:, :1], frames[:, :-1]], axis=1)
    frames = frames - _PREEMPHASIS * previous
    povey = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(size) / (size - 1))).astype(np.float32) ** np.float32(
        0.85
    )
    frames = np.pad(frames * povey, ((0, 0), (0, padded - size)))
    power = (np.abs(np.fft.rfft(frames, axis=1)) ** 2).astype(np.float32)
    energies = power @ _kaldi_mel_banks(num_mel_bins, padded, float(sample_frequency)).T
    return np.log(np.maximum(energies, _FLOAT32_EPS)).astype(np.float32)


def speaker_fbank(speech: np.ndarray) -> np.ndarray:
    """campplus's input: the 80-bin 16 kHz fbank minus its mean over time, [frames, 80]."""
    feat = kaldi_fbank(speech, num_mel_bins=80, sample_frequency=16000)
    return feat - feat.mean(axis=0, keepdims=True, dtype=np.float32)
