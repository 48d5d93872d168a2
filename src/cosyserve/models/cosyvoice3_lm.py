"""CosyVoice3's speech-token LM: CosyVoice2's Qwen2 LM with 200 special ids instead of CosyVoice2's 3.

Mirrors ``cosyvoice.llm.llm.CosyVoice3LM``. The differences from :class:`~cosyserve.models.qwen2lm.Qwen2LM`:

- no ``llm_embedding``: ``sos`` (6561) and ``task_id`` (6563) are rows of ``speech_embedding`` (6561 + 200 rows);
  ``llm_decoder`` is ``Linear(hidden, 6761)`` without bias. Ids: 6562 is the real end of speech, 6564 the "fill"
  token of streaming text input; every id from 6561 up ends an utterance.
- the prompt rule: ``<|endofprompt|>`` (text id 151646, hard-coded in the reference) must occur in prompt text +
  text; the reference asserts it and so do we (a ``ValueError`` saying what to write).
- the reference's minimum-length rule masks id ``speech_token_size`` = 6561 before ``min_len`` tokens, which for
  CosyVoice3 is ``sos``, not the real EOS: the EOS stays drawable. Kept as is (:attr:`eos_token` here is the id the
  shared :class:`~cosyserve.models.llm.SpeechLM` masks and stops from, 6561; :attr:`eos` is the real one).
- streaming text input (:meth:`bistream`): the reference's ``inference_bistream``, 5 text tokens interleaved with
  15 speech tokens and fill tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from cosyserve.models.llm import SamplingConfig, SpeechLM, ras_sample
from cosyserve.models.qwen2lm import Qwen2LM, Qwen2LMConfig, _Encoder

__all__ = ["ENDOFPROMPT", "CosyVoice3LM", "CosyVoice3LMConfig", "PromptRuleError"]

ENDOFPROMPT = 151646  # <|endofprompt|>'s text id, as the reference hard-codes it
N_SPECIAL = 200  # special ids after the speech tokens


class PromptRuleError(ValueError):
    """Prompt text + text hold no ``<|endofprompt|>`` (CosyVoice3 needs one)."""


@dataclass
class CosyVoice3LMConfig(Qwen2LMConfig):
    TARGET: ClassVar[str] = "cosyvoice.llm.llm.CosyVoice3LM"


# A sampling function for the bistream decode: (log-probabilities (1, V), tokens so far, whether the step may not
# end the utterance) -> the next id (the reference's sampling_ids)
Sampler = Callable[[Tensor, list[int], bool], int]


class CosyVoice3LM(Qwen2LM):
    """CosyVoice3's LM; attribute names match the official ``llm.pt`` keys."""

    ROW_TABLES = ("llm.model.model.embed_tokens.weight", "speech_embedding.weight")

    def __init__(self, cfg: CosyVoice3LMConfig) -> None:
        SpeechLM.__init__(self)
        self.cfg = cfg
        n = cfg.speech_token_size
        self.sos, self.eos, self.task_id, self.fill_token = n, n + 1, n + 2, n + 3
        self.eos_token = n  # the first stop id: masked before min_len (see the module docstring)
        self.mix_ratio = tuple(cfg.mix_ratio)
        if len(self.mix_ratio) != 2 or min(self.mix_ratio) < 1:
            raise ValueError(f"llm mix_ratio={cfg.mix_ratio} must be two positive counts (text, speech)")
        self.llm = _Encoder(cfg.qwen)
        self.llm_decoder = nn.Linear(cfg.llm_output_size, n + N_SPECIAL, bias=False)
        self.speech_embedding = nn.Embedding(n + N_SPECIAL, cfg.llm_input_size)
        self._register_load_state_dict_pre_hook(self._drop_text_head)

    def _row(self, token: int) -> Tensor:
        return self.speech_embedding.weight[token].reshape(1, 1, -1)

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
        """The LM's prompt (batch 1): sos, Qwen embeddings of prompt text + text, task_id, prompt speech (sos and
        task_id are speech-embedding rows). ``embedding`` (the speaker) is not used, as in the reference.

        Raises:
            PromptRuleError: ``<|endofprompt|>`` is in neither text nor prompt text.
        """
        ids = torch.cat([prompt_text, text], dim=1).to(torch.int64)
        if not bool((ids == ENDOFPROMPT).any()):
            raise PromptRuleError(
                "CosyVoice3 needs <|endofprompt|> in the prompt text or the text, e.g. a prompt text (or text) "
                "starting with 'You are a helpful assistant.<|endofprompt|>'"
            )
        dtype = self.speech_embedding.weight.dtype
        parts = [self._row(self.sos), self.stack.embed_tokens(ids).to(dtype), self._row(self.task_id)]
        if int(prompt_speech_token_len.reshape(-1)[0]) != 0:
            parts.append(self.speech_embedding(prompt_speech_token.to(torch.int64)))
        return torch.cat(parts, dim=1)

    @torch.inference_mode()
    def warm_up(self, n_tokens: int = 2) -> list[int]:
        """Generate ``n_tokens`` tokens for a dummy text (``<|endofprompt|>`` and three ids) through one layer;
        the caches are released after. Not while the LM serves requests."""
        from cosyserve.models import one_layer_per_stack

        text = torch.tensor([[ENDOFPROMPT, 1, 2, 3]], dtype=torch.int32)
        empty, zero = torch.zeros(1, 0, dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
        ratio = max(n_tokens, 1) / text.shape[1]
        trimmed = one_layer_per_stack(self)
        try:
            return list(
                trimmed.inference(
                    text, torch.tensor([4], dtype=torch.int32), empty, zero, empty, zero, torch.zeros(0, 192),
                    max_token_text_ratio=ratio, min_token_text_ratio=ratio,
                    generator=torch.Generator().manual_seed(0),
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
    ) -> Iterator[int]:
        """Speech tokens for text that arrives in pieces: the reference's ``inference_bistream`` (batch 1).

        The prompt text is split after its first ``<|endofprompt|>``: sos and everything up to it start the LM's
        input; the rest waits with the streamed text. While prompt speech tokens remain, each 5 waiting text tokens
        go in with the next 15 prompt speech tokens. Then the LM decodes: a fill token (6564; forced 15 tokens
        after the last one, or whenever sampled) asks for 5 more text tokens, which replace the step's input. When
        the text ends, the rest of it and ``task_id`` follow (after the input of the step that produced the last
        fill, fed a second time, as in the reference), and decoding runs to the real EOS (6562).

        Args:
            text: (1, n) text id tensors (n >= 0), in arrival order; consumed as they come.
            prompt_text: (1, P) ids holding ``<|endofprompt|>``.
            prompt_speech_token: (1, S) prompt speech tokens (S may be 0).
            sample: picks each step's id from its log-probabilities (see :data:`Sampler`); the third argument is
                True while the utterance may not end (the reference then masks id 6561 only).
            on_step: called with every step's log-probabilities (1, V) and its id, forced fills included.
            max_tokens: stop after this many ids (fills included); None for no limit.
        Yields:
            Speech token ids (< 6561), as they are decoded.
        Raises:
            PromptRuleError: no ``<|endofprompt|>`` in ``prompt_text``.
            ValueError: a step picked a special id other than fill (interleaved phase) or EOS (final phase), as
                the reference does.
        """
        n_text, n_speech = self.mix_ratio
        ids = prompt_text.reshape(-1).tolist()
        if ENDOFPROMPT not in ids:
            raise PromptRuleError(
                "CosyVoice3 streaming text input needs <|endofprompt|> in the prompt text, e.g. "
                "'You are a helpful assistant.<|endofprompt|>' before the prompt's transcript"
            )
        end = ids.index(ENDOFPROMPT) + 1
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
                if token >= self.sos:
                    if token == (self.fill_token if arriving else self.eos):
                        return x
                    when = "while text was still arriving" if arriving else "after the text ended"
                    raise ValueError(f"the LM picked special id {token} {when}")
                yield token
                x = self.speech_embedding.weight[token].reshape(1, 1, -1)

        self.stack.setup_caches(1, 256)
        try:
            for piece in text:
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
    ) -> Iterator[int]:
        """:meth:`bistream` with the reference's sampling (repetition-aware, id 6561 masked while the text still
        arrives). ``generator``: source of every draw (default a freshly seeded one, never the global RNG)."""
        cfg = sampling or self.cfg.sampling
        if generator is None:
            generator = torch.Generator(device=self.speech_embedding.weight.device)
            generator.seed()
        win = max(cfg.win_size, 0)

        def sample(logp: Tensor, out: list[int], ignore_eos: bool) -> int:
            if ignore_eos:
                logp = logp.clone()
                logp[:, self.eos_token] = -math.inf
            history = torch.full((1, win), -1, dtype=torch.int64, device=logp.device)
            recent = out[-win:] if win else []
            if recent:
                history[0, : len(recent)] = torch.tensor(recent, device=logp.device)
            return int(ras_sample(logp, history, cfg, generator))

        yield from self.bistream(text, prompt_text, prompt_speech_token, sample, max_tokens=max_tokens)

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


class _Limit(Exception):
    # max_tokens reached inside bistream: ends the generator quietly
    pass
