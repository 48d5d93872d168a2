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
