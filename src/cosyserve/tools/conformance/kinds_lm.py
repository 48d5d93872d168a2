"""The teacher-forced LM kinds (``llm_logprobs``, ``llm_bistream_logprobs``), one function each for every family
and both runtimes: the decode loop (:func:`cosyserve.runtime.decode.teacher_forced`) over the set's LM, the torch
modules or the lite runtime's graphs."""

from __future__ import annotations

from typing import Any

__all__ = ["llm_bistream_logprobs", "llm_logprobs", "run_llm_bistream_logprobs", "run_llm_logprobs"]


def llm_logprobs(lm: Any, model_input: dict[str, Any], teacher: list[int]) -> dict[str, Any]:
    """Each step's log-probabilities (before any mask) when ``teacher`` is fed back, and the length limits."""
    from cosyserve.runtime.lm import one_shot
    from cosyserve.runtime.oneoff import teacher_forced

    row = one_shot(lm, model_input)
    return {
        "logprobs": teacher_forced(lm, row, teacher).logprobs,
        "min_len": row.min_len,
        "max_len": row.max_len,
    }


def run_llm_logprobs(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """The ``llm_logprobs`` kind on the torch modules (every family)."""
    import torch

    def ids(name: str) -> Any:
        return inputs[name].to(torch.int32)

    model_input = {
        "text": ids("text"),
        "prompt_text": ids("prompt_text"),
        "llm_prompt_speech_token": ids("prompt_speech_token"),
        "llm_embedding": inputs["embedding"].float(),
    }
    return llm_logprobs(ctx.llm(), model_input, inputs["teacher_tokens"].reshape(-1).tolist())


def run_llm_bistream_logprobs(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """The ``llm_bistream_logprobs`` kind on the torch modules."""

    def ids(name: str) -> list[int]:
        return [int(t) for t in inputs[name].reshape(-1).tolist()]

    return llm_bistream_logprobs(
        ctx.llm(), ids("text"), ids("prompt_text"), ids("prompt_speech_token"), ids("teacher_tokens")
    )


def llm_bistream_logprobs(
    lm: Any, text: list[int], prompt_text: list[int], prompt_speech: list[int], teacher: list[int]
) -> dict[str, Any]:
    """The streamed-text run of ``text`` (one id at a time) with ``teacher``'s ids in place of samples (forced
    fills take none): every step's log-probabilities and id, and the speech tokens it yields."""
    from cosyserve.runtime.lm import Streamed
    from cosyserve.runtime.oneoff import teacher_forced

    spec = Streamed(([t] for t in text), prompt_text, prompt_speech, max_len=None, ratio=None)
    run = teacher_forced(lm, spec, teacher)
    return {"logprobs": run.logprobs, "step_tokens": run.step_tokens, "tokens": run.tokens}
