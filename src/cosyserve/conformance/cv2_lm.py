"""Conformance kinds ``tokenize`` and ``llm_logprobs`` for CosyVoice2 sets (KINDS-cosyvoice2.md)."""

from __future__ import annotations

from typing import Any


def tokenizer2(ctx: Any) -> Any:
    from cosyserve.frontend.qwen_tokenizer import QwenTokenizer

    return QwenTokenizer.from_dir(ctx.model_dir / "CosyVoice-BlankEN")


def run_tokenize(ctx: Any, inputs: dict) -> dict:
    import torch

    return {"ids": torch.tensor(tokenizer2(ctx).encode(inputs["text"]), dtype=torch.int32)}


KINDS = {"tokenize": run_tokenize}


def llm2(ctx: Any) -> Any:
    """The set's Qwen2 LM (from the model dir, or from its bundle with --via-bundle), loaded once."""
    return ctx.llm()


def run_llm_logprobs(ctx: Any, inputs: dict) -> dict:
    import torch

    def ids(x: Any) -> Any:
        return x.to(torch.int32)

    def n(x: Any) -> Any:
        return torch.tensor([x.shape[1]], dtype=torch.int32)

    text, prompt_text, prompt_speech = (
        ids(inputs["text"]),
        ids(inputs["prompt_text"]),
        ids(inputs["prompt_speech_token"]),
    )
    logprobs, min_len, max_len = llm2(ctx).teacher_forced_logprobs(
        text, n(text), prompt_text, n(prompt_text), prompt_speech, n(prompt_speech), inputs["embedding"].float(),
        inputs["teacher_tokens"],
    )  # fmt: skip
    return {"logprobs": logprobs, "min_len": min_len, "max_len": max_len}


KINDS["llm_logprobs"] = run_llm_logprobs
