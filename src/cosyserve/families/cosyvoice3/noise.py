"""CosyVoice3's fixed vocoder noise, as the reference's modules hold it.

CosyVoice3 draws no random numbers at inference: its causal vocoder's sine source reads two buffers that the
reference draws once, when the model is built, from torch's global CPU generator (``SineGen2.rand_ini`` [1, 9],
column 0 zeroed, and ``SineGen2.sine_waves`` [1, 7200000, 9], both uniform in [0, 1)). The generator was seeded 0
by the flow's CFM constructor, which drew its own noise (``randn(1, 80, 15000)``,
:func:`cosyserve.models.causal_flow.fixed_noise`); then it served the initialisation of the flow's token embedding
and speaker projection and of the vocoder's f0 predictor, in that order (KINDS-cosyvoice3.md). Replaying those draws with the same shapes gives the
same buffers, bit for bit (checked against the fixtures' recorded buffers), so a served model speaks as the
reference's does. Only a prefix of ``sine_waves`` is ever read (one sample row per output sample of a vocoder
call): it is made as long as calls need (10 s at first, doubling), the generator kept where it stopped so that a
longer prefix draws only what it adds.

The replay is numpy's, without torch (both runtimes use it; a lite bundle carries no noise, only the shapes in its
manifest's config): torch's CPU generator is a 32-bit Mersenne Twister seeded as ``init_genrand(seed)``; a float32
``uniform_`` / ``rand`` takes one 32-bit output per element, its low 24 bits times 2**-24; ``normal_`` of a
contiguous float32 tensor of n >= 16 elements takes n outputs, and 16 more when n is not a multiple of 16 (its last
16 values are drawn again). So the outputs before ``rand_ini`` are counted from the shapes and skipped.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["REFERENCE_SAMPLES", "VocoderNoise", "draws_before"]

REFERENCE_SAMPLES = 7_200_000  # the reference's buffer: a vocoder call over more samples fails there
FLOW_NOISE = 80 * 15000  # the flow's fixed noise, randn(1, 80, 15000)
SEED = 0
INITIAL_SAMPLES = 240_000  # 10 s at 24 kHz: the first prefix drawn


def _get(config: Any, name: str) -> Any:
    # a ModelConfig's field (an attribute) or a manifest config's (a key)
    return config[name] if isinstance(config, Mapping) else getattr(config, name)


def _normal(n: int) -> int:
    return n + (16 if n % 16 else 0)


def draws_before(config: Any) -> int:
    """The generator outputs the reference's construction draws before ``rand_ini``, for a model ``config`` (a
    :class:`~cosyserve.families.modelconfig.ModelConfig`, or a bundle manifest's ``config``): the flow's noise, its
    token embedding (normal) and speaker projection (kaiming uniform weight, uniform bias), the vocoder's f0
    predictor (5 convs, then its linear head)."""
    flow, hift = _get(config, "flow"), _get(config, "hift")
    f0 = _get(hift, "f0_predictor")
    inp, cond, classes = _get(f0, "in_channels"), _get(f0, "cond_channels"), _get(f0, "num_class")
    n = FLOW_NOISE + _normal(_get(flow, "vocab_size") * _get(flow, "input_size"))
    n += _get(flow, "spk_embed_dim") * _get(flow, "output_size") + _get(flow, "output_size")
    n += inp * cond * 4 + cond + 4 * (cond * cond * 3 + cond)
    return n + cond * classes + classes


def _mt19937(seed: int) -> np.random.MT19937:
    # torch's CPU generator after manual_seed(seed): the reference init_genrand (not numpy's SeedSequence)
    key = np.zeros(624, np.uint32)
    s = seed & 0xFFFFFFFF
    for i in range(624):
        key[i] = s
        s = (1812433253 * (s ^ (s >> 30)) + i + 1) & 0xFFFFFFFF
    bg = np.random.MT19937()
    bg.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": 624}}
    return bg


def _uniform(bg: np.random.MT19937, n: int) -> np.ndarray:
    # n float32 in [0, 1) as torch's rand draws them, in blocks (bounded temporary memory)
    out = np.empty(n, np.float32)
    for i in range(0, n, 1 << 22):
        raw = bg.random_raw(min(1 << 22, n - i))
        np.bitwise_and(raw, 0xFFFFFF, out=raw)
        out[i : i + raw.shape[0]] = raw  # exact: 24 bits fit a float32
    out *= np.float32(2.0**-24)  # exact: a power of two
    return out


class VocoderNoise:
    """The vocoder noise buffers of a CosyVoice3 model with ``config`` (a
    :class:`~cosyserve.families.modelconfig.ModelConfig`, or a bundle manifest's ``config``), made on first use and
    grown on demand; thread-safe. Numpy arrays (the torch runtime shares their memory)."""

    def __init__(self, config: Any) -> None:
        self.skip = draws_before(config)
        self.harmonics = int(_get(_get(config, "hift"), "nb_harmonics")) + 1
        self._lock = threading.Lock()
        # the buffers drawn so far, and the generator where they stop (a longer prefix draws on from there)
        self._drawn: tuple[dict[str, np.ndarray], np.random.MT19937] | None = None

    def draws(self, samples: int) -> dict[str, np.ndarray]:
        """``{"rand_ini": [1, H], "sine_waves": [1, >= samples, H]}`` float32 for a vocoder call of ``samples``.
        The arrays returned are never written afterwards (a longer prefix is a new array)."""
        if samples > REFERENCE_SAMPLES:
            raise ValueError(
                f"a vocoder call over {samples} samples exceeds the reference's noise buffer "
                f"({REFERENCE_SAMPLES} samples)"
            )
        with self._lock:
            drawn = self._drawn
            if drawn is None or drawn[0]["sine_waves"].shape[1] < samples:
                # 10 s at 24 kHz at first (a start draws ~30 ms of it, not the ~0.1-0.2 s a minute took while a
                # first request's LM prefill ran beside it), then doubling
                before = 0 if drawn is None else drawn[0]["sine_waves"].shape[1]
                n = min(REFERENCE_SAMPLES, max(samples, 2 * before, INITIAL_SAMPLES))
                self._drawn = drawn = self._extend(drawn, n)
        return drawn[0]

    def _extend(
        self, drawn: tuple[dict[str, np.ndarray], np.random.MT19937] | None, samples: int
    ) -> tuple[dict[str, np.ndarray], np.random.MT19937]:
        h = self.harmonics
        if drawn is None:
            bg = _mt19937(SEED)
            bg.random_raw(self.skip, output=False)  # advanced, nothing stored
            rand_ini = _uniform(bg, h).reshape(1, h)
            rand_ini[:, 0] = 0
            drawn = ({"rand_ini": rand_ini, "sine_waves": np.empty((1, 0, h), np.float32)}, bg)
        have, bg = drawn
        before = have["sine_waves"].shape[1]
        more = _uniform(bg, (samples - before) * h).reshape(1, samples - before, h)
        sine_waves = np.concatenate([have["sine_waves"], more], axis=1)
        return {"rand_ini": have["rand_ini"], "sine_waves": sine_waves}, bg
