"""Request bodies, checked field by field (each error names the field), and the OpenAPI document."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cosyserve.audiofile import FORMATS, MEDIA_TYPES
from cosyserve.errors import ClientError, cut, shown
from cosyserve.request import SPEED_MAX, SPEED_MIN

__all__ = ["MAX_NAME_CHARS", "SpeechRequest", "openapi_document", "parse_speech_request"]

# the longest voice name (``voice``, ``spk_id``) a request may give: a speaker of a model or a registered voice
MAX_NAME_CHARS = 256

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


def _bad(msg: str, param: str) -> ClientError:
    return ClientError(msg, param=param)


def parse_speech_request(body: bytes) -> SpeechRequest:
    """The JSON body of ``POST /v1/audio/speech`` -> :class:`SpeechRequest`: JSON types and the server's own
    choices (format) only; the values are checked with every other request's, by
    :meth:`cosyserve.request.SynthesisRequest.verify`.

    Raises:
        ClientError: not JSON, not an object, an unknown field, or a field of the wrong type (``param`` names it).
    """
    try:
        data = json.loads(body)
    except RecursionError:  # json's C parser recurses once per nested [ or {
        raise ClientError("the body is not valid JSON: nested too deeply", code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ClientError(f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ClientError("the body must be a JSON object", code="invalid_json")
    unknown = sorted(set(data) - _SPEECH_FIELDS)
    if unknown:
        accepted = ", ".join(sorted(_SPEECH_FIELDS))
        raise _bad(f"unknown field {shown(unknown[0])}; accepted: {accepted}", cut(unknown[0]))
    data = {k: v for k, v in data.items() if v is not None}  # null means "not given", as clients send it

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
    voice = string("voice", required=True)
    assert text is not None and voice is not None
    if not voice.strip():
        raise _bad("voice is empty: name a speaker, a registered voice or an OpenAI voice", "voice")
    fmt = string("response_format", "mp3")
    assert fmt is not None
    if fmt not in FORMATS:
        raise _bad(
            f"response_format {shown(fmt)} is not supported; choose one of {', '.join(FORMATS)}",
            "response_format",
        )
    speed = data.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, int | float):
        raise _bad(f"speed must be a number, got {shown(speed)}", "speed")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream must be true or false", "stream")
    sf = data.get("stream_format")
    if sf is not None and sf not in ("audio", "sse"):
        raise _bad("stream_format must be 'audio'", "stream_format")
    if sf == "sse":
        raise _bad("stream_format 'sse' is not supported; use 'audio' (chunked audio bytes)", "stream_format")
    seed = data.get("seed")
    if isinstance(seed, float) and seed.is_integer():  # JSON Schema counts 3.0 as an integer
        seed = int(seed)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad(f"seed must be an integer, got {shown(seed)}", "seed")
    return SpeechRequest(
        model=string("model"),
        input=text,
        voice=voice,
        response_format=fmt,
        speed=float(speed),
        stream=stream,
        seed=seed,
        instructions=string("instructions", "") or "",
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


def _health_schema() -> dict[str, Any]:
    model = {
        "type": "object",
        "required": ["state", "preload", "in_flight", "queue_depth", "cause"],
        "properties": {
            "state": {"type": "string"},
            "preload": {"type": "boolean"},
            "in_flight": {"type": "integer", "minimum": 0},
            "queue_depth": {"type": "integer", "minimum": 0},
            "cause": {"type": ["string", "null"]},
            "retry_in_s": {"type": "number", "minimum": 0},
        },
    }
    return {
        "type": "object",
        "required": ["status", "models", "model_states", "demo"],
        "properties": {
            "status": {"type": "string"},
            # with API keys, only the models of the caller's key (none without one)
            "models": {"type": "object", "additionalProperties": model},
            # every model, counted by state
            "model_states": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}},
            "demo": {"type": "boolean"},
            "error": {"type": "string"},
        },
    }


def openapi_document(max_text_chars: int = 4096) -> dict[str, Any]:
    """OpenAPI 3.1 description of the API (used by clients and by the schema fuzz test).

    ``max_text_chars`` is the server's text limit, so the document promises exactly what the server accepts.
    Which voices exist is known only at run time (speakers of the model, voices registered per API key): a
    well-formed request with an unknown one gets 400 ``voice_not_found``, as OpenAI answers an invalid voice.
    """
    err = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    binary = {"type": "string", "format": "binary"}
    audio = {t: {"schema": binary} for t in dict.fromkeys(MEDIA_TYPES.values())}

    def errors(*codes: int) -> dict[str, Any]:
        return {str(c): {"description": "error", "content": err} for c in codes}

    def json_body(description: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"description": description, "content": {"application/json": {"schema": schema}}}

    # a non-blank string, as the server checks it (blank text or names are refused with a 400)
    # something to speak: a letter or a digit (Python's [^\W_] is \p{L} and \p{N}, what the server requires)
    text = {"type": "string", "minLength": 1, "maxLength": max_text_chars, "pattern": r"[^\W_]"}
    name = {
        "type": "string",
        "minLength": 1,
        "maxLength": min(MAX_NAME_CHARS, max_text_chars),
        "pattern": r"\S",
    }

    def reference(op_id: str, fields: dict[str, Any], files: tuple[str, ...] = ()) -> dict[str, Any]:
        props = {**fields, **{f: {**binary, "minLength": 1} for f in files}}
        schema = {"type": "object", "required": list(props), "properties": props}
        content: dict[str, Any] = {"multipart/form-data": {"schema": schema}}
        if not files:
            content["application/x-www-form-urlencoded"] = {"schema": schema}

        def op(method: str) -> dict[str, Any]:
            return {
                "operationId": op_id + method.capitalize(),
                "requestBody": {"required": True, "content": content},
                "responses": {
                    "200": {
                        "description": "raw int16 PCM at the model's rate (X-Sample-Rate)",
                        "content": {"application/octet-stream": {"schema": binary}},
                    },
                    **errors(400, 401, 404, 413, 415, 429, 503, 504),
                },
            }

        # GET with a form body is what the reference's own client sends
        return {"get": op("get"), "post": op("post")}

    health = {"200": json_body("ok", _health_schema()), "503": json_body("not (yet) ok", _health_schema())}
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
                        **errors(400, 401, 404, 413, 415, 429, 503, 504),
                    },
                }
            },
            "/v1/models": {
                "get": {
                    "operationId": "listModels",
                    "responses": {
                        "200": json_body("models", {"$ref": "#/components/schemas/ModelList"}),
                        **errors(401),
                    },
                }
            },
            "/v1/audio/voices": {
                "get": {
                    "operationId": "listVoices",
                    "parameters": [
                        {"name": "model", "in": "query", "required": False, "schema": {"type": "string"}}
                    ],
                    "responses": {
                        "200": json_body("voices", {"$ref": "#/components/schemas/VoiceList"}),
                        **errors(401, 404),
                    },
                }
            },
            "/inference_sft": reference("inferenceSft", {"tts_text": text, "spk_id": name}),
            "/inference_zero_shot": reference(
                "inferenceZeroShot", {"tts_text": text, "prompt_text": text}, ("prompt_wav",)
            ),
            "/inference_cross_lingual": reference(
                "inferenceCrossLingual", {"tts_text": text}, ("prompt_wav",)
            ),
            "/inference_instruct": reference(
                "inferenceInstruct", {"tts_text": text, "spk_id": name, "instruct_text": text}
            ),
            "/inference_instruct2": reference(
                "inferenceInstruct2", {"tts_text": text, "instruct_text": text}, ("prompt_wav",)
            ),
            "/health/live": {
                "get": {
                    "operationId": "live",
                    "responses": {
                        "200": json_body(
                            "alive",
                            {
                                "type": "object",
                                "required": ["status", "uptime_s"],
                                "properties": {"status": {"const": "alive"}, "uptime_s": {"type": "number"}},
                            },
                        )
                    },
                }
            },
            "/health/ready": {"get": {"operationId": "ready", "responses": health}},
            "/health/startup": {"get": {"operationId": "startup", "responses": health}},
            "/metrics": {
                "get": {
                    "operationId": "metrics",
                    "responses": {
                        "200": {
                            "description": "Prometheus text format",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/v1/startup": {
                "get": {
                    "operationId": "startupReport",
                    "responses": {"200": json_body("start-up timings", {"type": "object"})},
                }
            },
        },
        "components": {
            "schemas": {
                "Error": _error_schema(),
                "SpeechRequest": {
                    "type": "object",
                    "required": ["input", "voice"],
                    "additionalProperties": False,
                    # an optional field given as null means the field is not given
                    "properties": {
                        "model": {"type": ["string", "null"]},
                        "input": text,
                        "voice": name,
                        "response_format": {"enum": [*FORMATS, None], "default": "mp3"},
                        "speed": {
                            "type": ["number", "null"],
                            "minimum": SPEED_MIN,
                            "maximum": SPEED_MAX,
                            "default": 1.0,
                        },
                        "stream": {"type": ["boolean", "null"], "default": False},
                        "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": 2**63 - 1},
                        "instructions": {"type": ["string", "null"], "maxLength": max_text_chars},
                        "stream_format": {"enum": ["audio", None]},
                    },
                    # speed is applied to whole sentences: a streamed request keeps the natural speed
                    "if": {"required": ["stream"], "properties": {"stream": {"const": True}}},
                    "then": {"properties": {"speed": {"const": 1.0}}},
                    "example": {"input": "Hello there.", "voice": "alloy", "response_format": "wav"},
                },
                "ModelList": {
                    "type": "object",
                    "required": ["object", "data"],
                    "properties": {
                        "object": {"const": "list"},
                        "data": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["id", "object", "owned_by", "state"],
                                "properties": {
                                    "id": {"type": "string"},
                                    "object": {"const": "model"},
                                    "owned_by": {"type": "string"},
                                    "state": {"type": "string"},
                                    "demo": {"type": "boolean"},
                                },
                            },
                        },
                    },
                },
                "VoiceList": {
                    "type": "object",
                    "required": ["model", "state", "voices"],
                    "properties": {
                        "model": {"type": "string"},
                        "state": {"type": "string"},
                        "voices": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["voice_id", "name", "kind"],
                                "properties": {
                                    "voice_id": {"type": "string"},
                                    "name": {"type": "string"},
                                    "kind": {"enum": ["pre-defined", "registered"]},
                                },
                            },
                        },
                        "aliases": {"type": "object", "additionalProperties": {"type": "string"}},
                    },
                },
            }
        },
    }
