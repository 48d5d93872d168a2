"""OpenAI-compatible routes: ``POST /v1/audio/speech``, ``GET /v1/models`` (the voices are :mod:`cosyserve.server.transports.voices`).

``model`` is a pool model name, or one of OpenAI's (``tts-1``, ``tts-1-hd``, ``gpt-4o-mini-tts``) for the default
model. ``voice`` is a speaker of the model, a voice registered for the caller's tenant (spoken in zero-shot
mode), or one of OpenAI's voice names (alloy, echo, ...), which always mean the default voice
(``--default-voice``; else the model's first speaker). ``instructions`` switches to instruct mode.
``stream`` (an extension; the openai client sends it through ``extra_body``) makes the engine emit audio
every ~2 s of speech tokens and the response stream it; without it, audio is cut per sentence and, for
wav/pcm/opus, still sent as it comes. ``stream_format: "sse"`` answers OpenAI's Server-Sent Events instead of the
audio bytes (``speech.audio.delta`` events, then ``speech.audio.done``), streamed as with ``stream``.
``ref_audio`` (the audio itself, base64 or a ``data:`` URL; never a URL the server would fetch) with ``ref_text``
(its transcript) clones a voice for one request (zero_shot mode); without ``ref_text``, cross_lingual mode, and
with ``instructions``, instruct2 (CosyVoice2).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cosyserve.core.errors import ClientError, PayloadTooLargeError, UnsupportedMediaTypeError, shown
from cosyserve.server.audiofile import FORMATS
from cosyserve.server.responses import synthesize_response
from cosyserve.server.schemas import OPENAI_VOICES, parse_speech_request, speech_body_limit
from cosyserve.server.synth import caller, order

__all__ = ["OPENAI_VOICES", "PARAMS", "read_body", "routes", "voice_fields"]

# request fields -> this route's names (an error names its field in the response's `param`)
PARAMS = {
    "text": "input",
    "speaker": "voice",
    "instruct_text": "instructions",
    "prompt_wav": "ref_audio",
    "prompt_text": "ref_text",
}


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


def voice_fields(
    state: Any, voice: str | None, instructions: str, ref_audio: bytes | None, ref_text: str | None
) -> dict[str, Any]:
    """The :class:`~cosyserve.core.request.SynthesisRequest` fields of an OpenAI-style voice choice: ``voice``, a voice to
    clone (``ref_audio`` and its transcript ``ref_text``, None when not given) and ``instructions``, as the speech
    route and the WebSocket take them.

    An OpenAI voice name means the default voice (configured, else the model's first speaker); any other name is a
    speaker or a registered voice, whose kind decides the mode (the runtime knows the voices). ``ref_audio``
    clones: zero_shot with ``ref_text``, cross_lingual without, instruct2 with ``instructions``.

    Raises:
        ClientError: ``voice`` with ``ref_audio``, ``ref_text`` without it, with ``instructions`` or blank
            (``param`` names the field).
    """
    alias = voice is not None and voice.lower() in OPENAI_VOICES
    if ref_text is not None and not ref_text.strip():
        raise ClientError(
            "ref_text is blank: give the transcript of ref_audio, or leave ref_text out (cross-lingual cloning)",
            param="ref_text",
        )
    if ref_audio is None:
        if ref_text is not None:
            raise ClientError(
                "ref_text is the transcript of ref_audio: send ref_audio with it", param="ref_text"
            )
        speaker = state.config.default_voice if alias else voice
        if instructions.strip():
            return {"mode": "instruct", "speaker": speaker, "instruct_text": instructions}
        return {"mode": None, "speaker": speaker}
    if voice is not None and not alias:
        raise ClientError(
            f"voice {shown(voice)} names a voice, and ref_audio gives one to clone: send one of them",
            param="voice",
        )
    if instructions.strip():
        if ref_text is not None:
            raise ClientError(
                "ref_text is not used with instructions: instruct2 clones the voice from ref_audio alone",
                param="ref_text",
            )
        return {"mode": "instruct2", "prompt_wav": ref_audio, "instruct_text": instructions}
    if ref_text is not None:
        return {"mode": "zero_shot", "prompt_wav": ref_audio, "prompt_text": ref_text}
    return {"mode": "cross_lingual", "prompt_wav": ref_audio}


def routes(state: Any) -> list[Route]:
    async def speech(request: Request) -> Response:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise UnsupportedMediaTypeError(
                f"Content-Type must be application/json, got {shown(ctype or 'none')}"
            )
        cfg = state.config
        sr = parse_speech_request(await read_body(request, speech_body_limit(cfg)), cfg.max_upload_bytes)
        sse = sr.stream_format == "sse"
        asked = order(
            state,
            **caller(state, request),
            params=PARAMS,
            model=sr.model,
            fmt=sr.response_format,
            formats=FORMATS,
            text=sr.input,
            stream=sr.stream or sse,  # an event stream is streamed
            speed=sr.speed,
            seed=sr.seed,
            **voice_fields(state, sr.voice, sr.instructions, sr.ref_audio, sr.ref_text),
        )
        return await synthesize_response(
            state, request, route="/v1/audio/speech", order=asked, sse=sse, params=PARAMS
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

    return [
        Route("/v1/audio/speech", speech, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
    ]
