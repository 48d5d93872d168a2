"""Conformance kinds of CosyVoice2 sets (``KINDS-cosyvoice2.md``).

``tokenize`` and ``llm_logprobs`` (the Qwen tokenizer and LM), ``flow_inference`` (the causal flow, its fixed noise
reproduced, not passed), ``hift_inference`` (the 24 kHz HiFT with the recorded draws), ``mel`` (the 24 kHz prompt
mel), ``token2wav_stream`` / ``token2wav_full`` (the reference's vc branch of ``CosyVoice2Model.tts``: all tokens
at once, the reference's chunk rules, the vocoder's recorded draws per call), the prompt frontends
(``zero_shot_frontend``, ``cross_lingual_frontend``, ``instruct2_frontend``: the 300M frontend's code with
CosyVoice2's parts and its trimming to 2 mel frames per token), and ``whisper_logmel`` / ``resample``, which mean
the same as for every family (:mod:`cosyserve.tools.conformance.kinds_features`). CosyVoice3's kinds
(:mod:`cosyserve.families.cosyvoice3.conformance`) reuse these functions on CosyVoice3's modules and frontend.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from cosyserve.tools.conformance import kinds_features, kinds_lm

__all__ = ["KINDS", "vc_chunks"]


def frontend2(ctx: Any) -> Any:
    """The set's CosyVoice2 frontend, built once per run (its ONNX sessions open on first use)."""
    if "cv2_frontend" not in ctx.cache:
        ctx.cache["cv2_frontend"] = ctx.family.frontend(ctx.model_dir, ctx.config)
    return ctx.cache["cv2_frontend"]


def run_tokenize(ctx: Any, inputs: dict) -> dict:
    import torch

    build = ctx.family.tokenizer(ctx.model_dir)
    assert build is not None, "a Qwen family builds its own tokenizer"
    tokenizer = build()
    return {"ids": torch.tensor(tokenizer.encode(inputs["text"]), dtype=torch.int32)}


def run_flow_inference(ctx: Any, inputs: dict) -> dict:
    # `flow_noise` is not passed on: the flow must reproduce the reference's fixed noise itself.
    mel = ctx.flow().inference(
        inputs["token"],
        inputs["prompt_token"],
        inputs["prompt_feat"].float(),
        inputs["embedding"].float(),
        streaming=bool(inputs["streaming"]),
        finalize=bool(inputs["finalize"]),
    )
    return {"mel": mel}


def run_hift_inference(ctx: Any, inputs: dict) -> dict:
    # draws recorded: sine_rand_ini [1, 9], sine_noise [1, L, 9], source_noise (unused by any output)
    speech, source = ctx.hift().inference(
        inputs["speech_feat"],
        inputs["cache_source"],
        sine_phase=inputs["sine_rand_ini"],
        sine_noise=inputs["sine_noise"],
    )
    return {"speech": speech, "source": source}


def run_mel(ctx: Any, inputs: dict) -> dict:
    from cosyserve.frontend.features import mel_spectrogram_24k

    return {"mel": mel_spectrogram_24k(inputs["speech"].float())}


def run_token2wav(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    from cosyserve.families.cosyvoice2.token2wav import Token2Wav2

    calls = sorted(
        {int(k[1 : k.index("_")]) for k in inputs if k.startswith("c") and k.endswith("_sine_noise")}
    )
    draws = iter(
        {"sine_phase": inputs[f"c{c}_sine_rand_ini"], "sine_noise": inputs[f"c{c}_sine_noise"]} for c in calls
    )
    t2w = Token2Wav2(ctx.flow(), ctx.hift())  # the reference policy: hops 25 (+ prompt pad), 50, 100
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


# Each frontend kind takes the frontend to run (default CosyVoice2's): CosyVoice3's kinds are the same calls on its own.


def run_zero_shot_frontend(ctx: Any, inputs: dict[str, Any], frontend: Any = None) -> dict[str, Any]:
    return (frontend or frontend2(ctx)).frontend_zero_shot(
        inputs["tts_text"],
        inputs["prompt_text"],
        ctx.set_dir / inputs["prompt_wav"],
    )


def run_cross_lingual_frontend(ctx: Any, inputs: dict[str, Any], frontend: Any = None) -> dict[str, Any]:
    return (frontend or frontend2(ctx)).frontend_cross_lingual(
        inputs["tts_text"], ctx.set_dir / inputs["prompt_wav"]
    )


def run_instruct2_frontend(ctx: Any, inputs: dict[str, Any], frontend: Any = None) -> dict[str, Any]:
    # the reference's frontend_instruct2: frontend_zero_shot with the instruction as the prompt text, minus the
    # LLM's prompt speech tokens
    out = (frontend or frontend2(ctx)).frontend_zero_shot(
        inputs["tts_text"],
        inputs["instruct_text"],
        ctx.set_dir / inputs["prompt_wav"],
    )
    out.pop("llm_prompt_speech_token")
    out.pop("llm_prompt_speech_token_len")
    return out


KINDS = {
    "tokenize": run_tokenize,
    "llm_logprobs": kinds_lm.run_llm_logprobs,
    "flow_inference": run_flow_inference,
    "hift_inference": run_hift_inference,
    "mel": run_mel,
    "whisper_logmel": kinds_features.run_whisper_logmel,
    "resample": kinds_features.run_resample,
    "token2wav_stream": run_token2wav,
    "token2wav_full": run_token2wav,
    "zero_shot_frontend": run_zero_shot_frontend,
    "cross_lingual_frontend": run_cross_lingual_frontend,
    "instruct2_frontend": run_instruct2_frontend,
}
