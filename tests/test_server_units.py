"""Server pieces that need no running server: config checks, audio encoders, request-body checks, API keys."""

from __future__ import annotations

import json

import pytest

from cosyserve.server.config import ServerConfig, ServerConfigError, parse_api_keys, parse_model_arg
from cosyserve.server.schemas import parse_speech_request

# -- config ------------------------------------------------------------------------------------------------


def test_model_args_name_defaults_to_the_directory_and_can_be_given() -> None:
    assert parse_model_arg("/models/CosyVoice-300M-SFT/").name == "CosyVoice-300M-SFT"
    m = parse_model_arg("sft=/models/x")
    assert (m.name, m.source) == ("sft", "/models/x")
    with pytest.raises(ServerConfigError, match="model name"):
        parse_model_arg("bad name!=/x")
    with pytest.raises(ServerConfigError, match="no path"):
        parse_model_arg("x=")


def test_flags_win_over_env_and_bad_values_name_their_source() -> None:
    env = {"COSYSERVE_PORT": "9000", "COSYSERVE_MAX_TEXT_CHARS": "100"}
    cfg = ServerConfig.from_args(env=env)
    assert (cfg.port, cfg.max_text_chars) == (9000, 100)
    assert ServerConfig.from_args(port=8001, env=env).port == 8001
    with pytest.raises(ServerConfigError, match="COSYSERVE_PORT='http'"):
        ServerConfig.from_args(env={"COSYSERVE_PORT": "http"})
    with pytest.raises(ServerConfigError, match="between"):
        ServerConfig.from_args(env={"COSYSERVE_REQUEST_TIMEOUT": "-1"})
    with pytest.raises(ServerConfigError, match="not an origin"):
        ServerConfig.from_args(env={"COSYSERVE_CORS_ORIGINS": "example.com"})
    with pytest.raises(ServerConfigError, match="given twice"):
        ServerConfig.from_args(models=["/a/m", "/b/m"], env={})
    assert ServerConfig.from_args(env={}).demo, "no model and no pool config must mean the demo model"


def test_bad_flag_values_are_named_as_the_flag() -> None:
    """If this fails, a bad flag value is reported as "flag for COSYSERVE_PORT=99999" instead of the flag the user
    typed (--port 99999)."""
    cases = [
        ({"port": 99999}, "--port 99999: must be between 0 and 65535"),
        ({"request_timeout_s": 0.0}, "--request-timeout 0.0: must be between"),
        ({"cors_origins": "example.com"}, "--cors-origins: 'example.com' is not an origin"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ServerConfigError) as exc:
            ServerConfig.from_args(env={}, **kwargs)  # type: ignore[arg-type]
        assert str(exc.value).startswith(message) and "COSYSERVE_" not in str(exc.value), exc.value
    with pytest.raises(ServerConfigError, match="^COSYSERVE_PORT='99999': must be between"):
        ServerConfig.from_args(env={"COSYSERVE_PORT": "99999"})


def test_drain_delay_has_a_default_a_flag_and_a_variable() -> None:
    """The window after SIGTERM in which the port still answers 503 (so load balancers see the drain)."""
    assert ServerConfig.from_args(env={}).drain_delay_s == 5.0
    assert ServerConfig.from_args(env={"COSYSERVE_DRAIN_DELAY": "2.5"}).drain_delay_s == 2.5
    assert ServerConfig.from_args(drain_delay_s=0, env={"COSYSERVE_DRAIN_DELAY": "9"}).drain_delay_s == 0
    with pytest.raises(ServerConfigError, match="COSYSERVE_DRAIN_DELAY='soon'"):
        ServerConfig.from_args(env={"COSYSERVE_DRAIN_DELAY": "soon"})
    with pytest.raises(ServerConfigError, match="between"):
        ServerConfig.from_args(drain_delay_s=-1, env={})


def test_api_keys_parse_and_reject_bad_entries(tmp_path) -> None:
    assert parse_api_keys("k-aaaaaaaa=alice, k-bbbbbbbb=bob # comment", "x") == {
        "k-aaaaaaaa": "alice",
        "k-bbbbbbbb": "bob",
    }
    with pytest.raises(ServerConfigError, match="KEY=TENANT"):
        parse_api_keys("justakey12345", "x")
    with pytest.raises(ServerConfigError, match="at least 8"):
        parse_api_keys("short=alice", "x")
    with pytest.raises(ServerConfigError, match="twice"):
        parse_api_keys("k-aaaaaaaa=a,k-aaaaaaaa=b", "x")
    f = tmp_path / "keys"
    f.write_text("# keys\nk-cccccccc=carol\n")
    cfg = ServerConfig.from_args(api_keys_file=str(f), env={"COSYSERVE_API_KEYS": "k-dddddddd=dan"})
    assert dict(cfg.api_keys) == {"k-cccccccc": "carol", "k-dddddddd": "dan"}
    with pytest.raises(ServerConfigError, match="cannot read"):
        ServerConfig.from_args(api_keys_file=str(tmp_path / "missing"), env={})


# -- request bodies ----------------------------------------------------------------------------------------


def body(**fields: object) -> bytes:
    return json.dumps({"input": "Hello.", "voice": "alloy"} | fields).encode()


def test_speech_request_defaults_are_openais() -> None:
    r = parse_speech_request(body())
    assert (r.response_format, r.speed, r.stream, r.seed, r.model) == ("mp3", 1.0, False, None, None)


def test_openai_speed_range_is_accepted_and_documented_as_one_range() -> None:
    """OpenAI's speed range (0.25-4.0) must pass the body check, and the OpenAPI document must state the same
    bounds, or clients written for OpenAI get 400s the documentation does not explain."""
    from cosyserve.request import SPEED_MAX, SPEED_MIN
    from cosyserve.server.schemas import openapi_document

    for speed in (0.25, 0.5, 2.0, 4.0, 3):
        assert parse_speech_request(body(speed=speed)).speed == speed
    doc = openapi_document(100)["components"]["schemas"]["SpeechRequest"]["properties"]["speed"]
    assert (doc["minimum"], doc["maximum"]) == (SPEED_MIN, SPEED_MAX) == (0.25, 4.0)


# -- errors ------------------------------------------------------------------------------------------------


def test_engine_error_messages_reach_the_client_without_server_paths() -> None:
    from cosyserve.errors import ClientError
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
