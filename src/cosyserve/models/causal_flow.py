"""CosyVoice2 flow model: speech tokens (+ prompt) -> 80-bin mel, causal and chunk-streamable.

``CausalMaskedDiffWithXvec`` = token embedding -> :class:`UpsampleConformerEncoder` (x2 to mel rate, 3-token
lookahead) -> ``encoder_proj`` -> ``CausalConditionalCFM`` (10 Euler steps of the
:class:`CausalConditionalDecoder` velocity with classifier-free guidance). Unlike CosyVoice-300M there is no length
regulator and no flow cache: a streaming caller re-runs the flow on every token so far, and the starting noise is
always the same fixed tensor (:func:`fixed_noise`), so the frames of earlier chunks come out the same again.
Attribute names follow the official ``flow.pt`` keys.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.models.causal_flow_decoder import CausalConditionalDecoder, CausalConditionalDecoderConfig
from cosyserve.models.flow import CFMParams, _euler_schedule
from cosyserve.models.upsample_encoder import (
    PRE_LOOKAHEAD_LEN,
    UPSAMPLE_STRIDE,
    UpsampleConformerEncoder,
    UpsampleConformerEncoderConfig,
)
from cosyserve.stop import ShouldStop, check

__all__ = [
    "NOISE_SHAPE",
    "CausalConditionalCFM",
    "CausalConditionalCFMConfig",
    "CausalFlowConfig",
    "CausalMaskedDiffWithXvec",
    "fixed_noise",
]

# The reference's CausalConditionalCFM draws this once at construction, right after seeding torch with 0.
NOISE_SHAPE = (1, 80, 50 * 300)
NOISE_SEED = 0


@functools.cache
def _noise_table() -> Tensor:
    generator = torch.Generator(device="cpu").manual_seed(NOISE_SEED)
    return torch.randn(NOISE_SHAPE, generator=generator)


def fixed_noise(
    frames: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The first ``frames`` columns of the reference's fixed flow noise, as a fresh (1, 80, frames) tensor.

    Equals ``set_all_random_seed(0); torch.randn([1, 80, 15000])[:, :, :frames]`` but draws from a private
    generator (the global torch RNG is left alone) once per process.
    """
    if not 0 <= frames <= NOISE_SHAPE[2]:
        raise ValueError(
            f"the flow's fixed noise has {NOISE_SHAPE[2]} frames (10 minutes of mel); {frames} were asked for"
        )
    return _noise_table()[:, :, :frames].to(device=device, dtype=dtype, copy=True)


@dataclass(kw_only=True)
class CausalConditionalCFMConfig:
    TARGET: ClassVar[str] = "cosyvoice.flow.flow_matching.CausalConditionalCFM"

    in_channels: int
    cfm_params: CFMParams
    n_spks: int = 1
    spk_emb_dim: int = 64
    estimator: CausalConditionalDecoderConfig


@dataclass(kw_only=True)
class CausalFlowConfig:
    TARGET: ClassVar[str] = "cosyvoice.flow.flow.CausalMaskedDiffWithXvec"

    input_size: int = 512
    output_size: int = 80
    spk_embed_dim: int = 192
    output_type: str = "mel"
    vocab_size: int = 4096
    input_frame_rate: int = 50
    only_mask_loss: bool = True
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    encoder: UpsampleConformerEncoderConfig
    decoder: CausalConditionalCFMConfig
    # Training-time default estimator description in the reference; the yaml's `decoder` is what is built.
    decoder_conf: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.output_type != "mel":
            raise ValueError(f"flow output_type={self.output_type!r} is not supported; expected 'mel'")
        if self.output_size != NOISE_SHAPE[1]:
            raise ValueError(
                f"flow output_size={self.output_size}: the reference's fixed noise and guidance buffers are "
                f"{NOISE_SHAPE[1]}-channel mels"
            )
        if self.input_size != self.encoder.input_size:
            raise ValueError(
                f"flow input_size={self.input_size} differs from encoder.input_size={self.encoder.input_size}"
            )
        if self.token_mel_ratio != UPSAMPLE_STRIDE:
            raise ValueError(
                f"flow token_mel_ratio={self.token_mel_ratio}: the encoder's upsampling is fixed at x{UPSAMPLE_STRIDE}"
            )
        if self.pre_lookahead_len != PRE_LOOKAHEAD_LEN:
            raise ValueError(
                f"flow pre_lookahead_len={self.pre_lookahead_len}: the encoder's lookahead layer is fixed at "
                f"{PRE_LOOKAHEAD_LEN} tokens"
            )
        need = 2 * self.output_size + self.decoder.spk_emb_dim + self.output_size  # x, mu, spks, cond
        if self.decoder.estimator.in_channels != need or self.decoder.spk_emb_dim != self.output_size:
            raise ValueError(
                f"flow decoder: estimator.in_channels={self.decoder.estimator.in_channels} and "
                f"spk_emb_dim={self.decoder.spk_emb_dim} do not fit x, mu, spks and cond of {self.output_size} "
                f"channels each (expected {4 * self.output_size} and {self.output_size})"
            )


class CausalConditionalCFM(nn.Module):
    def __init__(self, cfg: CausalConditionalCFMConfig):
        super().__init__()
        self.cfg = cfg
        self.t_scheduler = cfg.cfm_params.t_scheduler
        self.inference_cfg_rate = cfg.cfm_params.inference_cfg_rate
        self.estimator = CausalConditionalDecoder(cfg.estimator)

    def forward(
        self,
        mu: Tensor,
        spks: Tensor,
        cond: Tensor,
        noise: Tensor,
        n_timesteps: int,
        streaming: bool,
        should_stop: ShouldStop | None = None,
    ) -> Tensor:
        """Integrate from ``noise`` to a mel: fixed-step Euler, classifier-free guidance as one batch of 2B.

        Args:
            mu: (B, n, T) encoder condition.
            spks: (B, s) projected speaker embedding.
            cond: (B, n, T) prompt mel in the first frames, zeros after.
            noise: (B or 1, n, T) the starting sample.
            n_timesteps: Euler steps.
            streaming: chunk attention masks in the estimator.
            should_stop: asked before each Euler step (:class:`cosyserve.stop.Stopped` once it says True).
        Returns:
            (B, n, T) float32 mel.
        """
        B, n, T = mu.shape
        s, dtype = spks.shape[1], spks.dtype
        x = noise.to(dtype).expand(B, n, T)
        # Rows :B conditioned, rows B: unconditioned (zero mu, spks, cond); only x changes per step.
        h = torch.zeros(2 * B, self.estimator.in_channels, T, device=mu.device, dtype=dtype)  # (2B, C_in, T)
        h[:B, n : 2 * n] = mu
        h[:B, 2 * n : 2 * n + s] = spks.unsqueeze(-1)
        h[:B, 2 * n + s :] = cond
        t_in = torch.zeros(2 * B, device=mu.device, dtype=dtype)
        rate = self.inference_cfg_rate
        for t, dt in _euler_schedule(n_timesteps, self.t_scheduler, dtype, mu.device):
            check(should_stop)
            h.unflatten(0, (2, B))[:, :, :n] = x
            t_in.copy_(t.expand(2 * B))
            v = self.estimator.forward_packed(h, t_in, streaming, should_stop)  # (2B, n, T)
            x = x + dt * ((1.0 + rate) * v[:B] - rate * v[B:])
        return x.float()


class CausalMaskedDiffWithXvec(nn.Module):
    # Euler steps of the reference's flow inference (fixed there; the yaml has no count)
    N_TIMESTEPS = 10
    REPEATED_STACKS = ("encoder.encoders", "encoder.up_encoders", "decoder.estimator.mid_blocks")
    ROW_TABLES = ("input_embedding.weight",)

    def __init__(self, cfg: CausalFlowConfig):
        super().__init__()
        self.cfg = cfg
        self.input_size = cfg.input_size
        self.output_size = cfg.output_size
        self.pre_lookahead_len = cfg.pre_lookahead_len
        self.token_mel_ratio = cfg.token_mel_ratio
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.encoder = UpsampleConformerEncoder(cfg.encoder)
        self.encoder_proj = nn.Linear(cfg.encoder.output_size, cfg.output_size)
        self.decoder = CausalConditionalCFM(cfg.decoder)

    @torch.inference_mode()
    def warm_up(self, n_tokens: int = 2) -> Tensor:
        """One Euler step over dummy tokens through one layer of each stack, streaming and not (every kernel the
        flow runs, once; :func:`cosyserve.models.one_layer_per_stack`); returns the mel. Leaves the module as it
        was, so it may run while requests use the flow."""
        from cosyserve.models import one_layer_per_stack

        trimmed = one_layer_per_stack(self)
        tokens = torch.zeros(1, max(n_tokens, 1) + self.pre_lookahead_len, dtype=torch.int32)
        empty = torch.zeros(1, 0, dtype=torch.int32)
        feat, emb = torch.zeros(1, 0, self.output_size), torch.zeros(1, self.cfg.spk_embed_dim)
        trimmed.inference(tokens, empty, feat, emb, streaming=True, finalize=False, n_timesteps=1)
        return trimmed.inference(tokens, empty, feat, emb, streaming=False, finalize=True, n_timesteps=1)

    @torch.inference_mode()
    def inference(
        self,
        token: Tensor,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        streaming: bool,
        finalize: bool,
        *,
        n_timesteps: int | None = None,
        should_stop: ShouldStop | None = None,
    ) -> Tensor:
        """Speech tokens -> mel after a prompt, the whole utterance so far (the reference's flow inference).

        A batch of B > 1 must have equal lengths (no padding); every row starts from the same fixed noise.

        Args:
            token: (B, T) speech token ids to synthesise.
            prompt_token: (B, P) prompt speech tokens (P may be 0).
            prompt_feat: (B, F, n_mels) prompt mel. Usually F = 2P (the zero-shot frontend trims to it); voice
                conversion passes the prompt's whole mel, and the output then starts with the d = 2P - F frames of
                the last prompt tokens, as in the reference.
            embedding: (B, spk_embed_dim) speaker x-vector (L2-normalised here).
            streaming: static chunk attention in the encoder and estimator (what a streaming chunk uses).
            finalize: the utterance ends here; otherwise the last 3 tokens are lookahead context only and get no
                frames.
            n_timesteps: Euler steps (>= 1; None: :attr:`N_TIMESTEPS`).
            should_stop: asked before each Euler step (:class:`cosyserve.stop.Stopped` once it says True).
        Returns:
            (B, n_mels, M) float32 mel with M = 2(P + T) - F (finalize) or 2(P + T - 3) - F.
        """
        n_timesteps = self.N_TIMESTEPS if n_timesteps is None else n_timesteps
        if n_timesteps < 1:
            raise ValueError(f"n_timesteps must be >= 1, got {n_timesteps}")
        tokens = torch.cat([prompt_token, token], dim=1)
        lookahead = 0 if finalize else self.pre_lookahead_len
        if token.shape[1] <= lookahead:
            raise ValueError(
                f"a chunk that does not finalize needs more than {lookahead} tokens (the last {lookahead} are "
                f"lookahead), got {token.shape[1]}"
            )
        f = prompt_feat.shape[1]
        frames = self.token_mel_ratio * (tokens.shape[1] - lookahead)
        if f > frames:
            raise ValueError(f"prompt_feat has {f} frames, more than the {frames} the tokens make")
        dtype = self.spk_embed_affine_layer.weight.dtype
        device = self.spk_embed_affine_layer.weight.device
        spks = self.spk_embed_affine_layer(F.normalize(embedding.to(device=device, dtype=dtype), dim=1))

        x = self.input_embedding(tokens.to(device).clamp(min=0))  # (B, P+T, C)
        if lookahead:
            h = self.encoder(x[:, :-lookahead], x[:, -lookahead:], streaming=streaming)
        else:
            h = self.encoder(x, streaming=streaming)
        mu = self.encoder_proj(h).transpose(1, 2).contiguous()  # (B, n_mels, N), N = frames
        cond = torch.zeros_like(mu)
        cond[:, :, :f] = prompt_feat.to(device=device, dtype=dtype).transpose(1, 2)
        noise = fixed_noise(frames, device, dtype)
        mel = self.decoder(mu, spks, cond, noise, n_timesteps, streaming, should_stop)
        return mel[:, :, f:]
