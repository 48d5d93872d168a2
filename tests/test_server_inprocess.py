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
        # the web page shows it after its own "Demo model: " (it read "Demo model: demo model: ...")
        assert "demo model" not in models[0]["note"].lower(), models[0]["note"]
        r = client.post("/v1/audio/speech", json={"input": "Hi.", "voice": "alloy", "response_format": "pcm"})
        assert r.status_code == 200 and "X-Cosyserve-Demo" in r.headers and len(r.content) > 0
    assert (tmp_path / "demo-model" / "cosyvoice.yaml").exists()
    assert not list(tmp_path.glob("demo-model.tmp*")), (
        "the demo model is written under a temp name, then renamed"
    )
