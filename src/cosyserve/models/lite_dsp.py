"""The lite runtime's numpy parts: what the graphs leave out because it is cheap, stateful or random.

Each function follows its torch counterpart in :mod:`cosyserve.models` op for op where the order of float
operations matters (the interpolation's source index, the sine phase's float64 running sum, the fade's float64
products), so the lite runtime's audio equals the torch runtime's up to float32 rounding when both are given the
same random draws. Nothing here imports torch.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

__all__ = [
    "distance_pe",
    "euler_schedule",
    "fade_in_out",
    "hamming",
    "interp_linear",
    "istft",
    "normalize",
    "sine_source",
    "stft",
]


def distance_pe(d_model: int, start: int, stop: int) -> np.ndarray:
    """ESPnet relative-position rows for distances ``start .. stop-1``: (stop-start, d_model) float32, the rows
    :meth:`cosyserve.models.attention.EspnetRelPositionalEncoding.distances` gives."""
    position = np.arange(start, stop, dtype=np.float32)[:, None]
    div_term = np.exp(np.arange(0, d_model, 2, dtype=np.float32) * np.float32(-(math.log(10000.0) / d_model)))
    out = np.zeros((stop - start, d_model), dtype=np.float32)
    out[:, 0::2] = np.sin(position * div_term)
    out[:, 1::2] = np.cos(position * div_term)
    return out


def normalize(v: np.ndarray) -> np.ndarray:
    """``v`` as one row (1, N) float32 scaled to unit L2 norm, as ``F.normalize(v, dim=1)`` (a speaker
    embedding before its affine layer)."""
    v = v.astype(np.float32).reshape(1, -1)
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), np.float32(1e-12))


def interp_linear(x: np.ndarray, size: int) -> np.ndarray:
    """``F.interpolate(x, size, mode="linear")`` (align_corners False) over the last axis of (C, T)."""
    t = x.shape[-1]
    if size == t:
        return x.astype(np.float32, copy=True)
    scale = np.float32(t / size)
    src = (np.arange(size, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5)
    src = np.maximum(src, np.float32(0.0))
    i0 = np.minimum(src.astype(np.int64), t - 1)
    i1 = np.minimum(i0 + 1, t - 1)
    lam = (src - i0.astype(np.float32)).astype(np.float32)
    return (x[..., i0] * (np.float32(1.0) - lam) + x[..., i1] * lam).astype(np.float32)


def euler_schedule(n_timesteps: int, scheduler: str) -> list[tuple[np.float32, np.float32]]:
    """(t, dt) per Euler step, accumulated as the torch flow does (float32, t = t + dt)."""
    t_span = np.linspace(0, 1, n_timesteps + 1, dtype=np.float32)
    if scheduler == "cosine":
        t_span = (np.float32(1) - np.cos(t_span * np.float32(0.5) * np.float32(math.pi))).astype(np.float32)
    t, dt = t_span[0], t_span[1] - t_span[0]
    steps = []
    for step in range(1, n_timesteps + 1):
        steps.append((t, dt))
        t = np.float32(t + dt)
        if step < n_timesteps:
            dt = np.float32(t_span[step + 1] - t)
    return steps


@lru_cache(maxsize=8)
def hamming(n: int) -> np.ndarray:
    return np.hamming(n)  # float64, as the reference multiplies


def fade_in_out(fade_in: np.ndarray, fade_out: np.ndarray, window: np.ndarray) -> np.ndarray:
    """Cross-fade the head of ``fade_in`` with the tail of ``fade_out`` over the last axis (float64 products)."""
    n = window.shape[0] // 2
    out = fade_in.copy()
    mixed = (
        fade_in[..., :n].astype(np.float64) * window[:n] + fade_out[..., -n:].astype(np.float64) * window[n:]
    )
    out[..., :n] = mixed.astype(out.dtype)
    return out


@lru_cache(maxsize=4)
def _hann(n_fft: int) -> np.ndarray:
    # periodic hann in float64, cast (the torch vocoder's window)
    return (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)).astype(np.float32)


def stft(x: np.ndarray, n_fft: int, hop: int) -> np.ndarray:
    """Centered (reflect-padded) STFT of a 1-D signal with a periodic hann window: (n_fft/2+1, L/hop+1) complex."""
    pad = n_fft // 2
    xp = np.pad(x, (pad, pad), mode="reflect")
    n = 1 + (xp.shape[0] - n_fft) // hop
    idx = np.arange(n_fft)[None, :] + hop * np.arange(n)[:, None]
    frames = xp[idx] * _hann(n_fft)  # (N, n_fft)
    return np.fft.rfft(frames, axis=1).T.astype(np.complex64)


def source_stft(source: np.ndarray, n_fft: int, hop: int) -> np.ndarray:
    """HiFT's source spectrum: the :func:`stft` of the excitation ``source`` (L,) as (n_fft + 2, N) float32, real
    parts over imaginary ones (its decoder graph's ``s_stft``)."""
    spec = stft(source, n_fft, hop)
    return np.concatenate([spec.real, spec.imag]).astype(np.float32)


def spectrum_wave(x: np.ndarray, n_fft: int, hop: int) -> np.ndarray:
    """HiFT's waveform from its decoder's output ``x`` (n_fft + 2, N): log-magnitudes (capped at 1e2) over phases
    (through the reference's redundant ``sin``), inverted by :func:`istft`."""
    half = n_fft // 2 + 1
    magnitude = np.minimum(np.exp(x[:half]), np.float32(1e2))
    phase = np.sin(x[half:])
    return istft(magnitude * np.cos(phase) + 1j * (magnitude * np.sin(phase)), n_fft, hop)


def istft(spec: np.ndarray, n_fft: int, hop: int) -> np.ndarray:
    """Inverse of :func:`stft` (``torch.istft`` with center=True, a periodic hann window): (hop * (N-1),)."""
    window = _hann(n_fft)
    frames = np.fft.irfft(spec.T, n=n_fft, axis=1).astype(np.float32) * window  # (N, n_fft)
    n = frames.shape[0]
    length = n_fft + hop * (n - 1)
    y = np.zeros(length, dtype=np.float32)
    env = np.zeros(length, dtype=np.float32)
    w2 = window * window
    for j in range(n_fft // hop):  # overlap-add by hop-sized phases: n_fft/hop vector adds, not N frame adds
        part = frames[:, j * hop : (j + 1) * hop]  # (N, hop)
        y[j * hop : j * hop + n * hop] += part.reshape(-1)
        env[j * hop : j * hop + n * hop] += np.tile(w2[j * hop : (j + 1) * hop], n)
    pad = n_fft // 2
    y, env = y[pad : length - pad], env[pad : length - pad]
    return (y / np.where(env > 1e-11, env, np.float32(1.0))).astype(np.float32)


def sine_source(
    f0: np.ndarray,
    *,
    upsample: int,
    sampling_rate: int,
    nb_harmonics: int,
    alpha: float,
    sigma: float,
    voiced_threshold: float,
    weight: np.ndarray,
    bias: np.ndarray,
    phase: np.ndarray,
    noise: np.ndarray,
) -> np.ndarray:
    """The 22.05 kHz SineGen + harmonic merge: f0 (T,) in Hz -> the excitation (T * upsample,) float32.

    ``phase`` (H, 1) is the initial phase per harmonic (uniform in [-pi, pi); row 0 ignored), ``noise`` (H, L)
    standard normal; H = nb_harmonics + 1."""
    h = nb_harmonics + 1
    f0 = np.repeat(f0.astype(np.float32), upsample)  # nearest, (L,)
    harmonics = np.arange(1, h + 1, dtype=np.float32)[:, None]
    rad = f0[None, :] * harmonics / np.float32(sampling_rate)  # (H, L) cycles per sample
    # torch's CPU cumsum accumulates float32 in double
    theta = np.float32(2 * math.pi) * (
        np.cumsum(rad, axis=1, dtype=np.float64).astype(np.float32) % np.float32(1)
    )
    ph = phase.astype(np.float32).copy()
    ph[0] = 0
    sine = np.float32(alpha) * np.sin(theta + ph)
    uv = (f0 > voiced_threshold).astype(np.float32)[None, :]
    noise_amp = uv * np.float32(sigma) + (np.float32(1) - uv) * np.float32(alpha / 3)
    sine = sine * uv + noise_amp * noise.astype(np.float32)
    return np.tanh(weight.reshape(-1) @ sine + bias.reshape(-1)[0]).astype(np.float32)
