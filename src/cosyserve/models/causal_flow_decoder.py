"""The CosyVoice2 flow-matching estimator: ``CausalConditionalDecoder``.

The 300M U-Net of :mod:`cosyserve.models.flow_decoder` with causal pieces swapped in, as the reference does:
every ``Block1D`` becomes a ``CausalBlock1D`` (left-padded kernel-3 conv, LayerNorm over channels instead of
GroupNorm, Mish), and the last down/up level's kernel-3 conv becomes a ``CausalConv1d``. The strided
``Downsample1D`` and transposed-conv ``Upsample1D`` of the inner levels are unchanged. When streaming, every
transformer stack attends through static chunk masks of ``static_chunk_size`` frames (all left chunks, at every
level); otherwise attention is full. Keys follow the official ``decoder.estimator.*`` names (``block.0`` conv,
``block.2`` LayerNorm).

With one level (every CosyVoice2 release: ``channels: [256]``) every convolution is causal, so a flow stream's
chunk runs its own frames against the kept frames' conv tails and attention keys
(:class:`~cosyserve.models.flow_stream.StepCache`); more levels add the strided ``Downsample1D``, which looks one
frame ahead, and such a decoder only runs whole sequences.

Inference inputs never contain padding (one utterance, or a batch of equal lengths), so there is no frame mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.core.stop import ShouldStop, check
from cosyserve.models.flow_decoder import ConditionalDecoder, ConditionalDecoderConfig, ResnetBlock1D
from cosyserve.models.flow_stream import StepState
from cosyserve.models.transformer import subsequent_chunk_mask

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

    def forward(self, x: Tensor, cache: StepState | None = None) -> Tensor:
        # a stream's kept frames before x are the left context (zeros at its start)
        n = self.causal_padding
        return super().forward(F.pad(x, (n, 0)) if cache is None else cache.left(x, n))


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

    def forward(self, x: Tensor, mask: Tensor | None = None, cache: StepState | None = None) -> Tensor:
        # mask is always None here (no padding); the argument keeps ResnetBlock1D's call signature
        conv, *rest = self.block
        x = conv(x, cache)
        for layer in rest:
            x = layer(x)
        return x


class CausalResnetBlock1D(ResnetBlock1D):
    """``ResnetBlock1D`` of two :class:`CausalBlock1D` (same keys), whose convs may take a stream's cache."""

    def __init__(self, dim: int, dim_out: int, time_emb_dim: int):
        super().__init__(dim, dim_out, time_emb_dim)
        self.block1 = CausalBlock1D(dim, dim_out)
        self.block2 = CausalBlock1D(dim_out, dim_out)

    def forward(self, x: Tensor, mask: Tensor | None, temb: Tensor, cache: StepState | None = None) -> Tensor:
        h = self.block1(x, None, cache) + self.mlp(temb).unsqueeze(-1)
        return self.block2(h, None, cache) + self.res_conv(x)


class CausalConditionalDecoder(ConditionalDecoder):
    def __init__(self, cfg: CausalConditionalDecoderConfig):
        super().__init__(cfg)
        self.static_chunk_size = cfg.static_chunk_size
        temb_dim = self.time_mlp.linear_2.out_features
        for level in (*self.down_blocks, *self.mid_blocks, *self.up_blocks):
            resnet = level[0]
            level[0] = CausalResnetBlock1D(
                resnet.res_conv.in_channels, resnet.res_conv.out_channels, temb_dim
            )
        for blocks in (self.down_blocks, self.up_blocks):
            ch = blocks[-1][2].out_channels
            blocks[-1][2] = CausalConv1d(ch, ch, 3)
        ch = self.final_block.block[0].in_channels
        self.final_block = CausalBlock1D(ch, ch)

    @property
    def streams(self) -> bool:
        """Whether a stream's chunks can keep their frames: one level (no strided conv) and chunk attention."""
        return len(self.down_blocks) == 1 and self.static_chunk_size > 0

    def _attend(
        self, blocks: nn.ModuleList, x: Tensor, mask: Callable[[int], Tensor | None], cache: StepState | None
    ) -> Tensor:
        # x: (B, C, T) -> (B, T, C) for the blocks and back; `mask` gives the attention mask of T frames
        mask_t = mask(x.size(2))
        h = x.transpose(1, 2)
        for block in blocks:
            h = block(h, mask_t, cache)
        return h.transpose(1, 2).contiguous()

    def forward(  # type: ignore[override]
        self, x: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, streaming: bool = False
    ) -> Tensor:
        """:meth:`forward_packed` of cat([x, mu, spks over time, cond]); x, mu, cond (B, 80, T), spks (B, S)."""
        spks = spks.unsqueeze(-1).expand(-1, -1, x.shape[-1])
        return self.forward_packed(torch.cat([x, mu, spks, cond], dim=1), t, streaming)

    def forward_packed(  # type: ignore[override]
        self,
        h: Tensor,
        t: Tensor,
        streaming: bool = False,
        should_stop: ShouldStop | None = None,
        cache: StepState | None = None,
    ) -> Tensor:
        """Predict the flow velocity.

        Args:
            h: (B, in_channels, T) = cat([x, mu, spks repeated over time, cond], dim=1).
            t: (B,) flow time in [0, 1].
            streaming: static chunk attention masks instead of full attention.
            should_stop: asked before each block (:class:`cosyserve.core.stop.Stopped` once it says True).
            cache: a stream's state at this Euler step (streaming, :attr:`streams` only): h holds the frames
                after the ones it keeps (a multiple of the attention chunk), which it adds as left context.
        Returns:
            (B, out_channels, T) velocity.
        """
        if streaming and self.static_chunk_size <= 0:
            streaming = False  # the reference's chunk mask of size 0 is full attention
        if cache is not None and not (streaming and self.streams):
            raise ValueError("a flow stream's chunk needs a one-level decoder with static chunk attention")
        # a stream's call starts at a chunk boundary, so the mask of its own frames is the same
        c = self.static_chunk_size
        return self._forward(
            h, t, lambda n: subsequent_chunk_mask(n, c, h.device) if streaming else None, should_stop, cache
        )

    def forward_masked(
        self,
        h: Tensor,
        t: Tensor,
        mask: Tensor | None,
        should_stop: ShouldStop | None = None,
        cache: StepState | None = None,
    ) -> Tensor:
        """:meth:`forward_packed` with the attention mask of the call's own frames given: ``mask`` (T, T) bool
        (True = attend; None: full attention), the kept frames of ``cache`` seen whole; a one-level decoder only
        (every level has the call's T frames). What the lite runtime's one estimator graph traces."""
        if len(self.down_blocks) != 1:
            raise ValueError("forward_masked needs a one-level decoder (every level the same frames)")
        return self._forward(h, t, lambda n: mask, should_stop, cache)

    def _forward(
        self,
        h: Tensor,
        t: Tensor,
        mask: Callable[[int], Tensor | None],
        should_stop: ShouldStop | None,
        cache: StepState | None,
    ) -> Tensor:
        temb = self.time_mlp(self.time_embeddings(t).to(t.dtype))
        hiddens = []
        for resnet, blocks, downsample in self.down_blocks:
            check(should_stop)
            h = self._attend(blocks, resnet(h, None, temb, cache), mask, cache)
            hiddens.append(h)
            h = downsample(h, cache) if isinstance(downsample, CausalConv1d) else downsample(h)
        for resnet, blocks in self.mid_blocks:
            check(should_stop)
            h = self._attend(blocks, resnet(h, None, temb, cache), mask, cache)
        for resnet, blocks, upsample in self.up_blocks:
            check(should_stop)
            skip = hiddens.pop()
            h = torch.cat([h[:, :, : skip.shape[-1]], skip], dim=1)  # (B, 2C, T_level)
            h = self._attend(blocks, resnet(h, None, temb, cache), mask, cache)
            h = upsample(h, cache) if isinstance(upsample, CausalConv1d) else upsample(h)
        return self.final_proj(self.final_block(h, None, cache))
