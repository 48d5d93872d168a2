"""HiFT vocoder of CosyVoice-300M and CosyVoice2: mel -> waveform (neural source filter + iSTFTNet).

Mirrors ``cosyvoice.hifigan.generator.HiFTGenerator`` (with ``SineGen`` or, at rates other than 22050 Hz,
``SineGen2``, ``SourceModuleHnNSF``, ``ResBlock``,
``Snake``) and ``cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor``. Attribute names are the official
``hift.pt`` keys.

Weight norm: the convolutions hold torch's own ``parametrizations.weight_norm`` form, so a freshly built module's
``state_dict()`` has the official keys (``X.parametrizations.weight.original0/original1``) and the released
checkpoints load 1:1. Checkpoints written by older torch (``X.weight_g/X.weight_v``) are renamed by a load
pre-hook. After loading, call :meth:`HiFTGenerator.remove_weight_norm` once: it replaces each parametrization by
the plain weight torch would compute (``torch._weight_norm(v, g, 0)``, i.e. ``v * g / norm_except_dim(v, 2, 0)``),
bit-identical to the unfolded module, so inference does not recompute it on every call. A folded module still
accepts official checkpoints (the pre-hook folds them while loading) and its own plain ``X.weight`` keys.

Inference only: the forward passes reuse their own fresh buffers in place (allocating large temporaries costs as
much as the elementwise math on CPU), which autograd would reject.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from cosyserve.core.stop import ShouldStop, check
from cosyserve.system.device import module_device

__all__ = ["F0PredictorConfig", "HiFTConfig", "HiFTGenerator"]

_WN_G = ".parametrizations.weight.original0"
_WN_V = ".parametrizations.weight.original1"


@dataclass
class F0PredictorConfig:
    TARGET: ClassVar[str] = "cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor"

    num_class: int = 1
    in_channels: int = 80
    cond_channels: int = 512


@dataclass
class HiFTConfig:
    TARGET: ClassVar[str] = "cosyvoice.hifigan.generator.HiFTGenerator"

    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 22050
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10
    upsample_rates: list[int] = field(default_factory=lambda: [8, 8])
    upsample_kernel_sizes: list[int] = field(default_factory=lambda: [16, 16])
    istft_params: dict[str, int] = field(default_factory=lambda: {"n_fft": 16, "hop_len": 4})
    resblock_kernel_sizes: list[int] = field(default_factory=lambda: [3, 7, 11])
    resblock_dilation_sizes: list[list[int]] = field(
        default_factory=lambda: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    )
    source_resblock_kernel_sizes: list[int] = field(default_factory=lambda: [7, 11])
    source_resblock_dilation_sizes: list[list[int]] = field(default_factory=lambda: [[1, 3, 5], [1, 3, 5]])
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    # The reference default is None (the yaml always gives one); the release predictor is the usable default.
    f0_predictor: F0PredictorConfig = field(default_factory=F0PredictorConfig)

    def __post_init__(self) -> None:
        missing = {"n_fft", "hop_len"} - set(self.istft_params)
        if missing:
            raise ValueError(f"hift istft_params lacks {sorted(missing)}; expected keys n_fft and hop_len")

    @property
    def upsample_factor(self) -> int:
        """Audio samples per mel frame: prod(upsample_rates) * istft hop (256 for CosyVoice-300M)."""
        return math.prod(self.upsample_rates) * self.istft_params["hop_len"]


def _padding(kernel_size: int, dilation: int = 1) -> int:
    return (kernel_size * dilation - dilation) // 2


class Snake(nn.Module):
    """x + 1/alpha * sin(alpha * x)^2 per channel (linear-scale alpha, as CosyVoice uses it)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: Tensor) -> Tensor:
        # x: (B, C, T) or the vocoder's (B, C, 1, T) layout; alpha: (1, C, 1[, 1])
        alpha = self.alpha.view(1, -1, *([1] * (x.dim() - 2)))
        # x + 1/alpha * sin(x * alpha)^2, computed in one fresh buffer
        s = torch.mul(x, alpha).sin_().square_()
        return s.mul_(1.0 / (alpha + 1e-9)).add_(x)


def _conv(conv: nn.Conv1d | nn.ConvTranspose1d, x: Tensor) -> Tensor:
    """``conv`` applied to x: (B, C, 1, T) in channels-last memory, as a 2-D convolution of height 1.

    Why: oneDNN's fastest CPU kernels for these shapes (hundreds of channels, tens of thousands of samples, kernels
    up to 11 wide and dilated) want channels-last activations. Fed torch's (B, C, T) layout, each convolution
    reorders its input and output, and the wide or dilated ones fall back to im2col + GEMM; in channels-last
    memory the whole decoder chain runs without reorders (about a quarter less time). Same weights and bias, same
    sums: the results differ from the 1-D call by float32 rounding only.
    """
    w = conv.weight.unsqueeze(2)  # (O, I, 1, K) (transposed: (I, O, 1, K))
    stride, padding, dilation = (1, conv.stride[0]), (0, conv.padding[0]), (1, conv.dilation[0])
    if isinstance(conv, nn.ConvTranspose1d):
        out_pad = (0, conv.output_padding[0])
        return F.conv_transpose2d(x, w, conv.bias, stride, padding, out_pad, conv.groups, dilation)
    return F.conv2d(x, w, conv.bias, stride, padding, dilation, conv.groups)


def _channels_last(x: Tensor) -> Tensor:
    # (B, C, T) -> (B, C, 1, T) with C innermost in memory, the layout _conv runs in
    return x.unsqueeze(2).contiguous(memory_format=torch.channels_last)


def _wn(conv: nn.Module, use: bool) -> nn.Module:
    # weight_norm=False builds plain convolutions for already-folded weights (a bundle): registering the
    # parametrization costs a norm per conv, and seconds even on the meta device
    return weight_norm(conv) if use else conv


class ResBlock(nn.Module):
    def __init__(self, channels: int, kernel_size: int, dilations: list[int], wn: bool = True):
        super().__init__()
        self.convs1 = nn.ModuleList(
            _wn(nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=_padding(kernel_size, d)), wn)
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            _wn(nn.Conv1d(channels, channels, kernel_size, padding=_padding(kernel_size)), wn)
            for _ in dilations
        )
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: Tensor) -> Tensor:
        # x: (B, C, 1, T) channels-last (see _conv)
        for conv1, conv2, act1, act2 in zip(
            self.convs1, self.convs2, self.activations1, self.activations2, strict=True
        ):
            x = _conv(conv2, act2(_conv(conv1, act1(x)))).add_(x)
        return x


class ConvRNNF0Predictor(nn.Module):
    def __init__(self, cfg: F0PredictorConfig, wn: bool = True):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            cin = cfg.in_channels if i == 0 else cfg.cond_channels
            layers += [_wn(nn.Conv1d(cin, cfg.cond_channels, 3, padding=1), wn), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cfg.cond_channels, cfg.num_class)

    def forward(self, mel: Tensor) -> Tensor:
        # mel: (B, 80, T) -> f0 in Hz: (B, T)
        x = self.condnet(mel).transpose(1, 2)  # (B, T, C)
        return self.classifier(x).squeeze(-1).abs()


class SourceModuleHnNSF(nn.Module):
    # Holds only the harmonic merge; the sine generation lives in HiFTGenerator._source, which owns the draws.
    def __init__(self, nb_harmonics: int):
        super().__init__()
        self.l_linear = nn.Linear(nb_harmonics + 1, 1)

    def forward(self, sine_waves: Tensor) -> Tensor:
        # sine_waves: (B, H, L) -> source: (B, 1, L)
        w, b = self.l_linear.weight.float(), self.l_linear.bias.float()
        return torch.tanh(F.linear(sine_waves.transpose(1, 2), w, b)).transpose(1, 2)


class HiFTGenerator(nn.Module):
    # pitch and phase stay float32 in a bfloat16/float16 vocoder (cosyserve.models.precision.keeps_float32)
    FLOAT32_PARTS = ("f0_predictor", "m_source")

    def __init__(self, cfg: HiFTConfig, weight_norm: bool = True):
        """Args: weight_norm: build the official parametrized convolutions (True, loads official checkpoints)
        or plain ones for folded weights (False, what a bundle stores; official g/v keys still fold on load)."""
        super().__init__()
        wn = weight_norm
        # The reference's source generator: SineGen at 22050 Hz (CosyVoice-300M), SineGen2 at any other rate
        # (CosyVoice2's 24 kHz): phase integrated at the mel frame rate and interpolated, a uniform initial phase
        # in cycles
        self.sinegen2 = cfg.sampling_rate != 22050
        if not (
            len(cfg.upsample_rates) == len(cfg.upsample_kernel_sizes) == len(cfg.source_resblock_kernel_sizes)
        ):
            raise ValueError(
                "hift upsample_rates, upsample_kernel_sizes and source_resblock_kernel_sizes must have equal lengths"
            )
        self.cfg = cfg
        self.num_kernels = len(cfg.resblock_kernel_sizes)
        n_fft, base = cfg.istft_params["n_fft"], cfg.base_channels

        self.m_source = SourceModuleHnNSF(cfg.nb_harmonics)
        self.conv_pre = _wn(nn.Conv1d(cfg.in_channels, base, 7, padding=3), wn)
        self.ups = nn.ModuleList(
            _wn(nn.ConvTranspose1d(base // 2**i, base // 2 ** (i + 1), k, u, padding=(k - u) // 2), wn)
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes, strict=True))
        )
        # The source STFT (hop = istft hop) is brought to each upsampling stage's rate: stage i runs at
        # prod(upsample_rates[:i+1]) per frame, so it is downsampled by the product of the later rates.
        down_rates = [math.prod(cfg.upsample_rates[i + 1 :]) for i in range(len(cfg.upsample_rates))]
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (u, k, d) in enumerate(
            zip(down_rates, cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes, strict=True)
        ):
            ch = base // 2 ** (i + 1)
            if u == 1:
                self.source_downs.append(nn.Conv1d(n_fft + 2, ch, 1))
            else:
                self.source_downs.append(nn.Conv1d(n_fft + 2, ch, u * 2, u, padding=u // 2))
            self.source_resblocks.append(ResBlock(ch, k, d, wn))
        self.resblocks = nn.ModuleList(
            ResBlock(base // 2 ** (i + 1), k, d, wn)
            for i in range(len(self.ups))
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes, strict=True)
        )
        self.conv_post = _wn(nn.Conv1d(base // 2 ** len(self.ups), n_fft + 2, 7, padding=3), wn)
        self.f0_predictor = ConvRNNF0Predictor(cfg.f0_predictor, wn)
        self._register_load_state_dict_pre_hook(self._load_hook)

    # -- weights ---------------------------------------------------------------------------------------------

    def remove_weight_norm(self) -> HiFTGenerator:
        """Replace every weight-norm parametrization by its plain weight, computed once (idempotent)."""
        for module in self.modules():
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        return self

    def _load_hook(self, state_dict: dict, prefix: str, *args: object) -> None:
        # Accept the pre-parametrization key style (weight_g / weight_v) and, once folded, fold incoming ones.
        for key in [k for k in state_dict if k.startswith(prefix)]:
            for old, new in ((".weight_g", _WN_G), (".weight_v", _WN_V)):
                if key.endswith(old):
                    state_dict[key[: -len(old)] + new] = state_dict.pop(key)
        for key in [k for k in state_dict if k.startswith(prefix) and k.endswith(_WN_G)]:
            name = key[len(prefix) : -len(_WN_G)]
            try:
                module = self.get_submodule(name)
            except AttributeError:
                continue  # not ours: strict loading reports it as unexpected
            v_key = key[: -len(_WN_G)] + _WN_V
            if not parametrize.is_parametrized(module, "weight") and v_key in state_dict:
                g, v = state_dict.pop(key), state_dict.pop(v_key)
                # Same op torch's WeightNorm parametrization runs, so folding is bit-identical.
                state_dict[key[: -len(_WN_G)] + ".weight"] = torch._weight_norm(v, g, 0)

    # -- inference -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def warm_up(self, n_frames: int = 4) -> Tensor:
        """Vocode ``n_frames`` silent mel frames once (every kernel the vocoder runs; its stages differ in shape,
        so all of them run). Returns the audio."""
        mel = torch.zeros(1, self.cfg.in_channels, max(n_frames, 1), dtype=self.conv_pre.weight.dtype)
        audio, _ = self.inference(
            mel, None, generator=torch.Generator(device=module_device(self)).manual_seed(0)
        )
        return audio

    @torch.inference_mode()
    def inference(
        self,
        speech_feat: Tensor,
        cache_source: Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
        sine_phase: Tensor | None = None,
        sine_noise: Tensor | None = None,
        should_stop: ShouldStop | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Vocode a mel spectrogram.

        Args:
            speech_feat: (B, 80, T) log-mel frames.
            cache_source: (B, 1, S) source excitation to reuse for the first S samples (streaming, avoids
                glitches at chunk joins), or None / S == 0 for none.
            generator: source of the draws not given below, taken in the reference's order (phase, then noise).
            sine_phase: (B, H, 1) initial phase per harmonic, H = nb_harmonics + 1, as the reference draws it
                (uniform in [-pi, pi)); row 0 (the fundamental) is ignored, as in the reference.
            sine_noise: (B, H, L) standard normal noise, L = T * upsample_factor.
            should_stop: asked between the decoder's stages (:class:`cosyserve.core.stop.Stopped` once it says True).
        Returns:
            speech: (B, L) float32 waveform in [-audio_limit, audio_limit];
            source: (B, 1, L) float32 excitation after the cache overwrite (the next chunk's cache_source).
        """
        cfg = self.cfg
        if speech_feat.dim() != 3 or speech_feat.shape[1] != cfg.in_channels:
            raise ValueError(f"speech_feat must be (B, {cfg.in_channels}, T), got {tuple(speech_feat.shape)}")
        f0 = self.f0_predictor(speech_feat.to(_dtype(self.f0_predictor))).float()  # (B, T)
        source = self._source(f0, generator, sine_phase, sine_noise)  # (B, 1, L)
        if cache_source is not None and cache_source.shape[-1] > 0:
            if cache_source.dim() != 3 or cache_source.shape[-1] > source.shape[-1]:
                raise ValueError(
                    f"cache_source must be (B, 1, S) with S <= {source.shape[-1]}, got {tuple(cache_source.shape)}"
                )
            source[:, :, : cache_source.shape[-1]] = cache_source
        return self._decode(speech_feat, source, should_stop), source

    def draw_source_noise(
        self,
        batch: int,
        samples: int,
        generator: torch.Generator | None,
        sine_phase: Tensor | None = None,
        sine_noise: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The (sine_phase, sine_noise) that :meth:`inference` draws from ``generator`` when not given.

        ``samples`` = mel frames x ``upsample_factor``; given draws are returned as they are. Drawing them before
        the call (:class:`~cosyserve.runtime.stacking.VocoderBatcher`) leaves the generator as the call would.
        """
        if (sine_phase is None or sine_noise is None) and generator is None:
            raise ValueError(
                "HiFT inference draws random numbers: pass generator=torch.Generator(...) or both sine_phase= "
                "and sine_noise="
            )
        H = self.cfg.nb_harmonics + 1
        if self.sinegen2:
            # SineGen2: torch.rand(B, H) (cycles), then randn_like of the (B, L, H) sines
            if sine_phase is None:
                assert generator is not None
                sine_phase = torch.rand((batch, H), generator=generator, device=generator.device)
            if sine_noise is None:
                assert generator is not None
                sine_noise = torch.randn((batch, samples, H), generator=generator, device=generator.device)
            return sine_phase, sine_noise
        if sine_phase is None:
            assert generator is not None
            # torch.distributions.Uniform(-pi, pi).sample: low + rand * (high - low), in float32.
            low, high = torch.tensor(-math.pi), torch.tensor(math.pi)
            rand = torch.rand((batch, H, 1), generator=generator, device=generator.device)
            sine_phase = low.to(rand.device) + rand * (high - low).to(rand.device)
        if sine_noise is None:
            assert generator is not None
            sine_noise = torch.randn((batch, H, samples), generator=generator, device=generator.device)
        return sine_phase, sine_noise

    def _source(
        self,
        f0: Tensor,
        generator: torch.Generator | None,
        sine_phase: Tensor | None,
        sine_noise: Tensor | None,
    ) -> Tensor:
        if self.sinegen2:
            return self._source2(f0, generator, sine_phase, sine_noise)
        # SineGen (22.05 kHz variant) + SourceModuleHnNSF merge, float32 throughout.
        cfg = self.cfg
        B, H, device = f0.shape[0], cfg.nb_harmonics + 1, f0.device
        f0 = F.interpolate(f0[:, None], scale_factor=float(cfg.upsample_factor), mode="nearest")  # (B, 1, L)
        L = f0.shape[-1]
        harmonics = torch.arange(1, H + 1, device=device, dtype=torch.float32)[:, None]  # (H, 1)
        rad = f0 * harmonics / cfg.sampling_rate  # (B, H, L) cycles per sample
        theta = 2 * math.pi * (torch.cumsum(rad, dim=-1) % 1)

        # both draws up front, in the reference's order: nothing between them uses the generator
        sine_phase, sine_noise = self.draw_source_noise(B, L, generator, sine_phase, sine_noise)
        if sine_phase.shape != (B, H, 1):
            raise ValueError(f"sine_phase must be {(B, H, 1)}, got {tuple(sine_phase.shape)}")
        phase = sine_phase.to(device=device, dtype=torch.float32, copy=True)
        phase[:, 0] = 0  # no random phase for the fundamental
        sine = cfg.nsf_alpha * torch.sin(theta + phase)

        uv = (f0 > cfg.nsf_voiced_threshold).float()  # (B, 1, L)
        noise_amp = uv * cfg.nsf_sigma + (1 - uv) * cfg.nsf_alpha / 3
        if sine_noise.shape != (B, H, L):
            raise ValueError(f"sine_noise must be {(B, H, L)}, got {tuple(sine_noise.shape)}")
        sine = sine * uv + noise_amp * sine_noise.to(device=device, dtype=torch.float32)
        # The reference then draws `source_noise` (randn_like(uv), the noise branch of SourceModuleHnNSF) that no
        # output uses; it is the last draw of the call, so skipping it changes no other draw.
        return self.m_source(sine)

    def _source2(
        self,
        f0: Tensor,
        generator: torch.Generator | None,
        sine_phase: Tensor | None,
        sine_noise: Tensor | None,
    ) -> Tensor:
        # SineGen2 + SourceModuleHnNSF merge, float32, in the reference's (B, L, H) layout and op order: the
        # phase increments are averaged down to the frame rate (linear interpolation by 1/scale), integrated
        # there, and interpolated back up (linear, x scale), so the cumulative sum runs over frames, not samples
        cfg = self.cfg
        B, H, device = f0.shape[0], cfg.nb_harmonics + 1, f0.device
        scale = cfg.upsample_factor
        f0 = F.interpolate(f0[:, None], scale_factor=float(scale), mode="nearest").transpose(
            1, 2
        )  # (B, L, 1)
        L = f0.shape[1]
        harmonics = torch.arange(1, H + 1, device=device, dtype=torch.float32).view(1, 1, H)
        rad = (f0 * harmonics / cfg.sampling_rate) % 1  # (B, L, H) cycles per sample
        sine_phase, sine_noise = self.draw_source_noise(B, L, generator, sine_phase, sine_noise)
        if sine_phase.shape != (B, H):
            raise ValueError(f"sine_phase must be {(B, H)} (SineGen2), got {tuple(sine_phase.shape)}")
        if sine_noise.shape != (B, L, H):
            raise ValueError(f"sine_noise must be {(B, L, H)} (SineGen2), got {tuple(sine_noise.shape)}")
        rand_ini = sine_phase.to(device=device, dtype=torch.float32, copy=True)
        rand_ini[:, 0] = 0  # no random phase for the fundamental
        rad[:, 0, :] = rad[:, 0, :] + rand_ini
        rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / scale, mode="linear").transpose(1, 2)
        phase = torch.cumsum(rad, dim=1) * 2 * math.pi
        phase = F.interpolate(phase.transpose(1, 2) * scale, scale_factor=float(scale), mode="linear")
        sine = torch.sin(phase.transpose(1, 2)) * cfg.nsf_alpha  # (B, L, H)
        uv = (f0 > cfg.nsf_voiced_threshold).float()  # (B, L, 1)
        noise_amp = uv * cfg.nsf_sigma + (1 - uv) * cfg.nsf_alpha / 3
        sine = sine * uv + noise_amp * sine_noise.to(device=device, dtype=torch.float32)
        # the reference then draws the unused noise branch (randn_like(uv)): the call's last draw, skipped
        return self.m_source(sine.transpose(1, 2))

    def _decode(self, mel: Tensor, source: Tensor, should_stop: ShouldStop | None = None) -> Tensor:
        cfg = self.cfg
        n_fft, hop = cfg.istft_params["n_fft"], cfg.istft_params["hop_len"]
        # Built per call (16 values) so that meta-device construction leaves no uninitialised buffer. scipy's
        # periodic hann in float64, cast, as the reference builds it.
        window = torch.hann_window(n_fft, periodic=True, dtype=torch.float64, device=source.device).float()
        # (B, n_fft/2+1, N) with N = L/hop + 1 frames (centered, reflect-padded)
        spec = torch.stft(source.squeeze(1), n_fft, hop, n_fft, window=window, return_complex=True)
        x = self.decode_spectrum(mel, torch.cat([spec.real, spec.imag], dim=1), should_stop)

        magnitude = torch.exp(x[:, : n_fft // 2 + 1]).clamp(max=1e2)
        phase = torch.sin(x[:, n_fft // 2 + 1 :])  # the reference's (redundant) sin, kept for equality
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        speech = torch.istft(spec, n_fft, hop, n_fft, window=window)  # (B, L)
        return speech.clamp(-cfg.audio_limit, cfg.audio_limit)

    def decode_spectrum(self, mel: Tensor, s_stft: Tensor, should_stop: ShouldStop | None = None) -> Tensor:
        """The decoder from mel (B, 80, T) and the source's STFT (B, n_fft+2, N) as real and imaginary rows, to
        the float32 log-magnitude and phase rows (B, n_fft+2, N) the iSTFT takes (the lite runtime's graph).
        ``should_stop`` is asked before each upsampling stage and each of its residual blocks."""
        cfg = self.cfg
        dtype = _dtype(self.conv_pre)
        # (B, n_fft+2, 1, N) channels-last, N = L/hop + 1 (see _conv)
        s_stft = _channels_last(s_stft.to(dtype))

        # In-place ops below only touch buffers this function just created. From here to conv_post every
        # activation is (B, C, 1, T) channels-last; the elementwise ops keep that layout.
        x = _channels_last(self.conv_pre(mel.to(dtype)))
        for i, up in enumerate(self.ups):
            check(should_stop)
            x = _conv(up, F.leaky_relu(x, cfg.lrelu_slope, inplace=True))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0, 0, 0), mode="reflect")  # to the STFT's L/hop + 1 frames
            x = x.add_(self.source_resblocks[i](_conv(self.source_downs[i], s_stft)))
            blocks = self.resblocks[i * self.num_kernels : (i + 1) * self.num_kernels]
            xs = blocks[0](x)
            for block in blocks[1:]:
                check(should_stop)
                xs = xs.add_(block(x))
            x = xs.div_(self.num_kernels)
        # leaky_relu's default slope 0.01 here, as the reference; conv_post: (B, n_fft+2, N)
        return _conv(self.conv_post, F.leaky_relu(x, inplace=True)).squeeze(2).float()


def _dtype(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype
