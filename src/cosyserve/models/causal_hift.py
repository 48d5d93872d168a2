"""CosyVoice3's vocoder: ``CausalHiFTGenerator``, a causal HiFT (neural source filter + iSTFTNet) at 24 kHz.

What differs from the HiFT of :mod:`cosyserve.models.hift` (whose pieces it reuses):

- every convolution is causal: left zero padding (the upsampling stages repeat each frame, pad ``k - 1`` on the
  left and convolve; the source's STFT is brought down by strided convolutions padded ``stride - 1`` on the left);
  ``conv_pre`` looks ``conv_pre_look_right`` (4) frames ahead and the f0 predictor's first convolution 3 frames;
- ``finalize=False`` (a streaming chunk): those lookahead frames are real context instead of zero padding. The f0
  predictor sees the whole mel and gives ``T - 3`` frames; the decoder sees the first ``T - 3`` and gives
  ``T - 7`` frames of spectrum, and the last 480 samples are dropped, so a chunk of ``T`` mel frames gives
  ``(T - 8) * 480`` samples that no later frame can change;
- the f0 predictor runs in float64 (the reference converts it; phase is the integral of f0, so float32 f0 would
  drift audibly over a long utterance); its weights are folded from weight norm in float64 too;
- the sine source is SineGen2 with **nearest** (not linear) upsampling of the frame-rate phase, and it draws
  nothing: the initial phases (``rand_ini``, [1, 9], fundamental 0) and the additive noise (``sine_waves``, uniform
  [0, 1), [1, L, 9], the first L rows used) are fixed buffers in the reference, passed in here.

Streaming (:meth:`CausalHiFTGenerator.stream`): the reference re-runs the vocoder on the whole mel so far at every
chunk and emits the samples after those it emitted. Because every part is causal, a chunk needs only its new
frames and a bounded left context: a :class:`VocoderStream` keeps the last mel frames (the decoder's receptive
field, :attr:`CausalHiFTGenerator.context`, and the f0 predictor's), the excitation of those frames, the running
sum of the source's phase (in float64, as torch's CPU cumsum accumulates) and the place in the fixed noise.
The decoder re-runs over that context, whose first frames come out wrong (zero padding at its left edge) and are
not emitted; the source is never recomputed, so its phase and noise are exactly the whole mel's.

Attribute names are the official ``hift.pt`` keys (weight-norm ``parametrizations`` form, folded on load as in
:class:`~cosyserve.models.hift.HiFTGenerator`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.core.stop import ShouldStop, check
from cosyserve.models.hift import (
    ConvRNNF0Predictor,
    F0PredictorConfig,
    HiFTConfig,
    HiFTGenerator,
    ResBlock,
    SourceModuleHnNSF,
    _channels_last,
    _conv,
    _wn,
)
from cosyserve.system.device import module_device

__all__ = [
    "CausalF0PredictorConfig",
    "CausalHiFTConfig",
    "CausalHiFTGenerator",
    "VocoderStream",
    "source_noise",
]

F0_LOOKAHEAD = 3  # the f0 predictor's first conv: kernel 4, "right" causal (3 frames ahead)


@dataclass
class CausalF0PredictorConfig(F0PredictorConfig):
    TARGET: ClassVar[str] = "cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor"


@dataclass
class CausalHiFTConfig(HiFTConfig):
    TARGET: ClassVar[str] = "cosyvoice.hifigan.generator.CausalHiFTGenerator"

    conv_pre_look_right: int = 4
    f0_predictor: CausalF0PredictorConfig = field(default_factory=CausalF0PredictorConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sampling_rate == 22050:
            raise ValueError(
                "CausalHiFTGenerator sampling_rate=22050 selects the reference's SineGen, which has no causal form; "
                "CosyVoice3 is 24000 Hz"
            )
        if self.conv_pre_look_right < 1:
            raise ValueError(f"hift conv_pre_look_right={self.conv_pre_look_right} must be >= 1")

    @property
    def lookahead(self) -> int:
        """Mel frames a non-final call holds back: the f0 predictor's and conv_pre's lookahead, plus the last
        frame whose samples the iSTFT has not finished (8 for the release)."""
        return F0_LOOKAHEAD + self.conv_pre_look_right + 1


def _causal_padding(kernel_size: int, dilation: int = 1) -> int:
    # the reference's CausalConv1d: equals (k - 1) * d for the odd kernels and k - 1 for the even ones it builds
    return int((kernel_size * dilation - dilation) / 2) * 2 + (kernel_size + 1) % 2


def source_noise(
    samples: int, generator: torch.Generator | None = None, harmonics: int = 9
) -> tuple[Tensor, Tensor]:
    """Noise buffers drawn as the reference draws its own: ``rand_ini`` [1, harmonics] uniform in [0, 1) with
    column 0 zeroed, then ``sine_waves`` [1, samples, harmonics] uniform in [0, 1).

    A stream must give every call of one utterance the same buffers (each call reads their first rows)."""
    rand_ini = torch.rand(1, harmonics, generator=generator)
    rand_ini[:, 0] = 0
    return rand_ini, torch.rand(1, samples, harmonics, generator=generator)


@dataclass
class VocoderStream:
    """What a stream's causal vocoder keeps between calls (see the module docstring); ``whole`` keeps every
    frame instead (the reference's re-run on the whole mel, for comparisons)."""

    mel: Tensor | None = None  # (B, 80, n) the kept mel frames, from frame `start` on
    source: Tensor | None = None  # (B, 1, (f0_frames - start) * 480) their excitation
    phase: Tensor | None = None  # (B, 1, H) float64: the phase increments summed over frames < f0_frames
    start: int = 0
    f0_frames: int = 0  # frames whose excitation is known (a call holds back the f0 predictor's lookahead)
    emitted: int = 0  # samples emitted
    whole: bool = False

    @property
    def frames(self) -> int:
        """Mel frames given so far."""
        return self.start + (0 if self.mel is None else self.mel.shape[2])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.mel, self.source, self.phase) if t is not None)


def _resblock_left(kernel: int, dilations: list[int]) -> int:
    # the left context of a causal ResBlock: each dilation's conv pair, in series
    return sum((kernel - 1) * d + kernel - 1 for d in dilations)


class CausalResBlock(ResBlock):
    """HiFT's residual block with every dilated convolution padded on the left only."""

    def __init__(self, channels: int, kernel_size: int, dilations: list[int], wn: bool = True):
        super().__init__(channels, kernel_size, dilations, wn)
        for conv in (*self.convs1, *self.convs2):
            conv.padding = (0,)  # padded explicitly (left) in forward
        self.pads1 = [_causal_padding(kernel_size, d) for d in dilations]
        self.pad2 = _causal_padding(kernel_size)

    def forward(self, x: Tensor) -> Tensor:
        # x: (B, C, 1, T) channels-last (see hift._conv)
        for conv1, conv2, act1, act2, pad1 in zip(
            self.convs1, self.convs2, self.activations1, self.activations2, self.pads1, strict=True
        ):
            h = _conv(conv1, F.pad(act1(x), (pad1, 0)))
            x = _conv(conv2, F.pad(act2(h), (self.pad2, 0))).add_(x)
        return x


class CausalConvRNNF0Predictor(ConvRNNF0Predictor):
    """HiFT's f0 predictor with causal convolutions: the first looks 3 frames ahead, the others back only."""

    def __init__(self, cfg: F0PredictorConfig, wn: bool = True):
        super().__init__(cfg, wn)
        self.condnet[0] = _wn(nn.Conv1d(cfg.in_channels, cfg.cond_channels, F0_LOOKAHEAD + 1), wn)
        for conv in self.condnet[2::2]:
            conv.padding = (0,)  # padded explicitly (left) in forward

    def forward(self, mel: Tensor, finalize: bool = True) -> Tensor:
        # mel: (B, 80, T) -> f0 in Hz (B, T) if finalize, else (B, T - 3) (the last 3 frames are lookahead), in
        # the weights' dtype
        mel = mel.to(self.classifier.weight.dtype)
        x = F.pad(mel, (0, F0_LOOKAHEAD)) if finalize else mel
        for i, layer in enumerate(self.condnet):
            if isinstance(layer, nn.Conv1d) and i > 0:
                x = F.pad(x, (_causal_padding(layer.kernel_size[0]), 0))
            x = layer(x)
        return self.classifier(x.transpose(1, 2)).squeeze(-1).abs()


def _noise_rows(sine_waves: Tensor, at: int, n: int) -> Tensor:
    # rows at .. at+n-1 of a (1 or B, >= at+n, H) noise buffer
    if sine_waves.dim() != 3 or sine_waves.shape[1] < at + n:
        raise ValueError(f"sine_waves must be (1, >= {at + n}, H), got {tuple(sine_waves.shape)}")
    return sine_waves[:, at : at + n]


class CausalHiFTGenerator(HiFTGenerator):
    # in a lower-precision vocoder the source module stays float32 and the f0 predictor float64 (see _f0): a
    # bundle stores the f0 predictor as folded in float64
    FLOAT32_PARTS = ("f0_predictor", "m_source")

    def __init__(self, cfg: CausalHiFTConfig, weight_norm: bool = True):
        """Args: weight_norm: as :class:`~cosyserve.models.hift.HiFTGenerator`."""
        nn.Module.__init__(self)
        wn = weight_norm
        if not (
            len(cfg.upsample_rates) == len(cfg.upsample_kernel_sizes) == len(cfg.source_resblock_kernel_sizes)
        ):
            raise ValueError(
                "hift upsample_rates, upsample_kernel_sizes and source_resblock_kernel_sizes must have equal lengths"
            )
        self.cfg = cfg
        self.sinegen2 = True
        self.num_kernels = len(cfg.resblock_kernel_sizes)
        n_fft, base = cfg.istft_params["n_fft"], cfg.base_channels

        self.m_source = SourceModuleHnNSF(cfg.nb_harmonics)
        self.conv_pre = _wn(nn.Conv1d(cfg.in_channels, base, cfg.conv_pre_look_right + 1), wn)
        self.ups = nn.ModuleList(
            _wn(nn.Conv1d(base // 2**i, base // 2 ** (i + 1), k), wn)
            for i, k in enumerate(cfg.upsample_kernel_sizes)
        )
        down_rates = [math.prod(cfg.upsample_rates[i + 1 :]) for i in range(len(cfg.upsample_rates))]
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (u, k, d) in enumerate(
            zip(down_rates, cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes, strict=True)
        ):
            ch = base // 2 ** (i + 1)
            self.source_downs.append(
                nn.Conv1d(n_fft + 2, ch, 1) if u == 1 else nn.Conv1d(n_fft + 2, ch, 2 * u, u)
            )
            self.source_resblocks.append(CausalResBlock(ch, k, d, wn))
        self.resblocks = nn.ModuleList(
            CausalResBlock(base // 2 ** (i + 1), k, d, wn)
            for i in range(len(self.ups))
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes, strict=True)
        )
        self.conv_post = _wn(nn.Conv1d(base // 2 ** len(self.ups), n_fft + 2, 7), wn)
        self.f0_predictor = CausalConvRNNF0Predictor(cfg.f0_predictor, wn).to(torch.float64)
        self.context = self._decoder_context()
        # the f0 predictor's causal convs (after the first, which looks ahead) read this many earlier frames
        self.f0_context = sum(_causal_padding(c.kernel_size[0]) for c in self.f0_predictor.condnet[2::2])
        # f0 entries become float64 before the weight-norm fold, so the fold is float64 as in the reference
        self._register_load_state_dict_pre_hook(self._f0_float64)
        self._register_load_state_dict_pre_hook(self._load_hook)

    @staticmethod
    def _f0_float64(state_dict: dict, prefix: str, *args: object) -> None:
        for key in [k for k in state_dict if k.startswith(prefix + "f0_predictor.")]:
            if state_dict[key].is_floating_point():
                state_dict[key] = state_dict[key].to(torch.float64)

    def _decoder_context(self) -> int:
        """Mel frames before a call's first new output frame that the decoder must re-read for it to come out as
        the whole mel's: an upper bound of its left receptive field (zero padding at the left edge of a window of
        mel spoils at most that many frames), from the config."""
        cfg = self.cfg
        n_fft, hop = cfg.istft_params["n_fft"], cfg.istft_params["hop_len"]
        stft = math.prod(cfg.upsample_rates)  # source STFT frames per mel frame
        spoiled = 0.0
        source = (n_fft // 2) / hop / stft  # the STFT's centre padding at the window's start
        last = len(cfg.upsample_rates) - 1
        for i, k in enumerate(cfg.upsample_kernel_sizes):
            res = math.prod(cfg.upsample_rates[: i + 1])  # positions per mel frame at this stage
            main = spoiled + (k - 1 + (i == last)) / res
            down = self.source_downs[i]
            branch = source + (down.kernel_size[0] + down.stride[0]) / stft
            branch += (
                _resblock_left(cfg.source_resblock_kernel_sizes[i], cfg.source_resblock_dilation_sizes[i])
                / res
            )
            blocks = max(
                _resblock_left(k, d)
                for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes, strict=True)
            )
            spoiled = max(main, branch) + blocks / res
        spoiled += (self.conv_post.kernel_size[0] - 1 + n_fft // hop) / stft
        return math.ceil(spoiled) + 1

    # -- inference -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def warm_up(self, n_frames: int = 4) -> Tensor:
        """Vocode ``n_frames`` silent mel frames once, finalizing (every kernel the vocoder runs). Returns the
        audio."""
        mel = torch.zeros(1, self.cfg.in_channels, max(n_frames, 1), dtype=self.conv_pre.weight.dtype)
        rand_ini, sine_waves = source_noise(
            mel.shape[2] * self.cfg.upsample_factor, torch.Generator(device=module_device(self))
        )
        audio, _ = self.inference(mel, True, rand_ini=rand_ini, sine_waves=sine_waves)
        return audio

    @torch.inference_mode()
    def inference(  # type: ignore[override]
        self,
        speech_feat: Tensor,
        finalize: bool = True,
        *,
        rand_ini: Tensor,
        sine_waves: Tensor,
        should_stop: ShouldStop | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Vocode a mel spectrogram, the whole utterance so far.

        Args:
            speech_feat: (B, 80, T) log-mel frames.
            finalize: the utterance ends here. Otherwise the last frames are lookahead only: T must exceed
                :attr:`CausalHiFTConfig.lookahead` (8).
            rand_ini: (1 or B, H) initial phase per harmonic in cycles, H = nb_harmonics + 1 (column 0 ignored).
            sine_waves: (1 or B, >= L, H) the additive noise buffer (uniform [0, 1)); its first L rows are used.
            should_stop: asked between the decoder's stages (:class:`cosyserve.core.stop.Stopped` once it says True).
        Returns:
            speech: (B, T * 480) if finalizing, else (B, (T - 8) * 480), float32 in [-audio_limit, audio_limit];
            source: (B, 1, L) float32 excitation, L = T * 480 or (T - 3) * 480.
        """
        cfg = self.cfg
        if speech_feat.dim() != 3 or speech_feat.shape[1] != cfg.in_channels:
            raise ValueError(f"speech_feat must be (B, {cfg.in_channels}, T), got {tuple(speech_feat.shape)}")
        if not finalize and speech_feat.shape[2] <= cfg.lookahead:
            raise ValueError(
                f"a vocoder call that does not finalize needs more than {cfg.lookahead} mel frames, "
                f"got {speech_feat.shape[2]}"
            )
        f0 = self._f0(speech_feat, finalize)  # (B, T')
        source, _ = self._causal_source(
            f0, rand_ini, _noise_rows(sine_waves, 0, f0.shape[1] * self.cfg.upsample_factor)
        )
        mel = speech_feat if finalize else speech_feat[:, :, :-F0_LOOKAHEAD]
        return self._causal_decode(mel, source, finalize, should_stop), source

    def new_stream(self, whole: bool = False) -> VocoderStream:
        """A stream's state for :meth:`stream` (``whole``: keep every frame, the reference's re-run)."""
        return VocoderStream(whole=whole)

    @torch.inference_mode()
    def stream(
        self,
        state: VocoderStream,
        mel: Tensor,
        finalize: bool,
        *,
        rand_ini: Tensor,
        sine_waves: Tensor,
        should_stop: ShouldStop | None = None,
    ) -> Tensor:
        """Vocode a stream's next mel frames: the samples that :meth:`inference` on every frame so far would give
        after those already emitted, from the frames ``state`` keeps and ``mel``; updates ``state``.

        Args:
            state: the stream's :class:`VocoderStream` (a fresh one for its first call).
            mel: (1, 80, n) the frames after every frame given before.
            finalize: the stream ends here (else the last 8 frames so far are held back, see :meth:`inference`).
            rand_ini, sine_waves: the noise buffers, the same at every call of a stream (as :meth:`inference`).
            should_stop: as :meth:`inference`.
        Returns:
            (1, samples) float32 audio after the samples emitted before.
        """
        return self.stream_rows([state], [mel], finalize, [rand_ini], [sine_waves], should_stop)[0]

    def stream_shape(self, state: VocoderStream, mel: Tensor, finalize: bool) -> tuple[int, ...]:
        """What must match for calls of several streams to run as one batch (:meth:`stream_rows`): the frames
        the call sees, its excitation and its first output sample, each counted from the first frame its stream
        keeps (streams past their first chunks that give the same new frames keep the same frames)."""
        kept = 0 if state.mel is None else state.mel.shape[2]
        emitted = state.emitted - state.start * self.cfg.upsample_factor
        return (kept, mel.shape[2], int(finalize), state.f0_frames - state.start, emitted, int(state.whole))

    @torch.inference_mode()
    def stream_rows(
        self,
        states: list[VocoderStream],
        mels: list[Tensor],
        finalize: bool,
        rand_ini: list[Tensor],
        sine_waves: list[Tensor],
        should_stop: ShouldStop | None = None,
    ) -> list[Tensor]:
        """:meth:`stream` for several streams at once, as one batch: their calls must have equal
        :meth:`stream_shape` (each row keeps its own frames, phase and place in its noise). Returns each
        stream's (1, samples) audio."""
        shape = self.stream_shape(states[0], mels[0], finalize)
        if any(self.stream_shape(s, m, finalize) != shape for s, m in zip(states, mels, strict=True)):
            raise ValueError("stream_rows takes calls of equal stream_shape only")
        scale, (_, _, _, known, emitted, _) = self.cfg.upsample_factor, shape
        mel = torch.cat(
            [m if s.mel is None else torch.cat([s.mel, m], dim=2) for s, m in zip(states, mels, strict=True)]
        )
        n = mel.shape[2]  # (B, 80, n) every row from its stream's first kept frame
        if not finalize and min(s.start for s in states) + n <= self.cfg.lookahead:
            raise ValueError(
                f"a vocoder call that does not finalize needs more than {self.cfg.lookahead} mel frames, got {n}"
            )
        until = n if finalize else n - F0_LOOKAHEAD  # frames whose excitation this call makes
        source = None if states[0].source is None else torch.cat([s.source for s in states])
        phase = None if states[0].phase is None else torch.cat([s.phase for s in states])
        if until > known:
            # the f0 of frames known .. until-1, from their predictor context on
            read = max(0, known - self.f0_context)
            f0 = self._f0(mel[:, :, read:], finalize)[:, known - read :]
            at = [(s.start + known) * scale for s in states]  # each row's place in its noise
            noise = torch.cat(
                [_noise_rows(w, i, f0.shape[1] * scale) for w, i in zip(sine_waves, at, strict=True)]
            )
            new, phase = self._causal_source(f0, torch.cat(rand_ini), noise, phase)
            source = new if source is None else torch.cat([source, new], dim=2)
        assert source is not None and phase is not None
        speech = self._causal_decode(mel[:, :, :until], source, finalize, should_stop)[:, emitted:]
        # what the next call re-reads: the decoder's context before its first new frame, the f0 predictor's
        keep = 0
        if not states[0].whole:
            keep = max(0, min((emitted + speech.shape[1]) // scale - self.context, until - self.f0_context))
        out = []
        for i, s in enumerate(states):
            s.f0_frames = s.start + max(until, known)
            s.emitted += speech.shape[1]
            s.mel, s.source, s.phase = (
                mel[i : i + 1, :, keep:],
                source[i : i + 1, :, keep * scale :],
                phase[i : i + 1],
            )
            s.start += keep
            out.append(speech[i : i + 1])
        return out

    def _f0(self, speech_feat: Tensor, finalize: bool) -> Tensor:
        if next(self.f0_predictor.parameters()).dtype != torch.float64:
            # as the reference does (should a whole-module cast have undone it)
            self.f0_predictor.to(torch.float64)
        return self.f0_predictor(speech_feat.to(torch.float64), finalize).to(torch.float32)

    def _causal_source(
        self, f0: Tensor, rand_ini: Tensor, noise: Tensor, carry: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        # SineGen2 in the reference's (B, L, H) layout and op order; the frame-rate phase is upsampled by
        # repetition. f0 (B, T'); ``noise`` (1 or B, L, H) the noise of its samples; ``carry`` (B, 1, H) float64
        # is the sum of the earlier frames' phase increments (None: these are the first frames, which take
        # ``rand_ini``), returned updated
        cfg = self.cfg
        B, H, device = f0.shape[0], cfg.nb_harmonics + 1, f0.device
        scale = cfg.upsample_factor
        f0 = F.interpolate(f0[:, None], scale_factor=float(scale), mode="nearest")
        f0 = f0.transpose(1, 2)  # (B, L, 1)
        if rand_ini.dim() != 2 or rand_ini.shape[1] != H or rand_ini.shape[0] not in (1, B):
            raise ValueError(f"rand_ini must be (1, {H}) or ({B}, {H}), got {tuple(rand_ini.shape)}")
        if noise.shape[0] not in (1, B) or noise.shape[2] != H:
            raise ValueError(f"sine_waves must be (1, L, {H}), got (..., {noise.shape[2]})")
        harmonics = torch.arange(1, H + 1, device=device, dtype=torch.float32).view(1, 1, H)
        rad = (f0 * harmonics / cfg.sampling_rate) % 1  # (B, L, H) cycles per sample
        if carry is None:
            rad[:, 0, :] = rad[:, 0, :] + rand_ini.to(device=device, dtype=torch.float32)
            carry = torch.zeros(B, 1, H, device=device, dtype=torch.float64)
        rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / scale, mode="linear").transpose(1, 2)
        # torch's CPU cumsum of float32 sums in float64 and rounds each element: carrying the float64 sum gives
        # the whole sequence's values
        sums = torch.cumsum(torch.cat([carry, rad.double()], dim=1), dim=1)
        phase = sums[:, 1:].float() * 2 * math.pi  # (B, T', H)
        phase = F.interpolate(phase.transpose(1, 2) * scale, scale_factor=float(scale), mode="nearest")
        sine = torch.sin(phase.transpose(1, 2)) * cfg.nsf_alpha  # (B, L, H)
        uv = (f0 > cfg.nsf_voiced_threshold).float()  # (B, L, 1)
        noise_amp = uv * cfg.nsf_sigma + (1 - uv) * cfg.nsf_alpha / 3
        sine = sine * uv + noise_amp * noise.to(device=device, dtype=torch.float32)
        return self.m_source(sine.transpose(1, 2)), sums[:, -1:]

    def _causal_decode(
        self, mel: Tensor, source: Tensor, finalize: bool, should_stop: ShouldStop | None = None
    ) -> Tensor:
        cfg = self.cfg
        n_fft, hop = cfg.istft_params["n_fft"], cfg.istft_params["hop_len"]
        window = torch.hann_window(n_fft, periodic=True, dtype=torch.float64, device=source.device).float()
        spec = torch.stft(source.squeeze(1), n_fft, hop, n_fft, window=window, return_complex=True)
        s_stft = torch.cat([spec.real, spec.imag], dim=1)  # (B, n_fft+2, L/hop + 1)
        if not finalize:
            # conv_pre's right context gets no output frames: neither do the source frames under it
            s_stft = s_stft[:, :, : -math.prod(cfg.upsample_rates) * cfg.conv_pre_look_right]
        x = self.causal_spectrum(mel, s_stft, finalize, should_stop)
        magnitude = torch.exp(x[:, : n_fft // 2 + 1]).clamp(max=1e2)
        phase = torch.sin(x[:, n_fft // 2 + 1 :])  # the reference's (redundant) sin, kept for equality
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        speech = torch.istft(spec, n_fft, hop, n_fft, window=window)  # (B, samples)
        if not finalize:
            speech = speech[:, : -cfg.upsample_factor]
        return speech.clamp(-cfg.audio_limit, cfg.audio_limit)

    def causal_spectrum(
        self, mel: Tensor, s_stft: Tensor, finalize: bool, should_stop: ShouldStop | None = None
    ) -> Tensor:
        """The decoder from mel (B, 80, T) and the source's STFT rows (B, n_fft+2, N) to the float32
        log-magnitude and phase rows the iSTFT takes; not finalizing, conv_pre's last input frames are context.
        ``should_stop`` is asked before each upsampling stage and each of its residual blocks."""
        cfg = self.cfg
        dtype = next(self.conv_pre.parameters()).dtype
        s_stft = _channels_last(s_stft.to(dtype))
        x = _channels_last(mel.to(dtype))  # (B, 80, 1, T)
        if finalize:
            x = F.pad(x, (0, cfg.conv_pre_look_right))
        x = _conv(self.conv_pre, x)
        for i, (up, rate) in enumerate(zip(self.ups, cfg.upsample_rates, strict=True)):
            check(should_stop)
            x = F.leaky_relu(x, cfg.lrelu_slope)
            x = F.interpolate(x, scale_factor=(1.0, float(rate)), mode="nearest")
            x = _conv(up, F.pad(x, (up.kernel_size[0] - 1, 0)))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0, 0, 0), mode="reflect")  # to the STFT's L/hop + 1 frames
            down = self.source_downs[i]
            si = _conv(down, F.pad(s_stft, (down.stride[0] - 1, 0)))
            x = x.add_(self.source_resblocks[i](si))
            blocks = self.resblocks[i * self.num_kernels : (i + 1) * self.num_kernels]
            xs = blocks[0](x)
            for block in blocks[1:]:
                check(should_stop)
                xs = xs.add_(block(x))
            x = xs.div_(self.num_kernels)
        x = F.pad(F.leaky_relu(x), (self.conv_post.kernel_size[0] - 1, 0))
        return _conv(self.conv_post, x).squeeze(2).float()
