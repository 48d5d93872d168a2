"""Conformance kind for the flow model: `flow_inference`."""

from __future__ import annotations

from typing import Any

import torch


def run_flow_inference(ctx: Any, inputs: dict) -> dict:
    flow = ctx.flow()
    token = inputs["token"].long()
    prompt_token = inputs["prompt_token"].long()
    prompt_feat = inputs["prompt_feat"].float()
    mel, cache = flow.inference(
        token,
        torch.tensor([token.shape[1]]),
        prompt_token,
        torch.tensor([prompt_token.shape[1]]),
        prompt_feat,
        torch.tensor([prompt_feat.shape[1]]),
        inputs["embedding"].float(),
        inputs["flow_cache"].float(),
        noise=inputs["flow_noise"].float(),
    )
    return {"mel": mel, "flow_cache": cache}


KINDS = {"flow_inference": run_flow_inference}
