"""One-off runs of the decode loop in the caller's thread (one row, no loop thread): a row's tokens, a
teacher-forced run, an LM's warm-up. The tools (conformance, the quality gate, benchmarks) and the warm-ups use
these; serving goes through the runtime's own loop."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from cosyserve.runtime.decode import DecodeLoop
from cosyserve.runtime.lm import DecodeLM, OneShot, Streamed, TeacherForced, one_shot

__all__ = ["generate", "teacher_forced", "warm_up"]


def generate(lm: DecodeLM, spec: OneShot | Streamed, key: int, *, lag: int | None = None) -> Iterator[int]:
    """One row's speech tokens, decoded in the caller's thread (a one-off loop over ``lm``)."""
    return DecodeLoop(lm, 1, lag=lag, threaded=False, name="one-off").generate(spec, key)


def teacher_forced(lm: DecodeLM, spec: OneShot | Streamed, tokens: Iterable[int]) -> TeacherForced:
    """Run ``spec`` with ``tokens`` in place of samples (one-shot: one per step; streamed text: one per step that
    is not a forced fill) and keep every step's log-probabilities.

    Raises:
        ValueError: streamed text: a token the phase does not accept (a special id other than fill while the text
            arrives, other than EOS after), or too few tokens.
    """
    loop = DecodeLoop(lm, 1, lag=0, threaded=False, name="teacher-forced")
    teacher = [int(t) for t in tokens]
    if isinstance(spec, OneShot):
        spec = OneShot(spec.prompt, 0, len(teacher))
    record: list[Any] = []
    out = list(loop.generate(spec, 0, teacher=teacher, record=record))
    xp = lm.ops.xp
    logprobs = (
        xp.stack([lp for lp, _ in record]) if record else xp.zeros((0, lm.rules.vocab), dtype=xp.float32)
    )
    return TeacherForced(logprobs, [int(t) for _, t in record], out)


def warm_up(lm: DecodeLM, model_input: Mapping[str, Any], n_tokens: int) -> list[int]:
    """Decode exactly ``n_tokens`` tokens (no early EOS) for ``model_input`` in the caller's thread: prefill,
    decode steps and sampling run once; the caches are released after."""
    text_len = max(lm.prompt(model_input)[1], 1)
    ratio = max(n_tokens, 1) / text_len
    try:
        return list(generate(lm, one_shot(lm, model_input, min_ratio=ratio, max_ratio=ratio), 0))
    finally:
        lm.release()
