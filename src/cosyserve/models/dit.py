"""CosyVoice3's flow: speech tokens (+ prompt) -> 80-bin mel with a DiT velocity estimator.

``CausalMaskedDiffWithDiT`` has no encoder: the tokens' 80-wide embeddings pass a :class:`PreLookaheadLayer`
(conv1 sees the next 3 tokens, conv2 is causal, residual), are repeated x2 to the mel rate and are the DiT's
``mu`` directly. The ODE is CosyVoice2's (:class:`~cosyserve.models.causal_flow.CausalConditionalCFM`: the fixed
noise, 10 Euler steps on the cosine schedule, classifier-free guidance 0.7) with the :class:`DiT` as its estimator.

The DiT (F5-TTS's, as the reference builds it): a sinusoidal time embedding and MLP; the input
``proj(cat([x, cond, mu, spks]))`` plus a causal convolutional position embedding; ``depth`` blocks of adaptive
LayerNorm (shift/scale/gate from the time embedding), self-attention with x-transformers' rotary embedding and a
tanh-GELU feed-forward; a final adaptive LayerNorm and projection to 80 channels. Two details of the reference are
kept because the released weights were trained with them: the rotary embedding is applied to q and k **before**
they are split into heads, so only the first ``dim_head`` features (head 0) are rotated; its frequencies are
interleaved in pairs (``rotate_half`` maps (x0, x1) to (-x1, x0)). When streaming, attention uses static chunk
masks of ``static_chunk_size`` frames over all left chunks, otherwise it is full.

Attribute names follow the official ``flow.pt`` keys (``decoder.estimator.transformer_blocks.N.attn.to_q``, ...);
the rotary table's ``inv_freq`` is a persistent buffer there, as in the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.core.stop import ShouldStop, check
from cosyserve.models.causal_flow import (
    NOISE_SHAPE,
    CausalConditionalCFM,
    CausalConditionalCFMConfig,
    ChunkFlow,
)
from cosyserve.models.flow_decoder import SinusoidalPosEmb
from cosyserve.models.flow_stream import FlowStream, StepState
from cosyserve.models.transformer import subsequent_chunk_mask
from cosyserve.models.upsample_encoder import PreLookaheadLayer as _PreLookahead

__all__ = [
    "DiT",
    "DiTCFMConfig",
    "DiTConfig",
    "DiTFlowConfig",
    "CausalMaskedDiffWithDiT",
    "PreLookaheadLayer",
    "PreLookaheadLayerConfig",
]

TIME_FREQ_DIM = 256  # the reference's TimestepEmbedding sinusoid, fixed
POS_KERNEL, POS_GROUPS = 31, 16  # CausalConvPositionEmbedding, fixed
ROTARY_THETA = 10000.0  # x-transformers' RotaryEmbedding default, as the reference builds it


@dataclass(kw_only=True)
class DiTConfig:
    TARGET: ClassVar[str] = "cosyvoice.flow.DiT.dit.DiT"

    dim: int
    depth: int = 8
    heads: int = 8
    dim_head: int = 64
    dropout: float = 0.1
    ff_mult: int = 4
    mel_dim: int = 80
    mu_dim: int | None = None
    long_skip_connection: bool = False
    spk_dim: int | None = None
    out_channels: int | None = None
    static_chunk_size: int = 50
    # stored by the reference; its masks always attend to every left chunk
    num_decoding_left_chunks: int = 2

    def __post_init__(self) -> None:
        if self.dim % POS_GROUPS:
            raise ValueError(
                f"DiT dim={self.dim} must be a multiple of {POS_GROUPS} (the position embedding's grouped convs)"
            )
        if self.dim_head % 2:
            raise ValueError(f"DiT dim_head={self.dim_head} must be even (rotary pairs)")
        if self.long_skip_connection:
            raise ValueError("DiT long_skip_connection=True is not supported (no CosyVoice3 release uses it)")
        if self.out_channels not in (None, self.mel_dim):
            raise ValueError(f"DiT out_channels={self.out_channels} must equal mel_dim={self.mel_dim}")

    @property
    def in_channels(self) -> int:
        """Width of the packed estimator input cat([x, mu, spks, cond])."""
        return 2 * self.mel_dim + (self.mu_dim or self.mel_dim) + (self.spk_dim or 0)


@dataclass(kw_only=True)
class DiTCFMConfig(CausalConditionalCFMConfig):
    estimator: DiTConfig  # type: ignore[assignment]


@dataclass(kw_only=True)
class PreLookaheadLayerConfig:
    TARGET: ClassVar[str] = "cosyvoice.transformer.upsample_encoder.PreLookaheadLayer"

    in_channels: int
    channels: int
    pre_lookahead_len: int = 1


@dataclass(kw_only=True)
class DiTFlowConfig:
    TARGET: ClassVar[str] = "cosyvoice.flow.flow.CausalMaskedDiffWithDiT"

    input_size: int = 512
    output_size: int = 80
    spk_embed_dim: int = 192
    output_type: str = "mel"
    vocab_size: int = 4096
    input_frame_rate: int = 50
    only_mask_loss: bool = True
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    pre_lookahead_layer: PreLookaheadLayerConfig
    decoder: DiTCFMConfig
    # the reference's training-time default estimator description; the yaml's `decoder` is what is built
    decoder_conf: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        n = NOISE_SHAPE[1]
        est = self.decoder.estimator
        if self.output_type != "mel":
            raise ValueError(f"flow output_type={self.output_type!r} is not supported; expected 'mel'")
        # the reference's Euler loop allocates its x, mu, cond buffers as [2, 80, N] and spks as [2, 80]
        widths = {
            "output_size": self.output_size,
            "input_size": self.input_size,
            "estimator.mel_dim": est.mel_dim,
            "estimator.mu_dim": est.mu_dim or est.mel_dim,
            "estimator.spk_dim": est.spk_dim,
            "decoder.spk_emb_dim": self.decoder.spk_emb_dim,
        }
        wrong = {k: v for k, v in widths.items() if v != n}
        if wrong:
            raise ValueError(
                f"flow {', '.join(f'{k}={v}' for k, v in wrong.items())}: CosyVoice3's flow is {n} wide throughout "
                "(token embedding, mu, speaker projection, mel)"
            )
        lookahead = self.pre_lookahead_layer
        if lookahead.in_channels != self.input_size or lookahead.pre_lookahead_len != self.pre_lookahead_len:
            raise ValueError(
                f"flow pre_lookahead_layer in_channels={lookahead.in_channels}, "
                f"pre_lookahead_len={lookahead.pre_lookahead_len} must equal input_size={self.input_size} and "
                f"pre_lookahead_len={self.pre_lookahead_len}"
            )
        if self.token_mel_ratio < 1:
            raise ValueError(f"flow token_mel_ratio={self.token_mel_ratio} must be >= 1")


class PreLookaheadLayer(_PreLookahead):
    """CosyVoice2's lookahead layer with a hidden width of its own: conv1 in_channels -> channels (kernel
    ``pre_lookahead_len + 1``), conv2 channels -> in_channels (kernel 3, causal), residual."""

    def __init__(self, cfg: PreLookaheadLayerConfig):
        nn.Module.__init__(self)
        self.pre_lookahead_len = cfg.pre_lookahead_len
        self.conv1 = nn.Conv1d(cfg.in_channels, cfg.channels, cfg.pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(cfg.channels, cfg.in_channels, 3)


# --- the DiT --------------------------------------------------------------------------------------------------------


class _TimestepEmbedding(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.time_embed = SinusoidalPosEmb(TIME_FREQ_DIM)
        self.time_mlp = nn.Sequential(nn.Linear(TIME_FREQ_DIM, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: Tensor) -> Tensor:
        # t: (B,) -> (B, dim)
        return self.time_mlp(self.time_embed(t).to(t.dtype))


class _CausalConvPositionEmbedding(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, POS_KERNEL, groups=POS_GROUPS), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, POS_KERNEL, groups=POS_GROUPS), nn.Mish())

    def forward(self, x: Tensor, cache: StepState | None = None) -> Tensor:
        # x: (B, N, C) -> (B, N, C); each conv sees the current and the 30 previous frames (a stream's kept ones)
        h = x.transpose(1, 2)
        for conv in (self.conv1, self.conv2):
            h = conv(F.pad(h, (POS_KERNEL - 1, 0)) if cache is None else cache.left(h, POS_KERNEL - 1))
        return h.transpose(1, 2)


class _InputEmbedding(nn.Module):
    def __init__(self, in_features: int, dim: int):
        super().__init__()
        self.proj = nn.Linear(in_features, dim)
        self.conv_pos_embed = _CausalConvPositionEmbedding(dim)

    def forward(self, h: Tensor, cache: StepState | None = None) -> Tensor:
        # h: (B, N, in_features) = cat([x, cond, mu, spks]) -> (B, N, dim)
        x = self.proj(h)
        return self.conv_pos_embed(x, cache) + x


class _RotaryEmbedding(nn.Module):
    def __init__(self, dim_head: int):
        super().__init__()
        # on the CPU whatever device the module is built on: the same arithmetic on the meta device goes through
        # torch's reference ops, whose first use imports torch._dynamo and sympy (~0.65 s of a CosyVoice3 start)
        steps = torch.arange(0, dim_head, 2, device="cpu").float()
        inv_freq = 1.0 / (ROTARY_THETA ** (steps / dim_head))
        self.register_buffer("inv_freq", inv_freq)  # persistent: the official flow.pt holds it

    def forward(self, n: int, dtype: torch.dtype, offset: int | Tensor = 0) -> tuple[Tensor, Tensor]:
        # (R, N, dim_head) cos and sin of positions offset .. offset+N-1 in ``dtype``, frequencies repeated in
        # interleaved pairs (f0, f0, f1, f1, ...): R = 1 for an int or a 0-d tensor (the lite graph's offset, an
        # input), else a row per offset (R,) (streams stacked, each row at its own). Computed in float32 whatever
        # the flow's dtype: in bfloat16 the positions past 256 and the angles (up to a few thousand radians) are
        # off by whole radians, so the table would be noise for most frames.
        t = torch.arange(n, device=self.inv_freq.device, dtype=torch.float32)
        if isinstance(offset, Tensor):  # exact integers in float32, as arange's
            t = offset.to(t.device, torch.float32).reshape(-1, 1) + t  # (R, N)
        else:
            t = (t + offset).unsqueeze(0)  # (1, N)
        # dim=2, not -1: ONNX's export of repeat_interleave gets a negative dim wrong
        freqs = (t.unsqueeze(2) * self.inv_freq.float()).repeat_interleave(2, dim=2)
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


def _rotate_pairs(x: Tensor) -> Tensor:
    # (..., 2k) as pairs (x0, x1) -> (-x1, x0)
    # (B, N, 2k); reshaped to x's shape, not flattened: ONNX's export then knows the result's rank
    return torch.stack((-x[:, :, 1::2], x[:, :, 0::2]), dim=-1).reshape(x.shape)


def _apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: (B, N, inner), cos and sin (1 or B, N, d); only the first d features are rotated (the reference's order of
    # operations)
    d = cos.shape[-1]
    head, rest = x[:, :, :d], x[:, :, d:]  # no Ellipsis: ONNX's export must know the slices' rank
    return torch.cat((head * cos + _rotate_pairs(head) * sin, rest), dim=2)


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int):
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        # index 1: the reference's dropout
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Identity()])

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor | None, cache: StepState | None = None
    ) -> Tensor:
        # x: (B, N, dim); mask: (N, N) bool, True = attend, or None for full attention; a stream's cache adds the
        # kept frames' keys and values (seen whole)
        B, N, _ = x.shape
        q = _apply_rotary(self.to_q(x), *rope)
        k = _apply_rotary(self.to_k(x), *rope)
        v = self.to_v(x)
        # (B, nh, N, hs); the head size named, not -1 (ONNX's export)
        q, k, v = (t.view(B, N, self.heads, self.dim_head).transpose(1, 2) for t in (q, k, v))
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = cache.attend(q, k, v, mask)
        return self.to_out[0](y.transpose(1, 2).reshape(B, N, self.heads * self.dim_head))


class _AdaLayerNorm(nn.Module):
    # AdaLayerNormZero (chunks=6) and AdaLayerNormZero_Final (chunks=2): modulation from the time embedding
    def __init__(self, dim: int, chunks: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim * chunks)
        self.chunks = chunks

    def forward(self, t: Tensor) -> tuple[Tensor, ...]:
        # t: (B, dim) -> chunks x (B, 1, dim)
        return tuple(c.unsqueeze(1) for c in self.linear(F.silu(t)).chunk(self.chunks, dim=1))


def _norm(x: Tensor) -> Tensor:
    return F.layer_norm(x, (int(x.shape[-1]),), eps=1e-6)  # int: a constant width when traced for ONNX


class _FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int):
        super().__init__()
        inner = dim * mult
        # the reference's Sequential(Sequential(Linear, GELU), Dropout, Linear): keys ff.0.0 and ff.2
        self.ff = nn.Sequential(
            nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")),
            nn.Identity(),
            nn.Linear(inner, dim),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.ff(x)


class _DiTBlock(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.attn_norm = _AdaLayerNorm(cfg.dim, 6)
        self.attn = _Attention(cfg.dim, cfg.heads, cfg.dim_head)
        self.ff = _FeedForward(cfg.dim, cfg.ff_mult)

    def forward(
        self,
        x: Tensor,
        t: Tensor,
        rope: tuple[Tensor, Tensor],
        mask: Tensor | None,
        cache: StepState | None = None,
    ) -> Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(t)
        x = x + gate_msa * self.attn(_norm(x) * (1 + scale_msa) + shift_msa, rope, mask, cache)
        return x + gate_mlp * self.ff(_norm(x) * (1 + scale_mlp) + shift_mlp)


class DiT(nn.Module):
    """The velocity estimator; keys under ``decoder.estimator.*``."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        self.mel_dim = cfg.mel_dim
        self.in_channels = cfg.in_channels
        self.static_chunk_size = cfg.static_chunk_size
        self.time_embed = _TimestepEmbedding(cfg.dim)
        self.input_embed = _InputEmbedding(cfg.in_channels, cfg.dim)
        self.rotary_embed = _RotaryEmbedding(cfg.dim_head)
        self.transformer_blocks = nn.ModuleList(_DiTBlock(cfg) for _ in range(cfg.depth))
        self.norm_out = _AdaLayerNorm(cfg.dim, 2)
        self.proj_out = nn.Linear(cfg.dim, cfg.mel_dim)

    def forward(
        self, x: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, streaming: bool = False
    ) -> Tensor:
        """:meth:`forward_packed` of cat([x, mu, spks over time, cond]); x, mu, cond (B, 80, N), spks (B, 80)."""
        spks = spks.unsqueeze(-1).expand(-1, -1, x.shape[-1])
        return self.forward_packed(torch.cat([x, mu, spks, cond], dim=1), t, streaming)

    @property
    def streams(self) -> bool:
        """Whether a stream's chunks can keep their frames (static chunk attention when streaming)."""
        return self.static_chunk_size > 0

    def forward_packed(
        self,
        h: Tensor,
        t: Tensor,
        streaming: bool = False,
        should_stop: ShouldStop | None = None,
        cache: StepState | None = None,
    ) -> Tensor:
        """Predict the flow velocity.

        Args:
            h: (B, in_channels, N) = cat([x, mu, spks repeated over time, cond], dim=1), the layout the CFM packs.
            t: (B,) flow time in [0, 1].
            streaming: static chunk attention masks instead of full attention.
            should_stop: asked before each block (:class:`cosyserve.core.stop.Stopped` once it says True).
            cache: a stream's state at this Euler step (streaming only): h holds the frames after the
                ``cache.start`` it keeps (a multiple of the attention chunk), which it adds as left context; or
                several streams' (:class:`~cosyserve.models.flow_stream.StepRows`: each row at its own start).
        Returns:
            (B, mel_dim, N) velocity.
        """
        mask = None
        if streaming and self.static_chunk_size > 0:
            # a stream's call starts at a chunk boundary: the mask of its own frames is the same
            mask = subsequent_chunk_mask(h.shape[2], self.static_chunk_size, h.device)
        elif cache is not None:
            raise ValueError("a flow stream's chunk needs static chunk attention (streaming with chunks > 0)")
        return self.forward_masked(h, t, mask, should_stop, cache)

    def forward_masked(
        self,
        h: Tensor,
        t: Tensor,
        mask: Tensor | None,
        should_stop: ShouldStop | None = None,
        cache: StepState | None = None,
    ) -> Tensor:
        """:meth:`forward_packed` with the attention mask of the call's own frames given: ``mask`` (N, N) bool
        (True = attend; None: full attention), the kept frames of ``cache`` seen whole. What the lite runtime's
        one estimator graph traces (the mask an input: chunk attention or full, one graph)."""
        n_mel, c, n = self.mel_dim, h.shape[1], h.shape[2]
        # the reference's proj input order is x, cond, mu, spks (mu and spks are adjacent in the packed h)
        x, mu_spks, cond = h[:, :n_mel], h[:, n_mel : c - n_mel], h[:, c - n_mel :]
        inp = torch.cat([x, cond, mu_spks], dim=1).transpose(1, 2)  # (B, N, in_channels)
        temb = self.time_embed(t)  # (B, dim)
        y = self.input_embed(inp, cache)
        rope = self.rotary_embed(n, y.dtype, 0 if cache is None else cache.start)
        for block in self.transformer_blocks:
            check(should_stop)
            y = block(y, temb, rope, mask, cache)
        scale, shift = self.norm_out(temb)
        y = _norm(y) * (1 + scale) + shift
        return self.proj_out(y).transpose(1, 2)


# --- the flow -------------------------------------------------------------------------------------------------------


class DiTCFM(CausalConditionalCFM):
    """CosyVoice2's causal CFM (fixed noise, Euler, guidance) with the DiT as its estimator."""

    def __init__(self, cfg: DiTCFMConfig):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.t_scheduler = cfg.cfm_params.t_scheduler
        self.inference_cfg_rate = cfg.cfm_params.inference_cfg_rate
        self.estimator = DiT(cfg.estimator)


class CausalMaskedDiffWithDiT(ChunkFlow):
    # in a lower-precision flow the rotary frequencies stay float32 (see _RotaryEmbedding.forward)
    FLOAT32_PARTS = ("decoder.estimator.rotary_embed",)
    REPEATED_STACKS = ("decoder.estimator.transformer_blocks",)
    ROW_TABLES = ("input_embedding.weight",)

    def __init__(self, cfg: DiTFlowConfig):
        super().__init__()
        self.cfg = cfg
        self.output_size = cfg.output_size
        self.pre_lookahead_len = cfg.pre_lookahead_len
        self.token_mel_ratio = cfg.token_mel_ratio
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.pre_lookahead_layer = PreLookaheadLayer(cfg.pre_lookahead_layer)
        self.decoder = DiTCFM(cfg.decoder)

    def _mu(self, x: Tensor, lookahead: int, streaming: bool, stream: FlowStream | None, lead: int) -> Tensor:
        # the lookahead layer's output is the DiT's mu, repeated to the mel rate
        if lookahead:
            h = self.pre_lookahead_layer(x[:, :-lookahead], x[:, -lookahead:])
        else:
            h = self.pre_lookahead_layer(x)
        return h[:, lead:].repeat_interleave(self.token_mel_ratio, dim=1).transpose(1, 2).contiguous()
