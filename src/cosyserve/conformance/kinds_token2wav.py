"""Conformance kinds ``token2wav_stream`` and ``token2wav_full``: the reference's vc branch of ``tts``."""

from __future__ import annotations

from typing import Any

from cosyserve.runtime.token2wav import CallDraws, Token2Wav


def run_token2wav(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    calls = sorted(
        {int(k[1 : k.index("_")]) for k in inputs if k.startswith("c") and k.endswith("_flow_noise")}
    )
    draws = iter(
        CallDraws(
            flow_noise=inputs[f"c{c}_flow_noise"],
            sine_phase=inputs[f"c{c}_sine_phase"],
            sine_noise=inputs[f"c{c}_sine_noise"],
        )
        for c in calls
    )
    t2w = Token2Wav(ctx.flow(), ctx.hift())
    chunks = list(
        t2w(
            inputs["source_speech_token"].flatten().tolist(),
            embedding=inputs["flow_embedding"],
            prompt_token=inputs["flow_prompt_speech_token"],
            prompt_feat=inputs["prompt_speech_feat"],
            stream=bool(inputs["stream"]),
            speed=float(inputs["speed"]),
            draws=draws,
        )
    )
    out: dict[str, Any] = {f"chunk{i}": c for i, c in enumerate(chunks)}
    out["num_chunks"] = len(chunks)
    return out


KINDS = {"token2wav_stream": run_token2wav, "token2wav_full": run_token2wav}
