"""The flow-matching estimator of CosyVoice-300M: a 1-D U-Net with transformer blocks (``ConditionalDecoder``).

Matches ``cosyvoice.flow.decoder.ConditionalDecoder`` built from Matcha-TTS parts (sinusoidal time embedding,
``TimestepEmbedding``, ``ResnetBlock1D``, ``Downsample1D``/``Upsample1D``, ``Block1D``) and diffusers'
``BasicTransformerBlock`` (pre-LayerNorm self-attention without q/k/v bias, GELU feed-forward). Attribute names
follow the official ``decoder.estimator.*`` keys.

A ``mask`` of ``None`` means "no padding anywhere": every multiplication by the mask and the attention bias are
skipped, which is exact (multiplying by 1.0 and adding a 0.0 bias change nothing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.core.stop import ShouldStop, check
from cosyserve.models.flow_stream import StepState

__all__ = ["ConditionalDecoder", "ConditionalDecoderConfig"]

_ACTIVATIONS = {"gelu": "none", "gelu-approximate": "tanh"}


@dataclass
class ConditionalDecoderConfig:
    TARGET: ClassVar[str] = "cosyvoice.flow.decoder.ConditionalDecoder"

    in_channels: int
    out_channels: int
    channels: list[int] = field(default_factory=lambda: [256, 256])
    dropout: float = 0.05
    attention_head_dim: int = 64
    n_blocks: int = 1
    num_mid_blocks: int = 2
    num_heads: int = 4
    act_fn: str = "snake"

    def __post_init__(self) -> None:
        if self.act_fn not in _ACTIVATIONS:
            # Matcha's FeedForward builds nothing usable for other names ("snake" leaves it undefined).
            raise ValueError(
                f"ConditionalDecoder act_fn={self.act_fn!r} is not supported; expected one of {sorted(_ACTIVATIONS)}"
            )
        if not self.channels:
            raise ValueError("ConditionalDecoder channels must list at least one width")


def _masked(x: Tensor, mask: Tensor | None) -> Tensor:
    return x if mask is None else x * mask


class SinusoidalPosEmb(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        assert dim % 2 == 0, "SinusoidalPosEmb needs an even dim"
        self.dim = dim

    def forward(self, t: Tensor, scale: float = 1000.0) -> Tensor:
        # t: [B] -> [B, dim] as cat(sin, cos)
        half = self.dim // 2
        freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
        emb = scale * t.unsqueeze(1) * freqs.unsqueeze(0)
        return torch.cat((emb.sin(), emb.cos()), dim=-1)


class TimestepEmbedding(nn.Module):
    def __init__(self, in_channels: int, time_embed_dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, time_embed_dim)
        self.linear_2 = nn.Linear(time_embed_dim, time_embed_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class Block1D(nn.Module):
    def __init__(self, dim: int, dim_out: int, groups: int = 8):
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv1d(dim, dim_out, 3, padding=1), nn.GroupNorm(groups, dim_out), nn.Mish()
        )

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        return _masked(self.block(_masked(x, mask)), mask)


class ResnetBlock1D(nn.Module):
    def __init__(self, dim: int, dim_out: int, time_emb_dim: int, groups: int = 8):
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = Block1D(dim, dim_out, groups=groups)
        self.block2 = Block1D(dim_out, dim_out, groups=groups)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: Tensor, mask: Tensor | None, temb: Tensor) -> Tensor:
        # x: [B, C, T], temb: [B, E]
        h = self.block1(x, mask) + self.mlp(temb).unsqueeze(-1)
        h = self.block2(h, mask)
        return h + self.res_conv(_masked(x, mask))


class Downsample1D(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, 3, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


class Upsample1D(nn.Module):
    # The decoder only ever builds the transposed-convolution variant.
    def __init__(self, dim: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(dim, dim, 4, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Identity()])

    def forward(self, x: Tensor, bias: Tensor | None, cache: StepState | None = None) -> Tensor:
        # x: [B, T, C]; bias: [B, 1, 1, T] additive key mask, a bool mask (True = attend), or None; a flow stream's
        # cache adds the keys and values of the frames it keeps before x (seen whole; bias then a (T, T) bool mask)
        B, T, _ = x.shape
        q = self.to_q(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.to_k(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        v = self.to_v(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            y = cache.attend(q, k, v, bias)
        y = y.transpose(1, 2).reshape(B, T, self.heads * self.head_dim)  # (B, T, nh*hs)
        return self.to_out[0](y)


class GELUProj(nn.Module):
    def __init__(self, dim_in: int, dim_out: int, approximate: str):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.proj(x), approximate=self.approximate)


class FeedForward(nn.Module):
    def __init__(self, dim: int, approximate: str, mult: int = 4):
        super().__init__()
        inner = dim * mult
        # index 1 is the (inference no-op) dropout, kept so the output projection stays at net.2
        self.net = nn.ModuleList([GELUProj(dim, inner, approximate), nn.Identity(), nn.Linear(inner, dim)])

    def forward(self, x: Tensor) -> Tensor:
        return self.net[2](self.net[0](x))


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, approximate: str):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, approximate)

    def forward(self, x: Tensor, bias: Tensor | None, cache: StepState | None = None) -> Tensor:
        x = x + self.attn1(self.norm1(x), bias, cache)
        return x + self.ff(self.norm3(x))


def _transformer_stack(blocks: nn.ModuleList, x: Tensor, mask: Tensor | None) -> Tensor:
    # x: [B, C, T] -> [B, T, C] for the blocks and back
    bias = None if mask is None else ((1.0 - mask) * -1.0e10).unsqueeze(1)  # (B, 1, 1, T)
    x = x.transpose(1, 2)
    for block in blocks:
        x = block(x, bias)
    return x.transpose(1, 2).contiguous()


class ConditionalDecoder(nn.Module):
    def __init__(self, cfg: ConditionalDecoderConfig):
        super().__init__()
        self.cfg = cfg
        channels = tuple(cfg.channels)
        approx = _ACTIVATIONS[cfg.act_fn]
        self.in_channels = cfg.in_channels
        self.out_channels = cfg.out_channels
        self.time_embeddings = SinusoidalPosEmb(cfg.in_channels)
        temb_dim = channels[0] * 4
        self.time_mlp = TimestepEmbedding(cfg.in_channels, temb_dim)

        def blocks(dim: int) -> nn.ModuleList:
            return nn.ModuleList(
                [
                    BasicTransformerBlock(dim, cfg.num_heads, cfg.attention_head_dim, approx)
                    for _ in range(cfg.n_blocks)
                ]
            )

        self.down_blocks = nn.ModuleList()
        out_ch = cfg.in_channels
        for i, ch in enumerate(channels):
            in_ch, out_ch = out_ch, ch
            is_last = i == len(channels) - 1
            down = nn.Conv1d(out_ch, out_ch, 3, padding=1) if is_last else Downsample1D(out_ch)
            self.down_blocks.append(
                nn.ModuleList([ResnetBlock1D(in_ch, out_ch, temb_dim), blocks(out_ch), down])
            )

        self.mid_blocks = nn.ModuleList(
            nn.ModuleList([ResnetBlock1D(channels[-1], channels[-1], temb_dim), blocks(channels[-1])])
            for _ in range(cfg.num_mid_blocks)
        )

        up_channels = channels[::-1] + (channels[0],)
        self.up_blocks = nn.ModuleList()
        for i in range(len(up_channels) - 1):
            in_ch, out_ch = up_channels[i] * 2, up_channels[i + 1]
            is_last = i == len(up_channels) - 2
            up = nn.Conv1d(out_ch, out_ch, 3, padding=1) if is_last else Upsample1D(out_ch)
            self.up_blocks.append(nn.ModuleList([ResnetBlock1D(in_ch, out_ch, temb_dim), blocks(out_ch), up]))
        self.final_block = Block1D(up_channels[-1], up_channels[-1])
        self.final_proj = nn.Conv1d(up_channels[-1], cfg.out_channels, 1)

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None,
        mu: Tensor,
        t: Tensor,
        spks: Tensor | None = None,
        cond: Tensor | None = None,
    ) -> Tensor:
        """Predict the flow velocity.

        Args:
            x: [B, n_feats, T] current sample.
            mask: [B, 1, T] float 0/1 frame mask, or None when no frame is padding.
            mu: [B, n_feats, T] encoder condition.
            t: [B] flow time in [0, 1].
            spks: [B, spk_dim] speaker condition, repeated over time.
            cond: [B, n_feats, T] prompt mel condition.
        Returns:
            [B, out_channels, T] velocity.
        """
        parts = [x, mu]
        if spks is not None:
            parts.append(spks.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        if cond is not None:
            parts.append(cond)
        return self.forward_packed(torch.cat(parts, dim=1), mask, t)

    def forward_packed(
        self, h: Tensor, mask: Tensor | None, t: Tensor, should_stop: ShouldStop | None = None
    ) -> Tensor:
        """Same as :meth:`forward` with the inputs already concatenated: h = cat([x, mu, spks, cond], 1);
        ``should_stop`` is asked before each block (:class:`cosyserve.core.stop.Stopped`)."""
        temb = self.time_mlp(self.time_embeddings(t).to(t.dtype))
        hiddens = []
        masks = [mask]
        for resnet, blocks, downsample in self.down_blocks:
            check(should_stop)
            m = masks[-1]
            h = resnet(h, m, temb)
            h = _transformer_stack(blocks, h, m)
            hiddens.append(h)
            h = downsample(_masked(h, m))
            masks.append(None if m is None else m[:, :, ::2])
        masks.pop()
        m = masks[-1]
        for resnet, blocks in self.mid_blocks:
            check(should_stop)
            h = resnet(h, m, temb)
            h = _transformer_stack(blocks, h, m)
        for resnet, blocks, upsample in self.up_blocks:
            check(should_stop)
            m = masks.pop()
            skip = hiddens.pop()
            h = torch.cat([h[:, :, : skip.shape[-1]], skip], dim=1)  # (B, 2C, T_level)
            h = resnet(h, m, temb)
            h = _transformer_stack(blocks, h, m)
            h = upsample(_masked(h, m))
        h = self.final_block(h, m)
        return _masked(self.final_proj(_masked(h, m)), mask)
