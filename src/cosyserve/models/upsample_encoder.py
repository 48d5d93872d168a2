"""The CosyVoice2 flow encoder: ``UpsampleConformerEncoder`` (token rate -> mel rate, causal-capable).

embed (Linear + LayerNorm, ESPnet rel-pos) -> ``PreLookaheadLayer`` (sees the next 3 tokens) -> ``num_blocks``
conformer layers -> ``Upsample1D`` (x2 nearest + causal conv) -> ``up_embed`` -> 4 conformer layers -> LayerNorm.
The conformer layers, attention and embeddings are the CosyVoice-300M ones from :mod:`cosyserve.models.transformer`;
attribute names follow the official ``flow.pt`` keys (``encoder.pre_lookahead_layer.conv1``, ``encoder.up_layer.conv``,
``encoder.up_embed.out.0``, ``encoder.up_encoders.N``).

When streaming, attention uses static chunk masks (a frame sees its own chunk and every earlier one): chunk
``static_chunk_size`` before the upsampling and twice that after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.models.transformer import (
    _ACTIVATIONS,
    ConformerEncoder,
    ConformerEncoderConfig,
    ConformerEncoderLayer,
    EspnetRelPositionalEncoding,
    LinearNoSubsampling,
    PositionwiseFeedForward,
    RelPositionMultiHeadedAttention,
    subsequent_chunk_mask,
)

__all__ = [
    "ENCODER_WIDTH",
    "PRE_LOOKAHEAD_LEN",
    "UP_LAYERS",
    "UPSAMPLE_STRIDE",
    "PreLookaheadLayer",
    "Upsample1D",
    "UpsampleConformerEncoder",
    "UpsampleConformerEncoderConfig",
    "attention_mask",
]

# The reference hard-codes these in UpsampleConformerEncoder, whatever the yaml says.
ENCODER_WIDTH = 512  # PreLookaheadLayer(512, 512) and Upsample1D(512, 512)
PRE_LOOKAHEAD_LEN = 3
UPSAMPLE_STRIDE = 2
UP_LAYERS = 4  # up_encoders after the upsampling


@dataclass
class UpsampleConformerEncoderConfig(ConformerEncoderConfig):
    TARGET: ClassVar[str] = "cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder"

    def __post_init__(self) -> None:
        if self.input_size != ENCODER_WIDTH or self.output_size != ENCODER_WIDTH:
            raise ValueError(
                f"UpsampleConformerEncoder input_size={self.input_size}, output_size={self.output_size}: both must "
                f"be {ENCODER_WIDTH}, the width the reference hard-codes for its lookahead and upsampling layers"
            )


def attention_mask(length: int, chunk: int, device: torch.device) -> Tensor:
    """Self-attention mask (1, 1 or T, T) bool, True = attend: full when ``chunk`` <= 0, else static chunks."""
    if chunk <= 0:
        return torch.ones(1, 1, length, dtype=torch.bool, device=device)
    return subsequent_chunk_mask(length, chunk, device).unsqueeze(0)  # (1, T, T)


class PreLookaheadLayer(nn.Module):
    """Residual conv pair: conv1 looks ``pre_lookahead_len`` frames ahead, conv2 is causal (kernel 3)."""

    def __init__(self, channels: int, pre_lookahead_len: int):
        super().__init__()
        self.pre_lookahead_len = pre_lookahead_len
        self.conv1 = nn.Conv1d(channels, channels, pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(channels, channels, 3)

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        """x: (B, T, C); context: (B, pre_lookahead_len, C) frames after x (zeros when None) -> (B, T, C)."""
        h = x.transpose(1, 2)  # (B, C, T)
        if context is None:
            h = F.pad(h, (0, self.pre_lookahead_len))
        else:
            if context.size(1) != self.pre_lookahead_len:
                raise ValueError(
                    f"lookahead context has {context.size(1)} frames, expected {self.pre_lookahead_len}"
                )
            h = torch.cat([h, context.transpose(1, 2)], dim=2)
        h = F.leaky_relu(self.conv1(h))
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))
        return h.transpose(1, 2) + x


class Upsample1D(nn.Module):
    """x``stride`` nearest-neighbour repeat, then a causal conv (kernel 2*stride+1, left zero padding)."""

    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, stride * 2 + 1)

    def forward(self, x: Tensor) -> Tensor:
        # x: (B, C, T) -> (B, C, T * stride)
        h = F.interpolate(x, scale_factor=float(self.stride), mode="nearest")
        return self.conv(F.pad(h, (self.stride * 2, 0)))


def _conformer_layers(cfg: ConformerEncoderConfig, n: int) -> nn.ModuleList:
    return nn.ModuleList(
        ConformerEncoderLayer(
            cfg.output_size,
            RelPositionMultiHeadedAttention(cfg.attention_heads, cfg.output_size, cfg.key_bias),
            PositionwiseFeedForward(cfg.output_size, cfg.linear_units, _ACTIVATIONS[cfg.activation_type]()),
            cfg.normalize_before,
        )
        for _ in range(n)
    )


class UpsampleConformerEncoder(ConformerEncoder):
    """Reference ``cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder`` (no macaron, no conv module)."""

    def __init__(self, cfg: UpsampleConformerEncoderConfig) -> None:
        if cfg.input_layer != "linear":
            raise ValueError(
                f"UpsampleConformerEncoder input_layer={cfg.input_layer!r} is not supported; expected 'linear' "
                "(what CosyVoice2 uses)"
            )
        super().__init__(cfg)
        self.pre_lookahead_layer = PreLookaheadLayer(ENCODER_WIDTH, PRE_LOOKAHEAD_LEN)
        self.up_layer = Upsample1D(ENCODER_WIDTH, UPSAMPLE_STRIDE)
        self.up_embed = LinearNoSubsampling(
            cfg.input_size, cfg.output_size, EspnetRelPositionalEncoding(cfg.output_size)
        )
        self.up_encoders = _conformer_layers(cfg, UP_LAYERS)

    def forward(  # type: ignore[override]
        self, xs: Tensor, context: Tensor | None = None, streaming: bool = False
    ) -> Tensor:
        """Encode one unpadded sequence of token embeddings.

        Args:
            xs: (B, T, input_size) token embeddings.
            context: (B, 3, input_size) embeddings of the 3 tokens after ``xs`` (lookahead only, no output
                frames), or None at the end of the utterance (the lookahead sees zeros).
            streaming: static chunk attention masks instead of full attention.
        Returns:
            (B, T * 2, output_size) frames at mel rate, after ``after_norm``.
        """
        chunk = self.cfg.static_chunk_size if streaming else 0
        xs, pos_emb = self.embed(xs)
        if context is not None:
            context = self.embed(context)[0]
        xs = self.pre_lookahead_layer(xs, context)
        mask = attention_mask(xs.size(1), chunk, xs.device)
        for layer in self.encoders:
            xs = layer(xs, mask, pos_emb)

        xs = self.up_layer(xs.transpose(1, 2)).transpose(1, 2)  # (B, 2T, C)
        xs, pos_emb = self.up_embed(xs)
        mask = attention_mask(xs.size(1), chunk * self.up_layer.stride, xs.device)
        for layer in self.up_encoders:
            xs = layer(xs, mask, pos_emb)
        return self.after_norm(xs) if self.cfg.normalize_before else xs
