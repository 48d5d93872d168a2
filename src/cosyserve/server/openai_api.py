"""OpenAI-compatible routes: ``POST /v1/audio/speech``, ``GET /v1/models``, ``GET /v1/audio/voices``.

``model`` is a pool model name, or one of OpenAI's (``tts-1``, ``tts-1-hd``, ``gpt-4o-mini-tts``) for the default
model. ``voice`` is a speaker of the model, a voice registered for the caller's tenant (spoken in zero-shot
mode), or one of OpenAI's voice names (alloy, echo, ...), which always mean the default voice
(``--default-voice``; else the model's first speaker). ``instructions`` switches to instruct mode.
``stream`` (an extension; the openai client sends it through ``extra_body``) makes the engine emit audio
every ~2 s of speech tokens and the response stream it; without it, audio is cut per sentence and, for
wav/pcm/opus, still sent as it comes.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cosyserve.errors import PayloadTooLargeError, UnsupportedMediaTypeError, shown
from cosyserve.server.schemas import parse_speech_request
from cosyserve.server.synth import synthesis_request, synthesize_response

__all__ = ["OPENAI_VOICES", "PARAMS", "routes"]

# request fields -> this route's names (an error names its field in the response's `param`)
PARAMS = {"text": "input", "speaker": "voice", "instruct_text": "instructions"}

OPENAI_VOICES = (
    "alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse", "marin", "cedar",
)  # fmt: skip


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) more than ``limit`` bytes without reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"the body is {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"the body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def voice_list(state: Any, model: str, tenant: str | None) -> list[dict[str, Any]]:
    """The voices of ``model`` for ``tenant`` (none while the model is not loaded)."""
    eng = state.pool.engine(model)
    runtime = eng.runtime if eng is not None else None
    if runtime is None:
        return []
    return [{"voice_id": v.name, "name": v.name, "kind": v.kind} for v in runtime.voices(tenant or "default")]


def routes(state: Any) -> list[Route]:
    async def speech(request: Request) -> Response:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise UnsupportedMediaTypeError(
                f"Content-Type must be application/json, got {shown(ctype or 'none')}"
            )
        sr = parse_speech_request(await read_body(request, state.config.max_body_bytes))
        tenant = state.tenant_of(request)
        model = state.resolve_model(sr.model, tenant)
        # an OpenAI voice name means the default voice (configured, else the model's first speaker); any other
        # name is a speaker or a registered voice, whose kind decides the mode (the runtime knows the voices)
        speaker = sr.voice
        if sr.voice.lower() in OPENAI_VOICES:
            speaker = state.config.default_voice
        fields: dict[str, Any] = {"mode": None}
        if sr.instructions.strip():
            fields = {"mode": "instruct", "instruct_text": sr.instructions}
        req = synthesis_request(
            state,
            request,
            text=sr.input,
            speaker=speaker,
            stream=sr.stream,
            speed=sr.speed,
            seed=sr.seed,
            **fields,
        )
        return await synthesize_response(
            state, request, route="/v1/audio/speech", model=model, req=req, fmt=sr.response_format
        )

    async def models(request: Request) -> Response:
        desc = state.describe_models()
        data = [
            {
                "id": name,
                "object": "model",
                "owned_by": "cosyserve",
                "state": desc[name]["state"],
                "demo": state.demo,
                **({"note": "random weights, it makes noise, not speech"} if state.demo else {}),
            }
            for name in state.pool.visible(state.tenant_of(request))
        ]
        return JSONResponse({"object": "list", "data": data})

    async def voices(request: Request) -> Response:
        tenant = state.tenant_of(request)
        model = state.resolve_model(request.query_params.get("model"), tenant)
        return JSONResponse(
            {
                "model": model,
                "state": state.describe_models()[model]["state"],
                "voices": voice_list(state, model, tenant),
                "aliases": {v: "default voice" for v in OPENAI_VOICES},
            }
        )

    return [
        Route("/v1/audio/speech", speech, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/audio/voices", voices, methods=["GET"]),
    ]
