"""The quality gate's figures and how they are judged: the distance of two waveforms (:func:`audio_distance`),
the :data:`BOUNDS` of the gated figures and the :class:`QualityReport` that holds them (the measurements that make
them are :mod:`cosyserve.tools.quality`'s)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["BOUNDS", "AudioDistance", "Bound", "QualityReport", "audio_distance", "pooled"]


@dataclass(frozen=True)
class Bound:
    """A limit on one figure: ``value <= limit`` (``upper``) or ``value >= limit``."""

    limit: float
    upper: bool = True

    def holds(self, value: float) -> bool:
        return value <= self.limit if self.upper else value >= self.limit


# Bounds of the gate, set from measurements (seed 0) on the tiny test model and the full-size random-weight model:
# - llm: a bf16 bundle gives top1 0.985 / dlogp 0.0035 (tiny); the output layer and the flow's encoder projection
#   perturbed by 10% of their norm give top1 0.83 / dlogp 0.047: the bounds sit between, nearer the bf16 side.
# - token2wav.flow_mel_l1: bf16 0.006, the 10% perturbation 0.022 (tiny). The audio figures saturate on random
#   weights: their audio is noise-like, so the smallest change of the mel decorrelates the vocoder's phase and
#   gives ~0.2 log-mel L1 / ~5.6 dB LSD (bf16, tiny); their bounds only catch gross breakage.
# - chunks (the same saturation, plus each window's flow seeing only its own tokens): low-latency first hop 21
#   gives seam/overall log-mel L1 0.25/0.24 (tiny) and 0.27/0.28 (full), LSD 6.0-6.7 dB, the reference rule
#   0.25/0.24 (both); clicks at every chunk start push the seam L1 to 0.40 and seam/overall to 1.37. Hence the
#   absolute bounds below, and two ratios that do not saturate: seam over overall (an artefact at the seams) and
#   low-latency over reference overall (what the short windows cost beyond the reference rule).
BOUNDS: dict[str, Bound] = {
    "llm.top1": Bound(0.95, upper=False),
    "llm.dlogp": Bound(0.02),
    "token2wav.flow_mel_l1": Bound(0.015),
    "token2wav.mel_l1": Bound(0.35),
    "token2wav.lsd_db": Bound(7.5),
    "chunks.low-latency.seam.mel_l1": Bound(0.35),
    "chunks.low-latency.seam.lsd_db": Bound(7.5),
    "chunks.low-latency.overall.mel_l1": Bound(0.35),
    "chunks.low-latency.overall.lsd_db": Bound(7.5),
    "chunks.low-latency.seam_excess": Bound(1.25),
    "chunks.low-latency.vs_reference": Bound(1.35),
}


# -- distances ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AudioDistance:
    """How far two waveforms are apart (0 for identical audio).

    Attributes:
        mel_l1: mean |difference| of the log-mel spectrograms (natural log of magnitude; 80 bins, 1024/256).
        lsd_db: log-spectral distance in dB (per frame the RMS over 513 bins of the power difference in dB).
        frames: STFT frames compared.
    """

    mel_l1: float
    lsd_db: float
    frames: int


def _spectra(audio: torch.Tensor, sample_rate: int) -> tuple[torch.Tensor, torch.Tensor]:
    # (log-mel [80, T], power in dB [513, T]) on the same frames: the mel the model's features use
    from cosyserve.frontend.features import mel_spectrogram

    audio = audio.reshape(1, -1).float()
    logmel = mel_spectrogram(audio, sampling_rate=sample_rate)[0]
    pad = (1024 - 256) // 2
    y = torch.nn.functional.pad(audio.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    spec = torch.stft(
        y, 1024, 256, 1024, torch.hann_window(1024), center=False, return_complex=True
    )  # (1, 513, T)
    power_db = 10 * torch.log10(spec.abs()[0].pow(2).clamp(min=1e-10))
    return logmel, power_db


def audio_distance(
    a: torch.Tensor, b: torch.Tensor, sample_rate: int, regions: Sequence[tuple[int, int]] | None = None
) -> AudioDistance:
    """Distances between waveforms ``a`` and ``b`` (1-D or [1, N]; compared over their common length).

    Args:
        a, b: float waveforms at ``sample_rate``.
        sample_rate: Hz.
        regions: ``(start, end)`` sample ranges; only STFT frames whose centre falls in one count (None: all).
    Returns:
        An :class:`AudioDistance`.
    """
    n = min(a.numel(), b.numel())
    mel_a, pow_a = _spectra(a.reshape(-1)[:n], sample_rate)
    mel_b, pow_b = _spectra(b.reshape(-1)[:n], sample_rate)
    frames = mel_a.shape[1]
    keep = torch.ones(frames, dtype=torch.bool)
    if regions is not None:
        centres = torch.arange(frames) * 256 + 128  # a frame spans [k*256 - 384, k*256 + 640) of the audio
        keep = torch.zeros(frames, dtype=torch.bool)
        for start, end in regions:
            keep |= (centres >= start) & (centres < end)
    if not bool(keep.any()):
        return AudioDistance(0.0, 0.0, 0)
    mel_l1 = (mel_a[:, keep] - mel_b[:, keep]).abs().mean()
    lsd = (pow_a[:, keep] - pow_b[:, keep]).pow(2).mean(dim=0).sqrt().mean()
    return AudioDistance(float(mel_l1), float(lsd), int(keep.sum()))


def pooled(parts: Sequence[AudioDistance]) -> AudioDistance:
    n = sum(p.frames for p in parts)
    if n == 0:
        return AudioDistance(0.0, 0.0, 0)
    return AudioDistance(
        sum(p.mel_l1 * p.frames for p in parts) / n, sum(p.lsd_db * p.frames for p in parts) / n, n
    )


@dataclass
class QualityReport:
    """Figures by name (``llm.top1``, ``token2wav.mel_l1``, ``chunks.low-latency.seam.lsd_db``, ...).

    Attributes:
        model, variant: what was compared (the variant as bundle and options).
        figures: name -> value.
    """

    model: str
    variant: str
    figures: dict[str, float] = field(default_factory=dict)

    def failures(self) -> list[str]:
        """One line per figure outside its :data:`BOUNDS` entry."""
        out = []
        for name, bound in BOUNDS.items():
            if name in self.figures and not bound.holds(self.figures[name]):
                op = "<=" if bound.upper else ">="
                out.append(f"{name} = {self.figures[name]:.4g}, expected {op} {bound.limit:g}")
        return out

    def to_json(self) -> str:
        bounds = {k: {"limit": b.limit, "upper": b.upper} for k, b in BOUNDS.items()}
        return json.dumps(
            {
                "model": self.model,
                "variant": self.variant,
                "figures": self.figures,
                "bounds": bounds,
                "failures": self.failures(),
            },
            indent=2,
            ensure_ascii=False,
        )

    def table(self) -> str:
        lines = [
            f"model {self.model}; variant {self.variant} vs fp32",
            f"{'figure':<36} {'value':>10}  bound",
        ]
        for name, value in self.figures.items():
            bound = BOUNDS.get(name)
            shown = "" if bound is None else f"{'<=' if bound.upper else '>='} {bound.limit:g}"
            flag = "" if bound is None or bound.holds(value) else "  EXCEEDED"
            lines.append(f"{name:<36} {value:>10.4f}  {shown}{flag}")
        return "\n".join(lines)
