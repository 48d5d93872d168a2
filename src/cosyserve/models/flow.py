"""CosyVoice-300M flow model: speech tokens (+ prompt) -> 80-bin mel by conditional flow matching.

``MaskedDiffWithXvec`` = token embedding -> conformer encoder -> ``encoder_proj`` -> ``InterpolateRegulator``
(token rate -> mel rate) -> ``ConditionalCFM`` (10 Euler steps of the ``ConditionalDecoder`` velocity with
classifier-free guidance). Attribute names follow the official ``flow.pt`` keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.core.stop import ShouldStop, check
from cosyserve.models.flow_decoder import ConditionalDecoder, ConditionalDecoderConfig
from cosyserve.models.transformer import ConformerEncoder, ConformerEncoderConfig
from cosyserve.system.device import module_device

__all__ = [
    "CFMParams",
    "ConditionalCFM",
    "ConditionalCFMConfig",
    "FlowConfig",
    "InterpolateRegulator",
    "InterpolateRegulatorConfig",
    "MaskedDiffWithXvec",
    "mel_length",
]

MEL_SAMPLE_RATE = 22050
MEL_HOP = 256
# Frames of the streaming overlap (20 tokens at 50 Hz) the reference keeps fixed in the cache and regulator.
OVERLAP_TOKENS = 20
CACHE_TAIL_FRAMES = 34


def mel_length(num_tokens: int, input_frame_rate: int) -> int:
    """Mel frames the reference generates for ``num_tokens`` speech tokens (truncating float division)."""
    return int(num_tokens / input_frame_rate * MEL_SAMPLE_RATE / MEL_HOP)


@dataclass
class InterpolateRegulatorConfig:
    TARGET: ClassVar[str] = "cosyvoice.flow.length_regulator.InterpolateRegulator"

    channels: int
    sampling_ratios: list[int]
    out_channels: int | None = None
    groups: int = 1


@dataclass
class CFMParams:
    # `!new:omegaconf.DictConfig {content: {...}}`; defaults are those of the reference's flow `decoder_conf`.
    TARGET: ClassVar[str] = "omegaconf.DictConfig"

    sigma_min: float = 1e-6
    solver: str = "euler"
    t_scheduler: str = "cosine"
    training_cfg_rate: float = 0.2
    inference_cfg_rate: float = 0.7
    reg_loss_type: str = "l1"

    def __post_init__(self) -> None:
        if self.solver != "euler":
            raise ValueError(
                f"cfm_params.solver={self.solver!r} is not supported; the reference only has 'euler'"
            )
        if self.t_scheduler not in ("cosine", "linear"):
            raise ValueError(f"cfm_params.t_scheduler={self.t_scheduler!r}: expected 'cosine' or 'linear'")


@dataclass(kw_only=True)
class ConditionalCFMConfig:
    TARGET: ClassVar[str] = "cosyvoice.flow.flow_matching.ConditionalCFM"

    in_channels: int
    cfm_params: CFMParams
    n_spks: int = 1
    spk_emb_dim: int = 64
    estimator: ConditionalDecoderConfig


@dataclass(kw_only=True)
class FlowConfig:
    TARGET: ClassVar[str] = "cosyvoice.flow.flow.MaskedDiffWithXvec"

    input_size: int = 512
    output_size: int = 80
    spk_embed_dim: int = 192
    output_type: str = "mel"
    vocab_size: int = 4096
    input_frame_rate: int = 50
    only_mask_loss: bool = True
    encoder: ConformerEncoderConfig
    length_regulator: InterpolateRegulatorConfig
    decoder: ConditionalCFMConfig
    # Training-time default estimator description in the reference; the yaml's `decoder` is what is built.
    decoder_conf: dict[str, Any] | None = None


class InterpolateRegulator(nn.Module):
    def __init__(self, cfg: InterpolateRegulatorConfig):
        super().__init__()
        self.cfg = cfg
        ch = cfg.channels
        layers: list[nn.Module] = []
        for _ in cfg.sampling_ratios:
            layers += [nn.Conv1d(ch, ch, 3, 1, 1), nn.GroupNorm(cfg.groups, ch), nn.Mish()]
        layers.append(nn.Conv1d(ch, cfg.out_channels or ch, 1, 1))
        self.model = nn.Sequential(*layers)

    def forward(self, x: Tensor, ylens: Tensor) -> tuple[Tensor, Tensor]:
        """Training-path regulation: x [B, T, C] resampled to max(ylens) frames, padded frames zeroed."""
        mask = (
            (torch.arange(int(ylens.max()), device=x.device) < ylens.unsqueeze(1)).to(x.dtype).unsqueeze(-1)
        )
        x = F.interpolate(x.transpose(1, 2), size=int(ylens.max()), mode="linear")
        return self.model(x).transpose(1, 2) * mask, ylens

    def inference(
        self, x1: Tensor, x2: Tensor, mel_len1: int, mel_len2: int, input_frame_rate: int = 50
    ) -> tuple[Tensor, int]:
        """Resample prompt (x1 [B, P, C]) and target (x2 [B, T, C]) token features to mel rate separately.

        The target's first and last 20 tokens are interpolated on their own (when it has more than 40), so a
        streaming chunk boundary falls on a fixed mel frame. Returns ([B, mel_len1 + mel_len2, C_out], total).
        """
        x2 = x2.transpose(1, 2)  # (B, C, T)
        if x2.shape[2] > 2 * OVERLAP_TOKENS:
            edge = mel_length(OVERLAP_TOKENS, input_frame_rate)
            n = OVERLAP_TOKENS
            x2 = torch.cat(
                [
                    F.interpolate(x2[:, :, :n], size=edge, mode="linear"),
                    F.interpolate(x2[:, :, n:-n], size=mel_len2 - 2 * edge, mode="linear"),
                    F.interpolate(x2[:, :, -n:], size=edge, mode="linear"),
                ],
                dim=2,
            )
        else:
            x2 = F.interpolate(x2, size=mel_len2, mode="linear")
        if x1.shape[1] != 0:
            x1 = F.interpolate(x1.transpose(1, 2), size=mel_len1, mode="linear")
            x2 = torch.cat([x1, x2], dim=2)
        return self.model(x2).transpose(1, 2), mel_len1 + mel_len2


def _euler_schedule(n_timesteps: int, scheduler: str, dtype: torch.dtype, device: torch.device) -> Tensor:
    # [n_timesteps, 2] rows (t, dt), computed with the reference's own float ops (t accumulates as t + dt).
    t_span = torch.linspace(0, 1, n_timesteps + 1, dtype=dtype)
    if scheduler == "cosine":
        t_span = 1 - torch.cos(t_span * 0.5 * torch.pi)
    t, dt = t_span[0], t_span[1] - t_span[0]
    steps = []
    for step in range(1, n_timesteps + 1):
        steps.append((t, dt))
        t = t + dt
        if step < n_timesteps:
            dt = t_span[step + 1] - t
    return torch.stack([torch.stack(s) for s in steps]).to(device)


class ConditionalCFM(nn.Module):
    def __init__(self, cfg: ConditionalCFMConfig):
        super().__init__()
        self.cfg = cfg
        self.t_scheduler = cfg.cfm_params.t_scheduler
        self.inference_cfg_rate = cfg.cfm_params.inference_cfg_rate
        self.estimator = ConditionalDecoder(cfg.estimator)

    @torch.inference_mode()
    def inference(
        self,
        mu: Tensor,
        spks: Tensor,
        cond: Tensor,
        noise: Tensor,
        prompt_len: int = 0,
        cache: Tensor | None = None,
        n_timesteps: int = 10,
        mask: Tensor | None = None,
        should_stop: ShouldStop | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Integrate the flow from ``noise`` to a mel with classifier-free guidance.

        Args:
            mu: [B, n_feats, T] encoder condition.
            spks: [B, spk_dim] projected speaker embedding.
            cond: [B, n_feats, T] prompt mel in the first ``prompt_len`` frames, zeros after.
            noise: [B, n_feats, T] the starting sample z.
            prompt_len: prompt frames at the start (kept in the returned cache).
            cache: [B, n_feats, C, 2] (z, mu) of a previous chunk; its C frames replace the start of z and mu.
            n_timesteps: Euler steps.
            mask: [B, 1, T] float frame mask, or None for no padding (what equal-length inference has).
            should_stop: asked before each Euler step; :class:`cosyserve.core.stop.Stopped` once it says True.
        Returns:
            (mel [B, n_feats, T] float32, cache [B, n_feats, prompt_len + 34, 2]).
        """
        z = noise.to(mu.dtype).contiguous()  # a strided view makes every estimator step many times slower
        if cache is not None and cache.shape[2] > 0:
            c = cache.shape[2]
            if c > z.shape[2]:
                raise ValueError(f"flow cache holds {c} frames but this call only has {z.shape[2]}")
            z, mu = z.clone(), mu.clone()
            z[:, :, :c] = cache[:, :, :, 0]
            mu[:, :, :c] = cache[:, :, :, 1]
        tail = CACHE_TAIL_FRAMES
        new_cache = torch.stack(
            [
                torch.cat([z[:, :, :prompt_len], z[:, :, -tail:]], dim=2),
                torch.cat([mu[:, :, :prompt_len], mu[:, :, -tail:]], dim=2),
            ],
            dim=-1,
        )
        return self.solve_euler(z, mu, spks, cond, n_timesteps, mask, should_stop), new_cache

    def solve_euler(
        self,
        x: Tensor,
        mu: Tensor,
        spks: Tensor,
        cond: Tensor,
        n_timesteps: int,
        mask: Tensor | None,
        should_stop: ShouldStop | None = None,
    ) -> Tensor:
        """Fixed-step Euler with CFG as one batch of 2B: rows :B conditioned, rows B: with zero mu, spks, cond."""
        B, n, T = x.shape[0], x.shape[1], x.shape[2]
        s = spks.shape[1]
        if 2 * n + s + cond.shape[1] != self.estimator.in_channels:
            raise ValueError(
                f"x/mu ({n}) + spks ({s}) + cond ({cond.shape[1]}) channels do not add up to the estimator's "
                f"in_channels={self.estimator.in_channels}"
            )
        dtype = spks.dtype
        x = x.to(dtype)
        # The estimator input cat([x, mu, spks, cond]) lives in one buffer; only x changes per step.
        h = torch.zeros(2 * B, self.estimator.in_channels, T, device=x.device, dtype=dtype)  # (2B, C_in, T)
        h[:B, n : 2 * n] = mu
        h[:B, 2 * n : 2 * n + s] = spks.unsqueeze(-1)
        h[:B, 2 * n + s : 2 * n + s + cond.shape[1]] = cond
        t_in = torch.zeros(2 * B, device=x.device, dtype=dtype)
        mask_in = None if mask is None else mask.to(dtype).repeat(2, 1, 1)
        rate = self.inference_cfg_rate
        for t, dt in _euler_schedule(n_timesteps, self.t_scheduler, dtype, x.device):
            check(should_stop)
            h.unflatten(0, (2, B))[:, :, :n] = x  # both CFG halves, one write
            t_in.copy_(t.expand(2 * B))
            v = self.estimator.forward_packed(h, mask_in, t_in, should_stop)  # (2B, n, T)
            v = (1.0 + rate) * v[:B] - rate * v[B:]
            x = x + dt * v
        return x.float()


class MaskedDiffWithXvec(nn.Module):
    REPEATED_STACKS = ("encoder.encoders", "decoder.estimator.mid_blocks")  # see TransformerLM
    ROW_TABLES = ("input_embedding.weight",)
    # Euler steps when a call names none: the reference's flow inference fixes 10 (its yaml has no count)
    N_TIMESTEPS = 10

    def __init__(self, cfg: FlowConfig):
        super().__init__()
        if cfg.output_type != "mel":
            raise ValueError(f"flow output_type={cfg.output_type!r} is not supported; expected 'mel'")
        self.cfg = cfg
        self.input_size = cfg.input_size
        self.output_size = cfg.output_size
        self.input_frame_rate = cfg.input_frame_rate
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.encoder = ConformerEncoder(cfg.encoder)
        self.encoder_proj = nn.Linear(cfg.encoder.output_size, cfg.output_size)
        self.decoder = ConditionalCFM(cfg.decoder)
        self.length_regulator = InterpolateRegulator(cfg.length_regulator)

    def draw_noise(
        self,
        num_tokens: int,
        prompt_frames: int,
        generator: torch.Generator,
        device: torch.device | None = None,
    ) -> Tensor:
        """The starting noise [1, n_mels, F + M] that :meth:`inference` draws from ``generator`` when not given."""
        total = prompt_frames + mel_length(num_tokens, self.input_frame_rate)
        dtype = self.spk_embed_affine_layer.weight.dtype
        return torch.randn((1, self.output_size, total), generator=generator, device=device, dtype=dtype)

    @torch.inference_mode()
    def warm_up(self, n_tokens: int = 2) -> Tensor:
        """One Euler step over ``n_tokens`` dummy speech tokens through one layer of each stack (every kernel the
        flow runs, once: see :func:`cosyserve.models.one_layer_per_stack`); returns the mel (1, 80, frames). Leaves
        the module as it was, so it may run while requests use the flow."""
        from cosyserve.models import one_layer_per_stack

        tokens = torch.zeros(1, max(n_tokens, 1), dtype=torch.int32)
        empty, zero = torch.zeros(1, 0, dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
        mel, _ = one_layer_per_stack(self).inference(
            tokens,
            torch.tensor([tokens.shape[1]], dtype=torch.int32),
            empty,
            zero,
            torch.zeros(1, 0, self.cfg.output_size),
            zero,
            torch.zeros(1, self.cfg.spk_embed_dim),
            torch.zeros(1, self.cfg.output_size, 0, 2),
            generator=torch.Generator(device=module_device(self)).manual_seed(0),
            n_timesteps=1,  # the other steps only repeat the same kernels
        )
        return mel

    @torch.inference_mode()
    def inference(
        self,
        token: Tensor,
        token_len: Tensor,
        prompt_token: Tensor,
        prompt_token_len: Tensor,
        prompt_feat: Tensor,
        prompt_feat_len: Tensor,
        embedding: Tensor,
        flow_cache: Tensor,
        *,
        noise: Tensor | None = None,
        generator: torch.Generator | None = None,
        n_timesteps: int | None = None,
        should_stop: ShouldStop | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Speech tokens -> mel, continuing a prompt and (when streaming) a previous chunk's cache.

        A batch of B > 1 utterances must have equal lengths (every ``token_len`` = T, every
        ``prompt_token_len`` = P; no padding): row b then equals the call with row b alone, up to float rounding
        (:class:`~cosyserve.runtime.stacking.FlowBatcher` stacks concurrent requests' calls this way).

        Args:
            token: [B, T] speech token ids to synthesise.
            token_len: [B] = T.
            prompt_token: [B, P] prompt speech tokens (P may be 0).
            prompt_token_len: [B] = P.
            prompt_feat: [B, F, n_mels] prompt mel (F may be 0).
            prompt_feat_len: [B] = F.
            embedding: [B, spk_embed_dim] speaker x-vector (L2-normalised here).
            flow_cache: [B, n_mels, C, 2] cache returned by the previous call (C may be 0).
            noise: [B, n_mels, F + M] starting noise; drawn from ``generator`` when None (B = 1 only).
            generator: the source of the noise when ``noise`` is None.
            n_timesteps: Euler steps (>= 1; None: :attr:`N_TIMESTEPS`).
            should_stop: asked before each Euler step (:class:`cosyserve.core.stop.Stopped` once it says True).
        Returns:
            (mel [B, n_mels, M] float32 with M = int(T / input_frame_rate * 22050 / 256),
             new_flow_cache [B, n_mels, F + 34, 2]).
        """
        n_timesteps = self.N_TIMESTEPS if n_timesteps is None else n_timesteps
        if n_timesteps < 1:
            raise ValueError(f"n_timesteps must be >= 1, got {n_timesteps}")
        B = token.shape[0]
        if B > 1:
            full = token_len.eq(token.shape[1]).all() and prompt_token_len.eq(prompt_token.shape[1]).all()
            if not full:
                raise ValueError(
                    "a batch of flow inputs needs equal lengths (no padding): stack equal shapes only"
                )
        if (prompt_token.shape[1] == 0) != (prompt_feat.shape[1] == 0):
            raise ValueError(
                f"prompt_token has {prompt_token.shape[1]} tokens but prompt_feat has {prompt_feat.shape[1]} frames; "
                "give both (a prompt) or neither"
            )
        dtype = self.spk_embed_affine_layer.weight.dtype
        device = token.device
        spks = self.spk_embed_affine_layer(F.normalize(embedding.to(dtype), dim=1))

        p, t = prompt_token.shape[1], token.shape[1]
        tokens = torch.cat([prompt_token, token], dim=1)
        lens = (prompt_token_len + token_len).to(device)
        mask = (torch.arange(p + t, device=device) < lens.unsqueeze(1)).unsqueeze(-1).to(dtype)  # (B, P+T, 1)
        x = self.input_embedding(tokens.clamp(min=0)) * mask
        h, _ = self.encoder(x, lens)
        h = self.encoder_proj(h)  # (B, P+T, n_mels)

        f, m = prompt_feat.shape[1], mel_length(t, self.input_frame_rate)
        h, total = self.length_regulator.inference(h[:, :p], h[:, p:], f, m, self.input_frame_rate)
        if noise is None:
            if generator is None:
                raise ValueError("flow inference needs either `noise` or a `generator` to draw it from")
            if B != 1:
                raise ValueError("a batch of flow inputs needs its noise given, one draw per utterance")
            noise = self.draw_noise(t, f, generator, device)
        elif tuple(noise.shape) != (B, self.output_size, total):
            raise ValueError(f"noise has shape {tuple(noise.shape)}, expected {(B, self.output_size, total)}")

        cond = torch.zeros(B, self.output_size, total, device=device, dtype=dtype)
        cond[:, :, :f] = prompt_feat.to(dtype).transpose(1, 2)
        mel, new_cache = self.decoder.inference(
            mu=h.transpose(1, 2).contiguous(),
            spks=spks,
            cond=cond,
            noise=noise.to(device),
            prompt_len=f,
            cache=flow_cache.to(device=device, dtype=dtype),
            n_timesteps=n_timesteps,
            should_stop=should_stop,
        )
        mel = mel[:, :, f:]
        assert mel.shape[2] == m, "regulator returned the wrong number of frames"
        return mel.float(), new_cache
