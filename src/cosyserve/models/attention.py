"""ESPnet-style relative-position attention, as the CosyVoice encoders use it (inference only): the sinusoidal table
of relative distances and the input layers that scale by it, the attention, its masks, and the preallocated KV cache
its decode steps write in place.

``scores = ((q + u) k^T + (q + v) p^T) / sqrt(d_k)`` where ``p`` is ``linear_pos`` of the table indexed by the
relative distance ``i - j``. The encoder stacks that hold these are :mod:`cosyserve.models.transformer`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from cosyserve.models.flow_stream import StepCache

__all__ = [
    "DecodeStep",
    "EspnetRelPositionalEncoding",
    "KVCache",
    "LegacyLinearNoSubsampling",
    "LinearNoSubsampling",
    "RelPositionMultiHeadedAttention",
    "cache_dtype",
    "subsequent_chunk_mask",
]


def _espnet_rel_pe(d_model: int, length: int) -> Tensor:
    # Rows are relative distances length-1, ..., 1, 0, -1, ..., -(length-1) (the reference's `pe` layout).
    # Always computed on CPU in float32 like the reference, so values do not depend on the device's sin/cos.
    position = torch.arange(0, length, dtype=torch.float32).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
    pe_positive = torch.zeros(length, d_model)
    pe_negative = torch.zeros(length, d_model)
    pe_positive[:, 0::2] = torch.sin(position * div_term)
    pe_positive[:, 1::2] = torch.cos(position * div_term)
    pe_negative[:, 0::2] = torch.sin(-1 * position * div_term)
    pe_negative[:, 1::2] = torch.cos(-1 * position * div_term)
    return torch.cat([torch.flip(pe_positive, [0]), pe_negative[1:]], dim=0)  # (2*length-1, d_model)


class EspnetRelPositionalEncoding(nn.Module):
    """Scales the input by sqrt(d_model) and gives the relative position table (ESPnet ``rel_pos_espnet``)."""

    def __init__(self, d_model: int, dropout_rate: float = 0.0, max_len: int = 512) -> None:
        super().__init__()
        self.d_model = d_model
        self.xscale = math.sqrt(d_model)
        self._min_len = max_len
        self._pe_f32: Tensor | None = None  # grown on demand; derived data, never a checkpoint key
        self._pe: Tensor | None = None  # _pe_f32 in the dtype/device last asked for

    def _table(self, length: int, like: Tensor) -> Tensor:
        if self._pe_f32 is None or self._pe_f32.size(0) < 2 * length - 1:
            have = 0 if self._pe_f32 is None else (self._pe_f32.size(0) + 1) // 2
            self._pe_f32 = _espnet_rel_pe(self.d_model, max(length, 2 * have, self._min_len))
            self._pe = None
        pe = self._pe
        if (
            pe is None
            or pe.dtype != like.dtype
            or pe.device != like.device
            or pe.size(0) != self._pe_f32.size(0)
        ):
            pe = self._pe = self._pe_f32.to(device=like.device, dtype=like.dtype)
        return pe

    def position_encoding(self, offset: int, size: int, like: Tensor) -> Tensor:
        """Relative table for ``size`` keys after ``offset``: (1, 2*(size+offset)-1, d_model), distances descending."""
        pe = self._table(size + offset, like)
        center = pe.size(0) // 2
        return pe[center - size - offset + 1 : center + size + offset].unsqueeze(0)

    def distances(self, start: int, stop: int, like: Tensor) -> Tensor:
        """Rows of the table for distances ``start, ..., stop-1`` (ascending, non-negative): (stop-start, d_model)."""
        pe = self._table(stop, like)
        center = pe.size(0) // 2
        return torch.flip(pe[center - stop + 1 : center - start + 1], [0])

    def forward(self, x: Tensor, offset: int = 0) -> tuple[Tensor, Tensor]:
        return x * self.xscale, self.position_encoding(offset, x.size(1), x)


class LinearNoSubsampling(nn.Module):
    """``input_layer: linear``: Linear, LayerNorm(eps 1e-5), (dropout), then the positional encoding's scaling."""

    def __init__(self, idim: int, odim: int, pos_enc: EspnetRelPositionalEncoding) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5))
        self.pos_enc = pos_enc

    def forward(self, x: Tensor, offset: int = 0) -> tuple[Tensor, Tensor]:
        return self.pos_enc(self.out(x), offset)


class LegacyLinearNoSubsampling(LinearNoSubsampling):
    """``input_layer: linear_legacy``: Linear, LayerNorm(eps 1e-5), (dropout), ReLU, then positional scaling."""

    def __init__(self, idim: int, odim: int, pos_enc: EspnetRelPositionalEncoding) -> None:
        super().__init__(idim, odim, pos_enc)
        # Index 2 is the reference's (parameterless) Dropout; keeping the slot keeps the Sequential's layout.
        self.out = nn.Sequential(
            nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5), nn.Identity(), nn.ReLU()
        )


def subsequent_chunk_mask(size: int, chunk_size: int, device: torch.device | None = None) -> Tensor:
    """(size, size) bool: position i sees every position in its own chunk and all earlier chunks.

    The reference's ONNX-friendly version ignores ``num_left_chunks``; so does this one.
    """
    pos_idx = torch.arange(size, device=device)
    block_end = (torch.div(pos_idx, chunk_size, rounding_mode="trunc") + 1) * chunk_size
    return pos_idx.unsqueeze(0) < block_end.unsqueeze(1)


class DecodeStep(NamedTuple):
    """Per-step indices for ``forward_cached``, computed once and shared by all layers.

    pos: (B, T) absolute position of each new token; rel: (B, T, kv_len) distance ``pos - j`` clamped to >= 0;
    masked: (B, 1, T, kv_len) True where key j is after the query (j > pos); kv_len: keys attended (host int);
    rows: (B,) cache rows the batch rows use, or None for rows 0..B-1.
    """

    pos: Tensor
    rel: Tensor
    masked: Tensor
    kv_len: int
    rows: Tensor | None


def cache_dtype(weight_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the KV caches (and so of cached attention) for weights of ``weight_dtype`` on ``device``.

    On the CPU, half-precision weights still attend in float32: a bf16 batched matmul goes through oneDNN, which
    builds and keeps a kernel for every new key length, i.e. every decode step (memory that grows with every
    token, by hundreds of MB over one request), and is no faster than float32 on a CPU without AMX. The caches
    hold ~114 KB per position in float32 at CosyVoice-300M's size."""
    if device.type == "cpu" and weight_dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return weight_dtype


class KVCache(nn.Module):
    """Static per-layer key/value cache (max_batch_size, heads, max_seq_len, head_dim), written in place by index."""

    def __init__(
        self, max_batch_size: int, max_seq_len: int, n_heads: int, head_dim: int, dtype: torch.dtype, device
    ) -> None:
        super().__init__()
        shape = (max_batch_size, n_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, step: DecodeStep, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # k, v: (B, T, H, D) for positions step.pos (B, T); returns keys/values (B, H, kv_len, D)
        b = k.size(0)
        rows = step.rows if step.rows is not None else torch.arange(b, device=k.device)
        self.k_cache[rows.unsqueeze(1), :, step.pos] = k.to(self.k_cache.dtype)
        self.v_cache[rows.unsqueeze(1), :, step.pos] = v.to(self.v_cache.dtype)
        if step.rows is None:
            return self.k_cache[:b, :, : step.kv_len], self.v_cache[:b, :, : step.kv_len]
        return self.k_cache[step.rows, :, : step.kv_len], self.v_cache[step.rows, :, : step.kv_len]


class RelPositionMultiHeadedAttention(nn.Module):
    """Multi-head self-attention with ESPnet relative positions (reference ``RelPositionMultiHeadedAttention``)."""

    def __init__(self, n_head: int, n_feat: int, key_bias: bool = True) -> None:
        super().__init__()
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat, bias=key_bias)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(self.h, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(self.h, self.d_k))
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)
        self.kv_cache: KVCache | None = None
        # linear_pos(pe) for distances 0..max_seq_len-1, (H, max_seq_len, d_k); rows filled by the encoder as needed
        self.pos_proj: Tensor | None
        self.register_buffer("pos_proj", None, persistent=False)

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, t, _ = x.shape
        q = self.linear_q(x).view(b, t, self.h, self.d_k)  # (B, T, H, D)
        k = self.linear_k(x).view(b, t, self.h, self.d_k)
        v = self.linear_v(x).view(b, t, self.h, self.d_k)
        return q, k, v

    def _out(self, scores: Tensor, v: Tensor) -> Tensor:
        attn = torch.softmax(scores, dim=-1)
        x = torch.matmul(attn, v)  # (B, H, T, D)
        b, _, t, _ = x.shape
        # pos_bias_u: the float dtype, also when the linears are int8
        x = x.transpose(1, 2).reshape(b, t, self.h * self.d_k).to(self.pos_bias_u.dtype)
        return self.linear_out(x)

    def forward(self, x: Tensor, mask: Tensor, pos_emb: Tensor, cache: StepCache | None = None) -> Tensor:
        """x: (B, T, C); mask: (B, 1 or T, T) bool, True = attend; pos_emb: (1, 2T-1, C) -> (B, T, C).

        With a flow stream's ``cache`` (:class:`~cosyserve.models.flow_stream.StepCache`) x holds the frames after
        the S it keeps, whose keys and values come first: mask (B, T, S + T), pos_emb (1, 2(S + T) - 1, C)."""
        q, k, v = self._qkv(x)
        if cache is not None:
            k, v = cache.extend(k, v, dim=1)
        p = (
            self.linear_pos(pos_emb).view(pos_emb.size(0), -1, self.h, self.d_k).transpose(1, 2)
        )  # (1, H, 2T-1, D)
        q_u = (q + self.pos_bias_u).transpose(1, 2)  # (B, H, T, D)
        q_v = (q + self.pos_bias_v).transpose(1, 2)
        ac = torch.matmul(q_u, k.transpose(1, 2).transpose(-2, -1))  # (B, H, T, T)
        bd = torch.matmul(q_v, p.transpose(-2, -1))  # (B, H, T, 2T-1)
        if bd.shape != ac.shape:
            bd = _rel_shift(bd)
        scores = (ac + bd) / math.sqrt(self.d_k)
        scores = scores.masked_fill(~mask.unsqueeze(1), -float("inf"))
        return self._out(scores, v.transpose(1, 2))

    def forward_cached(self, x: Tensor, step: DecodeStep) -> Tensor:
        """x: (B, T, C) new tokens at positions step.pos, attending to the cache -> (B, T, C)."""
        assert self.kv_cache is not None and self.pos_proj is not None, "call setup_caches() first"
        q, k, v = self._qkv(x)
        keys, values = self.kv_cache.update(step, k, v)  # (B, H, kv_len, D)
        q_u = (q + self.pos_bias_u).transpose(1, 2).to(keys.dtype)  # (B, H, T, D)
        q_v = (q + self.pos_bias_v).transpose(1, 2).to(keys.dtype)
        ac = torch.matmul(q_u, keys.transpose(-2, -1))  # (B, H, T, kv_len)
        by_dist = torch.matmul(q_v, self.pos_proj[:, : step.kv_len].transpose(-2, -1))  # (B, H, T, distance)
        b, h, t, n = by_dist.shape
        bd = by_dist.gather(-1, step.rel.unsqueeze(1).expand(b, h, t, n))  # (B, H, T, kv_len)
        scores = ((ac + bd) / math.sqrt(self.d_k)).masked_fill(step.masked, -float("inf"))
        return self._out(scores, values)


def _rel_shift(x: Tensor) -> Tensor:
    # x: (B, H, T1, 2*T2-1) scores against distances T2-1 ... -(T2-1), queries being the last T1 of T2 positions.
    # Returns (B, H, T1, T2) with [i, j] = x[i, distance (T2-T1+i) - j]: the Transformer-XL pad-and-reshape trick.
    b, h, t1, n = x.shape
    x = F.pad(x, (1, 0)).view(b, h, n + 1, t1)[:, :, 1:]
    return x.reshape(b, h, t1, n)[..., : n // 2 + 1]
