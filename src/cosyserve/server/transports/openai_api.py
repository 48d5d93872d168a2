"""OpenAI-compatible routes: ``POST /v1/audio/speech``, ``GET /v1/models`` and ``GET /v1/audio/models`` (the voices
are :mod:`cosyserve.server.transports.voices`).

``model`` is a pool model name, or one of OpenAI's (``tts-1``, ``tts-1-hd``, ``gpt-4o-mini-tts``) for the default
model. ``voice`` is a speaker of the model, a voice registered for the caller's tenant (spoken in zero-shot
mode), or one of OpenAI's voice names (alloy, nova, echo, ...), each of which stands for one of the model's voices
(:mod:`cosyserve.engine.voicemap`; listed as ``aliases`` by ``GET /v1/audio/voices``). ``instructions``
switches to instruct mode.

The body streams as the audio is made, as OpenAI's does (chunked transfer encoding; every format but flac, which
is encoded when the audio ends): the engine emits audio every ~2 s of speech tokens, or per sentence where
``speed`` is not 1.0 (a tempo change needs a sentence's whole audio, as in the reference). ``stream: false`` (an
extension; the openai client sends it through ``extra_body``) answers one body with its Content-Length instead,
its audio cut per sentence (the reference's one-shot quality). ``stream_format: "sse"`` answers OpenAI's
Server-Sent Events instead of the audio bytes (``speech.audio.delta`` events as the audio is made, then
``speech.audio.done``). The audio is 24 kHz (OpenAI's rate, resampled where the model's differs: CosyVoice-300M's
22.05 kHz) unless ``sample_rate`` (an extension) names another; ``X-Sample-Rate`` states it.
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
from cosyserve.engine.voicemap import is_openai_voice
from cosyserve.server.audiofile import FORMATS, OPENAI_SAMPLE_RATE
from cosyserve.server.responses import synthesize_response
from cosyserve.server.schemas import parse_speech_request, speech_body_limit
from cosyserve.server.synth import caller, order

__all__ = ["PARAMS", "read_body", "routes", "voice_fields"]

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

    A voice name is a speaker, a registered voice or an OpenAI voice name (the model maps it to one of its voices
    when the request is admitted: :meth:`cosyserve.engine.engine.Engine.resolve`); its kind decides the mode (the
    runtime knows the voices). ``ref_audio`` clones: zero_shot with ``ref_text``, cross_lingual without, instruct2
    with ``instructions``; ``voice`` may then only be an OpenAI name, which means nothing there.

    Raises:
        ClientError: ``voice`` with ``ref_audio``, ``ref_text`` without it, with ``instructions`` or blank
            (``param`` names the field).
    """
    alias = voice is not None and is_openai_voice(voice)
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
        if instructions.strip():
            return {"mode": "instruct", "speaker": voice, "instruct_text": instructions}
        return {"mode": None, "speaker": voice}
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
        if sse and sr.stream is False:
            raise ClientError(
                "stream is false, which asks for one whole body, and stream_format is sse, an event stream: leave "
                "stream out (or true) for events as the audio is made, or leave stream_format out for one body",
                param="stream",
            )
        streamed = sr.stream is not False  # as OpenAI's, the body streams unless asked otherwise
        asked = order(
            state,
            **caller(state, request),
            params=PARAMS,
            model=sr.model,
            fmt=sr.response_format,
            formats=FORMATS,
            sample_rate=OPENAI_SAMPLE_RATE if sr.sample_rate is None else sr.sample_rate,
            streamed=streamed,
            text=sr.input,
            # the engine cuts audio every ~2 s of speech tokens when it streams; per sentence for a whole body,
            # and for a tempo change, which needs a sentence's whole audio (as in the reference)
            stream=streamed and sr.speed == 1.0,
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

    async def audio_models(request: Request) -> Response:
        # Open WebUI's list (GET {base}/audio/models -> {"models": [{"id", "name"}]}): what `model` takes
        names = state.pool.visible(state.tenant_of(request))
        return JSONResponse({"models": [{"id": name, "name": name} for name in names]})

    return [
        Route("/v1/audio/speech", speech, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/audio/models", audio_models, methods=["GET"]),
    ]
