"""Request bodies, checked field by field (each error names the field), and the OpenAPI document."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from cosyserve.server.encode import FORMATS
from cosyserve.server.errors import HTTPError

__all__ = ["SpeechRequest", "openapi_document", "parse_speech_request"]

_SPEECH_FIELDS = {
    "model",
    "input",
    "voice",
    "response_format",
    "speed",
    "stream",
    "seed",
    "instructions",
    "stream_format",
}


@dataclass(frozen=True)
class SpeechRequest:
    model: str | None
    input: str
    voice: str
    response_format: str
    speed: float
    stream: bool
    seed: int | None
    instructions: str


def _bad(msg: str, param: str) -> HTTPError:
    return HTTPError(400, msg, param=param, code="invalid_value")


def parse_speech_request(body: bytes, max_chars: int) -> SpeechRequest:
    """The JSON body of ``POST /v1/audio/speech`` -> :class:`SpeechRequest` (400 naming the field otherwise)."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HTTPError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "the body must be a JSON object", code="invalid_json")
    unknown = sorted(set(data) - _SPEECH_FIELDS)
    if unknown:
        raise _bad(f"unknown field {unknown[0]!r}; accepted: {', '.join(sorted(_SPEECH_FIELDS))}", unknown[0])

    def string(name: str, default: str | None = None, required: bool = False) -> str | None:
        v = data.get(name, default)
        if v is None:
            if required:
                raise _bad(f"{name} is required", name)
            return None
        if not isinstance(v, str):
            raise _bad(f"{name} must be a string, got {type(v).__name__}", name)
        return v

    text = string("input", required=True)
    assert text is not None
    if not text.strip():
        raise _bad("input is empty: give the text to speak", "input")
    if len(text) > max_chars:
        raise _bad(f"input is {len(text)} characters; the limit is {max_chars}", "input")
    voice = string("voice", required=True)
    assert voice is not None
    if not voice.strip():
        raise _bad("voice is empty", "voice")
    fmt = string("response_format", "mp3")
    assert fmt is not None
    if fmt not in FORMATS:
        raise _bad(
            f"response_format {fmt!r} is not supported; choose one of {', '.join(FORMATS)}", "response_format"
        )
    speed = data.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, int | float) or not math.isfinite(speed):
        raise _bad("speed must be a number", "speed")
    if not 0.5 <= speed <= 2.0:
        raise _bad(f"speed must be between 0.5 and 2.0, got {speed}", "speed")
    stream = data.get("stream", False)
    sf = data.get("stream_format")
    if sf is not None and sf not in ("audio", "sse"):
        raise _bad("stream_format must be 'audio'", "stream_format")
    if sf == "sse":
        raise _bad("stream_format 'sse' is not supported; use 'audio' (chunked audio bytes)", "stream_format")
    if not isinstance(stream, bool):
        raise _bad("stream must be true or false", "stream")
    if stream and speed != 1.0:
        raise _bad("speed other than 1.0 needs stream=false (as in the reference)", "speed")
    seed = data.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise _bad("seed must be an integer in [0, 2**63)", "seed")
    instructions = string("instructions", "") or ""
    if len(instructions) > max_chars:
        raise _bad(
            f"instructions is {len(instructions)} characters; the limit is {max_chars}", "instructions"
        )
    model = string("model")
    return SpeechRequest(
        model=model,
        input=text,
        voice=voice,
        response_format=fmt,
        speed=float(speed),
        stream=stream,
        seed=seed,
        instructions=instructions,
    )


def _error_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    }


def openapi_document() -> dict[str, Any]:
    """OpenAPI 3.1 description of the API (used by clients and by the schema fuzz test)."""
    err = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    audio = {
        t: {"schema": {"type": "string", "format": "binary"}}
        for t in ("audio/wav", "audio/mpeg", "audio/pcm")
    }

    def errors(*codes: int) -> dict[str, Any]:
        return {str(c): {"description": "error", "content": err} for c in codes}

    form_field = {"type": "string", "minLength": 1}
    ref_form = {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["tts_text", "spk_id"],
                "properties": {"tts_text": form_field, "spk_id": form_field},
            }
        },
        "application/x-www-form-urlencoded": {
            "schema": {
                "type": "object",
                "required": ["tts_text", "spk_id"],
                "properties": {"tts_text": form_field, "spk_id": form_field},
            }
        },
    }
    health = {"200": {"description": "ok"}, "503": {"description": "not ready"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "cosyserve", "version": "1"},
        "paths": {
            "/v1/audio/speech": {
                "post": {
                    "operationId": "createSpeech",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/SpeechRequest"}}
                        },
                    },
                    "responses": {
                        "200": {"description": "audio", "content": audio},
                        **errors(400, 401, 404, 429, 503, 504),
                    },
                }
            },
            "/v1/models": {
                "get": {"operationId": "listModels", "responses": {"200": {"description": "models"}}}
            },
            "/v1/audio/voices": {
                "get": {
                    "operationId": "listVoices",
                    "parameters": [
                        {"name": "model", "in": "query", "required": False, "schema": {"type": "string"}}
                    ],
                    "responses": {"200": {"description": "voices"}, **errors(404)},
                }
            },
            "/inference_sft": {
                "post": {
                    "operationId": "inferenceSft",
                    "requestBody": {"required": True, "content": ref_form},
                    "responses": {"200": {"description": "raw int16 PCM"}, **errors(400, 404, 429, 503)},
                }
            },
            "/health/live": {"get": {"operationId": "live", "responses": {"200": {"description": "alive"}}}},
            "/health/ready": {"get": {"operationId": "ready", "responses": health}},
            "/health/startup": {"get": {"operationId": "startup", "responses": health}},
            "/metrics": {
                "get": {"operationId": "metrics", "responses": {"200": {"description": "Prometheus text"}}}
            },
        },
        "components": {
            "schemas": {
                "Error": _error_schema(),
                "SpeechRequest": {
                    "type": "object",
                    "required": ["input", "voice"],
                    "additionalProperties": False,
                    "properties": {
                        "model": {"type": "string"},
                        "input": {"type": "string", "minLength": 1, "maxLength": 4096},
                        "voice": {"type": "string", "minLength": 1},
                        "response_format": {"type": "string", "enum": list(FORMATS), "default": "mp3"},
                        "speed": {"type": "number", "minimum": 0.5, "maximum": 2.0, "default": 1.0},
                        "stream": {"type": "boolean", "default": False},
                        "seed": {"type": "integer", "minimum": 0},
                        "instructions": {"type": "string"},
                        "stream_format": {"type": "string", "enum": ["audio"]},
                    },
                },
            }
        },
    }
