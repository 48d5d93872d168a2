"""CosyVoice2's speech-token LM: a Qwen2 decoder (our own code, no transformers) with CosyVoice2's embeddings.

Mirrors ``cosyvoice.llm.llm.Qwen2LM`` over ``transformers.Qwen2ForCausalLM``; attribute names are the official
``llm.pt`` keys (``llm.model.model.*`` for the Qwen2 stack, ``llm_embedding``, ``llm_decoder``,
``speech_embedding``). The Qwen2 stack: token embedding, N decoder layers (RMSNorm, grouped-query attention with
rotary positions and biased q/k/v projections, RMSNorm, SiLU-gated MLP), a final RMSNorm. The tied ``lm_head``
(text logits) is never used for speech and shares the embedding's tensor in the release: a load hook drops it,
so a bundle neither stores nor maps it a second time.

The LM's prompt: ``sos`` (``llm_embedding[0]``), the Qwen embeddings of prompt text + text, ``task_id``
(``llm_embedding[1]``), the speech embeddings of the prompt speech tokens; the speaker embedding is not used
(the reference takes it and ignores it). Decoding: ``llm_decoder`` on the last hidden state, log-softmax over
6561 speech tokens + 3 stop tokens; any stop token ends the utterance, and before ``min_len`` only the first stop
token (``eos``) is masked, as in the reference. The KV caches are preallocated and written in place, with the
same interface as the CosyVoice-300M LM (:mod:`cosyserve.models.llm`), so the runtime drives both alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.core.sampling import SamplingConfig, StopRules
from cosyserve.core.stop import ShouldStop, check
from cosyserve.models.llm import SpeechLM
from cosyserve.models.transformer import DecodeStep, KVCache, cache_dtype

__all__ = ["Qwen2Config", "Qwen2LM", "Qwen2LMConfig"]


@dataclass
class Qwen2Config:
    """The fields of ``CosyVoice-BlankEN/config.json`` the LM uses (others are ignored)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_hidden_layers: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"qwen hidden_size {self.hidden_size}, num_attention_heads {self.num_attention_heads} and "
                f"num_key_value_heads {self.num_key_value_heads} do not divide"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass
class Qwen2EncoderConfig:
    TARGET: ClassVar[str] = "cosyvoice.llm.llm.Qwen2Encoder"

    pretrain_path: str | None = None  # where the reference reads Qwen's own weights from; never read here


@dataclass
class Qwen2LMConfig:
    TARGET: ClassVar[str] = "cosyvoice.llm.llm.Qwen2LM"

    llm_input_size: int
    llm_output_size: int
    speech_token_size: int
    qwen: Qwen2Config
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    llm: Qwen2EncoderConfig = field(default_factory=Qwen2EncoderConfig)
    length_normalized_loss: bool = True
    lsm_weight: float = 0.0
    mix_ratio: list[int] = field(default_factory=lambda: [5, 15])
    spk_embed_dim: int = 192

    def __post_init__(self) -> None:
        if not self.llm_input_size == self.llm_output_size == self.qwen.hidden_size:
            raise ValueError(
                f"llm_input_size {self.llm_input_size} and llm_output_size {self.llm_output_size} must equal the "
                f"Qwen hidden_size {self.qwen.hidden_size}"
            )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # as transformers' Qwen2RMSNorm: the statistics in float32, scaled in the input's dtype
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        d = cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * d)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * d)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * d)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, cfg.hidden_size, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, step: DecodeStep) -> Tensor:
        # x: (B, T, C); cos/sin: (B, T, D) for the new positions
        assert self.kv_cache is not None, "call setup_caches() first"
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim)
        c, s = cos.unsqueeze(2), sin.unsqueeze(2)  # (B, T, 1, D)
        q = q * c + _rotate_half(q) * s
        k = k * c + _rotate_half(k) * s
        keys, values = self.kv_cache.update(step, k, v)  # (B, n_kv, kv_len, D)
        # grouped-query attention without copying the cache per step: query head h reads KV head h // groups, so
        # each KV head's group of query heads is stacked along the query axis, (B, n_kv, groups * T, D)
        groups = self.n_heads // self.n_kv
        q = (
            q.view(b, t, self.n_kv, groups, self.head_dim)
            .permute(0, 2, 3, 1, 4)
            .reshape(b, self.n_kv, -1, self.head_dim)
        )
        scores = torch.matmul(q.to(keys.dtype), keys.transpose(-2, -1)) / math.sqrt(self.head_dim)
        masked = step.masked.unsqueeze(2).expand(-1, -1, groups, -1, -1).reshape(b, 1, groups * t, -1)
        attn = scores.masked_fill(masked, -float("inf")).softmax(dim=-1)
        out = torch.matmul(attn, values).view(b, self.n_kv, groups, t, self.head_dim)
        return self.o_proj(out.permute(0, 3, 1, 2, 4).reshape(b, t, -1).to(x.dtype))


class MLP(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, step: DecodeStep) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, step)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    """The Qwen2 stack (``llm.model.model``) with static KV caches; the interface of the 300M LM's stack."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def _rotary(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        # transformers' default rope: inv_freq in float32, angles = pos * inv_freq, duplicated halves
        d = self.cfg.head_dim
        inv_freq = 1.0 / (
            self.cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=pos.device).float() / d)
        )
        freqs = pos.float().unsqueeze(-1) * inv_freq  # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = self.norm.weight.dtype
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def setup_caches(
        self, max_batch_size: int, max_seq_len: int, dtype: torch.dtype | None = None, device: Any = None
    ) -> None:
        """Allocate the KV caches (idempotent: keeps caches that are large enough and match)."""
        attn0: Attention = self.layers[0].self_attn
        device = torch.device(device) if device is not None else self.norm.weight.device
        dtype = dtype or cache_dtype(self.norm.weight.dtype, device)
        cache = attn0.kv_cache
        if cache is not None:
            b, _, s, _ = cache.k_cache.shape
            if b >= max_batch_size and s >= max_seq_len and cache.k_cache.dtype == dtype:
                return
        for layer in self.layers:
            attn: Attention = layer.self_attn
            attn.kv_cache = KVCache(max_batch_size, max_seq_len, attn.n_kv, attn.head_dim, dtype, device)

    def grow_caches(self, max_batch_size: int, max_seq_len: int) -> None:
        """As :meth:`setup_caches`, keeping what every row holds."""
        old = self.layers[0].self_attn.kv_cache
        if old is None:
            self.setup_caches(max_batch_size, max_seq_len)
            return
        b, _, s, _ = old.k_cache.shape
        if b >= max_batch_size and s >= max_seq_len:
            return
        saved = [layer.self_attn.kv_cache for layer in self.layers]
        for layer in self.layers:
            layer.self_attn.kv_cache = None
        self.setup_caches(max(b, max_batch_size), max(s, max_seq_len), old.k_cache.dtype, old.k_cache.device)
        for layer, kv in zip(self.layers, saved, strict=True):
            layer.self_attn.kv_cache.k_cache[:b, :, :s] = kv.k_cache
            layer.self_attn.kv_cache.v_cache[:b, :, :s] = kv.v_cache

    def release_caches(self) -> None:
        for layer in self.layers:
            layer.self_attn.kv_cache = None

    def max_seq_len(self) -> int:
        cache = self.layers[0].self_attn.kv_cache
        return 0 if cache is None else cache.k_cache.size(2)

    def forward_cached(
        self,
        xs: Tensor,
        input_pos: Tensor,
        kv_len: int,
        rows: Tensor | None = None,
        stop: ShouldStop | None = None,
    ) -> Tensor:
        """Run new inputs through the stack against the KV caches (causal).

        Args:
            xs: (B, T, hidden) new input embeddings; row b holds positions input_pos[b] .. input_pos[b]+T-1.
            input_pos: (B,) int64 start position per row.
            kv_len: host int >= max(input_pos) + T.
            rows: (B,) cache rows, or None for 0..B-1.
            stop: asked before each layer (:class:`cosyserve.core.stop.Stopped` once it says True): a long
                prompt's prefill ends within a layer of a stop.
        Returns:
            (B, T, hidden), after the final norm (the reference's ``hidden_states[-1]``).
        """
        if kv_len > self.max_seq_len():
            raise ValueError(f"kv_len={kv_len} exceeds the cache's max_seq_len={self.max_seq_len()}")
        t = xs.size(1)
        pos = input_pos.unsqueeze(1) + torch.arange(t, device=xs.device)  # (B, T)
        dist = pos.unsqueeze(2) - torch.arange(kv_len, device=xs.device)  # (B, T, kv_len)
        step = DecodeStep(pos, dist.clamp(min=0), (dist < 0).unsqueeze(1), kv_len, rows)
        cos, sin = self._rotary(pos)
        for layer in self.layers:
            check(stop)
            xs = layer(xs, cos, sin, step)
        return self.norm(xs)


class _CausalLM(nn.Module):
    # ``llm.model``: the Qwen2 stack under ``model``; the text head (``lm_head``) is dropped on load
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2Model(cfg)


class _Encoder(nn.Module):
    # ``llm``: the reference's Qwen2Encoder wrapper, kept for the key names
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.model = _CausalLM(cfg)


def _mix_ratio(cfg: Qwen2LMConfig) -> tuple[int, int]:
    ratio = tuple(cfg.mix_ratio)
    if len(ratio) != 2 or min(ratio) < 1:
        raise ValueError(f"llm mix_ratio={cfg.mix_ratio} must be two positive counts (text, speech)")
    return ratio  # type: ignore[return-value]


class Qwen2LM(SpeechLM):
    """CosyVoice2's LM; attribute names match the official ``llm.pt`` keys."""

    REPEATED_STACKS = ("llm.model.model.layers",)
    # the Qwen text vocabulary (151936 rows): a request reads a few rows of it, a preload leaves the rest unread
    ROW_TABLES = ("llm.model.model.embed_tokens.weight", "speech_embedding.weight")
    N_STOP = 3  # eos, and two more stop tokens (the "fill" tokens of training)
    # the text id a prompt must hold, after whose first occurrence a streamed-text prompt splits (CosyVoice3's
    # <|endofprompt|>); None: no such rule
    prompt_marker: ClassVar[int | None] = None

    def __init__(self, cfg: Qwen2LMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.sos, self.task_id = 0, 1
        self.eos_token = cfg.speech_token_size
        # streaming text input (bistream): the real end of speech and the token that asks for more text
        self.eos, self.fill_token = cfg.speech_token_size, cfg.speech_token_size + 2
        self.mix_ratio = _mix_ratio(cfg)
        self.llm_embedding = nn.Embedding(2, cfg.llm_input_size)
        self.llm = _Encoder(cfg.qwen)
        self.llm_decoder = nn.Linear(cfg.llm_output_size, cfg.speech_token_size + self.N_STOP)
        self.speech_embedding = nn.Embedding(cfg.speech_token_size + self.N_STOP, cfg.llm_input_size)
        self._register_load_state_dict_pre_hook(self._drop_text_head)

    @staticmethod
    def _drop_text_head(state_dict: dict, prefix: str, *args: object) -> None:
        state_dict.pop(prefix + "llm.model.lm_head.weight", None)

    @property
    def stack(self) -> Qwen2Model:
        return self.llm.model.model

    def _row(self, token: int) -> Tensor:
        # sos / task_id's embedding row (CosyVoice2: llm_embedding's)
        return self.llm_embedding.weight[token].reshape(1, 1, -1)

    @property
    def rules(self) -> StopRules:
        # streaming text input (the reference's bistream): the real end of speech, the token that asks for text
        return StopRules(
            self.llm_decoder.out_features, self.eos_token, self.eos, self.fill_token, self.mix_ratio,
            self.sos, self.task_id, self.prompt_marker,
        )  # fmt: skip

    def _embed_part(self, kind: str, ids: list[int]) -> Tensor:
        if kind == "text":
            return self.stack.embed_tokens(self._ids(ids)).to(self.speech_embedding.weight.dtype).unsqueeze(0)
        if kind == "special":
            return torch.cat([self._row(t) for t in ids], dim=1)
        return super()._embed_part(kind, ids)

    # --- input --------------------------------------------------------------------------------------------------

    def embed_inputs(
        self,
        text: Tensor,
        text_len: Tensor,
        prompt_text: Tensor,
        prompt_text_len: Tensor,
        prompt_speech_token: Tensor,
        prompt_speech_token_len: Tensor,
        embedding: Tensor,
    ) -> Tensor:
        """The LM's prompt (batch 1): sos, Qwen embeddings of prompt text + text, task_id, prompt speech.
        ``embedding`` (the speaker) is not used, as in the reference."""
        dtype = self.llm_embedding.weight.dtype
        text_emb = self.stack.embed_tokens(torch.cat([prompt_text, text], dim=1).to(torch.int64)).to(dtype)
        parts = [self.llm_embedding.weight[self.sos].reshape(1, 1, -1), text_emb]
        parts.append(self.llm_embedding.weight[self.task_id].reshape(1, 1, -1))
        if int(prompt_speech_token_len.reshape(-1)[0]) != 0:
            parts.append(self.speech_embedding(prompt_speech_token.to(torch.int64)))
        return torch.cat(parts, dim=1)

    def prefix_positions(self, model_input: Mapping[str, Any]) -> int:
        """sos and the prompt text (the text follows it, then task_id and the prompt speech), when there is one."""
        prompt_text = model_input.get("prompt_text")
        p = 0 if prompt_text is None else int(prompt_text.shape[1])
        return 1 + p if p else 0

    def _first_cache(self) -> Any:
        return self.stack.layers[0].self_attn.kv_cache
