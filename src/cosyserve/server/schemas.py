"""Request bodies, checked field by field (each error names the field); their OpenAPI schemas are
:mod:`cosyserve.server.openapi`'s."""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from typing import Any

from cosyserve.core.errors import ClientError, PayloadTooLargeError, cut, shown

__all__ = [
    "MAX_NAME_CHARS",
    "SESSION_FIELDS",
    "SESSION_FORMATS",
    "SPEECH_FIELDS",
    "SessionConfig",
    "SpeechRequest",
    "base64_size",
    "decode_ref_audio",
    "json_object",
    "parse_session_config",
    "parse_speech_request",
    "speech_body_limit",
]

# the longest consent record or model name the voices API takes (a voice name's limit is a setting: cosyserve.core.limits)
MAX_NAME_CHARS = 256

# the fields each body may carry, in the order the OpenAPI document lists them (cosyserve.server.openapi builds
# its schemas from these tables, so the document and the checks name the same fields)
SPEECH_FIELDS = (
    "model",
    "input",
    "voice",
    "ref_audio",
    "ref_text",
    "response_format",
    "sample_rate",
    "speed",
    "stream",
    "seed",
    "instructions",
    "stream_format",
)
# what a WebSocket session's session.config may carry (its "type" aside)
SESSION_FIELDS = (
    "model",
    "voice",
    "ref_audio",
    "ref_text",
    "instructions",
    "response_format",
    "sample_rate",
    "seed",
    "speed",
    "stream_audio",
)
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

    def __init__(self, data: dict[str, Any], accepted: tuple[str, ...]) -> None:
        unknown = sorted(set(data).difference(accepted))
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
    f = _Fields(json_object(body), SPEECH_FIELDS)
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
    f = _Fields(data, SESSION_FIELDS)
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
