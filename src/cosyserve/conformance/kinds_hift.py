"""Conformance kind ``hift_inference``: mel -> waveform with the reference's recorded source draws."""

from __future__ import annotations

from typing import Any


def run_hift_inference(ctx: Any, inputs: dict) -> dict:
    # Draws recorded: sine_phase, sine_noise, source_noise (in that order). source_noise feeds no output of the
    # reference (the unused noise branch of SourceModuleHnNSF), so it is accepted and not used.
    speech, source = ctx.hift().inference(
        inputs["speech_feat"],
        inputs["cache_source"],
        sine_phase=inputs["sine_phase"],
        sine_noise=inputs["sine_noise"],
    )
    return {"speech": speech, "source": source}


KINDS = {"hift_inference": run_hift_inference}
