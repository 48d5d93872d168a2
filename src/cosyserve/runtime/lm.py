"""The decode loop's LM interface and its rows (:mod:`cosyserve.runtime.decode` drives them).

:class:`DecodeLM` is what a backend LM gives the loop: the torch LMs (:class:`~cosyserve.models.llm.SpeechLM` and
its subclasses) and the lite runtime's :class:`~cosyserve.runtime.lite.lm.StepLM` implement it. A row is
:class:`OneShot` (text known: the reference's ``inference``) or :class:`Streamed` (text arriving: the reference's
``inference_bistream``, whose text rules :class:`StreamedText` keeps, one piece at a time):

- one-shot: a prompt, ``min_len`` (before it id ``eos_token`` is masked), ``max_len``;
- a one-shot prompt's leading positions that depend on its voice alone (sos, [speaker,] the prompt text: the LM reads
  the new text after them) are its :class:`Prefix`: the first row with that prefix leaves their keys and values in
  a store (the model's :class:`~cosyserve.voices.voicestates.VoiceStates`), and every later row starts from them
  and prefills only the rest (causal attention: the same keys and values; positions continue where they end);
- streamed text: the prompt split after its head (:meth:`~cosyserve.core.sampling.StopRules.prompt_head`),
  prompt speech interleaved 15 : 5 with the text, a fill token forced 15 steps after the last one (or sampled),
  after which the row waits for 5 more text tokens; when the text ends, the rest of it and ``task_id`` follow and
  the row runs to the real EOS; every special id but the one each phase accepts is masked; at most ``ratio`` steps
  per text token received.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from cosyserve.core.sampling import ArrayOps, SamplingConfig, StopRules
from cosyserve.core.stop import ShouldStop

__all__ = [
    "DecodeLM",
    "OneShot",
    "Part",
    "Prefix",
    "PromptPrefix",
    "Streamed",
    "StreamedText",
    "TeacherForced",
    "length_limits",
    "one_shot",
]

# a piece of an LM input, embedded by the LM: ("text", ids), ("speech", ids) or ("special", [id])
Part = tuple[str, list[int]]


class DecodeLM(Protocol):
    """What a backend LM provides to the decode loop."""

    @property
    def rules(self) -> StopRules: ...

    @property
    def sampling(self) -> SamplingConfig: ...

    @property
    def ops(self) -> ArrayOps:
        """The array namespace and device its log-probabilities and ids live in."""
        ...

    def prompt(self, model_input: Mapping[str, Any]) -> tuple[Any, int]:
        """A one-shot prompt (1, T0, C) from the reference frontend's model-input dict (``text``, ``prompt_text``,
        ``llm_prompt_speech_token``, ``llm_embedding``; absent keys empty), and the text's length in tokens."""
        ...

    def embed(self, parts: list[Part]) -> Any:
        """(1, T, C) the embeddings of ``parts`` in order."""
        ...

    def reserve(self, rows: int, positions: int) -> None:
        """Caches for at least ``rows`` rows of ``positions`` each, keeping what every row holds."""
        ...

    def release(self) -> None:
        """Drop the caches."""
        ...

    def prefix_positions(self, model_input: Mapping[str, Any]) -> int:
        """How many leading positions of ``model_input``'s one-shot prompt depend on its prompt text (and speaker)
        alone, whatever its text: sos, [speaker,] prompt text; 0 when there is no prompt text or the model's input
        order does not allow it."""
        ...

    def save_prefix(self, row: int, positions: int) -> list[Any]:
        """Copies of what cache row ``row`` holds at positions ``[0, positions)``."""
        ...

    def load_prefix(self, arrays: list[Any], row: int) -> None:
        """Put :meth:`save_prefix`'s ``arrays`` back at the start of cache row ``row`` (reserved for them)."""
        ...

    def extend(self, x: Any, row: int, start: int, stop: ShouldStop | None = None) -> Any:
        """Run ``x`` (1, T, C) into cache row ``row`` from position ``start``; (1, V) float32 log-probabilities
        of the next token. ``stop`` (the row's request's stop signal) may end the run early by raising
        :class:`~cosyserve.core.stop.Stopped`."""
        ...

    def decode(
        self,
        tokens: Any,
        pos: Any,
        kv_len: int,
        rows: Any | None,
        stops: Sequence[ShouldStop | None] | None = None,
    ) -> Any:
        """One step of B rows: feed ``tokens`` (B,) int64 at positions ``pos`` (B,) of cache rows ``rows`` (B,),
        or rows 0..B-1 when None; ``kv_len`` > every position. (B, V) float32 log-probabilities. ``stops`` (each
        row's stop signal) may end a row's part of the step early: that row's log-probabilities are then
        meaningless, and the loop ends the row (it asks the signal after the step)."""
        ...


@dataclass
class PromptPrefix:
    """What a cache row held at the start of a prompt (:meth:`DecodeLM.save_prefix`): ``positions`` positions."""

    positions: int
    arrays: list[Any]

    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays)


@dataclass(frozen=True)
class Prefix:
    """A one-shot prompt's first ``positions`` positions, kept in ``store`` under ``key`` (a digest of what they
    are made of): ``store.prompt_prefix(key)`` gives a :class:`PromptPrefix` or None,
    ``store.keep_prompt_prefix(key, prefix)`` keeps one."""

    key: str
    positions: int
    store: Any

    def kept(self) -> PromptPrefix | None:
        return self.store.prompt_prefix(self.key)  # type: ignore[no-any-return]

    def keep(self, lm: DecodeLM, row: int) -> None:
        """Keep what cache row ``row`` holds at the prefix's positions."""
        arrays = lm.save_prefix(row, self.positions)
        self.store.keep_prompt_prefix(self.key, PromptPrefix(self.positions, arrays))


@dataclass
class OneShot:
    """A row whose text is known: the reference's ``inference``."""

    prompt: Any  # (1, T0, C)
    min_len: int  # no eos_token before this many tokens
    max_len: int  # at most this many tokens
    prefix: Prefix | None = None  # its leading positions, kept for the next row with the same


@dataclass
class Streamed:
    """A row whose text arrives in pieces: the reference's ``inference_bistream``."""

    text: Iterable[Any]  # pieces of text ids (anything whose items int() reads), in arrival order
    prompt_text: list[int]
    prompt_speech: list[int]
    max_len: int | None = None  # at most this many steps, fills included
    ratio: float | None = 20.0  # at most this many steps per text token received (the reference: no limit)


@dataclass
class TeacherForced:
    """A teacher-forced run: ``logprobs`` (steps, V) of every step (before any mask), ``step_tokens`` the id of
    every step (fills included), ``tokens`` the speech tokens it yielded."""

    logprobs: Any
    step_tokens: list[int]
    tokens: list[int]


def length_limits(text_len: int, min_ratio: float = 2.0, max_ratio: float = 20.0) -> tuple[int, int]:
    """(min_len, max_len) of a one-shot row for ``text_len`` text tokens (without prompt), truncated as the
    reference computes them."""
    return int(text_len * min_ratio), int(text_len * max_ratio)


def one_shot(
    lm: DecodeLM,
    model_input: Mapping[str, Any],
    *,
    max_tokens: int | None = None,
    min_ratio: float = 2.0,
    max_ratio: float = 20.0,
    prefixes: Any = None,
) -> OneShot:
    """The one-shot row of a model-input dict; ``max_tokens`` caps ``max_len`` (and ``min_len`` with it).
    ``prefixes``: where its prompt's :class:`Prefix` is kept (None: it is prefilled whole)."""
    prompt, text_len = lm.prompt(model_input)
    min_len, max_len = length_limits(text_len, min_ratio, max_ratio)
    if max_tokens is not None:
        max_len = min(max_len, max_tokens)
        min_len = min(min_len, max_len)
    n = lm.prefix_positions(model_input) if prefixes is not None else 0
    prefix = Prefix(prefix_key(lm.ops, model_input, n), n, prefixes) if n else None
    return OneShot(prompt, min_len, max_len, prefix)


def prefix_key(ops: ArrayOps, model_input: Mapping[str, Any], positions: int) -> str:
    """The digest a prompt's :class:`Prefix` is kept under: its positions, prompt text ids and speaker embedding
    (the LM's, whether or not its prefix holds it)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"positions={positions};".encode())
    for name, dtype in (("prompt_text", np.int64), ("llm_embedding", np.float32)):
        a = model_input.get(name)
        if a is not None:
            a = np.ascontiguousarray(ops.to_host(a) if hasattr(a, "shape") else np.asarray(a), dtype=dtype)
            h.update(f"{name}{a.shape};".encode())
            h.update(a.tobytes())
    return h.hexdigest()


class StreamedText:
    """A streamed-text row's text state: the reference's bistream loop, one piece at a time."""

    def __init__(self, rules: StopRules, spec: Streamed, head: int) -> None:
        n_speech = rules.mix_ratio[1]
        self.rules = rules
        self.lm_input: list[Part] = [("special", [rules.sos]), ("text", spec.prompt_text[:head])]
        self.cache = list(spec.prompt_text[head:])  # text ids waiting (the prompt's, after its head, first)
        self.pst = list(spec.prompt_speech)
        s = len(self.pst)
        self.next_fill = (s // n_speech + 1) * n_speech - s
        self.words = len(spec.prompt_text) - head  # text tokens received
        self.started = False  # the LM has decoded
        self.after_fill = False

    def piece(self, ids: list[int]) -> list[Part] | None:
        """The input to decode from once ``ids`` arrived, or None: wait for more text."""
        n_text, n_speech = self.rules.mix_ratio
        self.words += len(ids)
        self.cache += ids
        while self.pst and len(self.cache) >= n_text:
            self.lm_input += [("text", self.cache[:n_text]), ("speech", self.pst[:n_speech])]
            self.cache, self.pst = self.cache[n_text:], self.pst[n_speech:]
        if self.pst:
            return None
        if self.after_fill or (not self.started and sum(len(p[1]) for p in self.lm_input) == 1):
            if len(self.cache) < n_text:
                return None
            chunk: Part = ("text", self.cache[:n_text])
            self.lm_input = [chunk] if self.after_fill else self.lm_input + [chunk]
            self.cache = self.cache[n_text:]
        self.started, self.after_fill = True, False
        return self.lm_input

    def end(self) -> list[Part]:
        # the input of the step that produced the last fill is fed a second time, as the reference does
        return self.lm_input + [("text", self.cache), ("special", [self.rules.task_id])]
