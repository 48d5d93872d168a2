"""The decode loop's one-off runs in the argument order the LM tests keep their inputs in: (text, text_len,
prompt_text, prompt_text_len, prompt_speech_token, prompt_speech_token_len, embedding)."""

from __future__ import annotations

from typing import Any

import torch

from cosyserve.core.sampling import row_key
from cosyserve.runtime.lm import one_shot
from cosyserve.runtime.oneoff import generate, teacher_forced


def model_input(args: tuple) -> dict[str, Any]:
    text, _, prompt_text, _, prompt_speech, _, embedding = args
    return {
        "text": text,
        "prompt_text": prompt_text,
        "llm_prompt_speech_token": prompt_speech,
        "llm_embedding": embedding,
    }


def tf(lm: Any, args: tuple, teacher: Any) -> tuple[torch.Tensor, int, int]:
    """(logprobs (K, V), min_len, max_len) of ``teacher`` fed back."""
    row = one_shot(lm, model_input(args))
    tokens = [int(t) for t in torch.as_tensor(teacher).reshape(-1).tolist()]
    return teacher_forced(lm, row, tokens).logprobs, row.min_len, row.max_len


def sample(
    lm: Any,
    args: tuple,
    seed: int,
    *,
    min_token_text_ratio: float = 2.0,
    max_token_text_ratio: float = 20.0,
    max_tokens: int | None = None,
    lag: int | None = None,
) -> list[int]:
    """The tokens a one-shot row samples for ``seed``."""
    row = one_shot(
        lm,
        model_input(args),
        max_tokens=max_tokens,
        min_ratio=min_token_text_ratio,
        max_ratio=max_token_text_ratio,
    )
    return list(generate(lm, row, row_key(seed), lag=lag))
