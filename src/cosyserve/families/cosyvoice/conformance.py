"""Conformance kinds of CosyVoice-300M sets (``KINDS.md``).

``tokenize`` (the whisper tokenizer), ``llm_logprobs`` (teacher-forced log-probabilities through the decode loop,
:mod:`cosyserve.tools.conformance.kinds_lm`), ``flow_inference`` and
``hift_inference`` (with the reference's recorded draws), ``token2wav_stream`` / ``token2wav_full`` (the reference's
vc branch of ``tts``), the text and prompt frontends (``text_frontend``, ``zero_shot_frontend``,
``cross_lingual_frontend``, ``instruct_frontend``). The audio features' kinds (``mel``, ``fbank``,
``whisper_logmel``, ``resample``) are in :mod:`cosyserve.tools.conformance.kinds_features`, shared by every family.
Imports are lazy, so that a run of one kind imports only what it needs (the text frontend's opens no ONNX session
and loads no FST).
"""

from __future__ import annotations

from typing import Any

from cosyserve.tools.conformance import kinds_lm

__all__ = ["KINDS"]


def _len(x: Any) -> Any:
    import torch

    return torch.tensor([x.shape[1]], dtype=torch.int32)


def run_tokenize(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    import torch

    from cosyserve.frontend.tokenizer import get_tokenizer

    ids = get_tokenizer().encode(inputs["text"])
    return {"ids": torch.tensor(ids, dtype=torch.int32)}


def run_flow_inference(ctx: Any, inputs: dict) -> dict:
    import torch

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


def run_token2wav(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    from cosyserve.families.cosyvoice.token2wav import CallDraws, Token2Wav

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


def _frontend(ctx: Any) -> Any:
    # kept on the context, so the ONNX sessions are created once per conformance run
    frontend = getattr(ctx, "_cosyserve_frontend", None)
    if frontend is None:
        from cosyserve.frontend.zeroshot import Frontend

        frontend = Frontend(ctx.model_dir, ctx.speakers)
        ctx._cosyserve_frontend = frontend
    return frontend


def run_text_frontend(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    from cosyserve.frontend.text import text_normalize

    return {"texts": text_normalize(inputs["text"], split=bool(inputs.get("split", True)))}


def run_zero_shot_frontend(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    return _frontend(ctx).frontend_zero_shot(
        inputs["tts_text"],
        inputs["prompt_text"],
        ctx.set_dir / inputs["prompt_wav"],
        inputs.get("zero_shot_spk_id", ""),
    )


def run_cross_lingual_frontend(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    return _frontend(ctx).frontend_cross_lingual(
        inputs["tts_text"],
        ctx.set_dir / inputs["prompt_wav"],
        inputs.get("zero_shot_spk_id", ""),
    )


def run_instruct_frontend(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    return _frontend(ctx).frontend_instruct(inputs["tts_text"], inputs["spk_id"], inputs["instruct_text"])


KINDS = {
    "tokenize": run_tokenize,
    "llm_logprobs": kinds_lm.run_llm_logprobs,
    "flow_inference": run_flow_inference,
    "hift_inference": run_hift_inference,
    "token2wav_stream": run_token2wav,
    "token2wav_full": run_token2wav,
    "text_frontend": run_text_frontend,
    "zero_shot_frontend": run_zero_shot_frontend,
    "cross_lingual_frontend": run_cross_lingual_frontend,
    "instruct_frontend": run_instruct_frontend,
}
