"""Conformance kinds of CosyVoice2's prompt frontends: ``zero_shot_frontend``, ``cross_lingual_frontend``,
``instruct2_frontend`` (KINDS-cosyvoice2.md): the 300M frontend's code with CosyVoice2's parts (the Qwen
tokenizer, the 24 kHz prompt mel, ``speech_tokenizer_v2.onnx``) and its trimming to 2 mel frames per token."""

from __future__ import annotations

from typing import Any


def frontend2(ctx: Any) -> Any:
    """The set's CosyVoice2 frontend, built once per run (its ONNX sessions open on first use)."""
    if "cv2_frontend" not in ctx.cache:
        ctx.cache["cv2_frontend"] = ctx.family.frontend(ctx.model_dir, ctx.config)
    return ctx.cache["cv2_frontend"]


# Each kind takes the frontend to run (default CosyVoice2's): CosyVoice3's kinds are the same calls on its own.


def run_zero_shot_frontend(ctx: Any, inputs: dict[str, Any], frontend: Any = None) -> dict[str, Any]:
    return (frontend or frontend2(ctx)).frontend_zero_shot(
        inputs["tts_text"],
        inputs["prompt_text"],
        ctx.set_dir / inputs["prompt_wav"],
        int(inputs["resample_rate"]),
    )


def run_cross_lingual_frontend(ctx: Any, inputs: dict[str, Any], frontend: Any = None) -> dict[str, Any]:
    return (frontend or frontend2(ctx)).frontend_cross_lingual(
        inputs["tts_text"], ctx.set_dir / inputs["prompt_wav"], int(inputs["resample_rate"])
    )


def run_instruct2_frontend(ctx: Any, inputs: dict[str, Any], frontend: Any = None) -> dict[str, Any]:
    # the reference's frontend_instruct2: frontend_zero_shot with the instruction as the prompt text, minus the
    # LLM's prompt speech tokens
    out = (frontend or frontend2(ctx)).frontend_zero_shot(
        inputs["tts_text"],
        inputs["instruct_text"],
        ctx.set_dir / inputs["prompt_wav"],
        int(inputs["resample_rate"]),
    )
    out.pop("llm_prompt_speech_token")
    out.pop("llm_prompt_speech_token_len")
    return out


KINDS = {
    "zero_shot_frontend": run_zero_shot_frontend,
    "cross_lingual_frontend": run_cross_lingual_frontend,
    "instruct2_frontend": run_instruct2_frontend,
}
