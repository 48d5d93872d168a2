"""Conformance kind for the CosyVoice2 flow: `flow_inference` (KINDS-cosyvoice2.md)."""

from __future__ import annotations

from typing import Any


def flow2(ctx: Any) -> Any:
    """The set's CosyVoice2 flow (from the model dir, or from its bundle with --via-bundle), loaded once."""
    return ctx.flow()


def run_flow_inference(ctx: Any, inputs: dict) -> dict:
    # `flow_noise` is not passed on: the flow must reproduce the reference's fixed noise itself.
    mel = flow2(ctx).inference(
        inputs["token"],
        inputs["prompt_token"],
        inputs["prompt_feat"].float(),
        inputs["embedding"].float(),
        streaming=bool(inputs["streaming"]),
        finalize=bool(inputs["finalize"]),
    )
    return {"mel": mel}


KINDS = {"flow_inference": run_flow_inference}
