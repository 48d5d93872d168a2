"""Feature extractors of the zero-shot frontend, equal to the reference's within float32 noise.

- `mel_spectrogram`: the flow's prompt mel (Matcha-TTS `mel_spectrogram` with a librosa slaney filterbank).
- `kaldi_fbank` / `speaker_fbank`: torchaudio's Kaldi-compatible fbank, the speaker encoder's input.
- `whisper_log_mel`: whisper's 128-bin log-mel, the speech tokenizer's input.

No librosa, torchaudio or whisper import: filterbanks and windows are rebuilt here with the reference's
arithmetic (and its float32 rounding points) and cached per device.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from cosyserve.frontend.features_np import MelSettings
from cosyserve.frontend.melbank import slaney_mel_filterbank  # shared with the numpy features


@lru_cache(maxsize=16)
def _mel_basis(
    sr: int, n_fft: int, n_mels: int, fmin: float, fmax: float | None, device: torch.device
) -> torch.Tensor:
    return torch.from_numpy(slaney_mel_filterbank(sr, n_fft, n_mels, fmin, fmax).copy()).to(device)


@lru_cache(maxsize=16)
def _hann_window(size: int, periodic: bool, device: torch.device) -> torch.Tensor:
    return torch.hann_window(size, periodic=periodic, dtype=torch.float32).to(device)


def _check_speech(speech: torch.Tensor, min_samples: int, what: str) -> None:
    if speech.dim() != 2 or speech.shape[0] != 1:
        raise ValueError(f"{what} expects speech of shape [1, N], got {tuple(speech.shape)}")
    if speech.shape[1] < min_samples:
        raise ValueError(
            f"{what} needs at least {min_samples} samples of audio, got {speech.shape[1]}; the prompt is too short"
        )


# ---------------------------------------------------------------------------------------------------------------------
# Matcha-TTS mel spectrogram (the yaml's feat_extractor)


@torch.no_grad()
def mel_spectrogram(
    speech: torch.Tensor,
    *,
    n_fft: int = 1024,
    num_mels: int = 80,
    sampling_rate: int = 22050,
    hop_size: int = 256,
    win_size: int = 1024,
    fmin: float = 0,
    fmax: float | None = 8000,
    center: bool = False,
) -> torch.Tensor:
    """Log-magnitude mel spectrogram, as `matcha.utils.audio.mel_spectrogram` computes it.

    Reflect-pads (n_fft - hop_size) // 2 samples each side, STFT with a periodic Hann window,
    magnitude sqrt(re^2 + im^2 + 1e-9), slaney mel filterbank, log(clamp(x, 1e-5)).

    Args:
        speech: float32 waveform [1, N] in [-1, 1] at `sampling_rate`.

    Returns:
        float32 tensor [1, num_mels, frames], frames = (N + 2 * pad - n_fft) // hop_size + 1 when center is False.
    """
    pad = int((n_fft - hop_size) / 2)
    _check_speech(speech, pad + 1, "mel_spectrogram")
    window = _hann_window(win_size, True, speech.device)
    basis = _mel_basis(sampling_rate, n_fft, num_mels, float(fmin), fmax, speech.device)

    y = F.pad(speech.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)  # [1, N + 2*pad]
    spec = torch.stft(
        y,
        n_fft,
        hop_length=hop_size,
        win_length=win_size,
        window=window,
        center=center,
        pad_mode="reflect",
        normalized=False,
        onesided=True,
        return_complex=True,
    )
    spec = torch.view_as_real(spec)  # [1, n_fft//2+1, frames, 2]
    magnitude = torch.sqrt(spec.pow(2).sum(-1) + 1e-9)  # [1, n_fft//2+1, frames]
    mel = torch.matmul(basis, magnitude)  # [1, num_mels, frames]
    return torch.log(torch.clamp(mel, min=1e-5))


# ---------------------------------------------------------------------------------------------------------------------
# torchaudio.compliance.kaldi.fbank with its defaults (povey window, preemphasis 0.97, DC removal, snip_edges,
# 25 ms / 10 ms frames, FFT size rounded up to a power of two, low_freq 20, high_freq = nyquist, power spectrum)

_PREEMPHASIS = 0.97
_KALDI_LOW_FREQ = 20.0
_FLOAT32_EPS = torch.finfo(torch.float32).eps


def _kaldi_mel_scale(freq: torch.Tensor | float) -> torch.Tensor | float:
    if isinstance(freq, torch.Tensor):
        return 1127.0 * (1.0 + freq / 700.0).log()
    return 1127.0 * math.log(1.0 + freq / 700.0)


@lru_cache(maxsize=8)
def _kaldi_mel_banks(
    num_bins: int, padded_window: int, sample_freq: float, device: torch.device
) -> torch.Tensor:
    # Same float32 arithmetic as torchaudio's get_mel_banks (vtln_warp 1.0), plus the zero Nyquist column.
    nyquist = 0.5 * sample_freq
    mel_low = _kaldi_mel_scale(_KALDI_LOW_FREQ)
    mel_high = _kaldi_mel_scale(nyquist)
    delta = (mel_high - mel_low) / (num_bins + 1)
    bins = torch.arange(num_bins).unsqueeze(1)  # [num_bins, 1] int64
    left = mel_low + bins * delta  # float32
    center = mel_low + (bins + 1.0) * delta
    right = mel_low + (bins + 2.0) * delta
    fft_bin_width = sample_freq / padded_window
    fft_freqs = fft_bin_width * torch.arange(float(padded_window // 2))  # float32, [n_fft/2]
    mel = _kaldi_mel_scale(fft_freqs).unsqueeze(0)  # [1, n_fft/2]
    up = (mel - left) / (center - left)
    down = (right - mel) / (right - center)
    banks = torch.clamp(torch.minimum(up, down), min=0.0)  # [num_bins, n_fft/2]
    return F.pad(banks, (0, 1)).to(device)  # [num_bins, n_fft/2 + 1]


@lru_cache(maxsize=8)
def _povey_window(size: int, device: torch.device) -> torch.Tensor:
    return torch.hann_window(size, periodic=False, dtype=torch.float32).pow(0.85).to(device)


@torch.no_grad()
def kaldi_fbank(
    speech: torch.Tensor, *, num_mel_bins: int = 80, sample_frequency: float = 16000
) -> torch.Tensor:
    """Kaldi log mel filterbank, as `torchaudio.compliance.kaldi.fbank(speech, num_mel_bins, dither=0,
    sample_frequency)` computes it (every other option at its default).

    Args:
        speech: float32 waveform [1, N] (in [-1, 1]; not int16 scale) at `sample_frequency`.

    Returns:
        float32 tensor [frames, num_mel_bins], frames = 1 + (N - window) // shift with 25 ms windows, 10 ms shift.
    """
    if num_mel_bins <= 3:
        raise ValueError(f"num_mel_bins must be at least 4, got {num_mel_bins}")
    if sample_frequency <= 0:
        raise ValueError(f"sample_frequency must be positive, got {sample_frequency}")
    shift = int(sample_frequency * 10.0 * 0.001)
    size = int(sample_frequency * 25.0 * 0.001)
    padded = 1 if size == 0 else 2 ** (size - 1).bit_length()
    _check_speech(speech, size, "kaldi_fbank")

    frames = speech[0].unfold(0, size, shift)  # [m, size]
    frames = frames - frames.mean(dim=1, keepdim=True)
    previous = torch.cat((frames[:, :1], frames[:, :-1]), dim=1)  # x[j-1], with x[-1] = x[0]
    frames = frames - _PREEMPHASIS * previous
    frames = frames * _povey_window(size, speech.device)
    frames = F.pad(frames, (0, padded - size))  # [m, padded]

    power = torch.fft.rfft(frames).abs().pow(2.0)  # [m, padded//2 + 1]
    banks = _kaldi_mel_banks(num_mel_bins, padded, float(sample_frequency), speech.device).to(speech.dtype)
    energies = torch.mm(power, banks.T)  # [m, num_mel_bins]
    return torch.clamp(energies, min=_FLOAT32_EPS).log()


def speaker_fbank(speech: torch.Tensor) -> torch.Tensor:
    """The speaker encoder's input: 80-bin `kaldi_fbank` at 16 kHz minus its mean over time.

    Args:
        speech: float32 waveform [1, N] at 16 kHz.

    Returns:
        float32 tensor [frames, 80].
    """
    feat = kaldi_fbank(speech, num_mel_bins=80, sample_frequency=16000)
    return feat - feat.mean(dim=0, keepdim=True)


# ---------------------------------------------------------------------------------------------------------------------
# openai-whisper log_mel_spectrogram (n_fft 400, hop 160, 16 kHz)

WHISPER_SAMPLE_RATE = 16000
WHISPER_N_FFT = 400
WHISPER_HOP_LENGTH = 160


@torch.no_grad()
def whisper_log_mel(speech: torch.Tensor, n_mels: int = 128) -> torch.Tensor:
    """Whisper's log-mel spectrogram, as `whisper.log_mel_spectrogram(speech, n_mels)` computes it.

    Centered STFT (reflect pad, periodic Hann 400, hop 160), power spectrum without the last frame,
    slaney mel filterbank, log10(clamp(x, 1e-10)), floor at (max - 8), then (x + 4) / 4.

    Args:
        speech: float32 waveform [1, N] at 16 kHz.
        n_mels: 80 or 128.

    Returns:
        float32 tensor [1, n_mels, N // 160].
    """
    if n_mels not in (80, 128):
        raise ValueError(f"whisper_log_mel supports n_mels 80 or 128, got {n_mels}")
    _check_speech(speech, WHISPER_N_FFT // 2 + 1, "whisper_log_mel")
    window = _hann_window(WHISPER_N_FFT, True, speech.device)
    filters = _mel_basis(WHISPER_SAMPLE_RATE, WHISPER_N_FFT, n_mels, 0.0, None, speech.device)

    stft = torch.stft(speech, WHISPER_N_FFT, WHISPER_HOP_LENGTH, window=window, return_complex=True)
    power = stft[..., :-1].abs() ** 2  # [1, 201, frames]
    mel = filters @ power  # [1, n_mels, frames]
    log_spec = torch.clamp(mel, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


@dataclass(frozen=True)
class MelSpectrogramConfig(MelSettings):
    """A model yaml's ``feat_extractor`` (``!name:matcha.utils.audio.mel_spectrogram`` and its arguments, checked by
    :class:`~cosyserve.frontend.features_np.MelSettings`); calling it computes that mel: waveform [1, N] at
    ``sampling_rate`` -> [1, num_mels, frames], in torch for a tensor (numpy's for a numpy array)."""

    TARGET: ClassVar[str] = "matcha.utils.audio.mel_spectrogram"

    def __call__(self, speech: Any) -> Any:
        if not isinstance(speech, torch.Tensor):
            return super().__call__(speech)
        return mel_spectrogram(speech, **asdict(self))


def mel_spectrogram_24k(speech: torch.Tensor) -> torch.Tensor:
    """CosyVoice2's prompt mel (its yaml's ``feat_extractor``): 24 kHz, n_fft/window 1920, hop 480, 80 mels up to
    8 kHz, no centering: ``N // 480`` frames."""
    return mel_spectrogram(
        speech, n_fft=1920, num_mels=80, sampling_rate=24000, hop_size=480, win_size=1920, fmin=0, fmax=8000
    )
