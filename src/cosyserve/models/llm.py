"""CosyVoice-300M speech-token language model (reference ``cosyvoice.llm.llm.TransformerLM``), inference only.

The prompt ``[sos_eos, speaker, encoded text, task_id, prompt speech tokens]`` is run once through the LM
(:meth:`TransformerLM.prefill`), then one speech token per step (:meth:`TransformerLM.decode_one_token`) against
static KV caches written in place. Sampling is the reference's repetition-aware sampling (:func:`ras_sample`) done
with tensor ops and an explicit generator; on the CPU the only host sync per token is reading the sampled id. On a
GPU the loop runs ahead of the host instead (:func:`decode_ahead`): the ids are read back a few steps late, without
a synchronisation per step, and the draws are the CPU loop's.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.device import module_device
from cosyserve.models.transformer import (
    ConformerEncoder,
    ConformerEncoderConfig,
    TransformerEncoder,
    TransformerEncoderConfig,
)

__all__ = [
    "READ_AHEAD",
    "LLMConfig",
    "SamplingConfig",
    "SpeechLM",
    "TransformerLM",
    "decode_ahead",
    "ras_sample",
]

# decode_ahead: how many steps the device may run ahead of the ids the host has read. Each step's id is read as soon
# as its copy is done (a GPU step takes milliseconds, the copy microseconds), so this bounds only the work queued
# past a stop token or a stop request, not the latency of the ids.
READ_AHEAD = 4


@dataclass(frozen=True)
class SamplingConfig:
    """Repetition-aware sampling (reference ``ras_sampling``): nucleus (top_p, top_k); if the pick occurred in the
    last ``win_size`` generated tokens at least ``win_size * tau_r`` times, draw again from the full distribution
    without it."""

    TARGET: ClassVar[str] = "cosyvoice.utils.common.ras_sampling"

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 1:
            raise ValueError(f"sampling top_k={self.top_k} must be >= 1")
        if self.win_size < 0 or self.tau_r < 0:
            raise ValueError(f"sampling win_size={self.win_size} and tau_r={self.tau_r} must be >= 0")


@dataclass
class LLMConfig:
    TARGET: ClassVar[str] = "cosyvoice.llm.llm.TransformerLM"

    text_encoder_input_size: int
    llm_input_size: int
    llm_output_size: int
    text_token_size: int
    speech_token_size: int
    text_encoder: ConformerEncoderConfig
    llm: TransformerEncoderConfig
    sampling: SamplingConfig
    length_normalized_loss: bool = True
    lsm_weight: float = 0.0
    spk_embed_dim: int = 192


def ras_sample(scores: Tensor, history: Tensor, cfg: SamplingConfig, generator: torch.Generator) -> Tensor:
    """Repetition-aware sampling, batched and without host syncs.

    Both the nucleus draw and the fallback draw are always made (a fixed number of random numbers per step), and
    the fallback is selected per row where the nucleus pick repeats too often.

    Args:
        scores: (B, V) log-probabilities (entries set to -inf are never drawn).
        history: (B, W) int64, the row's last W generated tokens in any order, -1 for none yet (W = win_size).
        cfg: sampling options.
        generator: source of all random draws.
    Returns:
        (B,) int64 token ids.
    """
    scores = scores.float()
    probs = scores.softmax(dim=-1)
    sorted_p, sorted_idx = probs.sort(dim=-1, descending=True, stable=True)
    head_p, head_idx = sorted_p[:, : cfg.top_k], sorted_idx[:, : cfg.top_k]
    # Candidate i is kept while the mass before it is < top_p (the reference's sequential float32 sum).
    mass_before = F.pad(head_p.cumsum(dim=-1)[:, :-1], (1, 0))
    keep = mass_before < cfg.top_p
    # argmax(p / Exp(1)) draws index i with probability p_i / sum(p) (no multinomial, no sync).
    race = head_p / torch.empty_like(head_p).exponential_(generator=generator)
    top = head_idx.gather(-1, torch.where(keep, race, -1.0).argmax(dim=-1, keepdim=True))  # (B, 1)

    fallback_p = scores.scatter(-1, top, -float("inf")).softmax(dim=-1)
    race = fallback_p / torch.empty_like(fallback_p).exponential_(generator=generator)
    fallback = torch.where(fallback_p > 0, race, -1.0).argmax(dim=-1)  # (B,)

    repeats = (history == top).sum(dim=-1)  # (B,)
    # `repeats >= win_size * tau_r` for an integer count is `repeats >= ceil(win_size * tau_r)`.
    return torch.where(repeats >= math.ceil(cfg.win_size * cfg.tau_r), fallback, top.squeeze(1))


def decode_ahead(
    lm: SpeechLM,
    lm_input: Tensor,
    min_len: int,
    max_len: int,
    sampling: SamplingConfig,
    generator: torch.Generator,
    ahead: int = READ_AHEAD,
) -> Iterator[int]:
    """:meth:`SpeechLM.inference`'s decode loop without a host synchronisation per step, for a GPU.

    The sampled token stays on the device: it is fed back to the next step as a tensor (a stop token as token 0:
    its embedding row may not exist, and what follows a stop is never yielded) while a non-blocking copy brings it
    to the host, where it is read once that copy is done, or at the latest when ``ahead`` more steps are queued
    (on the CPU every id waits for that: the same code then runs, and is tested, with the lag). A stop token is
    seen when read; the steps queued after it are dropped. The draws are the CPU loop's, step for step, and when
    the generator is left (a stop token, ``max_len``, or the consumer closing it after an id) its state is put back
    to the one after the last step read, so the draws that follow (the next piece, the flow's noise) are the CPU
    loop's too.

    Args:
        lm: the LM, its caches set up by this call.
        lm_input: (1, T0, C) the prompt (:meth:`SpeechLM.prepare_inference`); its device is where the loop runs.
        min_len, max_len: no stop token before ``min_len`` ids; at most ``max_len`` ids (> 0).
        sampling: the sampling options.
        generator: on ``lm_input``'s device; source of every draw.
        ahead: steps the device may run past the last id read (>= 0).
    Yields:
        Speech token ids (ints below ``lm.eos_token``); ends at a stop token or after ``max_len`` ids.
    """
    device = lm_input.device
    t0 = lm_input.size(1)
    lm.setup_caches(1, t0 + max_len)
    win = sampling.win_size
    history = torch.full((1, max(win, 0)), -1, dtype=torch.int64, device=device)
    pos = torch.full((1,), t0, dtype=torch.int64, device=device)
    on_gpu = device.type == "cuda"
    ids = torch.empty(max_len, dtype=torch.int64, pin_memory=on_gpu)  # the host's copy of every id
    host = ids.numpy()
    pending: deque[tuple[int, Any, Tensor]] = deque()  # (step, its copy's event, generator state after it)
    resume: Tensor | None = None  # the generator's state after the last step read
    logp = lm.prefill(lm_input)
    try:
        for i in range(max_len):
            if i < min_len:
                logp[:, lm.eos_token] = -float("inf")
            token = ras_sample(logp, history, sampling, generator)  # (1,), on the device
            ids[i : i + 1].copy_(token, non_blocking=True)
            event = None
            if on_gpu:
                event = torch.cuda.Event()
                event.record()
            pending.append((i, event, generator.get_state()))
            while pending and (len(pending) > ahead or (pending[0][1] is not None and pending[0][1].query())):
                step, done, resume = pending.popleft()
                if done is not None:
                    done.synchronize()  # returns at once when query() said so
                if host[step] >= lm.eos_token:  # eos, or another stop token after it
                    return
                yield int(host[step])
            if win > 0:
                history[:, i % win] = token
            if i + 1 < max_len:
                fed = torch.where(token < lm.eos_token, token, 0)
                logp = lm.decode_one_token(fed, pos, t0 + i + 1)
                pos += 1
        while pending:
            step, done, resume = pending.popleft()
            if done is not None:
                done.synchronize()
            if host[step] >= lm.eos_token:
                return
            yield int(host[step])
    finally:
        if resume is not None:
            generator.set_state(resume)


class SpeechLM(nn.Module):
    """What every speech-token LM shares: the prompt, the limits, the static KV caches, prefill and one-token
    decode steps, sampling until a stop token. A subclass builds ``embed_inputs`` (the prompt), ``stack`` (a
    transformer with ``forward_cached``/``setup_caches``/``grow_caches``), ``llm_decoder``, ``speech_embedding`` and
    ``eos_token``; every id from ``eos_token`` up is a stop token (CosyVoice-300M has one, CosyVoice2 three), and
    before ``min_len`` only ``eos_token`` is masked, as both references do. The batching LM
    (:mod:`cosyserve.runtime.batching`) drives ``prepare_inference``, ``prefill`` and ``decode_one_token``."""

    STREAMS_TEXT: bool = False  # an LM that takes text as it arrives has ``inference_bistream``
    cfg: Any
    eos_token: int
    llm_decoder: nn.Linear
    speech_embedding: nn.Embedding

    @property
    def stack(self) -> Any:
        raise NotImplementedError

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
        raise NotImplementedError

    def _first_cache(self) -> Any:
        raise NotImplementedError

    @staticmethod
    def length_limits(
        text_len: Tensor, min_token_text_ratio: float, max_token_text_ratio: float
    ) -> tuple[int, int]:
        """(min_len, max_len) of generated tokens from the text length without prompt, as the reference computes
        them (float32 product of the integer length and the ratio, truncated)."""
        n = text_len.reshape(-1)[:1].to(torch.int64)
        return int(n * min_token_text_ratio), int(n * max_token_text_ratio)

    def prepare_inference(
        self,
        text: Tensor,
        text_len: Tensor,
        prompt_text: Tensor,
        prompt_text_len: Tensor,
        prompt_speech_token: Tensor,
        prompt_speech_token_len: Tensor,
        embedding: Tensor,
        sampling: SamplingConfig | None,
        max_token_text_ratio: float,
        min_token_text_ratio: float,
        generator: torch.Generator | None,
        max_tokens: int | None = None,
    ) -> tuple[Tensor, int, int, SamplingConfig, torch.Generator]:
        """What :meth:`inference` (and the batching LM) start from: ``(lm_input (1, T0, C), min_len, max_len,
        sampling, generator)``, the generator freshly seeded when none is given (never the global RNG);
        ``max_tokens`` (None: none) caps max_len, and min_len with it."""
        sampling = sampling or self.cfg.sampling
        if generator is None:
            generator = torch.Generator(device=text.device)
            generator.seed()
        lm_input = self.embed_inputs(
            text,
            text_len,
            prompt_text,
            prompt_text_len,
            prompt_speech_token,
            prompt_speech_token_len,
            embedding,
        )
        min_len, max_len = self.length_limits(text_len, min_token_text_ratio, max_token_text_ratio)
        if max_tokens is not None:
            max_len = min(max_len, max_tokens)
            min_len = min(min_len, max_len)
        return lm_input, min_len, max_len, sampling, generator

    # --- hot path -----------------------------------------------------------------------------------------------

    def setup_caches(self, max_batch_size: int, max_seq_len: int) -> None:
        """Allocate the LM's KV caches (idempotent; grows them if needed). Each row is an independent sequence."""
        self.stack.setup_caches(max_batch_size, max_seq_len)

    def grow_caches(self, max_batch_size: int, max_seq_len: int) -> None:
        """As :meth:`setup_caches`, but growing keeps what every row holds (rows decoding go on undisturbed)."""
        self.stack.grow_caches(max_batch_size, max_seq_len)

    def cache_shape(self) -> tuple[int, int]:
        """(rows, positions per row) of the KV caches; (0, 0) before :meth:`setup_caches`."""
        cache = self._first_cache()
        return (0, 0) if cache is None else (cache.k_cache.size(0), cache.k_cache.size(2))

    def _logprobs(self, hidden: Tensor) -> Tensor:
        return self.llm_decoder(hidden).float().log_softmax(dim=-1)

    def prefill(self, lm_input: Tensor, lengths: Tensor | None = None, rows: Tensor | None = None) -> Tensor:
        """Run prompts through the LM from position 0, filling the caches.

        Args:
            lm_input: (B, T, llm_input_size) prompts, right-padded.
            lengths: (B,) int64 valid lengths (default: all T).
            rows: (B,) cache rows (default 0..B-1).
        Returns:
            (B, speech_token_size + 1) float32 log-probabilities of the first token after each prompt.
        """
        b, t, _ = lm_input.shape
        zeros = torch.zeros(b, dtype=torch.int64, device=lm_input.device)
        hidden = self.stack.forward_cached(lm_input, zeros, t, rows)  # (B, T, C)
        last = (
            hidden[:, -1] if lengths is None else hidden[torch.arange(b, device=hidden.device), lengths - 1]
        )
        return self._logprobs(last)

    def decode_one_token(
        self, tokens: Tensor, input_pos: Tensor, kv_len: int, rows: Tensor | None = None
    ) -> Tensor:
        """Feed one speech token per row.

        Args:
            tokens: (B,) int64 speech token ids (< speech_token_size).
            input_pos: (B,) int64 position each token is written at.
            kv_len: host int >= max(input_pos) + 1.
            rows: (B,) cache rows (default 0..B-1).
        Returns:
            (B, speech_token_size + 1) float32 log-probabilities of the next token.
        """
        x = self.speech_embedding(tokens).unsqueeze(1)  # (B, 1, C)
        return self._logprobs(self.stack.forward_cached(x, input_pos, kv_len, rows)[:, 0])

    @torch.inference_mode()
    def inference(
        self,
        text: Tensor,
        text_len: Tensor,
        prompt_text: Tensor,
        prompt_text_len: Tensor,
        prompt_speech_token: Tensor,
        prompt_speech_token_len: Tensor,
        embedding: Tensor,
        *,
        sampling: SamplingConfig | None = None,
        max_token_text_ratio: float = 20.0,
        min_token_text_ratio: float = 2.0,
        generator: torch.Generator | None = None,
        max_tokens: int | None = None,
    ) -> Iterator[int]:
        """Generate speech token ids one at a time, as the reference's ``TransformerLM.inference``.

        Args:
            text ... embedding: as :meth:`embed_inputs` (batch 1).
            sampling: overrides the config's sampling options.
            max_token_text_ratio, min_token_text_ratio: limits relative to the text length (without prompt);
                EOS cannot be drawn before min_len tokens, at most max_len tokens are produced.
            generator: source of every random draw (default: a freshly seeded one, never the global RNG).
            max_tokens: at most this many tokens whatever the text's length (None: the ratio alone, as the
                reference): bounds the work and memory of one piece.
        Yields:
            Speech token ids (ints < speech_token_size); stops at EOS or max_len.
        """
        lm_input, min_len, max_len, sampling, generator = self.prepare_inference(
            text, text_len, prompt_text, prompt_text_len, prompt_speech_token, prompt_speech_token_len, embedding,
            sampling, max_token_text_ratio, min_token_text_ratio, generator, max_tokens,
        )  # fmt: skip
        if max_len <= 0:
            return
        if lm_input.device.type != "cpu":  # no host sync per step; the CPU keeps the loop below
            yield from decode_ahead(self, lm_input, min_len, max_len, sampling, generator)
            return
        t0 = lm_input.size(1)
        self.setup_caches(1, t0 + max_len)
        win = sampling.win_size
        history = torch.full((1, max(win, 0)), -1, dtype=torch.int64, device=lm_input.device)
        pos = torch.full((1,), t0, dtype=torch.int64, device=lm_input.device)
        logp = self.prefill(lm_input)
        for i in range(max_len):
            if i < min_len:
                logp[:, self.eos_token] = -float("inf")
            token = ras_sample(logp, history, sampling, generator)  # (1,)
            token_id = int(token)  # the step's one host sync: the caller needs the id
            if token_id >= self.eos_token:  # eos, or another stop token after it
                return
            yield token_id
            if win > 0:
                history[:, i % win] = token
            if i + 1 < max_len:
                logp = self.decode_one_token(token, pos, t0 + i + 1)
                pos += 1

    @torch.inference_mode()
    def teacher_forced_logprobs(
        self,
        text: Tensor,
        text_len: Tensor,
        prompt_text: Tensor,
        prompt_text_len: Tensor,
        prompt_speech_token: Tensor,
        prompt_speech_token_len: Tensor,
        embedding: Tensor,
        teacher_tokens: Tensor,
        *,
        max_token_text_ratio: float = 20.0,
        min_token_text_ratio: float = 2.0,
    ) -> tuple[Tensor, int, int]:
        """Log-probabilities of each step when the tokens fed back are ``teacher_tokens`` (before EOS masking).

        Args:
            text ... embedding: as :meth:`embed_inputs`.
            teacher_tokens: (K,) speech token ids fed back after steps 0..K-2.
        Returns:
            (K, vocabulary) float32 log-probabilities, min_len, max_len.
        """
        lm_input = self.embed_inputs(
            text,
            text_len,
            prompt_text,
            prompt_text_len,
            prompt_speech_token,
            prompt_speech_token_len,
            embedding,
        )
        min_len, max_len = self.length_limits(text_len, min_token_text_ratio, max_token_text_ratio)
        k = teacher_tokens.numel()
        t0 = lm_input.size(1)
        self.setup_caches(1, t0 + k)
        tokens = teacher_tokens.reshape(-1, 1).to(device=lm_input.device, dtype=torch.int64)
        out = torch.empty(k, self.llm_decoder.out_features, dtype=torch.float32, device=lm_input.device)
        pos = torch.full((1,), t0, dtype=torch.int64, device=lm_input.device)
        logp = self.prefill(lm_input)
        for i in range(k):
            out[i] = logp[0]
            if i + 1 < k:
                logp = self.decode_one_token(tokens[i], pos, t0 + i + 1)
                pos += 1
        return out, min_len, max_len


class TransformerLM(SpeechLM):
    """Text encoder + speech-token LM; attribute names match the official ``llm.pt`` keys."""

    @property
    def stack(self) -> TransformerEncoder:
        return self.llm

    # stacks of identical layers: a warm-up runs one layer of each (cosyserve.models.one_layer_per_stack)
    REPEATED_STACKS = ("text_encoder.encoders", "llm.encoders")
    # tables read by row (embedding lookups): a preload leaves them to fault in row by row, so the rows no request
    # uses (most of the text vocabulary) cost no memory (cosyserve.bundle.loader)
    ROW_TABLES = ("text_embedding.weight", "llm_embedding.weight", "speech_embedding.weight")

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        if cfg.text_encoder.input_size != cfg.text_encoder_input_size:
            raise ValueError(
                f"text_encoder.input_size={cfg.text_encoder.input_size} != "
                f"text_encoder_input_size={cfg.text_encoder_input_size}"
            )
        if cfg.llm.input_size != cfg.llm_input_size or cfg.llm.output_size != cfg.llm_output_size:
            raise ValueError(
                f"llm.input_size/output_size ({cfg.llm.input_size}/{cfg.llm.output_size}) must equal "
                f"llm_input_size/llm_output_size ({cfg.llm_input_size}/{cfg.llm_output_size})"
            )
        self.cfg = cfg
        self.sos = 0
        self.task_id = 1
        self.eos_token = cfg.speech_token_size
        self.text_embedding = nn.Embedding(cfg.text_token_size, cfg.text_encoder_input_size)
        self.text_encoder = ConformerEncoder(cfg.text_encoder)
        self.text_encoder_affine_layer = nn.Linear(cfg.text_encoder.output_size, cfg.llm_input_size)
        self.llm_embedding = nn.Embedding(2, cfg.llm_input_size)
        self.llm = TransformerEncoder(cfg.llm)
        self.llm_decoder = nn.Linear(cfg.llm_output_size, cfg.speech_token_size + 1)
        self.speech_embedding = nn.Embedding(cfg.speech_token_size, cfg.llm_input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.llm_input_size)

    # --- input assembly -----------------------------------------------------------------------------------------

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
        """The LM's prompt, as the reference's ``inference`` builds it (batch 1).

        Args:
            text: (1, T) text token ids; text_len: (1,).
            prompt_text: (1, P) ids (P may be 0); prompt_text_len: (1,).
            prompt_speech_token: (1, S) speech ids (S may be 0); prompt_speech_token_len: (1,).
            embedding: (1, spk_embed_dim) speaker embedding, or (0, spk_embed_dim) for none.
        Returns:
            (1, 1 + [1] + P + T + 1 + S, llm_input_size): sos_eos, [speaker], encoded text, task_id, prompt speech.
        """
        dtype = self.llm_embedding.weight.dtype
        text = torch.cat([prompt_text, text], dim=1)
        text_emb = self.text_embedding(text)
        encoded, _ = self.text_encoder(text_emb, text_len + prompt_text_len, 1, -1)  # (1, P+T, C)
        encoded = self.text_encoder_affine_layer(encoded)
        parts = [self.llm_embedding.weight[self.sos].reshape(1, 1, -1)]
        if embedding.shape[0] != 0:
            spk = F.normalize(embedding.to(dtype), dim=1)
            parts.append(self.spk_embed_affine_layer(spk).unsqueeze(1))
        parts += [encoded, self.llm_embedding.weight[self.task_id].reshape(1, 1, -1)]
        if int(prompt_speech_token_len.reshape(-1)[0]) != 0:
            parts.append(self.speech_embedding(prompt_speech_token))
        return torch.cat(parts, dim=1)

    def warm_up(self, n_tokens: int = 2) -> list[int]:
        """Generate exactly ``n_tokens`` speech tokens for four dummy text ids through one layer of each stack
        (:func:`cosyserve.models.one_layer_per_stack`), paying the one-time costs of every kernel the LM runs
        (prefill, cached decode, sampling); the caches are released after, so no state is left behind. Not while
        the LM serves requests: the first layer's KV cache is set up and released here."""
        from cosyserve.models import one_layer_per_stack

        text = torch.arange(1, 5, dtype=torch.int32).unsqueeze(0)
        empty, zero = torch.zeros(1, 0, dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
        ratio = max(n_tokens, 1) / text.shape[1]  # min = max: exactly n_tokens, no early EOS
        embedding = torch.zeros(1, self.cfg.spk_embed_dim)  # float32, as speakers' embeddings are
        trimmed = one_layer_per_stack(self)
        try:
            return list(
                trimmed.inference(
                    text,
                    torch.tensor([text.shape[1]], dtype=torch.int32),
                    empty,
                    zero,
                    empty,
                    zero,
                    embedding,
                    max_token_text_ratio=ratio,
                    min_token_text_ratio=ratio,
                    generator=torch.Generator(device=module_device(self)).manual_seed(0),
                )
            )
        finally:
            trimmed.llm.release_caches()

    def _first_cache(self) -> Any:
        return self.llm.encoders[0].self_attn.kv_cache
