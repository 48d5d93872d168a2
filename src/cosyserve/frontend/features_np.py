"""The prompt features in numpy alone, for a runtime without torch (the lite runtime of ONNX Runtime + numpy).

The same computations as :mod:`cosyserve.frontend.features` (the torch versions the torch runtime uses, equal to
the reference's): Matcha-TTS's mel spectrogram (the flow's prompt mel) and whisper's log-mel (the speech
tokenizer's input). The slaney filterbank is shared (it is numpy already); the STFT is framed and transformed
with ``numpy.fft.rfft``. Importing this module imports numpy only.
"""

from __future__ import annotations

import numpy as np

from cosyserve.frontend.melbank import slaney_mel_filterbank

__all__ = ["mel_spectrogram", "mel_spectrogram_24k", "whisper_log_mel"]

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
) -> np.ndarray:
    """Matcha-TTS's log-magnitude mel (center False): float32 [1, num_mels, frames] from float32 [1, N]."""
    if win_size != n_fft:
        raise ValueError(f"win_size {win_size} != n_fft {n_fft} is not supported")
    pad = int((n_fft - hop_size) / 2)
    speech = _check(speech, pad + 1, "mel_spectrogram")
    y = np.pad(speech[0], (pad, pad), mode="reflect")
    spec = _stft(y, n_fft, hop_size, _hann(win_size))
    magnitude = np.sqrt(spec.real**2 + spec.imag**2 + 1e-9)
    mel = slaney_mel_filterbank(sampling_rate, n_fft, num_mels, float(fmin), fmax) @ magnitude
    return np.log(np.maximum(mel, 1e-5)).astype(np.float32)[None]


def mel_spectrogram_24k(speech: np.ndarray) -> np.ndarray:
    """CosyVoice2's prompt mel (see :func:`cosyserve.frontend.features.mel_spectrogram_24k`)."""
    return mel_spectrogram(speech, n_fft=1920, sampling_rate=24000, hop_size=480, win_size=1920)


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
