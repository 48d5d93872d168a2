"""Conformance kinds of the text and prompt frontends: ``text_frontend``, ``zero_shot_frontend``,
``cross_lingual_frontend``, ``instruct_frontend``."""

from __future__ import annotations

from typing import Any


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
        int(inputs["resample_rate"]),
        inputs.get("zero_shot_spk_id", ""),
    )


def run_cross_lingual_frontend(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    return _frontend(ctx).frontend_cross_lingual(
        inputs["tts_text"],
        ctx.set_dir / inputs["prompt_wav"],
        int(inputs["resample_rate"]),
        inputs.get("zero_shot_spk_id", ""),
    )


def run_instruct_frontend(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    return _frontend(ctx).frontend_instruct(inputs["tts_text"], inputs["spk_id"], inputs["instruct_text"])


KINDS = {
    "text_frontend": run_text_frontend,
    "zero_shot_frontend": run_zero_shot_frontend,
    "cross_lingual_frontend": run_cross_lingual_frontend,
    "instruct_frontend": run_instruct_frontend,
}
