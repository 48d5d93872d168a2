"""The OpenAPI 3.1 document of the API, as data built from the tables the request checks use.

A body's fields are the parsers' tables (:data:`cosyserve.server.schemas.SPEECH_FIELDS` and ``SESSION_FIELDS``,
the reference endpoints' :data:`~cosyserve.server.transports.reference_api.ENDPOINTS`, the voices form's
:data:`~cosyserve.server.transports.voices.FIELDS`), each given its schema by name from one table of field schemas
whose bounds are the server's :class:`~cosyserve.core.limits.Limits`: a field the checks take and the document does
not describe (or the reverse) fails when the document is built, not in a client.
"""

from __future__ import annotations

import copy
from typing import Any

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
from cosyserve.server.schemas import (
    MAX_NAME_CHARS,
    SESSION_FIELDS,
    SESSION_FORMATS,
    SPEECH_FIELDS,
    base64_size,
)
from cosyserve.server.transports import reference_api, voices

__all__ = ["openapi_document"]

_BINARY = {"type": "string", "format": "binary"}
_ERROR_CONTENT = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
# a non-blank string, as the server checks it (blank text or names are refused with a 400)
# something to speak: a letter or a digit (Python's [^\W_] is \p{L} and \p{N}, what the server requires)
_SPEAKABLE = {"type": "string", "minLength": 1, "pattern": r"[^\W_]"}
# a voice name the registry takes (cosyserve.voices.registry: at most 64 characters) and a request may give: no path
# separator, no control character, no blank at either end
_VOICE_NAME_PATTERN = r"^[^\s/\\\x00-\x1f\x7f-\x9f](?:[^/\\\x00-\x1f\x7f-\x9f]*[^\s/\\\x00-\x1f\x7f-\x9f])?$"
_BASE64_PATTERN = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"

_ERROR = {
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
_MODEL_HEALTH = {
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
_HEALTH = {
    "type": "object",
    "required": ["status", "models", "model_states", "demo"],
    "properties": {
        "status": {"type": "string"},
        # with API keys, only the models of the caller's key (none without one)
        "models": {"type": "object", "additionalProperties": _MODEL_HEALTH},
        # every model, counted by state
        "model_states": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}},
        "demo": {"type": "boolean"},
        "error": {"type": "string"},
    },
}
_VOICE_OBJECT = {
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
_VOICE_DELETED = {
    "type": "object",
    "required": ["id", "object", "deleted"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "audio.voice.deleted"},
        "deleted": {"const": True},
    },
}
_AUDIO_MODELS = {  # Open WebUI's shape
    "type": "object",
    "required": ["models"],
    "properties": {
        "models": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "name"],
                "properties": {"id": {"type": "string"}, "name": {"type": "string"}},
            },
        }
    },
}
_MODEL_LIST = {
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
}
_VOICE_LIST = {
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
}
# one Server-Sent Event of a speech stream, its data a JSON object of the event's type
_SSE_KINDS = ["speech.audio.delta", "speech.audio.done", "speech.audio.error"]
_SSE_EVENT = {
    "type": "object",
    "required": ["event", "data"],
    "properties": {
        "event": {"enum": _SSE_KINDS},
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {
                "type": "object",
                "required": ["type"],
                "properties": {
                    "type": {"enum": _SSE_KINDS},
                    "audio": {"type": "string", "contentEncoding": "base64"},
                    "format": {"enum": list(FORMATS)},
                    "usage": {"type": "object"},
                    "error": {"$ref": "#/components/schemas/Error/properties/error"},
                },
            },
        },
    },
}
_LIVE = {
    "type": "object",
    "required": ["status", "uptime_s"],
    "properties": {"status": {"const": "alive"}, "uptime_s": {"type": "number"}},
}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): {"description": "error", "content": _ERROR_CONTENT} for c in codes}


def _json_body(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _get(op_id: str, responses: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"get": {"operationId": op_id, **more, "responses": responses}}


def _given(field: str, pattern: str | None = None) -> dict[str, Any]:
    # the field is given: a string (null means not given), one that matches ``pattern`` if any
    schema: dict[str, Any] = {"type": "string"} | ({"pattern": pattern} if pattern else {})
    return {"required": [field], "properties": {field: schema}}


def _pick(fields: tuple[str, ...], table: dict[str, Any], what: str) -> dict[str, Any]:
    """``{field: its schema}`` for each field a check takes, in its order; the table must describe exactly those."""
    assert set(table) == set(fields), (
        f"{what}: the checks take {sorted(fields)}, the document {sorted(table)}"
    )
    return {f: table[f] for f in fields}


def _schemas(limits: Limits) -> dict[str, dict[str, Any]]:
    """The bounded field schemas, by name: each bound is the server's limit."""
    name = {"type": "string", "minLength": 1, "maxLength": MAX_NAME_CHARS, "pattern": r"\S"}
    voice = {**name, "maxLength": limits.voice_chars}  # a speaker or registered voice a request names
    return {
        "text": {**_SPEAKABLE, "maxLength": limits.text_chars},
        "prompt_text": {**_SPEAKABLE, "maxLength": limits.prompt_text_chars},
        "instruct_text": {**_SPEAKABLE, "maxLength": limits.instructions_chars},
        "name": name,
        "voice": voice,
        "voice_name": {
            "type": "string",
            "minLength": 1,
            "maxLength": min(64, limits.voice_chars),
            "pattern": _VOICE_NAME_PATTERN,
        },
        "sample": {  # an uploaded recording (a form's file)
            **_BINARY,
            "minLength": 1,
            "maxLength": limits.upload_bytes,
            "description": f"at most {limits.prompt_seconds:g} s long",
        },
        "base64_audio": {
            "type": "string",
            "minLength": 4,
            "maxLength": base64_size(limits.upload_bytes),
            "pattern": _BASE64_PATTERN,
            "description": "an audio file in base64 (or a data: URL with base64 data), at most "
            f"{limits.prompt_seconds:g} s long; never a URL to fetch",
        },
        # OpenAI's custom voice reference
        "voice_ref": {
            "type": "object",
            "required": ["id"],
            "additionalProperties": False,
            "properties": {"id": voice},
        },
    }


def _speech_properties(limits: Limits, s: dict[str, dict[str, Any]], formats: list[str]) -> dict[str, Any]:
    # an optional field given as null means the field is not given
    return _pick(
        SPEECH_FIELDS,
        {
            "model": {"type": ["string", "null"]},
            "input": s["text"],
            "voice": {"anyOf": [s["voice"], s["voice_ref"]]},
            "ref_audio": {"anyOf": [s["base64_audio"], {"type": "null"}]},
            "ref_text": {"type": ["string", "null"], "maxLength": limits.prompt_text_chars, "pattern": r"\S"},
            "response_format": {"enum": [*formats, None], "default": "mp3"},
            "sample_rate": {
                "type": ["integer", "null"],
                "minimum": 1,
                "maximum": MAX_SAMPLE_RATE,
                "default": OPENAI_SAMPLE_RATE,
                "description": "samples per second of the audio (resampled from the model's); mp3, "
                "opus and aac take their codec's rates only",
            },
            "speed": {"type": ["number", "null"], "minimum": SPEED_MIN, "maximum": SPEED_MAX, "default": 1.0},
            "stream": {
                "type": ["boolean", "null"],
                "default": True,
                "description": "false: the whole audio in one body with a Content-Length",
            },
            "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": 2**63 - 1},
            "instructions": {"type": ["string", "null"], "maxLength": limits.instructions_chars},
            "stream_format": {"enum": ["audio", "sse", None]},
        },
        "SpeechRequest",
    )


def _codec_rates(fmt: str, rates: tuple[int, ...]) -> dict[str, Any]:
    # a codec takes its own rates (mp3's also where response_format is not given: the default)
    return {
        "if": {
            "required": ["sample_rate"] if fmt == "mp3" else ["response_format", "sample_rate"],
            "properties": {
                "response_format": {"enum": [fmt, None] if fmt == "mp3" else [fmt]},
                "sample_rate": {"type": "integer"},
            },
        },
        "then": {"properties": {"sample_rate": {"enum": list(rates)}}},
    }


def _speech_request(limits: Limits, s: dict[str, dict[str, Any]], formats: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["input"],
        "additionalProperties": False,
        "properties": _speech_properties(limits, s, formats),
        # a voice to speak with, or one to clone
        "anyOf": [{"required": ["voice"]}, _given("ref_audio")],
        "allOf": [
            # ref_text is the transcript of ref_audio; instruct2 (instructions with ref_audio) takes none
            {"if": _given("ref_text"), "then": _given("ref_audio")},
            {"if": _given("ref_text"), "then": {"not": _given("instructions", r"\S")}},
            # an event stream is streamed
            {
                "if": {"required": ["stream_format"], "properties": {"stream_format": {"const": "sse"}}},
                "then": {"properties": {"stream": {"enum": [True, None]}}},
            },
            *(_codec_rates(fmt, rates) for fmt, rates in RATES.items() if fmt in formats),
            # with a voice to clone, voice may only be an OpenAI name (it then means nothing)
            {"if": _given("ref_audio"), "then": {"properties": {"voice": {"enum": list(OPENAI_VOICES)}}}},
        ],
        "example": {"input": "Hello there.", "voice": "alloy", "response_format": "wav"},
    }


def _speech_paths() -> dict[str, Any]:
    audio = {t: {"schema": _BINARY} for t in dict.fromkeys(MEDIA_TYPES.values())}
    return {
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
                        "content": {**audio, "text/event-stream": {"schema": _SSE_EVENT}},
                    },
                    **_errors(400, 401, 404, 413, 415, 429, 503, 504),
                },
            }
        },
        "/v1/models": _get(
            "listModels",
            {"200": _json_body("models", {"$ref": "#/components/schemas/ModelList"}), **_errors(401)},
        ),
        "/v1/audio/models": _get(
            "listAudioModels",
            {
                "200": _json_body("the models `model` takes (Open WebUI's shape)", _AUDIO_MODELS),
                **_errors(401),
            },
        ),
    }


def _voice_paths(limits: Limits, s: dict[str, dict[str, Any]]) -> dict[str, Any]:
    model = {"name": "model", "in": "query", "required": False, "schema": {"type": "string"}}
    form = _pick(
        voices.FIELDS,
        {
            "audio_sample": s["sample"],
            "name": s["voice_name"],
            "consent": s["name"],
            "ref_text": {**s["name"], "maxLength": limits.prompt_text_chars},
            "model": s["name"],
            "type": {"const": "audio_sample"},
        },
        "POST /v1/audio/voices",
    )
    schema = {
        "type": "object",
        "required": ["audio_sample", "name", "consent", "ref_text"],
        "additionalProperties": False,
        "properties": form,
    }
    return {
        "/v1/audio/voices": {
            **_get(
                "listVoices",
                {
                    "200": _json_body("voices", {"$ref": "#/components/schemas/VoiceList"}),
                    **_errors(401, 404),
                },
                parameters=[model],
            ),
            "post": {
                "operationId": "createVoice",
                "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}},
                "responses": {
                    "200": _json_body("the registered voice (OpenAI's voice object)", _VOICE_OBJECT),
                    **_errors(400, 401, 404, 413, 415, 503),
                },
            },
        },
        "/v1/audio/voices/{name}": {
            "delete": {
                "operationId": "deleteVoice",
                "parameters": [
                    {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}},
                    model,
                ],
                "responses": {"200": _json_body("deleted", _VOICE_DELETED), **_errors(400, 401, 404, 503)},
            }
        },
    }


def _reference_paths(s: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The reference's endpoints, each from its entry in the table its route checks the form with."""
    field_schemas = {
        "tts_text": s["text"],
        "spk_id": s["voice"],
        "prompt_text": s["prompt_text"],
        "instruct_text": s["instruct_text"],
    }
    paths = {}
    for endpoint, (_, fields, files) in reference_api.ENDPOINTS.items():
        props = {**{f: field_schemas[f] for f in fields}, **dict.fromkeys(files, s["sample"])}
        schema = {"type": "object", "required": list(props), "properties": props}
        content: dict[str, Any] = {"multipart/form-data": {"schema": schema}}
        if not files:
            content["application/x-www-form-urlencoded"] = {"schema": schema}
        op_id = "inference" + "".join(word.capitalize() for word in endpoint.split("_"))
        # GET with a form body is what the reference's own client sends
        paths[f"/inference_{endpoint}"] = {
            method: {
                "operationId": op_id + method.capitalize(),
                "requestBody": {"required": True, "content": content},
                "responses": {
                    "200": {
                        "description": "raw int16 PCM at the model's rate (X-Sample-Rate)",
                        "content": {"application/octet-stream": {"schema": _BINARY}},
                    },
                    **_errors(400, 401, 404, 413, 415, 429, 503, 504),
                },
            }
            for method in ("get", "post")
        }
    return paths


def _service_paths() -> dict[str, Any]:
    health = {"200": _json_body("ok", _HEALTH), "503": _json_body("not (yet) ok", _HEALTH)}
    return {
        "/health/live": _get("live", {"200": _json_body("alive", _LIVE)}),
        "/health/ready": _get("ready", health),
        "/health/startup": _get("startup", health),
        "/metrics": _get(
            "metrics",
            {
                "200": {
                    "description": "Prometheus text format",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                }
            },
        ),
        "/v1/startup": _get("startupReport", {"200": _json_body("start-up timings", {"type": "object"})}),
    }


def _event(kind: str, **props: Any) -> dict[str, Any]:
    return {"type": "object", "required": ["type"], "properties": {"type": {"const": kind}, **props}}


_WS_SERVER_EVENTS = [
    _event(
        "audio.start",
        utterance_index={"type": "integer"},
        sentence_index={"const": 0},
        request_id={"type": "string"},
        format={"enum": list(SESSION_FORMATS)},
        sample_rate={"type": "integer"},
        channels={"const": 1},
        sample_format={"const": "s16le"},
    ),
    _event(
        "audio.done",
        utterance_index={"type": "integer"},
        sentence_index={"const": 0},
        total_bytes={"type": "integer"},
        error={"const": False},
        usage={"type": "object"},
    ),
    _event(
        "session.done",
        utterance_index={"type": "integer"},
        total_sentences={"enum": [0, 1]},
        error={"type": "boolean"},
    ),
    _event(
        "error",
        code={"type": "string"},
        message={"type": "string"},
        param={"type": ["string", "null"]},
        status={"type": "integer"},
        fatal={"type": "boolean"},
    ),
]


def _websocket_doc(limits: Limits) -> dict[str, Any]:
    # what OpenAPI cannot describe: the WebSocket route's messages (cosyserve.server.transports.ws has the protocol)
    config = _pick(
        SESSION_FIELDS,
        {
            "model": {"type": "string"},
            "voice": {"type": "string", "maxLength": limits.voice_chars},
            "ref_audio": {"type": "string"},
            "ref_text": {"type": "string", "maxLength": limits.prompt_text_chars},
            "instructions": {"type": "string", "maxLength": limits.instructions_chars},
            "response_format": {"enum": list(SESSION_FORMATS)},
            "sample_rate": {"type": "integer", "minimum": 1, "maximum": MAX_SAMPLE_RATE},
            "seed": {"type": "integer"},
            "speed": {"const": 1.0},
            "stream_audio": {"type": "boolean", "default": True},
        },
        "session.config",
    )
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
                _event("session.config", **config),
                _event("input.text", text={"type": "string", "maxLength": limits.text_chars}),
                _event("input.done"),
                _event("session.close"),
            ],
            "server": _WS_SERVER_EVENTS,
        }
    }


def openapi_document(limits: Limits | None = None) -> dict[str, Any]:
    """OpenAPI 3.1 description of the API (used by clients and by the schema fuzz test).

    ``limits`` are the server's (default: the settings' defaults), so the document promises exactly what the
    server accepts; a voice sample's length in seconds is said in words (a schema cannot). Which voices exist is
    known only at run time (speakers of the model, voices registered per API key): a well-formed request with an
    unknown one gets 400 ``voice_not_found``, as OpenAI answers an invalid voice; whether uploaded bytes are audio
    cannot be said in a schema either. The WebSocket route, which OpenAPI cannot describe, is in ``x-websocket``
    (:mod:`cosyserve.server.transports.ws`).
    """
    limits = limits if limits is not None else Limits()
    formats = [f for f in FORMATS if format_error(f) is None]  # aac where PyAV is installed
    s = _schemas(limits)
    document = {
        "openapi": "3.1.0",
        "info": {"title": "cosyserve", "version": "1"},
        "paths": _speech_paths() | _voice_paths(limits, s) | _reference_paths(s) | _service_paths(),
        "x-websocket": _websocket_doc(limits),
        "components": {
            "schemas": {
                "Error": _ERROR,
                "SpeechRequest": _speech_request(limits, s, formats),
                "ModelList": _MODEL_LIST,
                "VoiceList": _VOICE_LIST,
            }
        },
    }
    return copy.deepcopy(
        document
    )  # the module's tables stay as they are whatever a caller does with its copy
