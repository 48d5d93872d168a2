"""librosa 0.10.2's slaney mel filterbank (``librosa.filters.mel`` with htk=False, norm="slaney", dtype=float32) in
numpy alone: shared by the torch features (:mod:`cosyserve.frontend.features`) and the torch-free ones
(:mod:`cosyserve.frontend.features_np`)."""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

__all__ = ["slaney_mel_filterbank"]


_F_SP = 200.0 / 3  # Hz per mel in the linear region
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOGSTEP = math.log(6.4) / 27.0


def _hz_to_mel(hz: float) -> float:
    if hz >= _MIN_LOG_HZ:
        return _MIN_LOG_MEL + float(np.log(hz / _MIN_LOG_HZ)) / _LOGSTEP
    return hz / _F_SP


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    hz = _F_SP * mels
    log_region = mels >= _MIN_LOG_MEL
    hz[log_region] = _MIN_LOG_HZ * np.exp(_LOGSTEP * (mels[log_region] - _MIN_LOG_MEL))
    return hz


@lru_cache(maxsize=8)
def slaney_mel_filterbank(
    sr: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None
) -> np.ndarray:
    """Slaney-scale, slaney-normalised triangular filters, as librosa 0.10.2 `filters.mel` returns them.

    Returns:
        float32 array [n_mels, n_fft // 2 + 1] (read-only; cached).
    """
    if fmax is None:
        fmax = sr / 2.0
    fft_freqs = np.fft.rfftfreq(n=n_fft, d=1.0 / sr)  # [n_fft//2+1] float64
    mel_f = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))  # band edges in Hz
    fdiff = np.diff(mel_f)
    ramps = mel_f[:, None] - fft_freqs[None, :]  # [n_mels+2, n_freqs]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    # librosa stores the triangles into a float32 array first, then scales in float64 and stores again
    weights = np.maximum(0.0, np.minimum(lower, upper)).astype(np.float32)
    enorm = 2.0 / (mel_f[2 : n_mels + 2] - mel_f[:n_mels])
    weights = (weights.astype(np.float64) * enorm[:, None]).astype(np.float32)
    weights.setflags(write=False)
    return weights
