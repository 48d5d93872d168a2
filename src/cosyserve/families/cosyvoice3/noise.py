"""CosyVoice3's fixed vocoder noise, as the reference's modules hold it.

CosyVoice3 draws no random numbers at inference: its causal vocoder's sine source reads two buffers that the
reference draws once, when the model is built, from torch's global CPU generator (``SineGen2.rand_ini`` [1, 9],
column 0 zeroed, and ``SineGen2.sine_waves`` [1, 7200000, 9], both uniform in [0, 1)). The generator was seeded 0
by the flow's CFM constructor, which drew its own noise (``randn(1, 80, 15000)``,
:func:`cosyserve.models.causal_flow.fixed_noise`); then it served the initialisation of the flow's token embedding
and speaker projection and of the vocoder's f0 predictor, in that order (KINDS-cosyvoice3.md). Replaying those draws with the same shapes gives the
same buffers, bit for bit (checked against the fixtures' recorded buffers), so a served model speaks as the
reference's does. Only a prefix of ``sine_waves`` is ever read (one sample row per output sample of a vocoder
call): it is made as long as calls need, and no longer.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["REFERENCE_SAMPLES", "VocoderNoise"]

REFERENCE_SAMPLES = 7_200_000  # the reference's buffer: a vocoder call over more samples fails there


class VocoderNoise:
    """The vocoder noise buffers of a CosyVoice3 model with ``config`` (a
    :class:`~cosyserve.families.modelconfig.ModelConfig`), made on first use and grown on demand; thread-safe."""

    def __init__(self, config: Any) -> None:
        self.flow, self.f0 = config.flow, config.hift.f0_predictor
        self.harmonics = config.hift.nb_harmonics + 1
        self._lock = threading.Lock()
        self._buffers: dict[str, Any] | None = None

    def draws(self, samples: int) -> dict[str, Any]:
        """``{"rand_ini": [1, H], "sine_waves": [1, >= samples, H]}`` for a vocoder call of ``samples``."""
        if samples > REFERENCE_SAMPLES:
            raise ValueError(
                f"a vocoder call over {samples} samples exceeds the reference's noise buffer "
                f"({REFERENCE_SAMPLES} samples)"
            )
        with self._lock:
            have = self._buffers
            if have is None or have["sine_waves"].shape[1] < samples:
                # at least a minute at 24 kHz, doubling: a few regenerations per process at most
                n = min(
                    REFERENCE_SAMPLES,
                    max(samples, 2 * (0 if have is None else have["sine_waves"].shape[1]), 1_440_000),
                )
                self._buffers = have = self._replay(n)
        return have

    def _replay(self, samples: int) -> dict[str, Any]:
        import torch
        from torch import nn

        with torch.random.fork_rng(devices=[]):  # the process's own generator is left as it was
            torch.manual_seed(0)
            torch.randn(1, 80, 15000)  # the flow's fixed noise
            flow = self.flow
            nn.Embedding(flow.vocab_size, flow.input_size)
            nn.Linear(flow.spk_embed_dim, flow.output_size)
            f0 = self.f0
            nn.Conv1d(f0.in_channels, f0.cond_channels, 4)  # CausalConvRNNF0Predictor: 5 convs, then its head
            for _ in range(4):
                nn.Conv1d(f0.cond_channels, f0.cond_channels, 3)
            nn.Linear(f0.cond_channels, f0.num_class)
            rand_ini = torch.rand(1, self.harmonics)
            rand_ini[:, 0] = 0
            sine_waves = torch.rand(1, samples, self.harmonics)
        return {"rand_ini": rand_ini, "sine_waves": sine_waves}
