"""cosyserve on Ray Serve: the builder's arguments, and two replicas of the tiny model on a local Ray instance
(answers streamed and not, a killed replica replaced, a disconnected stream freed)."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cosyserve.core.settings import SettingsError
from cosyserve.deploy.ray_serve import deployment_options, settings_flags
from server_util import wait_until


def test_replicas_fixed_or_autoscaled() -> None:
    # if this fails, `serve run ... min_replicas=1 max_replicas=4` does not autoscale, or a bad count starts anyway
    assert deployment_options({})["num_replicas"] == 1
    auto = deployment_options({"min_replicas": "1", "max_replicas": "4"})["autoscaling_config"]
    assert auto == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2.0}
    assert deployment_options({"num_cpus": "0.5"})["ray_actor_options"] == {"num_cpus": 0.5}
    for bad, match in [
        ({"num_replicas": "two"}, "num_replicas='two': expected a number"),
        ({"num_replicas": "0"}, "num_replicas='0': must be >= 1"),
        ({"min_replicas": "3", "max_replicas": "2"}, "max_replicas=2 is below min_replicas=3"),
        ({"num_replicas": "2", "max_replicas": "4"}, "not both"),
    ]:
        with pytest.raises(ValueError, match=match):
            deployment_options(bad)


def test_settings_are_checked_on_the_driver(tiny_model_dir: Path) -> None:
    # if this fails, a typo or a bad value reaches the replicas, which then fail one by one at start
    assert settings_flags({"model": str(tiny_model_dir), "num_replicas": "2"}) == {
        "models": str(tiny_model_dir)
    }
    with pytest.raises(ValueError, match="unknown modle"):
        settings_flags({"modle": "x"})
    with pytest.raises(ValueError, match="port are set by Ray Serve"):
        settings_flags({"port": "8000"})
    with pytest.raises(SettingsError, match="batch_size"):
        settings_flags({"batch_size": "none"})


def test_a_replica_applies_the_limits_it_is_given_as_every_route_does(tiny_model_dir: Path) -> None:
    """A replica is the whole server (create_app): its routes build their requests with the one constructor, within
    the limits its arguments set. If this fails, `serve run ... max_text_chars=100` would not limit the replicas."""
    from starlette.testclient import TestClient

    from cosyserve.deploy.ray_serve import CosyServeReplica

    flags = settings_flags(
        {"model": str(tiny_model_dir), "max_text_chars": "10", "max_instructions_chars": "5"}
    )
    app = CosyServeReplica(flags).__serve_build_asgi_app__()
    limits = app.state.cosy.limits
    assert (limits.text_chars, limits.instructions_chars) == (10, 5)
    client = TestClient(app)  # no lifespan: the model is never loaded, the request is refused before it
    r = client.post("/v1/audio/speech", json={"input": "x" * 11, "voice": "alloy"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


def _serve() -> Any:
    pytest.importorskip("ray", reason="Ray Serve not installed (pip install 'cosyserve[ray]')")
    return pytest.importorskip("ray.serve", reason="Ray Serve not installed (pip install 'cosyserve[ray]')")


CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "ray-serve.yaml"


def test_the_serve_run_config_is_valid() -> None:
    # if this fails, `serve run deploy/ray-serve.yaml` is refused by Ray, or its args by the builder
    import yaml

    _serve()
    from ray.serve.schema import ServeDeploySchema

    doc = yaml.safe_load(CONFIG.read_text())
    schema = ServeDeploySchema.model_validate(doc)
    (app,) = schema.applications
    assert app.import_path == "cosyserve.deploy.ray_serve:app_builder"
    assert "autoscaling_config" in deployment_options(app.args)
    assert settings_flags(app.args)["models"] == "/models/cosyvoice-300m-sft"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _replica_pids() -> set[int]:
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if cmd.startswith(b"ray::ServeReplica:cosyserve"):
                pids.add(int(entry))
    return pids


@pytest.fixture(scope="module")
def ray_app(tiny_model_dir: Path) -> Iterator[int]:
    serve = _serve()
    import ray

    from cosyserve.deploy.ray_serve import app_builder

    port = _free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = app_builder({"model": str(tiny_model_dir), "num_replicas": "2", "num_cpus": "0.5"})
        serve.run(app, name="cosyserve", route_prefix="/")
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def _speech(
    port: int,
    stream: bool,
    text: str = "Hello there.",
    timeout: float = 60,
    prefix: str = "",
    voice: str = "英文女",
) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    body = {"input": text, "voice": voice, "response_format": "pcm" if stream else "wav", "seed": 1}
    c.request(
        "POST",
        prefix + "/v1/audio/speech",
        json.dumps({**body, "stream": stream}),
        {"Content-Type": "application/json"},
    )
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def _get(port: int, path: str) -> tuple[int, Any]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", path)
    r = c.getresponse()
    body = json.loads(r.read() or b"null")
    c.close()
    return r.status, body


def test_replicas_answer_streamed_and_not(ray_app: int) -> None:
    # if this fails, Ray's proxy does not carry the app's responses (streamed pcm, a whole WAV, a client error)
    status, body = _get(ray_app, "/health/ready")
    assert status == 200 and body["status"] == "ready", body
    status, pcm = _speech(ray_app, stream=True)
    assert status == 200 and len(pcm) > 1000 and len(pcm) % 2 == 0
    status, wav = _speech(ray_app, stream=False)
    assert status == 200 and wav[:4] == b"RIFF" and len(wav) - 44 == len(pcm), "same seed: same audio"
    c = http.client.HTTPConnection("127.0.0.1", ray_app, timeout=30)
    c.request("POST", "/v1/audio/speech", "{", {"Content-Type": "application/json"})
    r = c.getresponse()
    status, error = r.status, json.loads(r.read())["error"]
    c.close()
    assert status == 400 and error["code"] == "invalid_json", error


def _cpu_seconds(pids: set[int]) -> float:
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def _cpu_per_second(pids: set[int], window: float = 0.5) -> float:
    before = _cpu_seconds(pids)
    time.sleep(window)
    return (_cpu_seconds(pids) - before) / window


def test_a_disconnected_stream_frees_its_replica(ray_app: int) -> None:
    # if this fails, a client that goes away keeps its replica synthesizing to nobody. Ray routes new requests
    # to the less busy replica, so the busy one is watched by its CPU time, not asked over HTTP. Each step waits
    # for its state with a generous bound: how much CPU a replica gets depends on what else runs on the machine
    pids = _replica_pids()
    wait_until(lambda: _cpu_per_second(pids) < 0.3, "the replicas are idle before the test", 60)
    start = _cpu_seconds(pids)
    s = socket.create_connection(("127.0.0.1", ray_app), timeout=30)
    body = json.dumps(
        {
            "input": "Hello there, this is long. " * 30,
            "voice": "英文女",
            "stream": True,
            "response_format": "pcm",
        }
    ).encode()
    head = f"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    s.sendall(head.encode() + body)
    assert s.recv(4096).startswith(b"HTTP/1.1 200"), "the stream started"
    wait_until(
        lambda: _cpu_seconds(pids) - start > 1.0, "a replica synthesizes the long stream (1 CPU s of it)", 60
    )
    s.close()
    wait_until(lambda: _cpu_per_second(pids) < 0.3, "the replicas idle again after the client left", 60)
    # idle CPU alone could be a stream paused by backpressure; a freed replica takes new work at once. Ray sends
    # two requests that arrive together to the two replicas, so a replica still holding the dead stream (one
    # request at a time per replica) would keep one of them waiting past the timeout
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: _speech(ray_app, stream=True, timeout=30)[0], range(2)))
    assert results == [200, 200], results


def test_a_killed_replica_is_replaced(ray_app: int) -> None:
    # if this fails, kill -9 of a replica leaves the application short of replicas, or requests fail meanwhile
    before = _replica_pids()
    assert len(before) == 2, before
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = _replica_pids()
        running = (
            _serve()
            .status()
            .applications["cosyserve"]
            .deployments["cosyserve"]
            .replica_states.get("RUNNING", 0)
        )
        if victim not in now and len(now) == 2 and running == 2:
            break
        time.sleep(0.5)
    assert victim not in now and len(now) == 2 and running == 2, (now, running)
    assert all(_speech(ray_app, stream=True)[0] == 200 for _ in range(4))


def test_a_replica_serves_a_cosyvoice3_lite_bundle(ray_app: int, cv3_lite_bundle: Path) -> None:
    """The deployment serves a CosyVoice3 bundle on the lite runtime (``runtime=lite``) as a second application
    beside the torch one: READY, and a streamed answer. If this fails, the Ray Serve route of issue 35 lost the
    lite runtime (the settings refuse it, or a replica cannot load or serve the bundle)."""
    from cosyserve.deploy.ray_serve import app_builder

    serve = _serve()
    app = app_builder({"model": str(cv3_lite_bundle), "runtime": "lite", "num_cpus": "0.5"})
    serve.run(app, name="lite", route_prefix="/lite")  # ready once its model is (the replica's start waits)
    try:
        status, body = _get(ray_app, "/lite/health/ready")
        assert status == 200 and body["status"] == "ready", body
        status, pcm = _speech(ray_app, stream=True, prefix="/lite", voice="中文女")
        assert status == 200 and len(pcm) > 1000 and len(pcm) % 2 == 0, (status, pcm[:200])
    finally:
        serve.delete("lite")
