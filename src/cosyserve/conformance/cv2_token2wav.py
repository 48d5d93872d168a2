"""Conformance kinds ``token2wav_stream`` / ``token2wav_full`` for CosyVoice2 sets: the reference's vc branch of
``CosyVoice2Model.tts`` (all tokens at once), with the reference's chunk rules (:mod:`cosyserve.runtime.token2wav2`)
and the vocoder's recorded draws per call. The flow's noise is its fixed buffer (not an input)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from cosyserve.conformance.cv2_audio import hift2
from cosyserve.conformance.cv2_flow import flow2


def run_token2wav(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    from cosyserve.runtime.token2wav2 import Token2Wav2

    calls = sorted(
        {int(k[1 : k.index("_")]) for k in inputs if k.startswith("c") and k.endswith("_sine_noise")}
    )
    draws = iter(
        {"sine_phase": inputs[f"c{c}_sine_rand_ini"], "sine_noise": inputs[f"c{c}_sine_noise"]} for c in calls
    )
    t2w = Token2Wav2(flow2(ctx), hift2(ctx))  # the reference policy: hops 25 (+ prompt pad), 50, 100
    return vc_chunks(t2w, inputs, draws)


def vc_chunks(t2w: Any, inputs: dict[str, Any], draws: Iterator[dict[str, Any]]) -> dict[str, Any]:
    """The case's outputs: ``t2w`` (a Token2Wav2 or a subclass) on the vc branch's inputs, with ``draws``."""
    chunks = list(
        t2w(
            inputs["source_speech_token"].flatten().tolist(),
            embedding=inputs["flow_embedding"].float(),
            prompt_token=inputs["flow_prompt_speech_token"],
            prompt_feat=inputs["prompt_speech_feat"].float(),
            stream=bool(inputs["stream"]),
            speed=float(inputs["speed"]),
            draws=draws,
        )
    )
    out: dict[str, Any] = {f"chunk{i}": c for i, c in enumerate(chunks)}
    out["num_chunks"] = len(chunks)
    return out


KINDS = {"token2wav_stream": run_token2wav, "token2wav_full": run_token2wav}
