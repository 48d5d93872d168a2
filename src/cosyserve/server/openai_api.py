"""OpenAI-compatible routes: ``POST /v1/audio/speech``, ``GET /v1/models``, ``GET /v1/audio/voices``.

``model`` is a pool model name, or one of OpenAI's (``tts-1``, ``tts-1-hd``, ``gpt-4o-mini-tts``) for the default
model. ``voice`` is a speaker of the model, a voice registered for the caller's tenant (spoken in zero-shot
mode), or one of OpenAI's voice names (alloy, echo, ...), which mean the default voice
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

from cosyserve.engine.engine import shared
from cosyserve.errors import CosyserveError
from cosyserve.server.errors import HTTPError, from_engine_error
from cosyserve.server.schemas import parse_speech_request
from cosyserve.server.synth import engine_request, new_request_id, synthesize_response

__all__ = ["OPENAI_VOICES", "routes"]

# the engine's request fields -> this route's (an engine error names its field in the response's `param`)
_PARAMS = {"text": "input", "speaker": "voice", "instruct_text": "instructions"}

OPENAI_VOICES = (
    "alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse", "marin", "cedar",
)  # fmt: skip


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) more than ``limit`` bytes without reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPError(413, f"the body is {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPError(413, f"the body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def loaded_engine(state: Any, model: str) -> Any:
    """The model's engine, loading it first if it is not resident (a lazy model's first request)."""
    eng = state.pool.engine(model)
    if eng is None or eng.state.value != "ready":
        eng = await shared(state.pool.start_load(model))
    return eng


def voice_known(eng: Any, name: str, tenant: str | None) -> bool | None:
    """Whether ``name`` is a pre-defined speaker of ``eng`` or a voice registered for ``tenant``; None: can't tell.

    Checked before submitting so that an unknown voice is a 400 naming the field, not the engine's bare 400.
    """
    if name in eng.speakers:
        return True
    registry = getattr(eng.resident_hint, "registry", None) if eng.resident_hint is not None else None
    if registry is None:
        return None
    try:
        return registry.get(name, tenant or "default") is not None
    except Exception:  # noqa: BLE001 - a name the registry cannot hold (a path, too long) is no voice
        return False


def unknown_voice(name: str, model: str, param: str) -> HTTPError:
    return HTTPError(
        400,
        f"unknown {param} {name!r}: not a speaker of model {model!r} nor a voice registered for this API key "
        "(GET /v1/audio/voices lists them)",
        param=param,
        code="voice_not_found",
    )


def speaker_list(state: Any, model: str, tenant: str | None) -> list[dict[str, Any]]:
    eng = state.pool.engine(model)
    voices: list[dict[str, Any]] = []
    if eng is None or eng.resident_hint is None:
        return voices
    for s in eng.speakers:
        voices.append({"voice_id": s, "name": s, "kind": "pre-defined"})
    try:
        registered = eng.resident_hint.list_speakers(tenant or "default")
    except Exception:  # noqa: BLE001 - a model without a registry lists its pre-defined speakers only
        registered = []
    for sp in registered:
        name = getattr(sp, "name", str(sp))
        voices.append({"voice_id": name, "name": name, "kind": "registered"})
    return voices


def routes(state: Any) -> list[Route]:
    def default_voice(eng: Any) -> str:
        if state.config.default_voice:
            return str(state.config.default_voice)
        if not eng.speakers:
            raise HTTPError(
                400, "this model has no pre-defined speakers; name a registered voice", param="voice"
            )
        return str(eng.speakers[0])

    async def speech(request: Request) -> Response:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise HTTPError(415, f"Content-Type must be application/json, got {ctype or 'none'!r}")
        body = await read_body(request, state.config.max_body_bytes)
        sr = parse_speech_request(body, state.config.max_text_chars)
        tenant = state.tenant_of(request)
        model = state.resolve_model(sr.model, tenant)
        if state.draining:
            raise HTTPError(503, "the server is shutting down", headers={"Retry-After": "1"})
        eng = await loaded_engine(state, model)
        voice = sr.voice
        mode, speaker = "sft", voice
        if voice not in eng.speakers:
            if voice.lower() in OPENAI_VOICES:
                speaker = default_voice(eng)
            elif voice_known(eng, voice, tenant) is False:
                raise unknown_voice(voice, model, "voice")
            else:
                mode = "zero_shot"  # a registered voice of this tenant
        fields: dict[str, Any] = {}
        if sr.instructions.strip():
            if mode != "sft":
                raise HTTPError(400, "instructions need a pre-defined speaker as voice", param="instructions")
            mode, fields = "instruct", {"instruct_text": sr.instructions}
        ereq = engine_request(
            state,
            new_request_id(request),
            text=sr.input,
            speaker=speaker,
            mode=mode,
            stream=sr.stream,
            speed=sr.speed,
            seed=sr.seed,
            tenant=tenant,
            **fields,
        )
        try:
            return await synthesize_response(
                state,
                request,
                route="/v1/audio/speech",
                model=model,
                ereq=ereq,
                fmt=sr.response_format,
                tenant=tenant,
            )
        except CosyserveError as e:
            raise from_engine_error(e, _PARAMS) from e

    async def models(request: Request) -> Response:
        tenant = state.tenant_of(request)
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
            for name in state.visible_models(tenant)
        ]
        return JSONResponse({"object": "list", "data": data})

    async def voices(request: Request) -> Response:
        tenant = state.tenant_of(request)
        model = state.resolve_model(request.query_params.get("model"), tenant)
        voices = speaker_list(state, model, tenant)
        return JSONResponse(
            {
                "model": model,
                "state": state.describe_models()[model]["state"],
                "voices": voices,
                "aliases": {v: "default voice" for v in OPENAI_VOICES},
            }
        )

    return [
        Route("/v1/audio/speech", speech, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/audio/voices", voices, methods=["GET"]),
    ]
