"""Request bodies, checked field by field (each error names the field), and the OpenAPI document."""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from typing import Any

from cosyserve.core.errors import ClientError, PayloadTooLargeError, cut, shown
from cosyserve.core.limits import Limits
from cosyserve.core.request import SPEED_MAX, SPEED_MIN
from cosyserve.engine.voicemap import OPENAI_VOICES
from cosyserve.server.audiofile import (
    FORMATS,
    MAX_SAMPLE_RATE,
    MEDIA_TYPES,
    OPENAI_SAMPLE_RATE,
    RATES,
    format_error,
)

__all__ = [
    "MAX_NAME_CHARS",
    "SESSION_FORMATS",
    "SessionConfig",
    "SpeechRequest",
    "base64_size",
    "decode_ref_audio",
    "json_object",
    "openapi_document",
    "parse_session_config",
    "parse_speech_request",
    "speech_body_limit",
]

# the longest consent record or model name the voices API takes (a voice name's limit is a setting: cosyserve.core.limits)
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
    "ref_audio",
    "ref_text",
    "sample_rate",
}
# what a WebSocket session's session.config may carry (its "type" aside)
_SESSION_FIELDS = {
    "model",
    "voice",
    "response_format",
    "sample_rate",
    "speed",
    "seed",
    "instructions",
    "ref_audio",
    "ref_text",
    "stream_audio",
}
# what the WebSocket sends: 16-bit PCM, raw or after a WAV header
SESSION_FORMATS = ("pcm", "wav")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass(frozen=True)
class SpeechRequest:
    model: str | None
    input: str
    voice: str | None
    response_format: str
    speed: float
    stream: bool | None  # None: not given (streamed, as OpenAI's)
    seed: int | None
    instructions: str
    stream_format: str = "audio"
    ref_audio: bytes | None = None
    ref_text: str | None = None
    sample_rate: int | None = None


@dataclass(frozen=True)
class SessionConfig:
    """A WebSocket session's ``session.config``: what every utterance of the session is spoken with."""

    model: str | None
    voice: str | None
    response_format: str
    sample_rate: int | None
    speed: float
    seed: int | None
    instructions: str
    ref_audio: bytes | None
    ref_text: str | None
    stream_audio: bool = True


def _bad(msg: str, param: str) -> ClientError:
    return ClientError(msg, param=param)


def base64_size(n: int) -> int:
    """Characters of ``n`` bytes in base64 (with padding)."""
    return 4 * ((n + 2) // 3)


def speech_body_limit(config: Any) -> int:
    """The largest ``/v1/audio/speech`` body (and WebSocket frame): the JSON limit, plus room for ``ref_audio`` of
    the upload limit in base64."""
    return int(config.max_body_bytes + base64_size(config.max_upload_bytes) + 1024)


def decode_ref_audio(value: object, limit: int, param: str = "ref_audio") -> bytes:
    """A client's reference audio given inline: base64, or a ``data:`` URL with base64 data.

    A URL of any other scheme (http, https, file, ...) is refused: the server never fetches what a client names.

    Raises:
        ClientError: not a string, a URL, not base64, or empty (``param`` names the field).
        PayloadTooLargeError: more than ``limit`` bytes once decoded.
    """
    if not isinstance(value, str):
        raise _bad(f"{param} must be a string (base64 or a data: URL), got {type(value).__name__}", param)
    text = value.strip()
    if text[:5].lower() == "data:":
        head, comma, text = text.partition(",")
        if not comma or not head.lower().endswith(";base64"):
            raise _bad(
                f"{param} is a data: URL without base64 data: send data:audio/wav;base64,<the file in base64>",
                param,
            )
    elif _URL.match(text):
        raise _bad(
            f"{param} is a URL ({shown(text.split('://', 1)[0] + '://...')}): the server never fetches a URL; "
            "send the audio file itself, in base64 or as a data: URL",
            param,
        )
    text = "".join(text.split())  # line breaks, as some encoders write them
    if len(text) > base64_size(limit):
        raise PayloadTooLargeError(
            f"{param} is over the upload limit of {limit} bytes ({len(text)} base64 characters)", param=param
        )
    altchars = b"-_" if ("-" in text or "_" in text) else None  # the URL-safe alphabet
    try:
        data = base64.b64decode(text, altchars=altchars, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(
            f"{param} is not valid base64: send the audio file in base64 (standard or URL-safe alphabet, "
            "with its padding), or as a data: URL",
            param,
        ) from None
    if not data:
        raise _bad(f"{param} is empty: send an audio file", param)
    if len(data) > limit:
        raise PayloadTooLargeError(f"{param} is over the upload limit of {limit} bytes", param=param)
    return data


def json_object(body: bytes | str, what: str = "the body") -> dict[str, Any]:
    """``body`` parsed as a JSON object.

    Raises:
        ClientError: not JSON (also when nested too deeply for the parser), or not an object.
    """
    try:
        data = json.loads(body)
    except RecursionError:  # json's C parser recurses once per nested [ or {
        raise ClientError(f"{what} is not valid JSON: nested too deeply", code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ClientError(f"{what} is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ClientError(f"{what} must be a JSON object", code="invalid_json")
    return data


class _Fields:
    """A JSON object's fields, checked one by one: unknown names refused, null meaning "not given"."""

    def __init__(self, data: dict[str, Any], accepted: set[str]) -> None:
        unknown = sorted(set(data) - accepted)
        if unknown:
            names = ", ".join(sorted(accepted))
            raise _bad(f"unknown field {shown(unknown[0])}; accepted: {names}", cut(unknown[0]))
        self.data = {k: v for k, v in data.items() if v is not None}  # null: not given, as clients send it

    def string(self, name: str, default: str | None = None, required: bool = False) -> str | None:
        v = self.data.get(name, default)
        if v is None:
            if required:
                raise _bad(f"{name} is required", name)
            return None
        if not isinstance(v, str):
            raise _bad(f"{name} must be a string, got {type(v).__name__}", name)
        return v

    def voice(self) -> str | None:
        v = self.data.get("voice")
        if isinstance(v, dict):  # OpenAI's custom voice reference: {"id": "..."}
            if set(v) != {"id"} or not isinstance(v["id"], str):
                raise _bad('voice as an object must be {"id": "<voice name>"}', "voice")
            v = v["id"]
        if v is not None and not isinstance(v, str):
            raise _bad(f"voice must be a string or {{'id': ...}}, got {type(v).__name__}", "voice")
        if v is not None and not v.strip():
            raise _bad("voice is empty: name a speaker, a registered voice or an OpenAI voice", "voice")
        return v

    def choice(self, name: str, default: str, choices: tuple[str, ...]) -> str:
        v = self.string(name, default)
        assert v is not None
        if v not in choices:
            raise _bad(f"{name} {shown(v)} is not supported; choose one of {', '.join(choices)}", name)
        return v

    def speed(self) -> float:
        speed = self.data.get("speed", 1.0)
        if isinstance(speed, bool) or not isinstance(speed, int | float):
            raise _bad(f"speed must be a number, got {shown(speed)}", "speed")
        return float(speed)

    def boolean(self, name: str, default: bool) -> bool:
        v = self.optional_boolean(name)
        return default if v is None else v

    def optional_boolean(self, name: str) -> bool | None:
        v = self.data.get(name)
        if v is not None and not isinstance(v, bool):
            raise _bad(f"{name} must be true or false", name)
        return v

    def integer(self, name: str) -> int | None:
        v = self.data.get(name)
        if isinstance(v, float) and v.is_integer():  # JSON Schema counts 3.0 as an integer
            v = int(v)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise _bad(f"{name} must be an integer, got {shown(v)}", name)
        return v

    def ref_audio(self, limit: int) -> bytes | None:
        v = self.data.get("ref_audio")
        return None if v is None else decode_ref_audio(v, limit)


def parse_speech_request(body: bytes, max_upload_bytes: int = 16 << 20) -> SpeechRequest:
    """The JSON body of ``POST /v1/audio/speech`` -> :class:`SpeechRequest`: JSON types and the protocol's own
    choice (``stream_format``) only; the values are checked with every other request's, by the one constructor
    (:meth:`cosyserve.core.limits.Limits.request`). ``ref_audio`` is decoded here (its base64 at most that of
    ``max_upload_bytes``).

    Raises:
        ClientError: not JSON, not an object, an unknown field, or a field of the wrong type (``param`` names it).
    """
    f = _Fields(json_object(body), _SPEECH_FIELDS)
    text = f.string("input", required=True)
    assert text is not None
    voice = f.voice()
    if voice is None and "ref_audio" not in f.data:
        raise _bad("voice is required (or ref_audio, a voice to clone)", "voice")
    fmt = f.string("response_format", "mp3")
    assert fmt is not None
    sf = f.choice("stream_format", "audio", ("audio", "sse"))
    return SpeechRequest(
        model=f.string("model"),
        input=text,
        voice=voice,
        response_format=fmt,
        speed=f.speed(),
        stream=f.optional_boolean("stream"),
        seed=f.integer("seed"),
        instructions=f.string("instructions", "") or "",
        stream_format=sf,
        ref_audio=f.ref_audio(max_upload_bytes),
        ref_text=f.string("ref_text"),
        sample_rate=f.integer("sample_rate"),
    )


def parse_session_config(data: dict[str, Any], max_upload_bytes: int) -> SessionConfig:
    """A WebSocket ``session.config`` message (its ``type`` removed) -> :class:`SessionConfig`: JSON types only,
    as :func:`parse_speech_request`; the values are checked by the one constructor.

    Raises:
        ClientError: an unknown field, or a field of the wrong type or value (``param`` names it).
    """
    f = _Fields(data, _SESSION_FIELDS)
    return SessionConfig(
        model=f.string("model"),
        voice=f.voice(),
        response_format=f.string("response_format", "pcm") or "pcm",
        sample_rate=f.integer("sample_rate"),
        speed=f.speed(),
        seed=f.integer("seed"),
        instructions=f.string("instructions", "") or "",
        ref_audio=f.ref_audio(max_upload_bytes),
        ref_text=f.string("ref_text"),
        stream_audio=f.boolean("stream_audio", True),
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


def _websocket_doc(limits: Limits) -> dict[str, Any]:
    # what OpenAPI cannot describe: the WebSocket route's messages (cosyserve.server.transports.ws has the whole protocol)
    def event(kind: str, **props: Any) -> dict[str, Any]:
        return {"type": "object", "required": ["type"], "properties": {"type": {"const": kind}, **props}}

    return {
        "/v1/audio/speech/stream": {
            "description": "text in as it is written, audio out as it is spoken (vLLM-Omni's protocol): JSON text "
            "frames in; JSON events and binary frames of 16-bit little-endian mono PCM out. API keys as on every "
            "route: 'Authorization: Bearer KEY', or from a browser the subprotocol 'bearer.<the key in "
            "base64url>' beside 'cosyserve'. The limits are the HTTP routes': an input.text piece of at most "
            f"{limits.text_chars} characters; ref_audio of at most {limits.upload_bytes} bytes and "
            f"{limits.prompt_seconds:g} s. Text an utterance holds received and not yet read by the model stays "
            f"within {limits.buffered_text_chars} characters (or one piece): past it the server reads no more "
            "frames until the model catches up (TCP holds the client back). session.config may be sent again "
            "between utterances (not while one has text open) to change what the next ones are spoken with. "
            "sample_rate resamples (the model's rate by default; audio.start states it). stream_audio false: each "
            "utterance's audio in one binary frame at its end.",
            "client": [
                event(
                    "session.config",
                    model={"type": "string"},
                    voice={"type": "string", "maxLength": limits.voice_chars},
                    ref_audio={"type": "string"},
                    ref_text={"type": "string", "maxLength": limits.prompt_text_chars},
                    instructions={"type": "string", "maxLength": limits.instructions_chars},
                    response_format={"enum": list(SESSION_FORMATS)},
                    sample_rate={"type": "integer", "minimum": 1, "maximum": MAX_SAMPLE_RATE},
                    seed={"type": "integer"},
                    speed={"const": 1.0},
                    stream_audio={"type": "boolean", "default": True},
                ),
                event("input.text", text={"type": "string", "maxLength": limits.text_chars}),
                event("input.done"),
                event("session.close"),
            ],
            "server": [
                event(
                    "audio.start",
                    utterance_index={"type": "integer"},
                    sentence_index={"const": 0},
                    request_id={"type": "string"},
                    format={"enum": list(SESSION_FORMATS)},
                    sample_rate={"type": "integer"},
                    channels={"const": 1},
                    sample_format={"const": "s16le"},
                ),
                event(
                    "audio.done",
                    utterance_index={"type": "integer"},
                    sentence_index={"const": 0},
                    total_bytes={"type": "integer"},
                    error={"const": False},
                    usage={"type": "object"},
                ),
                event(
                    "session.done",
                    utterance_index={"type": "integer"},
                    total_sentences={"enum": [0, 1]},
                    error={"type": "boolean"},
                ),
                event(
                    "error",
                    code={"type": "string"},
                    message={"type": "string"},
                    param={"type": ["string", "null"]},
                    status={"type": "integer"},
                    fatal={"type": "boolean"},
                ),
            ],
        }
    }


def openapi_document(limits: Limits | None = None) -> dict[str, Any]:
    """OpenAPI 3.1 description of the API (used by clients and by the schema fuzz test).

    ``limits`` are the server's (default: the settings' defaults), so the document promises exactly what the
    server accepts; a voice sample's length in seconds is said in words (a schema cannot). Which voices exist is
    known only at run time (speakers of the model, voices registered per API key): a well-formed request with an unknown one gets 400 ``voice_not_found``, as OpenAI answers an invalid
    voice; whether uploaded bytes are audio cannot be said in a schema either. The WebSocket route, which
    OpenAPI cannot describe, is in ``x-websocket`` (:mod:`cosyserve.server.transports.ws`).
    """
    limits = limits if limits is not None else Limits()
    formats = [f for f in FORMATS if format_error(f) is None]  # aac where PyAV is installed
    max_upload_bytes = limits.upload_bytes
    err = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    binary = {"type": "string", "format": "binary"}
    audio = {t: {"schema": binary} for t in dict.fromkeys(MEDIA_TYPES.values())}

    def errors(*codes: int) -> dict[str, Any]:
        return {str(c): {"description": "error", "content": err} for c in codes}

    def json_body(description: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"description": description, "content": {"application/json": {"schema": schema}}}

    # a non-blank string, as the server checks it (blank text or names are refused with a 400)
    # something to speak: a letter or a digit (Python's [^\W_] is \p{L} and \p{N}, what the server requires)
    speakable = {"type": "string", "minLength": 1, "pattern": r"[^\W_]"}
    text = {**speakable, "maxLength": limits.text_chars}
    prompt_text = {**speakable, "maxLength": limits.prompt_text_chars}
    instruct_text = {**speakable, "maxLength": limits.instructions_chars}
    name = {"type": "string", "minLength": 1, "maxLength": MAX_NAME_CHARS, "pattern": r"\S"}
    voice = {**name, "maxLength": limits.voice_chars}  # a speaker or registered voice a request names

    # a voice name the registry takes (cosyserve.voices.registry: at most 64 characters) and a request may give: no path
    # separator, no control character, no blank at either end
    voice_name = {
        "type": "string",
        "minLength": 1,
        "maxLength": min(64, limits.voice_chars),
        "pattern": r"^[^\s/\\\x00-\x1f\x7f-\x9f](?:[^/\\\x00-\x1f\x7f-\x9f]*[^\s/\\\x00-\x1f\x7f-\x9f])?$",
    }

    def given(field: str, pattern: str | None = None) -> dict[str, Any]:
        # the field is given: a string (null means not given), one that matches ``pattern`` if any
        schema: dict[str, Any] = {"type": "string"} | ({"pattern": pattern} if pattern else {})
        return {"required": [field], "properties": {field: schema}}

    base64_audio = {
        "type": "string",
        "minLength": 4,
        "maxLength": base64_size(max_upload_bytes),
        "pattern": r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$",
        "description": "an audio file in base64 (or a data: URL with base64 data), at most "
        f"{limits.prompt_seconds:g} s long; never a URL to fetch",
    }
    voice_ref = {  # OpenAI's custom voice reference
        "type": "object",
        "required": ["id"],
        "additionalProperties": False,
        "properties": {"id": voice},
    }
    voice_object = {
        "type": "object",
        "required": ["id", "object", "name", "type", "created_at", "consent", "ref_text", "model"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "audio.voice"},
            "name": {"type": "string"},
            "type": {"const": "audio_sample"},
            "created_at": {"type": "integer"},
            "consent": {"type": "string"},
            "ref_text": {"type": "string"},
            "model": {"type": "string"},
        },
    }

    # one Server-Sent Event of a speech stream, its data a JSON object of the event's type
    sse_kinds = ["speech.audio.delta", "speech.audio.done", "speech.audio.error"]
    sse_event = {
        "type": "object",
        "required": ["event", "data"],
        "properties": {
            "event": {"enum": sse_kinds},
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": {
                    "type": "object",
                    "required": ["type"],
                    "properties": {
                        "type": {"enum": sse_kinds},
                        "audio": {"type": "string", "contentEncoding": "base64"},
                        "format": {"enum": list(FORMATS)},
                        "usage": {"type": "object"},
                        "error": {"$ref": "#/components/schemas/Error/properties/error"},
                    },
                },
            },
        },
    }

    def reference(op_id: str, fields: dict[str, Any], files: tuple[str, ...] = ()) -> dict[str, Any]:
        sample = {
            **binary,
            "minLength": 1,
            "maxLength": max_upload_bytes,
            "description": f"at most {limits.prompt_seconds:g} s long",
        }
        props = {**fields, **dict.fromkeys(files, sample)}
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
                        "200": {
                            "description": "audio, or with stream_format sse its Server-Sent Events "
                            "(speech.audio.delta, then speech.audio.done or speech.audio.error)",
                            "content": {**audio, "text/event-stream": {"schema": sse_event}},
                        },
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
            "/v1/audio/models": {
                "get": {
                    "operationId": "listAudioModels",
                    "responses": {
                        "200": json_body(
                            "the models `model` takes (Open WebUI's shape)",
                            {
                                "type": "object",
                                "required": ["models"],
                                "properties": {
                                    "models": {
                                        "type": "array",
                                        "items": {
                                            "type": "object",
                                            "required": ["id", "name"],
                                            "properties": {
                                                "id": {"type": "string"},
                                                "name": {"type": "string"},
                                            },
                                        },
                                    }
                                },
                            },
                        ),
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
                },
                "post": {
                    "operationId": "createVoice",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "multipart/form-data": {
                                "schema": {
                                    "type": "object",
                                    "required": ["audio_sample", "name", "consent", "ref_text"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "audio_sample": {
                                            **binary,
                                            "minLength": 1,
                                            "maxLength": max_upload_bytes,
                                            "description": f"at most {limits.prompt_seconds:g} s long",
                                        },
                                        "name": voice_name,
                                        "consent": name,
                                        "ref_text": {**name, "maxLength": limits.prompt_text_chars},
                                        "model": name,
                                        "type": {"const": "audio_sample"},
                                    },
                                }
                            }
                        },
                    },
                    "responses": {
                        "200": json_body("the registered voice (OpenAI's voice object)", voice_object),
                        **errors(400, 401, 404, 413, 415, 503),
                    },
                },
            },
            "/v1/audio/voices/{name}": {
                "delete": {
                    "operationId": "deleteVoice",
                    "parameters": [
                        {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}},
                        {"name": "model", "in": "query", "required": False, "schema": {"type": "string"}},
                    ],
                    "responses": {
                        "200": json_body(
                            "deleted",
                            {
                                "type": "object",
                                "required": ["id", "object", "deleted"],
                                "properties": {
                                    "id": {"type": "string"},
                                    "object": {"const": "audio.voice.deleted"},
                                    "deleted": {"const": True},
                                },
                            },
                        ),
                        **errors(400, 401, 404, 503),
                    },
                }
            },
            "/inference_sft": reference("inferenceSft", {"tts_text": text, "spk_id": voice}),
            "/inference_zero_shot": reference(
                "inferenceZeroShot", {"tts_text": text, "prompt_text": prompt_text}, ("prompt_wav",)
            ),
            "/inference_cross_lingual": reference(
                "inferenceCrossLingual", {"tts_text": text}, ("prompt_wav",)
            ),
            "/inference_instruct": reference(
                "inferenceInstruct", {"tts_text": text, "spk_id": voice, "instruct_text": instruct_text}
            ),
            "/inference_instruct2": reference(
                "inferenceInstruct2", {"tts_text": text, "instruct_text": instruct_text}, ("prompt_wav",)
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
        "x-websocket": _websocket_doc(limits),
        "components": {
            "schemas": {
                "Error": _error_schema(),
                "SpeechRequest": {
                    "type": "object",
                    "required": ["input"],
                    "additionalProperties": False,
                    # an optional field given as null means the field is not given
                    "properties": {
                        "model": {"type": ["string", "null"]},
                        "input": text,
                        "voice": {"anyOf": [voice, voice_ref]},
                        "ref_audio": {"anyOf": [base64_audio, {"type": "null"}]},
                        "ref_text": {
                            "type": ["string", "null"],
                            "maxLength": limits.prompt_text_chars,
                            "pattern": r"\S",
                        },
                        "response_format": {"enum": [*formats, None], "default": "mp3"},
                        "sample_rate": {
                            "type": ["integer", "null"],
                            "minimum": 1,
                            "maximum": MAX_SAMPLE_RATE,
                            "default": OPENAI_SAMPLE_RATE,
                            "description": "samples per second of the audio (resampled from the model's); mp3, "
                            "opus and aac take their codec's rates only",
                        },
                        "speed": {
                            "type": ["number", "null"],
                            "minimum": SPEED_MIN,
                            "maximum": SPEED_MAX,
                            "default": 1.0,
                        },
                        "stream": {
                            "type": ["boolean", "null"],
                            "default": True,
                            "description": "false: the whole audio in one body with a Content-Length",
                        },
                        "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": 2**63 - 1},
                        "instructions": {"type": ["string", "null"], "maxLength": limits.instructions_chars},
                        "stream_format": {"enum": ["audio", "sse", None]},
                    },
                    # a voice to speak with, or one to clone
                    "anyOf": [{"required": ["voice"]}, given("ref_audio")],
                    "allOf": [
                        # ref_text is the transcript of ref_audio; instruct2 (instructions with ref_audio) takes none
                        {"if": given("ref_text"), "then": given("ref_audio")},
                        {"if": given("ref_text"), "then": {"not": given("instructions", r"\S")}},
                        # an event stream is streamed
                        {
                            "if": {
                                "required": ["stream_format"],
                                "properties": {"stream_format": {"const": "sse"}},
                            },
                            "then": {"properties": {"stream": {"enum": [True, None]}}},
                        },
                        # a codec takes its own rates (mp3's also where response_format is not given: the default)
                        *(
                            {
                                "if": {
                                    "required": ["sample_rate"]
                                    if fmt == "mp3"
                                    else ["response_format", "sample_rate"],
                                    "properties": {
                                        "response_format": {"enum": [fmt, None] if fmt == "mp3" else [fmt]},
                                        "sample_rate": {"type": "integer"},
                                    },
                                },
                                "then": {"properties": {"sample_rate": {"enum": list(rates)}}},
                            }
                            for fmt, rates in RATES.items()
                            if fmt in formats
                        ),
                        # with a voice to clone, voice may only be an OpenAI name (it then means nothing)
                        {
                            "if": given("ref_audio"),
                            "then": {"properties": {"voice": {"enum": list(OPENAI_VOICES)}}},
                        },
                    ],
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
                                "required": ["id", "name", "voice_id", "kind", "language"],
                                "properties": {
                                    # what `voice` takes (Open WebUI reads id and name)
                                    "id": {"type": "string"},
                                    "name": {"type": "string"},
                                    "voice_id": {"type": "string"},
                                    "kind": {"enum": ["pre-defined", "registered"]},
                                    # the language the voice's name states (BCP 47), else null
                                    "language": {"type": ["string", "null"]},
                                    # a voice registered through POST /v1/audio/voices
                                    "consent": {"type": "string"},
                                    "ref_text": {"type": "string"},
                                    "created_at": {"type": "integer"},
                                },
                            },
                        },
                        # each OpenAI voice name -> the voice it stands for on this model
                        "aliases": {"type": "object", "additionalProperties": {"type": ["string", "null"]}},
                    },
                },
            }
        },
    }
