"""The CosyVoice2 flow-matching estimator: ``CausalConditionalDecoder``.

The 300M U-Net of :mod:`cosyserve.models.flow_decoder` with causal pieces swapped in, as the reference does:
every ``Block1D`` becomes a ``CausalBlock1D`` (left-padded kernel-3 conv, LayerNorm over channels instead of
GroupNorm, Mish), and the last down/up level's kernel-3 conv becomes a ``CausalConv1d``. The strided
``Downsample1D`` and transposed-conv ``Upsample1D`` of the inner levels are unchanged. When streaming, every
transformer stack attends through static chunk masks of ``static_chunk_size`` frames (all left chunks, at every
level); otherwise attention is full. Keys follow the official ``decoder.estimator.*`` names (``block.0`` conv,
``block.2`` LayerNorm).

Inference inputs never contain padding (one utterance, or a batch of equal lengths), so there is no frame mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.models.flow_decoder import ConditionalDecoder, ConditionalDecoderConfig
from cosyserve.models.transformer import subsequent_chunk_mask
from cosyserve.stop import ShouldStop, check

__all__ = ["CausalBlock1D", "CausalConditionalDecoder", "CausalConditionalDecoderConfig", "CausalConv1d"]


@dataclass
class CausalConditionalDecoderConfig(ConditionalDecoderConfig):
    TARGET: ClassVar[str] = "cosyvoice.flow.decoder.CausalConditionalDecoder"

    static_chunk_size: int = 50
    # The reference stores it but its forward always attends to every left chunk.
    num_decoding_left_chunks: int = 2


class CausalConv1d(nn.Conv1d):
    """Stride-1 conv whose output frame i sees input frames <= i (kernel_size - 1 zeros on the left)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__(in_channels, out_channels, kernel_size)
        self.causal_padding = kernel_size - 1

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.pad(x, (self.causal_padding, 0)))


class _Transpose(nn.Module):
    # (B, C, T) <-> (B, T, C) inside the block's Sequential; parameterless, it only keeps the key indices.
    def forward(self, x: Tensor) -> Tensor:
        return x.transpose(1, 2)


class CausalBlock1D(nn.Module):
    def __init__(self, dim: int, dim_out: int):
        super().__init__()
        self.block = nn.Sequential(
            CausalConv1d(dim, dim_out, 3), _Transpose(), nn.LayerNorm(dim_out), _Transpose(), nn.Mish()
        )

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        # mask is always None here (no padding); the argument keeps ResnetBlock1D's call signature
        return self.block(x)


class CausalConditionalDecoder(ConditionalDecoder):
    def __init__(self, cfg: CausalConditionalDecoderConfig):
        super().__init__(cfg)
        self.static_chunk_size = cfg.static_chunk_size
        for level in (*self.down_blocks, *self.mid_blocks, *self.up_blocks):
            resnet = level[0]
            dim, dim_out = resnet.res_conv.in_channels, resnet.res_conv.out_channels
            resnet.block1 = CausalBlock1D(dim, dim_out)
            resnet.block2 = CausalBlock1D(dim_out, dim_out)
        for blocks in (self.down_blocks, self.up_blocks):
            ch = blocks[-1][2].out_channels
            blocks[-1][2] = CausalConv1d(ch, ch, 3)
        ch = self.final_block.block[0].in_channels
        self.final_block = CausalBlock1D(ch, ch)

    def _attend(self, blocks: nn.ModuleList, x: Tensor, streaming: bool) -> Tensor:
        # x: (B, C, T) -> (B, T, C) for the blocks and back
        mask = subsequent_chunk_mask(x.size(2), self.static_chunk_size, x.device) if streaming else None
        h = x.transpose(1, 2)
        for block in blocks:
            h = block(h, mask)
        return h.transpose(1, 2).contiguous()

    def forward(  # type: ignore[override]
        self, x: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, streaming: bool = False
    ) -> Tensor:
        """:meth:`forward_packed` of cat([x, mu, spks over time, cond]); x, mu, cond (B, 80, T), spks (B, S)."""
        spks = spks.unsqueeze(-1).expand(-1, -1, x.shape[-1])
        return self.forward_packed(torch.cat([x, mu, spks, cond], dim=1), t, streaming)

    def forward_packed(  # type: ignore[override]
        self, h: Tensor, t: Tensor, streaming: bool = False, should_stop: ShouldStop | None = None
    ) -> Tensor:
        """Predict the flow velocity.

        Args:
            h: (B, in_channels, T) = cat([x, mu, spks repeated over time, cond], dim=1).
            t: (B,) flow time in [0, 1].
            streaming: static chunk attention masks instead of full attention.
            should_stop: asked before each block (:class:`cosyserve.stop.Stopped` once it says True).
        Returns:
            (B, out_channels, T) velocity.
        """
        if streaming and self.static_chunk_size <= 0:
            streaming = False  # the reference's chunk mask of size 0 is full attention
        temb = self.time_mlp(self.time_embeddings(t).to(t.dtype))
        hiddens = []
        for resnet, blocks, downsample in self.down_blocks:
            check(should_stop)
            h = self._attend(blocks, resnet(h, None, temb), streaming)
            hiddens.append(h)
            h = downsample(h)
        for resnet, blocks in self.mid_blocks:
            check(should_stop)
            h = self._attend(blocks, resnet(h, None, temb), streaming)
        for resnet, blocks, upsample in self.up_blocks:
            check(should_stop)
            skip = hiddens.pop()
            h = torch.cat([h[:, :, : skip.shape[-1]], skip], dim=1)  # (B, 2C, T_level)
            h = upsample(self._attend(blocks, resnet(h, None, temb), streaming))
        return self.final_proj(self.final_block(h))
