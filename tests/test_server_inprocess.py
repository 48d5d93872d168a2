"""The ASGI app in-process (starlette TestClient runs its lifespan): CORS, hub ids, demo announcement."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from cosyserve.bundle.sources import resolve_source
from cosyserve.core.settings import Settings
from cosyserve.engine.pool import ModelPool, ModelSpec
from cosyserve.engine.quotas import Tenant
from fake_runtime import FakeRuntime
from server_util import in_process, wait_ready


def test_cors_is_off_by_default_and_allows_only_configured_origins(tiny_model_dir: Path) -> None:
    origin = "http://app.example:3000"
    cfg = Settings.load(flags={"models": [f"m={tiny_model_dir}"]})
    with in_process(cfg, ready=False) as client:
        r = client.get("/v1/models", headers={"Origin": origin})
        assert "access-control-allow-origin" not in r.headers, "CORS must be off unless configured"
    cfg = Settings.load(flags={"models": [f"m={tiny_model_dir}"], "cors_origins": origin})
    with in_process(cfg, ready=False) as client:
        pre = client.options(
            "/v1/audio/speech",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type",
            },
        )
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == origin
        other = client.options(
            "/v1/audio/speech",
            headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert other.status_code == 400, "an origin that is not listed must not pass the preflight"
        wait_ready(client)
        r = client.post(
            "/v1/audio/speech",
            json={"input": "Hi.", "voice": "alloy", "response_format": "wav"},
            headers={"Origin": origin},
        )
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert "x-request-id" in r.headers.get("access-control-expose-headers", "").lower()


def test_hub_ids_without_the_hub_extra_say_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "modelscope", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ValueError, match=r"iic/CosyVoice-300M-SFT: ModelScope ids need .*cosyserve\[hub\]"):
        resolve_source("iic/CosyVoice-300M-SFT")
    with pytest.raises(
        ValueError, match=r"FunAudioLLM/CosyVoice-300M: Hugging Face ids need huggingface_hub"
    ):
        resolve_source("FunAudioLLM/CosyVoice-300M")
    assert str(resolve_source("/some/local/dir")) == "/some/local/dir"


def test_demo_model_is_made_once_and_announced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COSYSERVE_CACHE_DIR", str(tmp_path))
    with in_process() as client:
        models = client.get("/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["demo"] and models[0]["demo"] is True
        assert "noise" in models[0]["note"]
        # the web page shows it after its own "Demo model: " (it read "Demo model: demo model: ...")
        assert "demo model" not in models[0]["note"].lower(), models[0]["note"]
        r = client.post("/v1/audio/speech", json={"input": "Hi.", "voice": "alloy", "response_format": "pcm"})
        assert r.status_code == 200 and "X-Cosyserve-Demo" in r.headers and len(r.content) > 0
    assert (tmp_path / "demo-model" / "cosyvoice.yaml").exists()
    assert not list(tmp_path.glob("demo-model.tmp*")), (
        "the demo model is written under a temp name, then renamed"
    )


# --- bodies nobody expected ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def app_client(tiny_model_dir: Path) -> Iterator[TestClient]:
    """The app with the tiny model; server errors are not re-raised into the test, they must become responses."""
    with in_process(Settings.load(flags={"models": [f"m={tiny_model_dir}"]}), ready=False) as client:
        yield client


def errors_counted(client: TestClient, route: str, status: int, code: str) -> float:
    metrics = client.app.state.cosy.metrics  # type: ignore[attr-defined]
    labels = {"route": route, "status": str(status), "code": code}
    return metrics.registry.get_sample_value("cosyserve_http_errors_total", labels) or 0.0


def openai_error(r: Any, status: int) -> dict[str, Any]:
    assert r.status_code == status, f"expected {status}, got {r.status_code}: {r.text[:300]}"
    assert r.headers["content-type"].startswith("application/json"), f"not JSON: {r.text[:300]}"
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), err
    return dict(err)


@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"])
def test_deeply_nested_json_is_a_400(app_client: TestClient, body: bytes) -> None:
    """json's parser recurses per bracket: a deep body raised RecursionError, a plain-text 500 nobody counted."""
    before = errors_counted(app_client, "/v1/audio/speech", 400, "invalid_json")
    r = app_client.post("/v1/audio/speech", content=body, headers={"content-type": "application/json"})
    assert openai_error(r, 400)["code"] == "invalid_json"
    assert errors_counted(app_client, "/v1/audio/speech", 400, "invalid_json") == before + 1


@pytest.mark.parametrize(
    ("path", "kwargs"),
    [
        ("/v1/audio/speech", {"json": {"input": "Hi.", "voice": "alloy"}}),
        ("/inference_sft", {"data": {"tts_text": "Hi.", "spk_id": "x"}}),
    ],
)
def test_an_unexpected_error_is_an_openai_shaped_500_logged_once(
    app_client: TestClient,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    path: str,
    kwargs: dict[str, Any],
) -> None:
    """A bug in a route answers JSON that gives nothing of the server away (no message, path or traceback),
    is counted, and its traceback is logged once (the TestClient re-raises whatever escapes the app)."""
    secret = "cannot open /srv/private/weights.bin"

    def broken(*args: Any, **kw: Any) -> Any:
        raise RuntimeError(secret)

    monkeypatch.setattr(app_client.app.state.cosy, "resolve_model", broken)  # type: ignore[attr-defined]
    before = errors_counted(app_client, path, 500, "internal_error")
    with caplog.at_level(logging.ERROR):
        r = app_client.post(path, **kwargs)
    err = openai_error(r, 500)
    assert err["type"] == "server_error" and err["code"] == "internal_error", err
    for leak in ("/srv/private", "RuntimeError", "Traceback", "weights.bin"):
        assert leak not in r.text, f"the 500 body shows {leak!r}: {r.text}"
    assert errors_counted(app_client, path, 500, "internal_error") == before + 1, "a 500 must be counted"
    logged = [rec for rec in caplog.records if rec.exc_info and secret in str(rec.exc_info[1])]
    assert len(logged) == 1, f"the traceback must be logged once, got {len(logged)}"


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("application/x-www-form-urlencoded", b"[" * 100_000),
        ("application/x-www-form-urlencoded", b"tts_text=" + b"%5B" * 30_000),
        ("application/x-www-form-urlencoded", b"&" * 100_000),
        ("application/x-www-form-urlencoded", b"tts_text=%ff%fe&spk_id"),
        ("multipart/form-data", b"no boundary"),
        ("multipart/form-data; boundary=xyz", b"--xyz\r\nnot a part\r\n--xyz"),
        ("multipart/form-data; boundary=xyz", b"[" * 100_000),
        ("application/json", b"[" * 100_000),
    ],
)
def test_reference_routes_answer_odd_bodies_with_openai_errors(
    app_client: TestClient, content_type: str, body: bytes
) -> None:
    r = app_client.post("/inference_sft", content=body, headers={"content-type": content_type})
    assert 400 <= r.status_code < 500, f"{body[:30]!r} as {content_type}: {r.status_code} {r.text[:200]}"
    openai_error(r, r.status_code)


# --- what a tenant sees --------------------------------------------------------------------------------------


def test_startup_report_names_only_the_callers_models() -> None:
    """/v1/startup is open (probes, the web page), but with API keys it must not list every model name that
    /v1/models hides per tenant: a key sees its tenant's models, no key sees none."""
    pool = ModelPool(
        [ModelSpec("model-a", policy="preload"), ModelSpec("model-b", policy="preload")],
        tenants=[Tenant("a", frozenset({"model-a"})), Tenant("b", frozenset({"model-b"}))],
        load_model=lambda spec, reload: FakeRuntime(),
        memory_probe=None,
    )
    cfg = Settings.load().replace(api_keys={"key-a": "a", "key-b": "b"})
    with in_process(cfg, pool=pool) as client:
        as_a = client.get("/v1/startup", headers={"Authorization": "Bearer key-a"})
        assert as_a.status_code == 200 and list(as_a.json()["models"]) == ["model-a"], as_a.json()
        assert "model-b" not in as_a.text, "tenant a must not learn tenant b's model names"
        anonymous = client.get("/v1/startup")
        assert anonymous.status_code == 200 and anonymous.json()["models"] == {}, anonymous.json()
        assert "ready" in anonymous.json()["server"]["points_ms"], "the server's own timings stay open"
        models = client.get("/v1/models", headers={"Authorization": "Bearer key-b"}).json()["data"]
        assert [m["id"] for m in models] == ["model-b"]
        as_b = client.get("/v1/startup", headers={"Authorization": "Bearer key-b"}).json()
        assert list(as_b["models"]) == ["model-b"], "the same models as /v1/models"
        assert client.get("/openapi.json").status_code == 200, "the OpenAPI document stays open"


# --- errors name the field of the route ---------------------------------------------------------------------

SPK = "英文女"
BAD_WAV = b"RIFF" + (100).to_bytes(4, "little") + b"WAVEfmt " + bytes(40)  # a 'fmt ' chunk cut short


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path, plain_model_dir: Path) -> Iterator[TestClient]:
    """An instruct model ``m`` (the default) and ``plain``: the same weights, not an instruct model."""
    cfg = Settings.load(flags={"models": [f"m={tiny_model_dir}", f"plain={plain_model_dir}"]})
    with in_process(cfg) as c:
        yield c


@pytest.mark.parametrize("text", ["!!!", "\u200b\u200b"])
def test_text_with_nothing_to_speak_is_a_400_naming_the_field(client: TestClient, text: str) -> None:
    """Zero-width-only text must be refused like punctuation-only text, and the error must name the route's
    field (``input`` / ``tts_text``), not leave ``param`` null."""
    r = client.post("/v1/audio/speech", json={"input": text, "voice": "alloy", "response_format": "wav"})
    err = openai_error(r, 400)
    assert err["param"] == "input" and "nothing to speak" in err["message"], err
    r = client.post("/inference_sft", data={"tts_text": text, "spk_id": SPK})
    assert openai_error(r, 400)["param"] == "tts_text"


@pytest.mark.parametrize("endpoint", ["zero_shot", "cross_lingual"])
def test_unreadable_prompt_wav_is_a_400_naming_it(client: TestClient, endpoint: str) -> None:
    """A prompt with a broken WAV header: 400 with ``param: prompt_wav`` and a message a client can read (no
    ``<_io.BytesIO object at 0x...>``)."""
    r = client.post(
        f"/inference_{endpoint}",
        data={"tts_text": "Hello.", "prompt_text": "Hello there."}
        if endpoint == "zero_shot"
        else {"tts_text": "Hi."},
        files={"prompt_wav": ("p.wav", BAD_WAV, "audio/wav")},
    )
    err = openai_error(r, 400)
    assert err["param"] == "prompt_wav", err
    assert "not a readable audio file" in err["message"] and "object at 0x" not in err["message"], err


def test_instruct_on_a_model_that_is_not_instruct_is_a_400(client: TestClient) -> None:
    """As the reference: instructions need an -Instruct model. The refusal names ``instructions`` (OpenAI
    route) / ``instruct_text`` (reference route); the instruct model still follows them."""
    body = {"input": "Hello.", "voice": SPK, "response_format": "wav", "instructions": "Speak calmly."}
    err = openai_error(client.post("/v1/audio/speech", json={**body, "model": "plain"}), 400)
    assert err["param"] == "instructions" and "not an instruct model" in err["message"], err
    r = client.post(
        "/inference_instruct",
        data={"tts_text": "Hello.", "spk_id": SPK, "instruct_text": "Speak calmly."},
        headers={"X-Model": "plain"},
    )
    assert openai_error(r, 400)["param"] == "instruct_text"
    assert client.post("/v1/audio/speech", json={**body, "model": "m"}).status_code == 200


def test_instruct2_on_a_cosyvoice_300m_model_is_a_400_that_says_whose_mode_it_is(client: TestClient) -> None:
    """/inference_instruct2 is CosyVoice2's route: on a 300M model it is refused before the prompt is read,
    naming the mode's family and the 300M alternative (not a 500, not a silent fallback to another mode)."""
    r = client.post(
        "/inference_instruct2",
        data={"tts_text": "Hello.", "instruct_text": "Speak calmly.<|endofprompt|>"},
        files={"prompt_wav": ("p.wav", BAD_WAV, "audio/wav")},
    )
    err = openai_error(r, 400)
    assert "CosyVoice2" in err["message"] and "instruct2" in err["message"], err


def test_openai_speed_range_is_served(client: TestClient) -> None:
    """speed 0.25 and 4.0 (OpenAI's bounds) are served, the audio 1/speed as long as at speed 1.0."""
    body = {"input": "Hello there.", "voice": SPK, "response_format": "pcm", "seed": 3}
    sizes = {}
    for speed in (1.0, 0.25, 4.0):
        r = client.post("/v1/audio/speech", json={**body, "speed": speed})
        assert r.status_code == 200, r.text
        sizes[speed] = len(r.content) // 2
    for speed in (0.25, 4.0):
        assert abs(sizes[speed] - sizes[1.0] / speed) <= 256, sizes
    assert openai_error(client.post("/v1/audio/speech", json={**body, "speed": 4.5}), 400)["param"] == "speed"


def test_damaged_onnx_answers_a_clear_error_without_server_paths(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import io
    import logging

    import soundfile as sf

    from cosyserve.bundle.convert import convert

    bundle = convert(tiny_model_dir, tmp_path / "b", progress=False)
    onnx = bundle / "campplus.onnx"
    onnx.write_bytes(onnx.read_bytes()[:1000])
    buf = io.BytesIO()
    sf.write(
        buf,
        (0.3 * np.sin(np.arange(32000) / 16000 * 2 * np.pi * 220)).astype(np.float32),
        16000,
        "PCM_16",
        format="WAV",
    )
    caplog.set_level(logging.ERROR)
    with in_process(Settings.load(flags={"models": [f"m={bundle}"]})) as client:
        r = client.post(
            "/inference_zero_shot",
            data={"tts_text": "Hi.", "prompt_text": "A short prompt."},
            files={"prompt_wav": ("prompt_wav", buf.getvalue(), "application/octet-stream")},
        )
    assert r.status_code == 500, r.text
    message = r.json()["error"]["message"]
    assert "campplus.onnx" in message and "damaged" in message and "converted again" in message, message
    assert str(tmp_path) not in r.text, f"a server path reached the client: {message}"
    rid = message.rsplit("request ", 1)[1].rstrip(")")
    logged = [rec for rec in caplog.records if rid in rec.getMessage()]
    assert logged and str(onnx) in (logged[0].exc_text or ""), "the detail (with the path) belongs in the log"


def test_demo_model_generation_removes_only_stale_temporaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cosyserve.system.staging import Staging
    from proc_util import killed_staging

    live = Staging(tmp_path / "demo-model", "making").start()  # another process generating it right now
    try:
        stale = killed_staging(tmp_path / "demo-model", "making")  # a generation killed with SIGKILL
        mine = tmp_path / ".demo-model.making.backup01"  # similar name, not ours (no lock file)
        mine.mkdir()
        (mine / "keep.txt").write_text("mine")
        assert resolve_source("demo", tmp_path) == tmp_path / "demo-model"
        assert (tmp_path / "demo-model" / "cosyvoice.yaml").is_file()
        assert not stale.exists(), "the killed generation's temporary was left behind"
        assert live.tmp is not None and live.tmp.exists(), "a live writer's temporary was removed"
        assert (mine / "keep.txt").read_text() == "mine"
    finally:
        live.discard()


def body(**fields: object) -> bytes:
    return json.dumps({"input": "Hello.", "voice": "alloy"} | fields).encode()


@pytest.fixture(scope="module")
def limited_client(tiny_model_dir: Path) -> Iterator[TestClient]:
    """The app with a 100-character text limit (the model never loads: bad bodies are refused before it)."""
    cfg = Settings.load(flags={"models": [f"m={tiny_model_dir}"], "max_text_chars": 100})
    with in_process(cfg, ready=False) as client:
        yield client


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
        (body(sample_rate=0), "sample_rate", "between 1 and"),
        (body(sample_rate="fast"), "sample_rate", "integer"),
        (body(response_format="mp3", sample_rate=44000), "sample_rate", "not a rate mp3 takes"),
        (body(seed=-1), "seed", "integer"),
        (body(temperature=1), "temperature", "unknown field"),
        (body(stream_format="json"), "stream_format", "not supported"),
        (body(stream_format="sse", stream=False), "stream", "event stream"),
        (json.dumps({"voice": "alloy"}).encode(), "input", "required"),
    ],
)
def test_bad_speech_requests_name_their_field(
    limited_client: TestClient, raw: bytes, param: str | None, message: str
) -> None:
    """Every bad body is a 400 whose ``param`` is the OpenAI field at fault, whichever layer refuses it (the
    body's JSON types, the server's limits, or the request's own checks)."""
    r = limited_client.post("/v1/audio/speech", content=raw, headers={"Content-Type": "application/json"})
    err = openai_error(r, 400)
    assert err["param"] == param and message in err["message"], err
