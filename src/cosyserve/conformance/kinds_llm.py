"""Conformance kind for the speech-token LM: `llm_logprobs` (teacher-forced log-probabilities)."""

from __future__ import annotations

from typing import Any

import torch


def _len(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor([x.shape[1]], dtype=torch.int32)


def run_llm_logprobs(ctx: Any, inputs: dict) -> dict:
    text, prompt_text = inputs["text"], inputs["prompt_text"]
    prompt_speech_token = inputs["prompt_speech_token"]
    logprobs, min_len, max_len = ctx.llm().teacher_forced_logprobs(
        text,
        _len(text),
        prompt_text,
        _len(prompt_text),
        prompt_speech_token,
        _len(prompt_speech_token),
        inputs["embedding"].float(),
        inputs["teacher_tokens"],
    )
    return {"logprobs": logprobs, "min_len": min_len, "max_len": max_len}


KINDS = {"llm_logprobs": run_llm_logprobs}
