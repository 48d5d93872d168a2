"""Server pieces that need no running server: request-body checks and error messages."""

from __future__ import annotations

import json

from cosyserve.server.schemas import parse_speech_request

# -- request bodies ----------------------------------------------------------------------------------------


def body(**fields: object) -> bytes:
    return json.dumps({"input": "Hello.", "voice": "alloy"} | fields).encode()


def test_speech_request_defaults_are_openais() -> None:
    """mp3, speed 1.0, and stream and sample_rate not given (the route then streams, at 24 kHz, as OpenAI)."""
    r = parse_speech_request(body())
    assert (r.response_format, r.speed, r.stream, r.seed, r.model, r.sample_rate) == (
        "mp3",
        1.0,
        None,
        None,
        None,
        None,
    )


def test_openai_speed_range_is_accepted_and_documented_as_one_range() -> None:
    """OpenAI's speed range (0.25-4.0) must pass the body check, and the OpenAPI document must state the same
    bounds, or clients written for OpenAI get 400s the documentation does not explain."""
    from cosyserve.core.request import SPEED_MAX, SPEED_MIN
    from cosyserve.server.openapi import openapi_document

    for speed in (0.25, 0.5, 2.0, 4.0, 3):
        assert parse_speech_request(body(speed=speed)).speed == speed
    doc = openapi_document()["components"]["schemas"]["SpeechRequest"]["properties"]["speed"]
    assert (doc["minimum"], doc["maximum"]) == (SPEED_MIN, SPEED_MAX) == (0.25, 4.0)


def test_the_openapi_document_names_the_fields_the_checks_take() -> None:
    """Each body the document describes has exactly the fields its parser accepts (the JSON body, a WebSocket
    session.config, each reference endpoint's form, the voices form): a field accepted and undocumented, or
    documented and refused, would make clients generated from the document wrong."""
    from cosyserve.server.openapi import openapi_document
    from cosyserve.server.schemas import SESSION_FIELDS, SPEECH_FIELDS
    from cosyserve.server.transports import reference_api, voices

    doc = openapi_document()
    assert list(doc["components"]["schemas"]["SpeechRequest"]["properties"]) == list(SPEECH_FIELDS)
    config = doc["x-websocket"]["/v1/audio/speech/stream"]["client"][0]["properties"]
    assert list(config) == ["type", *SESSION_FIELDS]
    for endpoint, (_, fields, files) in reference_api.ENDPOINTS.items():
        for method in ("get", "post"):
            content = doc["paths"][f"/inference_{endpoint}"][method]["requestBody"]["content"]
            assert list(content["multipart/form-data"]["schema"]["properties"]) == [*fields, *files], endpoint
    form = doc["paths"]["/v1/audio/voices"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert list(form["properties"]) == list(voices.FIELDS)


# -- errors ------------------------------------------------------------------------------------------------


def test_engine_error_messages_reach_the_client_without_server_paths() -> None:
    from cosyserve.core.errors import ClientError
    from cosyserve.server.errors import client_message

    e = ClientError(
        "zero_shot synthesis is unavailable: model dir /srv/models/CosyVoice-300M has no campplus.onnx "
        "(copy it from the official model dir; available modes: sft, instruct)"
    )
    message = client_message(e)
    assert "/srv" not in message, message
    assert message.startswith("zero_shot synthesis is unavailable: model dir CosyVoice-300M has no")
    assert "sft, instruct" in message
    for text in ("speed 1/2 of audio/wav", "see http://example.com/a/b"):
        assert client_message(ClientError(text)) == text, "text that is not a path was changed"
