"""CosyVoice-300M speech-token language model (reference ``cosyvoice.llm.llm.TransformerLM``), inference only.

The prompt ``[sos_eos, speaker, encoded text, task_id, prompt speech tokens]`` is run through the LM once
(:meth:`SpeechLM.extend`), then one speech token per row per step (:meth:`SpeechLM.decode`) against static KV
caches written in place. The models compute; sampling, the stop rules and the decode loop are the runtime's
(:mod:`cosyserve.runtime.decode`, which every runtime's LM goes through): a :class:`SpeechLM` is its
:class:`~cosyserve.runtime.decode.DecodeLM`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.core.sampling import ArrayOps, SamplingConfig, StopRules
from cosyserve.models.transformer import (
    ConformerEncoder,
    ConformerEncoderConfig,
    KVCache,
    TransformerEncoder,
    TransformerEncoderConfig,
    cache_dtype,
)
from cosyserve.system.device import module_device

__all__ = ["LLMConfig", "SamplingConfig", "SpeechLM", "TransformerLM"]


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


class SpeechLM(nn.Module):
    """What every speech-token LM shares: the prompt, the static KV caches, the extend and one-token decode steps
    the decode loop drives (:class:`~cosyserve.runtime.decode.DecodeLM`). A subclass builds ``embed_inputs`` (the
    prompt), ``stack`` (a transformer with ``forward_cached``/``setup_caches``/``grow_caches``), ``llm_decoder``,
    ``speech_embedding`` and ``eos_token``; every id from ``eos_token`` up is a stop token (CosyVoice-300M has one,
    CosyVoice2 three), and before ``min_len`` only ``eos_token`` is masked, as both references do."""

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

    # --- the decode loop's LM (cosyserve.runtime.decode.DecodeLM) -------------------------------------------------

    @property
    def rules(self) -> StopRules:
        return StopRules(self.llm_decoder.out_features, self.eos_token, self.eos_token)

    @property
    def sampling(self) -> SamplingConfig:
        return self.cfg.sampling  # type: ignore[no-any-return]

    @property
    def ops(self) -> ArrayOps:
        return ArrayOps(torch, module_device(self))

    def prompt(self, model_input: Mapping[str, Any]) -> tuple[Tensor, int]:
        """The one-shot prompt (1, T0, C) of a reference model-input dict (``text``, ``prompt_text``,
        ``llm_prompt_speech_token``, ``llm_embedding``; absent keys empty) and the text's length."""
        d = module_device(self)
        empty = torch.zeros(1, 0, dtype=torch.int32, device=d)
        text = model_input["text"]
        prompt_text = model_input.get("prompt_text", empty)
        speech = model_input.get("llm_prompt_speech_token", empty)
        embedding = model_input.get("llm_embedding")
        if embedding is None:
            embedding = torch.zeros(0, self.cfg.spk_embed_dim, device=d)

        def n(x: Tensor) -> Tensor:
            return torch.tensor([x.shape[1]], dtype=torch.int32, device=d)

        lm_input = self.embed_inputs(text, n(text), prompt_text, n(prompt_text), speech, n(speech), embedding)
        return lm_input, int(text.shape[1])

    def embed(self, parts: list[tuple[str, list[int]]]) -> Tensor:
        """(1, T, C) the embeddings of ``parts`` (("text" | "speech" | "special", ids)) in order."""
        return torch.cat([self._embed_part(kind, ids) for kind, ids in parts if ids], dim=1)

    def _embed_part(self, kind: str, ids: list[int]) -> Tensor:
        if kind == "speech":
            return self.speech_embedding(self._ids(ids)).unsqueeze(0)
        raise ValueError(f"{type(self).__name__} takes no {kind!r} input after its prompt")

    def _ids(self, ids: list[int]) -> Tensor:
        return torch.tensor(ids, dtype=torch.int64, device=self.speech_embedding.weight.device)

    def reserve(self, rows: int, positions: int) -> None:
        cache = self._first_cache()
        w = self.speech_embedding.weight
        if cache is not None and cache.k_cache.dtype != cache_dtype(w.dtype, w.device):
            self.release()  # made before a cast (Module.to casts the buffers too): set up again
        self.grow_caches(rows, positions)

    def release(self) -> None:
        self.stack.release_caches()

    def prefix_positions(self, model_input: Mapping[str, Any]) -> int:
        """Leading prompt positions that depend on the prompt text (and speaker) alone (see
        :class:`~cosyserve.runtime.lm.Prefix`): none here; a subclass whose input order allows it says how many."""
        return 0

    def _caches(self) -> list[KVCache]:
        return [m for m in self.stack.modules() if isinstance(m, KVCache)]

    def save_prefix(self, row: int, positions: int) -> list[Tensor]:
        """Copies of cache row ``row``'s keys and values at positions ``[0, positions)``, every layer's."""
        return [c[row, :, :positions].clone() for kv in self._caches() for c in (kv.k_cache, kv.v_cache)]

    def load_prefix(self, arrays: list[Tensor], row: int) -> None:
        """:meth:`save_prefix`'s copies back at the start of cache row ``row``."""
        caches = [c for kv in self._caches() for c in (kv.k_cache, kv.v_cache)]
        for cache, a in zip(caches, arrays, strict=True):
            cache[row, :, : a.shape[1]] = a

    def extend(self, x: Tensor, row: int, start: int, stop: Any = None) -> Tensor:
        """Run ``x`` (1, T, C) into cache row ``row`` from position ``start``: (1, V) float32 log-probabilities of
        the token after it. ``stop`` is asked before each layer (a prompt's prefill is the longest run of the LM:
        a 12 s voice's is seconds on a CPU), raising :class:`~cosyserve.core.stop.Stopped`."""
        rows = None if row == 0 else torch.tensor([row], device=x.device)
        pos = torch.full((1,), start, dtype=torch.int64, device=x.device)
        return self._logprobs(self.stack.forward_cached(x, pos, start + x.shape[1], rows, stop)[:, -1])

    def decode(
        self, tokens: Tensor, pos: Tensor, kv_len: int, rows: Tensor | None = None, stops: Any = None
    ) -> Tensor:
        """Feed one speech token per row.

        Args:
            tokens: (B,) int64 speech token ids (< speech_token_size).
            pos: (B,) int64 position each token is written at.
            kv_len: host int >= max(pos) + 1.
            rows: (B,) cache rows (default 0..B-1).
            stops: each row's stop signal (not asked here: the decode loop asks between steps).
        Returns:
            (B, V) float32 log-probabilities of the next token.
        """
        x = self.speech_embedding(tokens).unsqueeze(1)  # (B, 1, C)
        return self._logprobs(self.stack.forward_cached(x, pos, kv_len, rows)[:, 0])

    def warmup_input(self) -> dict[str, Tensor]:
        """A dummy model input for the warm-up (four text ids)."""
        return {"text": torch.arange(1, 5, dtype=torch.int32).unsqueeze(0)}


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

    def prefix_positions(self, model_input: Mapping[str, Any]) -> int:
        """sos, the speaker (when the input has one) and the prompt text's encoded frames, when there is prompt text
        and the text encoder is causal (``static_chunk_size: 1``, as CosyVoice-300M's: a frame of the prompt text
        sees no frame after it, so the new text leaves it as it is)."""
        enc = self.text_encoder.cfg
        prompt_text = model_input.get("prompt_text")
        p = 0 if prompt_text is None else int(prompt_text.shape[1])
        if p == 0 or enc.use_dynamic_chunk or enc.static_chunk_size != 1:
            return 0
        embedding = model_input.get("llm_embedding")
        return 1 + int(embedding is not None and embedding.shape[0] != 0) + p

    def warmup_input(self) -> dict[str, Tensor]:
        # a speaker embedding too (float32, as speakers' are): the speaker projection runs
        return {**super().warmup_input(), "llm_embedding": torch.zeros(1, self.cfg.spk_embed_dim)}

    def _first_cache(self) -> Any:
        return self.llm.encoders[0].self_attn.kv_cache
