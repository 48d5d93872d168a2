"""The CosyVoice2 flow encoder: ``UpsampleConformerEncoder`` (token rate -> mel rate, causal-capable).

embed (Linear + LayerNorm, ESPnet rel-pos) -> ``PreLookaheadLayer`` (sees the next 3 tokens) -> ``num_blocks``
conformer layers -> ``Upsample1D`` (x2 nearest + causal conv) -> ``up_embed`` -> 4 conformer layers -> LayerNorm.
The conformer layers, attention and embeddings are the CosyVoice-300M ones from :mod:`cosyserve.models.transformer`;
attribute names follow the official ``flow.pt`` keys (``encoder.pre_lookahead_layer.conv1``, ``encoder.up_layer.conv``,
``encoder.up_embed.out.0``, ``encoder.up_encoders.N``).

When streaming, attention uses static chunk masks (a frame sees its own chunk and every earlier one): chunk
``static_chunk_size`` before the upsampling and twice that after it. A flow stream's call runs the tokens after
the ones it keeps against their kept keys and values (:class:`~cosyserve.models.flow_stream.StepCache`, one at
token rate, one at mel rate, which also keeps the upsampling conv's input tail).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.models.flow_stream import StepCache
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

    def forward(self, x: Tensor, cache: StepCache | None = None) -> Tensor:
        # x: (B, C, T) -> (B, C, T * stride); a stream's kept frames before x are the conv's left context
        h = F.interpolate(x, scale_factor=float(self.stride), mode="nearest")
        n = self.stride * 2
        return self.conv(F.pad(h, (n, 0)) if cache is None else cache.left(h, n))


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
        self,
        xs: Tensor,
        context: Tensor | None = None,
        streaming: bool = False,
        caches: list[StepCache] | None = None,
        lead: int = 0,
    ) -> Tensor:
        """Encode one unpadded sequence of token embeddings.

        Args:
            xs: (B, T, input_size) token embeddings.
            context: (B, 3, input_size) embeddings of the 3 tokens after ``xs`` (lookahead only, no output
                frames), or None at the end of the utterance (the lookahead sees zeros).
            streaming: static chunk attention masks instead of full attention.
            caches: a flow stream's token-rate and mel-rate caches (streaming only): ``xs`` follows the tokens
                they keep, after ``lead`` tokens of left context for the lookahead layer (no output frames).
            lead: see ``caches``.
        Returns:
            (B, (T - lead) * 2, output_size) frames at mel rate, after ``after_norm``.
        """
        chunk = self.cfg.static_chunk_size if streaming else 0
        tokens, frames = caches if caches is not None else (None, None)
        xs = self.embed(xs)[0]
        if context is not None:
            context = self.embed(context)[0]
        xs = self.pre_lookahead_layer(xs, context)[:, lead:]
        for layers, cache, c in ((self.encoders, tokens, chunk), (self.up_encoders, frames, chunk * 2)):
            if layers is self.up_encoders:
                xs = self.up_layer(xs.transpose(1, 2), frames).transpose(1, 2)  # (B, 2T, C)
                xs = self.up_embed(xs)[0]
            start = 0 if cache is None else cache.start
            pos_emb = self.embed.pos_enc.position_encoding(start, xs.size(1), xs)
            mask = _stream_mask(xs.size(1), c, start, xs.device)
            for layer in layers:
                xs = layer(xs, mask, pos_emb, cache=cache)
        return self.after_norm(xs) if self.cfg.normalize_before else xs


def _stream_mask(length: int, chunk: int, kept: int, device: torch.device) -> Tensor:
    # (1, 1 or T, kept + T): the attention mask of T frames after ``kept`` ones a stream keeps (a multiple of chunk,
    # seen whole); full attention when chunk <= 0
    mask = attention_mask(length, chunk, device)
    if kept:
        mask = torch.cat([mask.new_ones(1, mask.shape[1], kept), mask], dim=2)
    return mask
