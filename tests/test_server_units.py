"""Server pieces that need no running server: audio encoders and request-body checks."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import soundfile as sf

from cosyserve.server.encode import STREAMABLE, Encoder, encode_all, to_int16, wav_header
from cosyserve.server.errors import HTTPError
from cosyserve.server.schemas import parse_speech_request

RATE = 22050


def tone(seconds: float = 1.0, rate: int = RATE) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


# -- encoders ----------------------------------------------------------------------------------------------


def test_int16_scaling_matches_the_reference_and_clips_instead_of_wrapping() -> None:
    x = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 1.5], dtype=np.float32)
    got = np.frombuffer(to_int16(x), dtype="<i2")
    # the reference sends (x * 2**15).astype(int16); 1.0 and 1.5 would wrap to negative there
    assert got.tolist() == [0, 16384, -16384, 32767, -32768, 32767]


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus"])
def test_whole_files_decode_to_the_same_duration(fmt: str) -> None:
    x = tone(1.0)
    data = encode_all([x[:10000], x[10000:]], fmt, RATE)
    audio, rate = sf.read(io.BytesIO(data))
    assert abs(len(audio) / rate - 1.0) < 0.06, f"{fmt}: {len(audio)} samples at {rate} Hz"
    if fmt in ("wav", "flac"):  # lossless: the samples survive up to 16-bit rounding
        assert rate == RATE and np.abs(audio - x).max() < 1e-4


@pytest.mark.parametrize("fmt", STREAMABLE)
def test_streamed_bytes_decode_like_the_whole_file(fmt: str) -> None:
    x = tone(1.5)
    enc = Encoder(fmt, RATE)
    parts = [enc.header()] + [enc.encode(x[i : i + 4000]) for i in range(0, len(x), 4000)] + [enc.finish()]
    data = b"".join(parts)
    if fmt == "pcm":
        assert np.array_equal(np.frombuffer(data, "<i2"), np.frombuffer(to_int16(x), "<i2"))
        return
    audio, rate = sf.read(io.BytesIO(data))
    assert abs(len(audio) / rate - 1.5) < 0.06, f"{fmt}: streamed file lost samples ({len(audio)} at {rate})"
    if fmt == "wav":
        assert data[:4] == b"RIFF" and np.abs(audio - x).max() < 1e-4


def test_wav_header_sizes() -> None:
    h = wav_header(RATE, 100)
    assert (
        len(h) == 44 and int.from_bytes(h[4:8], "little") == 136 and int.from_bytes(h[40:44], "little") == 100
    )
    assert wav_header(RATE, None)[40:44] == b"\xff\xff\xff\xff"
    with pytest.raises(ValueError, match="cannot be streamed"):
        Encoder("mp3", RATE)


# -- request bodies ----------------------------------------------------------------------------------------


def body(**fields: object) -> bytes:
    return json.dumps({"input": "Hello.", "voice": "alloy"} | fields).encode()


def test_speech_request_defaults_are_openais() -> None:
    r = parse_speech_request(body(), 100)
    assert (r.response_format, r.speed, r.stream, r.seed, r.model) == ("mp3", 1.0, False, None, None)


def test_openai_speed_range_is_accepted_and_documented_as_one_range() -> None:
    """OpenAI's speed range (0.25-4.0) must pass the body check, and the OpenAPI document must state the same
    bounds, or clients written for OpenAI get 400s the documentation does not explain."""
    from cosyserve.engine.modes import SPEED_MAX, SPEED_MIN
    from cosyserve.server.schemas import openapi_document

    for speed in (0.25, 0.5, 2.0, 4.0, 3):
        assert parse_speech_request(body(speed=speed), 100).speed == speed
    doc = openapi_document(100)["components"]["schemas"]["SpeechRequest"]["properties"]["speed"]
    assert (doc["minimum"], doc["maximum"]) == (SPEED_MIN, SPEED_MAX) == (0.25, 4.0)


@pytest.mark.parametrize(
    ("raw", "param", "message"),
    [
        (b"{not json", None, "not valid JSON"),
        (b"[1, 2]", None, "JSON object"),
        (body(input=""), "input", "empty"),
        (body(input="x" * 101), "input", "limit is 100"),
        (body(input=3), "input", "must be a string"),
        (body(voice=""), "voice", "empty"),
        (body(response_format="ogg"), "response_format", "not supported"),
        (body(speed=4.5), "speed", "between 0.25 and 4.0"),
        (body(speed=0.2), "speed", "between 0.25 and 4.0"),
        (body(speed="fast"), "speed", "number"),
        (body(speed=True), "speed", "number"),
        (body(stream="yes"), "stream", "true or false"),
        (body(stream=True, speed=1.5), "speed", "stream=false"),
        (body(seed=-1), "seed", "integer"),
        (body(temperature=1), "temperature", "unknown field"),
        (body(stream_format="sse"), "stream_format", "not supported"),
        (json.dumps({"voice": "alloy"}).encode(), "input", "required"),
    ],
)
def test_bad_speech_requests_name_their_field(raw: bytes, param: str | None, message: str) -> None:
    with pytest.raises(HTTPError) as info:
        parse_speech_request(raw, 100)
    assert info.value.status == 400 and info.value.param == param and message in info.value.message


# -- errors ------------------------------------------------------------------------------------------------


def test_engine_error_messages_reach_the_client_without_server_paths() -> None:
    from cosyserve.errors import ClientError
    from cosyserve.server.errors import from_engine_error

    e = ClientError(
        "zero_shot synthesis is unavailable: model dir /srv/models/CosyVoice-300M has no campplus.onnx "
        "(copy it from the official model dir; available modes: sft, instruct)"
    )
    message = from_engine_error(e).message
    assert "/srv" not in message, message
    assert message.startswith("zero_shot synthesis is unavailable: model dir CosyVoice-300M has no")
    assert "sft, instruct" in message
    for text in ("speed 1/2 of audio/wav", "see http://example.com/a/b"):
        assert from_engine_error(ClientError(text)).message == text, "text that is not a path was changed"
