"""What the server tells whom: model names and server paths on the open routes, a model that cannot load, the
client's own values in error messages (cut when long, never mangled), urlencoded forms in UTF-8, exit codes.

In-process (starlette's TestClient) on the fake runtime, with a fake clock where time matters; one test starts a
real ``cosyserve serve`` to see its exit code.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from starlette.testclient import TestClient

from cosyserve.core.errors import BundleError, LoadFailedError, shown
from cosyserve.core.request import SynthesisRequest
from cosyserve.core.settings import Settings
from cosyserve.engine.pool import LOAD_BACKOFF_S, ModelPool, ModelSpec, PoolEvent
from cosyserve.engine.quotas import Tenant
from cosyserve.server.app import create_app
from cosyserve.server.metrics import OTHER_MODELS
from cosyserve.server.run import EXIT_CODES
from fake_runtime import FakeRuntime
from server_util import start_server, wait_until

SECRET_DIR = "/srv/secret-models/tenant-b"


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def keyed_settings() -> Settings:
    # key-ops's tenant is not in the pool: it sees every model (a scraper's key)
    return Settings.load().replace(api_keys={"key-a": "a", "key-b": "b", "key-ops": "ops"})


def two_tenants(load_model: Callable[[ModelSpec, bool], Any], **kw: Any) -> ModelPool:
    return ModelPool(
        [ModelSpec("model-a", policy="preload"), ModelSpec("model-b", **kw)],
        tenants=[Tenant("a", frozenset({"model-a"})), Tenant("b", frozenset({"model-b"}))],
        load_model=load_model,
        memory_probe=None,
        clock=Clock(),  # stopped: a failed model stays in its back-off
    )


def fails_b(spec: ModelSpec, reload: bool) -> FakeRuntime:
    if spec.name == "model-b":
        raise BundleError(
            f"{SECRET_DIR}/llm.safetensors: header length 99999999 is over the file's 1000 bytes"
        )
    return FakeRuntime()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# --- model names and server paths on the open routes --------------------------------------------------------


@pytest.fixture(scope="module")
def keyed() -> Iterator[TestClient]:
    """API keys for tenants a (model-a, preloaded) and b (model-b, lazy, whose bundle is damaged), and ops."""
    with TestClient(create_app(keyed_settings(), pool=two_tenants(fails_b))) as client:
        wait_until(lambda: client.get("/health/ready").status_code == 200, "ready")
        r = client.post(
            "/v1/audio/speech",
            json={"input": "Hi.", "voice": "alice", "model": "model-b"},
            headers=auth("key-b"),
        )
        assert r.status_code == 503, r.text  # model-b failed to load: now in its back-off
        yield client


@pytest.mark.parametrize("path", ["/health/ready", "/health/startup", "/metrics", "/v1/startup"])
def test_open_routes_name_no_model_to_a_caller_without_a_key(keyed: TestClient, path: str) -> None:
    """If this fails, anyone who can reach the port learns every tenant's model names (and so which customers
    the server has) from a route that needs no key, though /v1/models hides them per key."""
    r = keyed.get(path)
    assert r.status_code == 200, f"{path} must answer a probe without a key: {r.status_code} {r.text[:300]}"
    for name in ("model-a", "model-b"):
        assert name not in r.text, f"{path} names {name} to a caller without a key:\n{r.text[:2000]}"
    assert SECRET_DIR not in r.text and "secret-models" not in r.text, f"{path} shows a server path"


def test_health_counts_every_model_by_state_and_names_the_keys_own(keyed: TestClient) -> None:
    """If this fails, a probe without a key cannot tell a failed model from a healthy server, or a tenant sees
    another tenant's model (or not its own)."""
    anonymous = keyed.get("/health/ready").json()
    assert anonymous["models"] == {} and anonymous["model_states"] == {"ready": 1, "failed": 1}, anonymous
    as_a = keyed.get("/health/ready", headers=auth("key-a")).json()
    assert list(as_a["models"]) == ["model-a"] and as_a["models"]["model-a"]["state"] == "ready", as_a
    as_b = keyed.get("/health/startup", headers=auth("key-b")).json()
    b = as_b["models"]["model-b"]
    assert list(as_b["models"]) == ["model-b"] and b["state"] == "failed", as_b
    assert "llm.safetensors: header length 99999999" in b["cause"], "the cause is named to whom may use it"
    assert SECRET_DIR not in b["cause"], f"a server path reached an open route: {b['cause']}"
    assert 0 < b["retry_in_s"] <= LOAD_BACKOFF_S[0]
    ops = keyed.get("/health/ready", headers=auth("key-ops")).json()
    assert sorted(ops["models"]) == ["model-a", "model-b"], "a key of no pool tenant sees every model"


def test_metrics_name_the_keys_models_and_sum_the_others(keyed: TestClient) -> None:
    """If this fails, /metrics shows a keyless scraper (or another tenant) every model name, or the sums over
    hidden models are lost (a dashboard's total in flight, a count of failed models)."""
    keyed.post(
        "/v1/audio/speech",
        json={"input": "Hi.", "voice": "alice", "response_format": "pcm"},
        headers=auth("key-a"),
    )
    anonymous = keyed.get("/metrics").text
    assert f'cosyserve_model_state{{model="{OTHER_MODELS}",state="failed"}} 1.0' in anonymous, anonymous
    assert f'cosyserve_model_state{{model="{OTHER_MODELS}",state="ready"}} 1.0' in anonymous
    requests = [line for line in anonymous.splitlines() if line.startswith("cosyserve_requests_total{")]
    assert requests and all(f'model="{OTHER_MODELS}"' in line for line in requests), requests
    assert "cosyserve_real_time_factor{" not in anonymous, "a median does not sum: left out, not added up"
    as_a = keyed.get("/metrics", headers=auth("key-a")).text
    assert 'cosyserve_model_state{model="model-a",state="ready"} 1.0' in as_a and "model-b" not in as_a
    assert f'cosyserve_model_state{{model="{OTHER_MODELS}",state="failed"}} 1.0' in as_a
    ops = keyed.get("/metrics", headers=auth("key-ops")).text
    assert 'model="model-b"' in ops and OTHER_MODELS not in ops, "a key of no pool tenant sees every series"


def test_a_failed_preload_shows_its_cause_without_the_server_path() -> None:
    """If this fails, /health/startup (open, polled by Kubernetes) shows where the server keeps its models, or
    names a tenant's model to a caller without a key, while the same failure on the API is cut."""
    pool = two_tenants(fails_b, policy="preload")
    with TestClient(create_app(keyed_settings(), pool=pool)) as client:
        wait_until(lambda: client.get("/health/startup").json()["status"] == "failed", "failed")
        anonymous = client.get("/health/startup")
        assert anonymous.status_code == 503 and "model-b" not in anonymous.text, anonymous.text
        assert "failed to load" in anonymous.json()["error"] and SECRET_DIR not in anonymous.text
        as_b = client.get("/health/startup", headers=auth("key-b")).json()
        assert "model 'model-b' failed to load" in as_b["error"] and "llm.safetensors" in as_b["error"], as_b
        assert SECRET_DIR not in json.dumps(as_b), as_b
    no_keys = two_tenants(fails_b, policy="preload")
    with TestClient(create_app(Settings.load(), pool=no_keys)) as client:
        wait_until(lambda: client.get("/health/startup").json()["status"] == "failed", "failed")
        body = client.get("/health/startup").json()
        assert "model-b" in body["error"] and SECRET_DIR not in json.dumps(body), body


# --- a model that cannot load ---------------------------------------------------------------------------------


class FailingLoader:
    """Fails every load (a damaged bundle) until ``fixed``; counts the attempts."""

    def __init__(self) -> None:
        self.attempts = 0
        self.fixed = False

    def __call__(self, spec: ModelSpec, reload: bool) -> FakeRuntime:
        self.attempts += 1
        if not self.fixed:
            raise BundleError(f"{SECRET_DIR}/flow.safetensors: checksum mismatch")
        return FakeRuntime()


def backing_off(path: str | None = None) -> tuple[ModelPool, FailingLoader, Clock, list[PoolEvent]]:
    loader, clock, events = FailingLoader(), Clock(), []
    pool = ModelPool([ModelSpec("m", path=path)], load_model=loader, memory_probe=None, clock=clock)
    pool.add_listener(events.append)
    return pool, loader, clock, events


def starts(events: list[PoolEvent]) -> int:
    return sum(ev.kind == "load_started" for ev in events)


def test_a_model_that_cannot_load_is_not_loaded_per_request() -> None:
    """If this fails, every request to a model whose bundle is damaged loads it again (a core, and a large
    bundle's checksum reads, per request), and clients are told neither why nor when to come back."""
    pool, loader, clock, events = backing_off()
    with TestClient(create_app(Settings.load(), pool=pool)) as client:
        answers = [
            client.post("/v1/audio/speech", json={"input": "Hi.", "voice": "alice", "response_format": "pcm"})
            for _ in range(4)
        ]
        assert loader.attempts == 1 and starts(events) == 1, f"{loader.attempts} loads for 4 requests"
        for r in answers:
            assert r.status_code == 503 and r.headers.get("retry-after") == "1", (r.status_code, r.headers)
            err = r.json()["error"]
            assert err["code"] == "load_failed" and "flow.safetensors: checksum mismatch" in err["message"], (
                err
            )
            assert SECRET_DIR not in err["message"], err
        ready = client.get("/health/ready").json()["models"]["m"]
        assert ready["state"] == "failed" and "checksum mismatch" in ready["cause"], ready


def test_load_back_off_doubles_to_its_bound_and_a_success_ends_it() -> None:
    """If this fails, a model that keeps failing is tried too often (no doubling: CPU burnt) or too rarely (no
    bound: a fixed bundle stays refused for long), or a model that loads again keeps its old failure."""
    pool, loader, clock, events = backing_off()
    waits = []
    for _ in range(9):
        with pytest.raises(LoadFailedError) as info:
            pool.submit_sync("m", SynthesisRequest("hi", "alice"), load_timeout=10)
        waits.append(info.value.retry_after)
        assert isinstance(info.value.__cause__, BundleError), "the loader's own exception is the cause"
        for _ in range(3):  # within the back-off: refused at once, no load
            with pytest.raises(LoadFailedError):
                pool.submit_sync("m", SynthesisRequest("hi", "alice"), load_timeout=10)
        clock.t += info.value.retry_after
    assert waits == [1, 2, 4, 8, 16, 32, 60, 60, 60], waits
    assert loader.attempts == starts(events) == 9
    assert pool.stats()["models"]["m"]["rejected"]["load_backoff"] == 27
    loader.fixed = True
    assert list(pool.submit_sync("m", SynthesisRequest("hi", "alice"), load_timeout=10))
    assert pool.load_failure("m") is None and pool.stats()["models"]["m"]["state"] == "ready"
    pool.close_sync()


def test_load_back_off_ends_early_when_the_files_change(tmp_path: Path) -> None:
    """If this fails, an operator who replaced a damaged bundle waits out a back-off of up to a minute."""
    (tmp_path / "flow.safetensors").write_bytes(b"damaged")
    pool, loader, clock, _ = backing_off(str(tmp_path))
    for t in (0.0, 1.0, 3.0):  # three failures, each at the end of the last back-off: the next try at t=7
        clock.t = t
        with pytest.raises(LoadFailedError):
            pool.submit_sync("m", SynthesisRequest("hi", "alice"), load_timeout=10)
    clock.t = 4.0
    with pytest.raises(LoadFailedError, match="3 times in a row"):  # the files are as they were: refused
        pool.submit_sync("m", SynthesisRequest("hi", "alice"), load_timeout=10)
    assert loader.attempts == 3
    (tmp_path / "flow.safetensors").write_bytes(b"converted again")
    loader.fixed = True
    clock.t = 5.0
    assert list(pool.submit_sync("m", SynthesisRequest("hi", "alice"), load_timeout=10)), "loaded at t=5"
    assert loader.attempts == 4
    pool.close_sync()


# --- the client's own values in messages ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def fake() -> Iterator[TestClient]:
    pool = ModelPool(
        [ModelSpec("m", policy="preload")],
        load_model=lambda spec, reload: FakeRuntime(speakers=("alice", "中文女")),
        memory_probe=None,
    )
    with TestClient(create_app(Settings.load(), pool=pool)) as client:
        wait_until(lambda: client.get("/health/ready").status_code == 200, "ready")
        yield client


def speech(client: TestClient, **fields: Any) -> Any:
    return client.post(
        "/v1/audio/speech", json={"input": "Hi.", "voice": "alice", "response_format": "pcm"} | fields
    )


def test_a_long_value_is_cut_in_the_error_and_the_access_log(
    fake: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    """If this fails, a client's 100,000-character value comes back whole in the 400 (and fills the log):
    a megabyte of echo per request, for free; or its length is said twice (the cut value cut again: "'vvv…'
    (81 characters) (100000 characters)")."""
    huge = "v" * 100_000
    for fields, param in (
        ({"voice": huge}, "voice"),
        ({"speed": huge}, "speed"),
        ({huge: 1}, None),
        ({"response_format": huge}, "response_format"),
        ({"seed": huge}, "seed"),
    ):
        r = speech(fake, **fields)
        assert r.status_code == 400 and len(r.content) < 1000, (r.status_code, len(r.content))
        err = r.json()["error"]
        assert err["message"].count("100000 characters") == 1 and "(81 characters)" not in err["message"], err
        if param is not None:
            assert err["param"] == param, err
    with caplog.at_level(logging.INFO, logger="cosyserve.access"):
        r = speech(fake, voice="w" * 200)  # under the name limit: the model's own refusal, logged
    err = r.json()["error"]
    assert r.status_code == 400 and f"{shown('w' * 200)}; known speakers: alice, 中文女" in err["message"], (
        err
    )
    lines = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "cosyserve.access"]
    assert lines and lines[-1]["voice"] == "w" * 80 + "… (200 characters)", lines[-1:]


def test_the_clients_own_path_is_echoed_as_given(fake: TestClient) -> None:
    """If this fails, the path-stripping meant for the server's paths rewrites the client's own value
    (``"model": "/etc/passwd"`` answered "unknown model 'passwd'"): the client is told of a value it never sent."""
    err = speech(fake, model="/etc/passwd").json()["error"]
    assert err["message"].startswith("unknown model '/etc/passwd'; available: m"), err
    err = speech(fake, voice="/etc/passwd").json()["error"]
    assert "'/etc/passwd'" in err["message"], err


def sft_form(client: TestClient, body: bytes) -> Any:
    headers = {"content-type": "application/x-www-form-urlencoded"}
    return client.post("/inference_sft", content=body, headers=headers)


def test_a_urlencoded_form_is_read_as_utf8(fake: TestClient) -> None:
    """If this fails, `curl --data 'tts_text=你好&spk_id=中文女'` (raw UTF-8, as curl and browsers send it) is
    read as latin-1 and refused as an unknown speaker with a garbled name."""
    raw = "tts_text=你好&spk_id=中文女".encode()
    r = sft_form(fake, raw)
    assert r.status_code == 200 and r.content, r.text[:300]
    escaped = urlencode({"tts_text": "你好", "spk_id": "中文女"}).encode()
    assert sft_form(fake, escaped).status_code == 200, "percent-encoded UTF-8 is read as before"
    for body in (b"tts_text=\xff\xfe&spk_id=alice", b"tts_text=%ff%fe&spk_id=alice"):
        err = sft_form(fake, body).json()["error"]
        assert "not UTF-8" in err["message"] and err["code"] == "invalid_form", err


# --- exit codes ---------------------------------------------------------------------------------------------


def test_a_taken_port_exits_with_the_documented_code(tiny_model_dir: Path, tmp_path: Path) -> None:
    """If this fails, `cosyserve serve` on a port in use exits with a code the documentation does not give it
    (it said 3 meant a preload model that failed), and a supervisor reads the wrong cause."""
    codes = dict(EXIT_CODES)
    assert sorted(codes) == [0, 1, 2, 3] and "port" in codes[3] and "model" in codes[3], codes
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = start_server(
            tiny_model_dir, tmp_path, env={"OMP_NUM_THREADS": "1"}, wait_ready=False, port=port
        )
        code = server.proc.wait(300)
    assert code == 3, f"exit {code}:\n{server.log()[-2000:]}"
    assert "address already in use" in server.log().lower(), server.log()[-2000:]
