"""Conformance kinds of the text side: ``tokenize``."""

from __future__ import annotations

from typing import Any

import torch


def run_tokenize(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    from cosyserve.frontend.tokenizer import get_tokenizer

    ids = get_tokenizer().encode(inputs["text"])
    return {"ids": torch.tensor(ids, dtype=torch.int32)}


KINDS = {"tokenize": run_tokenize}
