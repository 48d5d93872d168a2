"""Audio input: decode a prompt file to a mono float waveform and resample it.

Matches the reference `cosyvoice.utils.file_utils.load_wav`: decode (16-bit PCM becomes int16/32768 exactly),
mean over channels, then torchaudio's default `Resample` (Hann-windowed sinc, lowpass_filter_width 6,
rolloff 0.99) when the file's rate differs from the one asked for. No torchaudio dependency: the sinc
kernel is rebuilt here with the same float64 arithmetic and float32 cast.
"""

from __future__ import annotations

import io
import math
import os
import re
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from cosyserve.core.errors import AudioError

if TYPE_CHECKING:
    import torch

LOWPASS_FILTER_WIDTH = 6
ROLLOFF = 0.99
MIN_SOURCE_SR = 16000  # the reference refuses to resample audio recorded below this rate


def decode_failure(e: BaseException) -> str:
    """libsndfile's reason for refusing a file, without the Python object it was handed (``<_io.BytesIO object
    at 0x...>`` means nothing to a client)."""
    reason = getattr(e, "error_string", None)  # soundfile.LibsndfileError: libsndfile's own message
    if not isinstance(reason, str) or not reason:
        reason = re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "the data", str(e))
    return f"not a readable audio file ({reason.strip()}); supported: WAV, FLAC, OGG/Vorbis, MP3"


def _describe(source: str | os.PathLike | bytes | bytearray | memoryview) -> str:
    if isinstance(source, bytes | bytearray | memoryview):
        return f"<{len(source)} bytes of audio>"
    return f"'{os.fspath(source)}'"


def load_wav(
    source: str | os.PathLike | bytes | bytearray | memoryview,
    target_sr: int,
    *,
    min_sr: int = MIN_SOURCE_SR,
) -> torch.Tensor:
    """Decode an audio file (or its bytes) to a mono waveform at `target_sr`.

    Args:
        source: a path, or the encoded file's bytes (WAV, FLAC, OGG/Vorbis; MP3 where libsndfile supports it).
        target_sr: sample rate of the returned waveform, in Hz.
        min_sr: audio recorded below this rate is refused when it would need resampling (as the reference does).

    Returns:
        float32 tensor [1, N]: the channel mean, resampled to `target_sr` if the file's rate differs.

    Raises:
        AudioError: undecodable data, no samples, a non-positive target rate or a source rate below `min_sr`.
    """
    import torch

    data, sample_rate, name = _decode(source, target_sr)
    speech = torch.from_numpy(data).mean(dim=0, keepdim=True)  # [1, N]
    if sample_rate != target_sr:
        _check_source_rate(sample_rate, target_sr, min_sr, name)
        speech = resample(speech, sample_rate, target_sr)
    return speech


def load_wav_np(
    source: str | os.PathLike | bytes | bytearray | memoryview,
    target_sr: int,
    *,
    min_sr: int = MIN_SOURCE_SR,
) -> np.ndarray:
    """:func:`load_wav` in numpy alone (the lite runtime): float32 [1, N], resampled by :func:`resample_np`."""
    data, sample_rate, name = _decode(source, target_sr)
    speech = data.mean(axis=0, keepdims=True, dtype=np.float32)  # [1, N]
    if sample_rate != target_sr:
        _check_source_rate(sample_rate, target_sr, min_sr, name)
        speech = resample_np(speech, sample_rate, target_sr)
    return speech


def _check_source_rate(sample_rate: int, target_sr: int, min_sr: int, name: str) -> None:
    if sample_rate < min_sr:
        raise AudioError(
            f"audio {name} has sample rate {sample_rate} Hz; prompts must be recorded at >= {min_sr} Hz "
            f"to be resampled to {target_sr} Hz"
        )


def _decode(
    source: str | os.PathLike | bytes | bytearray | memoryview, target_sr: int
) -> tuple[np.ndarray, int, str]:
    """(samples float32 [C, N], the file's rate, how messages name it); raises AudioError for what is unusable."""
    import soundfile  # lazy: libsndfile is only needed when audio is actually read

    name = _describe(source)
    if not isinstance(target_sr, int) or isinstance(target_sr, bool) or target_sr <= 0:
        raise AudioError(f"target sample rate must be a positive integer, got {target_sr!r} (for {name})")
    if isinstance(source, bytes | bytearray | memoryview):
        if len(source) == 0:
            raise AudioError("cannot decode audio: the data is empty (0 bytes)")
        fileobj: str | io.BytesIO = io.BytesIO(bytes(source))
    else:
        fileobj = os.fspath(source)
        if not os.path.isfile(fileobj):
            raise AudioError(f"audio file {name} does not exist or is not a regular file")
    try:
        data, sample_rate = soundfile.read(fileobj, dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as e:
        raise AudioError(f"cannot decode audio {name}: {decode_failure(e)}") from e
    if data.shape[0] == 0 or data.shape[1] == 0:
        raise AudioError(f"audio {name} contains no samples")
    if sample_rate <= 0:
        raise AudioError(f"audio {name} declares an invalid sample rate {sample_rate}")
    return np.ascontiguousarray(data.T), int(sample_rate), name


@lru_cache(maxsize=32)
def _sinc_kernel(orig: int, new: int) -> tuple[torch.Tensor, int]:
    import torch

    # orig/new are already divided by their gcd. Output phase j (0 <= j < new) of each block of `new` output
    # samples is a dot product of a windowed sinc, evaluated at offsets (i/orig - j/new), with input samples
    # i in [-width, width + orig) around the block start.
    base_freq = min(orig, new) * ROLLOFF
    width = math.ceil(LOWPASS_FILTER_WIDTH * orig / base_freq)
    idx = torch.arange(-width, width + orig, dtype=torch.float64) / orig  # [K]
    # torchaudio forms -j/new in the default float32 before adding the float64 offsets; keep that rounding
    phase = (torch.arange(0, -new, -1, dtype=torch.float32) / new).to(torch.float64)  # [new]
    t = (phase[:, None, None] + idx[None, None, :]) * base_freq  # [new, 1, K]
    t = t.clamp(-LOWPASS_FILTER_WIDTH, LOWPASS_FILTER_WIDTH)
    window = torch.cos(t * math.pi / LOWPASS_FILTER_WIDTH / 2) ** 2
    t = t * math.pi
    kernel = torch.where(t == 0, torch.ones_like(t), t.sin() / t)
    kernel = kernel * (window * (base_freq / orig))
    return kernel.to(torch.float32), width


def _resampled_length(length: int, orig: int, new: int) -> int:
    # torchaudio takes ceil of the ratio after rounding it to float32 (torch.as_tensor of a Python float)
    return math.ceil(float(np.float32(new * length / orig)))


def _check_rates(orig_sr: int, new_sr: int) -> None:
    for label, rate in (("orig_sr", orig_sr), ("new_sr", new_sr)):
        if not isinstance(rate, int) or isinstance(rate, bool) or rate <= 0:
            raise AudioError(f"{label} must be a positive integer sample rate, got {rate!r}")


@lru_cache(maxsize=32)
def _sinc_kernel_np(orig: int, new: int) -> tuple[np.ndarray, int]:
    # _sinc_kernel's arithmetic in numpy float64 (the phase rounded through float32 first, as torchaudio does)
    base_freq = min(orig, new) * ROLLOFF
    width = math.ceil(LOWPASS_FILTER_WIDTH * orig / base_freq)
    idx = np.arange(-width, width + orig, dtype=np.float64) / orig  # [K]
    phase = (np.arange(0, -new, -1, dtype=np.float32) / np.float32(new)).astype(np.float64)  # [new]
    t = (phase[:, None] + idx[None, :]) * base_freq  # [new, K]
    t = np.clip(t, -LOWPASS_FILTER_WIDTH, LOWPASS_FILTER_WIDTH)
    window = np.cos(t * math.pi / LOWPASS_FILTER_WIDTH / 2) ** 2
    t = t * math.pi
    with np.errstate(invalid="ignore", divide="ignore"):
        kernel = np.where(t == 0, 1.0, np.sin(t) / t)
    kernel = kernel * (window * (base_freq / orig))
    return kernel.astype(np.float32), width


def resample_np(wave: np.ndarray, orig_sr: int, new_sr: int) -> np.ndarray:
    """:func:`resample` in numpy alone: float32 [C, N] -> [C, ceil(N * new_sr / orig_sr)]."""
    _check_rates(orig_sr, new_sr)
    if orig_sr == new_sr:
        return wave
    gcd = math.gcd(orig_sr, new_sr)
    orig, new = orig_sr // gcd, new_sr // gcd
    kernel, width = _sinc_kernel_np(orig, new)  # [new, K]
    x = np.asarray(wave, dtype=np.float32).reshape(-1, wave.shape[-1])
    length = x.shape[-1]
    x = np.pad(x, ((0, 0), (width, width + orig)))
    frames = np.lib.stride_tricks.sliding_window_view(x, kernel.shape[1], axis=-1)[
        :, ::orig
    ]  # [B, blocks, K]
    y = (frames @ kernel.T).reshape(x.shape[0], -1)  # [B, blocks * new]
    y = y[:, : _resampled_length(length, orig, new)]
    return np.ascontiguousarray(y.reshape(*wave.shape[:-1], y.shape[-1]), dtype=np.float32)


def resample(wave: torch.Tensor, orig_sr: int, new_sr: int) -> torch.Tensor:
    """Resample like `torchaudio.transforms.Resample(orig_sr, new_sr)` with its defaults.

    Args:
        wave: float tensor [C, N] (any leading dims work; time is last).
        orig_sr: sample rate of `wave` in Hz (positive integer).
        new_sr: wanted sample rate in Hz (positive integer).

    Returns:
        float32 tensor [C, N'] with N' = ceil(N * new_sr / orig_sr); `wave` itself when the rates are equal.
    """
    import torch.nn.functional as F

    _check_rates(orig_sr, new_sr)
    if not wave.is_floating_point():
        raise TypeError(f"resample expects a floating point waveform, got {wave.dtype}")
    if orig_sr == new_sr:
        return wave
    gcd = math.gcd(orig_sr, new_sr)
    orig, new = orig_sr // gcd, new_sr // gcd
    kernel, width = _sinc_kernel(orig, new)
    kernel = kernel.to(device=wave.device, dtype=wave.dtype)

    shape = wave.shape
    x = wave.reshape(-1, shape[-1])  # [B, N]
    length = x.shape[-1]
    x = F.pad(x, (width, width + orig))
    y = F.conv1d(x[:, None], kernel, stride=orig)  # [B, new, blocks]
    y = y.transpose(1, 2).reshape(x.shape[0], -1)  # [B, blocks * new]
    y = y[:, : _resampled_length(length, orig, new)]
    return y.reshape(*shape[:-1], y.shape[-1])
