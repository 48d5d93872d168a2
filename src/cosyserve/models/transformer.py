"""Transformer and Conformer encoder stacks shared by the CosyVoice-300M LLM and flow models (inference only).

Module and attribute names follow the official checkpoints (``embed.out.0``, ``encoders.N.self_attn.linear_q``,
``pos_bias_u``, ``feed_forward.w_1``, ``norm_mha``/``norm_ff`` or ``norm1``/``norm2``, ``after_norm``), so an
official state dict loads with ``strict=True``. Dropout is omitted: these modules are for inference only.

Attention uses ESPnet-style relative positions: ``scores = ((q + u) k^T + (q + v) p^T) / sqrt(d_k)`` where ``p`` is
``linear_pos`` of a sinusoidal table indexed by the relative distance ``i - j``. Two paths compute it:

- ``forward``: the whole sequence at once (masks as the reference's ``BaseEncoder.forward``).
- ``forward_cached``: new tokens against a preallocated per-layer KV cache written in place by index, with every
  batch row its own sequence at its own position. ``linear_pos`` of the non-negative distances is computed once per
  distance and kept, instead of re-projecting ``2L - 1`` rows every step as the reference's ``forward_chunk`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor, nn

from cosyserve.core.stop import ShouldStop, check
from cosyserve.models.attention import (
    DecodeStep,
    EspnetRelPositionalEncoding,
    KVCache,
    LegacyLinearNoSubsampling,
    LinearNoSubsampling,
    RelPositionMultiHeadedAttention,
    cache_dtype,
    subsequent_chunk_mask,
)

if TYPE_CHECKING:
    from cosyserve.models.flow_stream import StepCache

__all__ = [
    "ConformerEncoder",
    "ConformerEncoderConfig",
    "ConformerEncoderLayer",
    "DecodeStep",
    "EspnetRelPositionalEncoding",
    "KVCache",
    "LegacyLinearNoSubsampling",
    "LinearNoSubsampling",
    "PositionwiseFeedForward",
    "RelPositionMultiHeadedAttention",
    "TransformerEncoder",
    "TransformerEncoderConfig",
    "TransformerEncoderLayer",
    "subsequent_chunk_mask",
]

_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "hardtanh": nn.Hardtanh,
    "tanh": nn.Tanh,
    "relu": nn.ReLU,
    "selu": nn.SELU,
    "swish": nn.SiLU,
    "gelu": nn.GELU,
}

# Distances of linear_pos(pe) are projected in blocks of this many rows as decoding reaches them.
_POS_PROJ_BLOCK = 128


@dataclass
class TransformerEncoderConfig:
    TARGET: ClassVar[str] = "cosyvoice.transformer.encoder.TransformerEncoder"

    input_size: int
    output_size: int = 256
    attention_heads: int = 4
    linear_units: int = 2048
    num_blocks: int = 6
    dropout_rate: float = 0.1
    positional_dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.0
    input_layer: str = "conv2d"
    pos_enc_layer_type: str = "abs_pos"
    normalize_before: bool = True
    static_chunk_size: int = 0
    use_dynamic_chunk: bool = False
    global_cmvn: None = None
    use_dynamic_left_chunk: bool = False
    key_bias: bool = True
    selfattention_layer_type: str = "selfattn"
    activation_type: str = "relu"
    gradient_checkpointing: bool = False


@dataclass
class ConformerEncoderConfig:
    TARGET: ClassVar[str] = "cosyvoice.transformer.encoder.ConformerEncoder"

    input_size: int
    output_size: int = 256
    attention_heads: int = 4
    linear_units: int = 2048
    num_blocks: int = 6
    dropout_rate: float = 0.1
    positional_dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.0
    input_layer: str = "conv2d"
    pos_enc_layer_type: str = "rel_pos"
    normalize_before: bool = True
    static_chunk_size: int = 0
    use_dynamic_chunk: bool = False
    global_cmvn: None = None
    use_dynamic_left_chunk: bool = False
    positionwise_conv_kernel_size: int = 1
    macaron_style: bool = True
    selfattention_layer_type: str = "rel_selfattn"
    activation_type: str = "swish"
    use_cnn_module: bool = True
    cnn_module_kernel: int = 15
    causal: bool = False
    cnn_module_norm: str = "batch_norm"
    key_bias: bool = True
    gradient_checkpointing: bool = False


def _verify_common(cfg: TransformerEncoderConfig | ConformerEncoderConfig) -> None:
    name = type(cfg).__name__
    if cfg.input_layer not in ("linear", "linear_legacy"):
        raise ValueError(
            f"{name}.input_layer={cfg.input_layer!r} is not supported; cosyserve implements 'linear' and "
            "'linear_legacy' (what CosyVoice-300M uses)"
        )
    if cfg.pos_enc_layer_type != "rel_pos_espnet":
        raise ValueError(
            f"{name}.pos_enc_layer_type={cfg.pos_enc_layer_type!r} is not supported; cosyserve implements "
            "'rel_pos_espnet' only (what CosyVoice-300M uses)"
        )
    if cfg.selfattention_layer_type != "rel_selfattn":
        raise ValueError(
            f"{name}.selfattention_layer_type={cfg.selfattention_layer_type!r} is not supported; cosyserve "
            "implements 'rel_selfattn' only (what CosyVoice-300M uses)"
        )
    if cfg.activation_type not in _ACTIVATIONS:
        raise ValueError(
            f"{name}.activation_type={cfg.activation_type!r}; expected one of {sorted(_ACTIVATIONS)}"
        )
    if cfg.global_cmvn is not None:
        raise ValueError(f"{name}.global_cmvn must be None; cosyserve does not implement GlobalCMVN")
    if cfg.output_size % cfg.attention_heads != 0:
        raise ValueError(
            f"{name}.output_size={cfg.output_size} is not divisible by attention_heads={cfg.attention_heads}"
        )


class PositionwiseFeedForward(nn.Module):
    def __init__(self, idim: int, hidden_units: int, activation: nn.Module) -> None:
        super().__init__()
        self.w_1 = nn.Linear(idim, hidden_units)
        self.activation = activation
        self.w_2 = nn.Linear(hidden_units, idim)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(self.activation(self.w_1(x)))


class _EncoderLayer(nn.Module):
    # Pre-norm (or post-norm) residual attention then feed-forward; subclasses name the two norms.
    norm_attn: nn.LayerNorm
    norm_ffn: nn.LayerNorm

    def __init__(
        self, self_attn: RelPositionMultiHeadedAttention, feed_forward: nn.Module, normalize_before: bool
    ):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.normalize_before = normalize_before

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None,
        pos_emb: Tensor | None,
        step: DecodeStep | None = None,
        cache: StepCache | None = None,
    ) -> Tensor:
        residual = x
        if self.normalize_before:
            x = self.norm_attn(x)
        if step is None:
            assert mask is not None and pos_emb is not None
            x = self.self_attn(x, mask, pos_emb, cache)
        else:
            x = self.self_attn.forward_cached(x, step)
        x = residual + x
        if not self.normalize_before:
            x = self.norm_attn(x)
        residual = x
        if self.normalize_before:
            x = self.norm_ffn(x)
        x = residual + self.feed_forward(x)
        if not self.normalize_before:
            x = self.norm_ffn(x)
        return x


class TransformerEncoderLayer(_EncoderLayer):
    def __init__(self, size: int, self_attn, feed_forward, normalize_before: bool = True) -> None:
        super().__init__(self_attn, feed_forward, normalize_before)
        self.norm1 = nn.LayerNorm(size, eps=1e-12)
        self.norm2 = nn.LayerNorm(size, eps=1e-12)

    @property
    def norm_attn(self) -> nn.LayerNorm:  # type: ignore[override]
        return self.norm1

    @property
    def norm_ffn(self) -> nn.LayerNorm:  # type: ignore[override]
        return self.norm2


class ConformerEncoderLayer(_EncoderLayer):
    """Conformer layer without macaron feed-forward and without the convolution module (CosyVoice-300M)."""

    def __init__(self, size: int, self_attn, feed_forward, normalize_before: bool = True) -> None:
        super().__init__(self_attn, feed_forward, normalize_before)
        self.norm_ff = nn.LayerNorm(size, eps=1e-12)
        self.norm_mha = nn.LayerNorm(size, eps=1e-12)

    @property
    def norm_attn(self) -> nn.LayerNorm:  # type: ignore[override]
        return self.norm_mha

    @property
    def norm_ffn(self) -> nn.LayerNorm:  # type: ignore[override]
        return self.norm_ff


class _BaseEncoder(nn.Module):
    encoders: nn.ModuleList

    def __init__(self, cfg: TransformerEncoderConfig | ConformerEncoderConfig) -> None:
        super().__init__()
        _verify_common(cfg)
        self.cfg = cfg
        pos_enc = EspnetRelPositionalEncoding(cfg.output_size, cfg.positional_dropout_rate)
        embed_cls = LinearNoSubsampling if cfg.input_layer == "linear" else LegacyLinearNoSubsampling
        self.embed = embed_cls(cfg.input_size, cfg.output_size, pos_enc)
        self.after_norm = nn.LayerNorm(cfg.output_size, eps=1e-5)
        self._pos_proj_rows = 0  # rows of each layer's pos_proj already projected
        self.register_load_state_dict_post_hook(_invalidate_pos_proj)

    def output_size(self) -> int:
        return self.cfg.output_size

    def _chunk_masks(self, masks: Tensor, decoding_chunk_size: int) -> Tensor:
        # The reference's add_optional_chunk_mask in eval; num_decoding_left_chunks is ignored by its mask too.
        t = masks.size(-1)
        if self.cfg.use_dynamic_chunk:
            if decoding_chunk_size == 0:
                raise ValueError(
                    "use_dynamic_chunk with decoding_chunk_size=0 draws a random chunk size (training only); "
                    "pass decoding_chunk_size < 0 (full context) or > 0"
                )
            chunk = t if decoding_chunk_size < 0 else decoding_chunk_size
            chunk_masks = masks & subsequent_chunk_mask(t, chunk, masks.device).unsqueeze(0)  # (B, T, T)
        elif self.cfg.static_chunk_size > 0:
            chunk_masks = masks & subsequent_chunk_mask(
                t, self.cfg.static_chunk_size, masks.device
            ).unsqueeze(0)
        else:
            chunk_masks = masks  # (B, 1, T)
        # A query that sees nothing would give NaN; the reference lets such rows see everything.
        return chunk_masks | ~chunk_masks.any(dim=-1, keepdim=True)

    def forward(
        self, xs: Tensor, xs_lens: Tensor, decoding_chunk_size: int = 0, num_decoding_left_chunks: int = -1
    ) -> tuple[Tensor, Tensor]:
        """Encode a padded batch.

        Args:
            xs: (B, T, input_size) padded input.
            xs_lens: (B,) valid lengths.
            decoding_chunk_size: only used with ``use_dynamic_chunk`` (<0 full context, >0 that chunk size).
            num_decoding_left_chunks: accepted for API parity; the reference's chunk mask ignores it.
        Returns:
            (B, T, output_size) encoded frames (padded frames hold unspecified values) and the (B, 1, T) bool
            mask of valid frames.
        """
        t = xs.size(1)
        masks = (torch.arange(t, device=xs.device).unsqueeze(0) < xs_lens.unsqueeze(1)).unsqueeze(
            1
        )  # (B, 1, T)
        xs, pos_emb = self.embed(xs)
        chunk_masks = self._chunk_masks(masks, decoding_chunk_size)
        for layer in self.encoders:
            xs = layer(xs, chunk_masks, pos_emb)
        if self.cfg.normalize_before:
            xs = self.after_norm(xs)
        return xs, masks

    # --- incremental decoding ---------------------------------------------------------------------------------

    def setup_caches(
        self,
        max_batch_size: int,
        max_seq_len: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """Allocate the KV caches (idempotent: keeps existing caches that are large enough and match).

        Args:
            max_batch_size: cache rows; each row is an independent sequence.
            max_seq_len: positions per row.
            dtype, device: default to the attention weights'.
        """
        attn0: RelPositionMultiHeadedAttention = self.encoders[0].self_attn
        # pos_bias_u: the attention's float dtype and device, whether its linears are float or int8
        device = torch.device(device) if device is not None else attn0.pos_bias_u.device
        dtype = dtype or cache_dtype(attn0.pos_bias_u.dtype, device)
        cache = attn0.kv_cache
        if cache is not None:
            b, _, s, _ = cache.k_cache.shape
            if (
                b >= max_batch_size
                and s >= max_seq_len
                and cache.k_cache.dtype == dtype
                and cache.k_cache.device == device
            ):
                return
            max_batch_size, max_seq_len = max(b, max_batch_size), max(s, max_seq_len)
        for layer in self.encoders:
            attn: RelPositionMultiHeadedAttention = layer.self_attn
            attn.kv_cache = KVCache(max_batch_size, max_seq_len, attn.h, attn.d_k, dtype, device)
            attn.pos_proj = torch.zeros(attn.h, max_seq_len, attn.d_k, dtype=dtype, device=device)
        self._pos_proj_rows = 0

    def release_caches(self) -> None:
        """Drop the KV caches and projected distances of every layer (the next decode sets them up again)."""
        for layer in self.encoders:
            layer.self_attn.kv_cache = None
            layer.self_attn.pos_proj = None
        self._pos_proj_rows = 0

    def grow_caches(self, max_batch_size: int, max_seq_len: int) -> None:
        """As :meth:`setup_caches`, but caches that must grow keep what they hold (every row's keys/values and
        the projected distances), so sequences being decoded in other rows continue undisturbed."""
        attn0: RelPositionMultiHeadedAttention = self.encoders[0].self_attn
        old = attn0.kv_cache
        if old is None:
            self.setup_caches(max_batch_size, max_seq_len)
            return
        b, _, s, _ = old.k_cache.shape
        if b >= max_batch_size and s >= max_seq_len:
            return
        kept = self._pos_proj_rows
        saved = [(layer.self_attn.kv_cache, layer.self_attn.pos_proj) for layer in self.encoders]
        self.setup_caches(max_batch_size, max_seq_len, old.k_cache.dtype, old.k_cache.device)
        for layer, (kv, proj) in zip(self.encoders, saved, strict=True):
            attn: RelPositionMultiHeadedAttention = layer.self_attn
            assert attn.kv_cache is not None and attn.pos_proj is not None
            attn.kv_cache.k_cache[:b, :, :s] = kv.k_cache  # (B, H, S, D)
            attn.kv_cache.v_cache[:b, :, :s] = kv.v_cache
            attn.pos_proj[:, :s] = proj  # (H, S, D)
        self._pos_proj_rows = kept

    def max_seq_len(self) -> int:
        """Positions per cache row (0 when no cache is set up)."""
        cache = self.encoders[0].self_attn.kv_cache
        return 0 if cache is None else cache.k_cache.size(2)

    def _ensure_pos_proj(self, n: int) -> None:
        # linear_pos(pe[distance]) for distances [0, n): weight-only, so computed once and reused by every step.
        if n <= self._pos_proj_rows:
            return
        attn0: RelPositionMultiHeadedAttention = self.encoders[0].self_attn
        assert attn0.pos_proj is not None, "call setup_caches() first"
        cap = attn0.pos_proj.size(1)
        start = self._pos_proj_rows
        stop = min(cap, -(-n // _POS_PROJ_BLOCK) * _POS_PROJ_BLOCK)
        pe = self.embed.pos_enc.distances(start, stop, attn0.linear_pos.weight)  # (stop-start, C)
        for layer in self.encoders:
            attn: RelPositionMultiHeadedAttention = layer.self_attn
            p = attn.linear_pos(pe).view(stop - start, attn.h, attn.d_k).transpose(0, 1)  # (H, rows, D)
            attn.pos_proj[:, start:stop] = p
        self._pos_proj_rows = stop

    def forward_cached(
        self,
        xs: Tensor,
        input_pos: Tensor,
        kv_len: int,
        rows: Tensor | None = None,
        stop: ShouldStop | None = None,
    ) -> Tensor:
        """Run new tokens through the stack against the KV caches (causal within and across steps).

        Args:
            xs: (B, T, input_size) new inputs; row b holds positions input_pos[b] .. input_pos[b]+T-1.
            input_pos: (B,) int64 start position per row (rows may be at different positions).
            kv_len: host int >= max(input_pos) + T: how many cache positions the step reads.
            rows: (B,) cache rows to use, or None for rows 0..B-1.
            stop: asked before each layer (:class:`cosyserve.core.stop.Stopped` once it says True): a long
                prompt's prefill ends within a layer of a stop.
        Returns:
            (B, T, output_size) outputs, after ``after_norm``.
        """
        if kv_len > self.max_seq_len():
            raise ValueError(f"kv_len={kv_len} exceeds the cache's max_seq_len={self.max_seq_len()}")
        t = xs.size(1)
        pos = input_pos.unsqueeze(1) + torch.arange(t, device=xs.device)  # (B, T)
        dist = pos.unsqueeze(2) - torch.arange(kv_len, device=xs.device)  # (B, T, kv_len)
        step = DecodeStep(pos, dist.clamp(min=0), (dist < 0).unsqueeze(1), kv_len, rows)
        self._ensure_pos_proj(kv_len)
        xs, _ = self.embed(xs)
        for layer in self.encoders:
            check(stop)
            xs = layer(xs, None, None, step)
        if self.cfg.normalize_before:
            xs = self.after_norm(xs)
        return xs

    def _apply(self, fn, recurse: bool = True):
        # .to()/.half()/... change linear_pos: the projected distances must be recomputed.
        self._pos_proj_rows = 0
        return super()._apply(fn, recurse)


def _invalidate_pos_proj(module: _BaseEncoder, incompatible_keys) -> None:
    module._pos_proj_rows = 0


class TransformerEncoder(_BaseEncoder):
    """Reference ``cosyvoice.transformer.encoder.TransformerEncoder`` (rel_pos_espnet, rel_selfattn)."""

    def __init__(self, cfg: TransformerEncoderConfig) -> None:
        super().__init__(cfg)
        self.encoders = nn.ModuleList(
            TransformerEncoderLayer(
                cfg.output_size,
                RelPositionMultiHeadedAttention(cfg.attention_heads, cfg.output_size, cfg.key_bias),
                PositionwiseFeedForward(
                    cfg.output_size, cfg.linear_units, _ACTIVATIONS[cfg.activation_type]()
                ),
                cfg.normalize_before,
            )
            for _ in range(cfg.num_blocks)
        )


class ConformerEncoder(_BaseEncoder):
    """Reference ``cosyvoice.transformer.encoder.ConformerEncoder`` without macaron FFN and conv module."""

    def __init__(self, cfg: ConformerEncoderConfig) -> None:
        if cfg.use_cnn_module:
            raise ValueError(
                "ConformerEncoderConfig.use_cnn_module=True is not supported: cosyserve implements the conformer "
                "without the convolution module (CosyVoice-300M sets use_cnn_module: False)"
            )
        if cfg.macaron_style:
            raise ValueError(
                "ConformerEncoderConfig.macaron_style=True is not supported: cosyserve implements the conformer "
                "without the macaron feed-forward (CosyVoice-300M sets macaron_style: False)"
            )
        if cfg.positionwise_conv_kernel_size != 1:
            raise ValueError("ConformerEncoderConfig.positionwise_conv_kernel_size must be 1 (a Linear FFN)")
        super().__init__(cfg)
        self.encoders = nn.ModuleList(
            ConformerEncoderLayer(
                cfg.output_size,
                RelPositionMultiHeadedAttention(cfg.attention_heads, cfg.output_size, cfg.key_bias),
                PositionwiseFeedForward(
                    cfg.output_size, cfg.linear_units, _ACTIVATIONS[cfg.activation_type]()
                ),
                cfg.normalize_before,
            )
            for _ in range(cfg.num_blocks)
        )
