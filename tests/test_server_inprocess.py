"""The ASGI app in-process (starlette TestClient runs its lifespan): CORS, hub ids, demo announcement."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from cosyserve.server.app import _load_source, create_app
from cosyserve.server.config import ModelArg, ServerConfig


def wait_ready(client: TestClient, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        r = client.get("/health/ready")
        if r.status_code == 200:
            return
        assert r.status_code == 503 and r.json()["status"] in ("not_ready", "draining")
        time.sleep(0.05)
    raise AssertionError(f"not ready after {timeout} s: {client.get('/health/startup').json()}")


def test_cors_is_off_by_default_and_allows_only_configured_origins(tiny_model_dir: Path) -> None:
    origin = "http://app.example:3000"
    cfg = ServerConfig(models=(ModelArg("m", str(tiny_model_dir)),))
    with TestClient(create_app(cfg)) as client:
        r = client.get("/v1/models", headers={"Origin": origin})
        assert "access-control-allow-origin" not in r.headers, "CORS must be off unless configured"
    cfg = ServerConfig(models=(ModelArg("m", str(tiny_model_dir)),), cors_origins=(origin,))
    with TestClient(create_app(cfg)) as client:
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


def test_hub_ids_without_the_hub_extra_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "modelscope", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ValueError, match=r"iic/CosyVoice-300M-SFT: ModelScope ids need .*cosyserve\[hub\]"):
        _load_source("iic/CosyVoice-300M-SFT", "m")
    with pytest.raises(
        ValueError, match=r"FunAudioLLM/CosyVoice-300M: Hugging Face ids need huggingface_hub"
    ):
        _load_source("FunAudioLLM/CosyVoice-300M", "m")
    assert _load_source("/some/local/dir", "m") == "/some/local/dir"


def test_demo_model_is_made_once_and_announced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COSYSERVE_CACHE_DIR", str(tmp_path))
    with TestClient(create_app(ServerConfig())) as client:
        wait_ready(client)
        models = client.get("/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["demo"] and models[0]["demo"] is True
        assert "noise" in models[0]["note"]
        r = client.post("/v1/audio/speech", json={"input": "Hi.", "voice": "alloy", "response_format": "pcm"})
        assert r.status_code == 200 and "X-Cosyserve-Demo" in r.headers and len(r.content) > 0
    assert (tmp_path / "demo-model" / "cosyvoice.yaml").exists()
    assert not list(tmp_path.glob("demo-model.tmp*")), (
        "the demo model is written under a temp name, then renamed"
    )


def test_damaged_onnx_answers_a_clear_error_without_server_paths(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import io
    import logging

    import numpy as np
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
    with TestClient(create_app(ServerConfig(models=(ModelArg("m", str(bundle)),)))) as client:
        wait_ready(client)
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
    from cosyserve.server.config import DEMO_MODEL
    from cosyserve.staging import Staging
    from proc_util import killed_staging

    monkeypatch.setenv("COSYSERVE_CACHE_DIR", str(tmp_path))
    live = Staging(tmp_path / "demo-model", "making").start()  # another process generating it right now
    try:
        stale = killed_staging(tmp_path / "demo-model", "making")  # a generation killed with SIGKILL
        mine = tmp_path / ".demo-model.making.backup01"  # similar name, not ours (no lock file)
        mine.mkdir()
        (mine / "keep.txt").write_text("mine")
        assert _load_source(DEMO_MODEL, DEMO_MODEL) == str(tmp_path / "demo-model")
        assert (tmp_path / "demo-model" / "cosyvoice.yaml").is_file()
        assert not stale.exists(), "the killed generation's temporary was left behind"
        assert live.tmp is not None and live.tmp.exists(), "a live writer's temporary was removed"
        assert (mine / "keep.txt").read_text() == "mine"
    finally:
        live.discard()
