"""CosyVoice2's and CosyVoice3's token2wav models on the lite graphs (:mod:`cosyserve.bundle.lite.export_chunkflow`),
driven by numpy; nothing here imports torch.

:class:`LiteChunkFlow` is :meth:`cosyserve.models.causal_flow.ChunkFlow.inference` without a stream (each call
over every token so far, as the reference's): ``mu`` from the ``flow_mu`` graph (``flow_mu_stream`` for a
streamed chunk), the speaker affine and the prompt condition, then the Euler steps over the estimator graph from
the fixed noise (a table). :class:`LiteCausalVocoder` is
:meth:`cosyserve.models.causal_hift.CausalHiFTGenerator.inference`: the f0 graph, the causal sine source in numpy
(the reference's SineGen2, the model's fixed noise buffers given), the STFT, the spectrum graph and the iSTFT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from cosyserve.core.sampling import ArrayOps
from cosyserve.core.stop import ShouldStop, check
from cosyserve.models import lite_dsp as dsp
from cosyserve.runtime.lite import terminate
from cosyserve.runtime.lite.models import LiteVocoder

__all__ = ["LiteCausalVocoder", "LiteChunkFlow", "LiteVocoder2"]


class LiteChunkFlow:
    """Speech tokens after a prompt -> mel over the ``flow_mu*`` and ``flow_estimator*`` graphs."""

    def __init__(self, bundle: Any, tables: dict[str, np.ndarray], n_timesteps: int | None = None) -> None:
        c = bundle.config["flow"]
        self.bundle = bundle
        self.cfg = SimpleNamespace(**c)  # attributes, as the torch flow's config
        self.input_frame_rate = int(c["input_frame_rate"])
        self.output_size = int(c["output_size"])
        self.in_channels = int(c["in_channels"])
        self.token_mel_ratio = int(c["token_mel_ratio"])
        self.pre_lookahead_len = int(c["pre_lookahead_len"])
        self.n_timesteps = int(n_timesteps or c["n_timesteps"])
        self.scheduler = str(c["t_scheduler"])
        self.cfg_rate = np.float32(c["inference_cfg_rate"])
        self.spk_w, self.spk_b = tables["flow.spk_affine.weight"], tables["flow.spk_affine.bias"]
        self.noise = tables["flow.noise"]  # (80, frames): the reference's fixed noise

    ops = ArrayOps(np)  # the array ops of the token2wav that drives it (numpy's)
    streams = False  # each streamed chunk re-runs the flow over every token so far (no kept frames yet)

    def inference(
        self,
        token: np.ndarray,
        prompt_token: np.ndarray,
        prompt_feat: np.ndarray,
        embedding: np.ndarray,
        streaming: bool,
        finalize: bool,
        *,
        n_timesteps: int | None = None,
        should_stop: ShouldStop | None = None,
    ) -> np.ndarray:
        """The torch flow's ``inference`` (:meth:`cosyserve.models.causal_flow.ChunkFlow.inference`, no stream),
        the same shapes in numpy: mel (1, 80, M) float32 of ``token`` after the prompt.

        Args:
            token, prompt_token: (1, T), (1, P) speech token ids.
            prompt_feat: (1, F, 80) prompt mel.
            embedding: (1, 192) speaker x-vector.
            streaming, finalize: a streamed chunk (chunk attention, the last ``pre_lookahead_len`` tokens
                lookahead only) or the utterance's end (full attention, no lookahead): the two calls the
                reference's token2wav makes.
        """
        if streaming == finalize:
            raise ValueError(
                "the lite flow runs a streamed chunk (streaming, not finalize) or the utterance's end (finalize, "
                f"not streaming); got streaming={streaming}, finalize={finalize}"
            )
        look = 0 if finalize else self.pre_lookahead_len
        if token.shape[1] <= look:
            raise ValueError(
                f"a chunk that does not finalize needs more than {look} tokens (the last {look} are "
                f"lookahead), got {token.shape[1]}"
            )
        ids = np.concatenate([prompt_token, token], axis=1).astype(np.int64)
        prompt_feat = prompt_feat[0]
        f, n = prompt_feat.shape[0], self.output_size
        frames = self.token_mel_ratio * (ids.shape[1] - look)
        if f > frames:
            raise ValueError(f"prompt_feat has {f} frames, more than the {frames} the tokens make")
        if frames > self.noise.shape[1]:
            raise ValueError(
                f"the flow's fixed noise has {self.noise.shape[1]} frames; {frames} were asked for"
            )
        suffix = "_stream" if streaming else ""
        (mu,) = terminate.run(self.bundle.session("flow_mu" + suffix), {"tokens": ids}, should_stop)
        spks = (dsp.normalize(embedding) @ self.spk_w.T + self.spk_b)[0]  # (80,)
        h = np.zeros((2, self.in_channels, frames), np.float32)  # rows: conditioned, unconditioned
        h[0, n : 2 * n] = mu[0]
        h[0, 2 * n : 3 * n] = spks[:, None]
        h[0, 3 * n :, :f] = prompt_feat.T
        x = self.noise[:, :frames].astype(np.float32)
        est, rate = self.bundle.session("flow_estimator" + suffix), self.cfg_rate
        for t, dt in dsp.euler_schedule(n_timesteps or self.n_timesteps, self.scheduler):
            check(should_stop)
            h[:, :n] = x
            (v,) = terminate.run(est, {"h": h, "t": np.full(2, t, np.float32)}, should_stop)
            x = x + dt * ((np.float32(1.0) + rate) * v[0] - rate * v[1])
        return x[None, :, f:].astype(np.float32)


class LiteCausalVocoder:
    """CosyVoice3's causal vocoder: mel -> audio over the ``hift_f0`` and ``hift_decode`` graphs."""

    def __init__(self, bundle: Any, tables: dict[str, np.ndarray]) -> None:
        self.bundle = bundle
        self.cfg = SimpleNamespace(**bundle.config["hift"])  # attributes, as the torch vocoder's config
        c = self.cfg
        self.w, self.b = tables["hift.source.weight"], tables["hift.source.bias"]
        self.harmonics = int(c.nb_harmonics) + 1
        self.upsample = int(c.upsample_factor)
        self.lookahead = int(c.lookahead)

    def _f0(self, mel: np.ndarray, finalize: bool, should_stop: ShouldStop | None) -> np.ndarray:
        # mel (80, T) -> f0 (T,) finalizing (3 zero frames of lookahead), else (T - 3,)
        if finalize:
            mel = np.pad(mel, ((0, 0), (0, int(self.cfg.f0_lookahead))))
        (f0,) = terminate.run(
            self.bundle.session("hift_f0"), {"mel": mel[None].astype(np.float32)}, should_stop
        )
        return f0[0]

    def _source(self, f0: np.ndarray, rand_ini: np.ndarray, sine_waves: np.ndarray) -> np.ndarray:
        # SineGen2 as the torch vocoder's _causal_source (first frame 0, no carry): f0 (T,) -> (T * 480,)
        c, scale, H = self.cfg, self.upsample, self.harmonics
        f0 = np.repeat(f0.astype(np.float32), scale)[:, None]  # (L, 1) nearest
        L = f0.shape[0]
        if sine_waves.shape[0] < L or sine_waves.shape[1] != H or rand_ini.shape[-1] != H:
            raise ValueError(f"sine_waves must be (>= {L}, {H}) and rand_ini ({H},)")
        harmonics = np.arange(1, H + 1, dtype=np.float32)[None, :]
        rad = (f0 * harmonics / np.float32(c.sampling_rate)) % np.float32(1)  # (L, H)
        rad[0] = rad[0] + rand_ini.reshape(-1).astype(np.float32)
        rad = _frame_mean(rad, scale)  # (T, H): linear downsampling by `scale`
        phase = np.cumsum(rad, axis=0, dtype=np.float64).astype(np.float32) * np.float32(
            2 * math.pi
        )  # (T, H)
        phase = np.repeat(phase * np.float32(scale), scale, axis=0)  # (L, H)
        sine = np.sin(phase) * np.float32(c.nsf_alpha)
        uv = (f0 > np.float32(c.nsf_voiced_threshold)).astype(np.float32)
        noise_amp = uv * np.float32(c.nsf_sigma) + (np.float32(1) - uv) * np.float32(c.nsf_alpha / 3)
        sine = sine * uv + noise_amp * sine_waves[:L].astype(np.float32)
        return np.tanh(sine @ self.w.reshape(-1) + self.b.reshape(-1)[0]).astype(np.float32)

    def new_stream(self, whole: bool = True) -> _VocoderStream:
        """A stream's state for :meth:`stream` (every call re-runs on the whole mel so far, as the reference)."""
        return _VocoderStream()

    def stream(
        self,
        state: _VocoderStream,
        mel: np.ndarray,
        finalize: bool,
        *,
        rand_ini: np.ndarray,
        sine_waves: np.ndarray,
        should_stop: ShouldStop | None = None,
    ) -> np.ndarray:
        """The torch vocoder's ``stream`` on the reference's rule: the mel so far (1, 80, n frames more) vocoded
        whole, the samples after those emitted before returned (1, samples)."""
        state.mel = mel if state.mel is None else np.concatenate([state.mel, mel], axis=2)
        speech, _ = self.inference(state.mel, finalize, rand_ini, sine_waves, should_stop)
        speech = speech[:, state.emitted :]
        state.emitted += speech.shape[1]
        return speech

    def inference(
        self,
        mel: np.ndarray,
        finalize: bool,
        rand_ini: np.ndarray,
        sine_waves: np.ndarray,
        should_stop: ShouldStop | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The torch vocoder's ``inference``, the same shapes in numpy: mel (1, 80, T) -> (speech (1, T * 480)
        finalizing, else (1, (T - 8) * 480); the source excitation (1, 1, L)). ``rand_ini`` (1, H),
        ``sine_waves`` (1, >= L, H): the model's fixed noise buffers."""
        c = self.cfg
        mel = mel[0]
        if not finalize and mel.shape[1] <= self.lookahead:
            raise ValueError(
                f"a vocoder call that does not finalize needs more than {self.lookahead} mel frames, "
                f"got {mel.shape[1]}"
            )
        source = self._source(self._f0(mel, finalize, should_stop), rand_ini[0], sine_waves[0])
        n_fft, hop, right = int(c.n_fft), int(c.hop_len), int(c.conv_pre_look_right)
        s_stft = dsp.source_stft(source, n_fft, hop)  # (n_fft + 2, N)
        if finalize:
            mel = np.pad(mel, ((0, 0), (0, right)))  # conv_pre's lookahead sees zeros
        else:
            mel = mel[:, : -int(c.f0_lookahead)]
            s_stft = s_stft[:, : -int(c.stft_per_frame) * right]
        feeds = {"mel": mel[None].astype(np.float32), "s_stft": s_stft[None]}
        (x,) = terminate.run(self.bundle.session("hift_decode"), feeds, should_stop)
        speech = dsp.spectrum_wave(x[0], n_fft, hop)
        if not finalize:
            speech = speech[: -self.upsample]
        limit = np.float32(c.audio_limit)
        return np.clip(speech, -limit, limit).astype(np.float32)[None], source[None, None]


@dataclass
class _VocoderStream:
    mel: np.ndarray | None = None  # (1, 80, n) every frame so far
    emitted: int = 0  # samples emitted

    @property
    def frames(self) -> int:
        return 0 if self.mel is None else int(self.mel.shape[2])


class LiteVocoder2(LiteVocoder):
    """CosyVoice2's 24 kHz HiFT (the reference's SineGen2 source) with the torch vocoder's shapes, for the shared
    :class:`~cosyserve.families.cosyvoice2.token2wav.Token2Wav2`: its draws ``sine_phase`` (1, H) uniform in
    [0, 1) and ``sine_noise`` (1, L, H) standard normal."""

    def _draws(
        self, frames: int, generator: Any, sine_phase: np.ndarray | None, sine_noise: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        # its draws: sine_phase (1, H) uniform in [0, 1), sine_noise (1, L, H) standard normal, given or drawn in
        # that order -> the source's (phase (H,), noise (L, H))
        H, L = self.harmonics, frames * self.upsample
        if sine_phase is None:
            sine_phase = generator.random((1, H), dtype=np.float32)
        if sine_noise is None:
            sine_noise = generator.standard_normal((1, L, H), dtype=np.float32)
        return sine_phase.reshape(-1), sine_noise[0]

    def _source(self, f0: np.ndarray, phase: np.ndarray, noise: np.ndarray) -> np.ndarray:
        # SineGen2 as the torch vocoder's _source2: the phase increments averaged down to the frame rate,
        # integrated there and interpolated back up (linear); phase (H,) in cycles, noise (L, H)
        c, scale, H = self.cfg, self.upsample, self.harmonics
        f0 = np.repeat(f0.astype(np.float32), scale)[:, None]  # (L, 1) nearest
        rad = (
            f0 * np.arange(1, H + 1, dtype=np.float32)[None, :] / np.float32(c["sampling_rate"])
        ) % np.float32(1)
        rand_ini = phase.astype(np.float32).copy()
        rand_ini[0] = 0  # no random phase for the fundamental
        rad[0] = rad[0] + rand_ini
        rad = _frame_mean(rad, scale)  # (T, H)
        phase_t = (
            np.cumsum(rad, axis=0, dtype=np.float64).astype(np.float32) * np.float32(2) * np.float32(math.pi)
        )
        up = dsp.interp_linear(phase_t.T * np.float32(scale), phase_t.shape[0] * scale).T  # (L, H)
        sine = np.sin(up) * np.float32(c["nsf_alpha"])
        uv = (f0 > np.float32(c["nsf_voiced_threshold"])).astype(np.float32)
        noise_amp = uv * np.float32(c["nsf_sigma"]) + (np.float32(1) - uv) * np.float32(c["nsf_alpha"] / 3)
        sine = sine * uv + noise_amp * noise.astype(np.float32)
        return np.tanh(sine @ self.w.reshape(-1) + self.b.reshape(-1)[0]).astype(np.float32)


def _frame_mean(rad: np.ndarray, scale: int) -> np.ndarray:
    # (L, H) -> (L / scale, H): torch's linear interpolation by 1 / scale (align_corners False), which reads the
    # two samples about each frame's centre (the middle one for an odd scale)
    mid = scale // 2
    return (rad[mid - 1 :: scale] + rad[mid::scale]) * np.float32(0.5) if scale % 2 == 0 else rad[mid::scale]
