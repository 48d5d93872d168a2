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
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.device import module_device
from cosyserve.models.llm import SamplingConfig, SpeechLM, ras_sample
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
        self, xs: Tensor, input_pos: Tensor, kv_len: int, rows: Tensor | None = None
    ) -> Tensor:
        """Run new inputs through the stack against the KV caches (causal).

        Args:
            xs: (B, T, hidden) new input embeddings; row b holds positions input_pos[b] .. input_pos[b]+T-1.
            input_pos: (B,) int64 start position per row.
            kv_len: host int >= max(input_pos) + T.
            rows: (B,) cache rows, or None for 0..B-1.
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


# A sampling function for the bistream decode: (log-probabilities (1, V), tokens so far, whether the step may not
# end the utterance) -> the next id (the reference's sampling_ids)
Sampler = Callable[[Tensor, list[int], bool], int]


class _Limit(Exception):
    # max_tokens reached inside bistream: ends the generator quietly
    pass


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
    STREAMS_TEXT: bool = True  # takes text as it arrives (inference_bistream)

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

    def _prompt_head(self, prompt_ids: list[int]) -> int:
        # how many prompt text ids start the bistream LM input with sos (CosyVoice2: none)
        return 0

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

    def _first_cache(self) -> Any:
        return self.stack.layers[0].self_attn.kv_cache

    # --- entry points -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def warm_up(self, n_tokens: int = 2) -> list[int]:
        """Generate ``n_tokens`` tokens for four dummy text ids through one layer (every kernel the LM runs);
        the caches are released after. Not while the LM serves requests."""
        from cosyserve.models import one_layer_per_stack

        text = torch.arange(1, 5, dtype=torch.int32).unsqueeze(0)
        empty, zero = torch.zeros(1, 0, dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
        ratio = max(n_tokens, 1) / text.shape[1]  # min = max: n_tokens unless a non-eos stop token is drawn
        trimmed = one_layer_per_stack(self)
        try:
            return list(
                trimmed.inference(
                    text, torch.tensor([4], dtype=torch.int32), empty, zero, empty, zero, torch.zeros(0, 192),
                    max_token_text_ratio=ratio, min_token_text_ratio=ratio,
                    generator=torch.Generator(device=module_device(self)).manual_seed(0),
                )
            )  # fmt: skip
        finally:
            trimmed.stack.release_caches()

    # --- streaming text input -------------------------------------------------------------------------------------

    def bistream(
        self,
        text: Iterable[Tensor],
        prompt_text: Tensor,
        prompt_speech_token: Tensor,
        sample: Sampler,
        *,
        on_step: Callable[[Tensor, int], None] | None = None,
        max_tokens: int | None = None,
        max_token_text_ratio: float | None = None,
    ) -> Iterator[int]:
        """Speech tokens for text that arrives in pieces: the reference's ``inference_bistream`` (batch 1).

        The LM's input starts with sos (CosyVoice3: and the prompt text up to its first ``<|endofprompt|>``,
        :meth:`_prompt_head`); the rest of the prompt text waits with the streamed text. While prompt speech tokens remain, each 5 waiting text tokens
        go in with the next 15 prompt speech tokens. Then the LM decodes: a fill token (:attr:`fill_token`; forced
        15 tokens after the last one, or whenever sampled) asks for 5 more text tokens, which replace the step's
        input. When the text ends, the rest of it and ``task_id`` follow (after the input of the step that produced
        the last fill, fed a second time, as in the reference), and decoding runs to the real EOS (:attr:`eos`).

        Args:
            text: (1, n) text id tensors (n >= 0), in arrival order; consumed as they come.
            prompt_text: (1, P) ids (CosyVoice3: holding ``<|endofprompt|>``).
            prompt_speech_token: (1, S) prompt speech tokens (S may be 0).
            sample: picks each step's id from its log-probabilities (see :data:`Sampler`); the third argument is
                True while the utterance may not end (the reference then masks id ``speech_token_size`` only).
            on_step: called with every step's log-probabilities (1, V) and its id, forced fills included.
            max_tokens: stop after this many ids (fills included); None for no limit.
            max_token_text_ratio: stop after this many ids per text token received (None: no limit, as the
                reference): bounds a run whose LM never picks EOS, as one-shot synthesis's max_len does.
        Yields:
            Speech token ids (< ``speech_token_size``), as they are decoded.
        Raises:
            PromptRuleError: CosyVoice3, no ``<|endofprompt|>`` in ``prompt_text``.
            ValueError: a step picked a special id other than fill (interleaved phase) or EOS (final phase), as
                the reference does.
        """
        n_text, n_speech = self.mix_ratio
        end = self._prompt_head(prompt_text.reshape(-1).tolist())
        embed = self.stack.embed_tokens
        device, dtype = self.speech_embedding.weight.device, self.speech_embedding.weight.dtype

        def words(t: Tensor) -> Tensor:
            return embed(t.reshape(1, -1).to(device=device, dtype=torch.int64)).to(dtype)

        lm_input = torch.cat([self._row(self.sos), words(prompt_text[:, :end])], dim=1)
        text_cache = words(prompt_text[:, end:])
        pst = self.speech_embedding(prompt_speech_token.reshape(1, -1).to(device=device, dtype=torch.int64))
        s = prompt_speech_token.shape[1]
        next_fill = (s // n_speech + 1) * n_speech - s
        out: list[int] = []
        pos = 0

        def step(x: Tensor) -> Tensor:
            nonlocal pos
            need = pos + x.shape[1]
            if need > self.stack.max_seq_len():
                self.stack.grow_caches(1, max(need, 2 * self.stack.max_seq_len(), 256))
            hidden = self.stack.forward_cached(x, torch.tensor([pos], device=device), need)
            pos = need
            return self._logprobs(hidden[:, -1])

        def decode(x: Tensor, arriving: bool) -> Generator[int, None, Tensor]:
            # LM steps from input x until a fill (text still arriving) or EOS; returns the last step's input
            nonlocal next_fill
            while True:
                logp = step(x)
                forced = arriving and len(out) == next_fill
                token = self.fill_token if forced else sample(logp, out, arriving)
                if token == self.fill_token:
                    next_fill = len(out) + n_speech + 1
                out.append(token)
                if on_step is not None:
                    on_step(logp, token)
                if max_tokens is not None and len(out) >= max_tokens:
                    raise _Limit
                if max_token_text_ratio is not None and len(out) >= max_token_text_ratio * max(n_words, 1):
                    raise _Limit
                if token >= self.eos_token:
                    if token == (self.fill_token if arriving else self.eos):
                        return x
                    when = "while text was still arriving" if arriving else "after the text ended"
                    raise ValueError(f"the LM picked special id {token} {when}")
                yield token
                x = self.speech_embedding.weight[token].reshape(1, 1, -1)

        # text tokens received (the prompt text's, after its head, with them)
        n_words = prompt_text.shape[1] - end
        self.stack.setup_caches(1, 256)
        try:
            for piece in text:
                n_words += piece.reshape(1, -1).shape[1]
                text_cache = torch.cat([text_cache, words(piece)], dim=1)
                while pst.shape[1] and text_cache.shape[1] >= n_text:
                    lm_input = torch.cat([lm_input, text_cache[:, :n_text], pst[:, :n_speech]], dim=1)
                    text_cache, pst = text_cache[:, n_text:], pst[:, n_speech:]
                if pst.shape[1]:
                    continue
                after_fill = bool(out) and out[-1] == self.fill_token
                if after_fill or (not out and lm_input.shape[1] == 1):
                    if text_cache.shape[1] < n_text:
                        continue  # wait for more text
                    chunk = text_cache[:, :n_text]
                    lm_input = chunk if after_fill else torch.cat([lm_input, chunk], dim=1)
                    text_cache = text_cache[:, n_text:]
                lm_input = yield from decode(lm_input, True)
            lm_input = torch.cat([lm_input, text_cache, self._row(self.task_id)], dim=1)
            yield from decode(lm_input, False)
        except _Limit:
            return

    @torch.inference_mode()
    def inference_bistream(
        self,
        text: Iterable[Tensor],
        prompt_text: Tensor,
        prompt_speech_token: Tensor,
        *,
        sampling: SamplingConfig | None = None,
        generator: torch.Generator | None = None,
        max_tokens: int | None = None,
        max_token_text_ratio: float | None = 20.0,
    ) -> Iterator[int]:
        """:meth:`bistream` with the reference's sampling (repetition-aware). ``generator``: source of every draw
        (default a freshly seeded one, never the global RNG).

        Two departures. The reference decodes until EOS however long that takes; here at most
        ``max_token_text_ratio`` speech tokens per text token received (the reference's own one-shot limit, 20).
        And the reference masks only id ``speech_token_size`` while the text still arrives, and raises
        when its sampling then picks another special id (or, once the text ended, a special id other than EOS):
        a request that fails half-way through its audio. Here the special ids a step may not pick are masked
        (every one but fill while text arrives, every one but EOS after), so the same draw picks among the ids
        the reference accepts; a trained model gives them almost no probability."""
        cfg = sampling or self.cfg.sampling
        if generator is None:
            generator = torch.Generator(device=self.speech_embedding.weight.device)
            generator.seed()
        win = max(cfg.win_size, 0)

        def sample(logp: Tensor, out: list[int], ignore_eos: bool) -> int:
            keep = self.fill_token if ignore_eos else self.eos
            allowed = logp[:, keep].clone()
            logp = logp.clone()
            logp[:, self.eos_token :] = -math.inf
            logp[:, keep] = allowed
            history = torch.full((1, win), -1, dtype=torch.int64, device=logp.device)
            recent = out[-win:] if win else []
            if recent:
                history[0, : len(recent)] = torch.tensor(recent, device=logp.device)
            return int(ras_sample(logp, history, cfg, generator))

        yield from self.bistream(
            text,
            prompt_text,
            prompt_speech_token,
            sample,
            max_tokens=max_tokens,
            max_token_text_ratio=max_token_text_ratio,
        )

    @torch.inference_mode()
    def teacher_forced_bistream(
        self, text: Tensor, prompt_text: Tensor, prompt_speech_token: Tensor, teacher_tokens: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`bistream` with ``text`` streamed one id at a time and each sampled id taken from
        ``teacher_tokens`` in order (forced fills take none).

        Returns:
            (steps, V) float32 log-probabilities of every step, (steps,) int32 each step's id, (K,) int32 the
            yielded speech tokens.
        """
        teacher = iter(teacher_tokens.reshape(-1).tolist())
        rows: list[Tensor] = []
        ids: list[int] = []

        def sample(logp: Tensor, out: list[int], ignore_eos: bool) -> int:
            try:
                return next(teacher)
            except StopIteration:
                raise ValueError("teacher_tokens ran out before the LM reached EOS") from None

        def on_step(logp: Tensor, token: int) -> None:
            rows.append(logp[0])
            ids.append(token)

        pieces = (text[:, i : i + 1] for i in range(text.shape[1]))
        tokens = list(self.bistream(pieces, prompt_text, prompt_speech_token, sample, on_step=on_step))
        return (
            torch.stack(rows) if rows else torch.zeros(0, self.llm_decoder.out_features),
            torch.tensor(ids, dtype=torch.int32),
            torch.tensor(tokens, dtype=torch.int32),
        )
