"""The server's life: readiness while loading, a failed preload, client disconnects, the SIGTERM drain, streams
cut short, and metrics over several workers.

Real ``cosyserve serve`` processes on 127.0.0.1 (tests/server_util.py), plus in-process checks of the same
states where a real process shows them only for a moment (the app via starlette's TestClient, whose lifespan
runs the preload), and the app under a real uvicorn in this process over the fake runtime where only the
server's side is tested and a real model's speed would decide the outcome (a stream cut at its deadline).

On SIGTERM the port stays open ``--drain-delay`` seconds answering 503 (the test servers run with 0 unless a
test gives it: then uvicorn closes the listening socket at its next tick, ~0.1 s, and a probe sees either
readiness 503 or a refused connection, never 200); requests already being answered then get
``--shutdown-grace`` to finish, what still runs is cut, and the process exits 0.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cosyserve.core.settings import Settings
from fake_runtime import FakeRuntime
from server_util import (
    LOAD_S,
    ServerProcess,
    in_process,
    post_and_hold,
    running_server,
    serve,
    start_server,
    wait_ready,
    wait_until,
)

# ~6 sentences: a stream that lasts a few seconds on the tiny model, long after its first chunk
LONG_TEXT = "Hello there, this is a long sentence to speak. " * 6
# 2 sentences: the stream a SIGTERM test drains, read whole twice (alone, then drained); it outlasts the signal's
# handling (milliseconds) by the rest of its first sentence and all of its second
DRAIN_TEXT = "Hello there, this is a long sentence to speak. " * 2
GRACE_S = 120  # generous: the 2-core test machine is shared; the drain normally takes a few seconds


def speech_body(text: str = LONG_TEXT, seed: int = 7) -> dict[str, Any]:
    return {"input": text, "voice": "alloy", "stream": True, "response_format": "pcm", "seed": seed}


def refused_or_503(client: httpx.Client, method: str, path: str, **kwargs: Any) -> str:
    """'refused' when the listener is gone, else the 503 body's status (anything else fails the test)."""
    try:
        r = client.request(method, path, **kwargs)
    except httpx.TransportError:  # connection refused or reset: uvicorn closed its listener
        return "refused"
    assert r.status_code == 503, f"{method} {path} after SIGTERM answered {r.status_code}: {r.text[:300]}"
    return str(r.json().get("status") or r.json()["error"]["message"])


def wait_for_log(server: ServerProcess, needle: str, timeout_s: float = 60.0) -> None:
    wait_until(
        lambda: needle in server.log(),
        lambda: f"{needle!r} in the server log:\n{server.log()[-3000:]}",
        timeout_s,
    )


@contextlib.contextmanager
def sigterm_mid_stream(
    c: httpx.Client, server: ServerProcess, body: dict[str, Any], wait_for: str | None = None
) -> Iterator[tuple[list[bytes], Iterator[bytes]]]:
    """Start a stream, read its first chunk, SIGTERM the server (and wait for ``wait_for`` in its log); yields
    the chunks read so far and the iterator over the rest."""
    with c.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200, r.read()
        chunks = r.iter_raw()
        got = [next(chunks)]
        server.proc.send_signal(signal.SIGTERM)
        if wait_for is not None:
            wait_for_log(server, wait_for)
        yield got, chunks


def metric_samples(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = client.get("/metrics")
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def in_flight(samples: dict[Any, float], model: str) -> float:
    return samples[("cosyserve_in_flight_requests", (("model", model),))]


def count(samples: dict[Any, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


@pytest.fixture(scope="module", params=["torch", "lite"])
def server(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The server on each runtime: the model dir on torch, its --runtime lite bundle on the lite runtime."""
    if request.param == "lite":
        model, env = request.getfixturevalue("tiny_lite_bundle"), {"COSYSERVE_RUNTIME": "lite"}
    else:
        model, env = tiny_model_dir, {}
    with running_server(f"tiny={model}", tmp_path_factory.mktemp("lifecycle"), env=env) as s:
        yield s


# --- readiness while the model loads ---------------------------------------------------------------------


def test_probes_before_ready_say_loading(server: ServerProcess) -> None:
    """The port opens before the model is ready; any probe answered before that is a 503 with the state.

    The tiny model can load before the first probe gets through, so no 503 at all is accepted here (the
    in-process test below holds the load to see that state for sure); what was seen must have this shape.
    """
    seen = server.before_ready
    if "ready" in seen:
        status, body = seen["ready"]
        assert status == 503 and body["status"] == "not_ready"
        assert body["models"]["tiny"]["state"] in ("new", "loading", "ready")
        assert body["models"]["tiny"]["preload"] is True
        assert seen["live"][0] == 200 and seen["live"][1]["status"] == "alive"
        status, body = seen["startup"]
        assert status in (200, 503) and body["status"] in ("starting", "started")
    with server.client() as c:
        assert c.get("/health/ready").json()["status"] == "ready"
        assert c.get("/health/startup").json()["status"] == "started"


def test_readiness_is_503_with_the_state_until_the_preload_finishes(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In process, with the load held back until the test lets it go: live 200, startup/ready 503 'loading'."""
    gate = threading.Event()
    from cosyserve.engine.pool import ModelPool

    original = ModelPool._default_load_model

    def held_load(self: ModelPool, spec: Any, reload: bool) -> Any:
        assert gate.wait(120), "the test never released the load"
        return original(self, spec, reload)

    monkeypatch.setattr(ModelPool, "_default_load_model", held_load)
    cfg = Settings.load(flags={"models": [f"m={tiny_model_dir}"]})
    try:
        with in_process(cfg, ready=False) as client:
            assert client.get("/health/live").status_code == 200
            r = client.get("/health/ready")
            assert r.status_code == 503
            assert r.json()["status"] == "not_ready" and r.json()["models"]["m"]["state"] == "loading"
            r = client.get("/health/startup")
            assert r.status_code == 503 and r.json()["status"] == "starting"
            assert r.json()["models"]["m"]["state"] == "loading"
            # a request that comes while the preload runs waits for it (as a lazy model's first request does)
            early: list[Any] = []
            t = threading.Thread(
                target=lambda: early.append(
                    client.post("/v1/audio/speech", json={"input": "Hi.", "voice": "alloy", "seed": 1})
                )
            )
            t.start()
            gate.set()
            t.join(120)
            assert early and early[0].status_code == 200, early and early[0].text
            wait_ready(client)
            assert client.get("/health/startup").json()["status"] == "started"
    finally:
        gate.set()


# --- a failed preload --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corrupt_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    bad = tmp_path_factory.mktemp("corrupt") / "bad"
    shutil.copytree(tiny_model_dir, bad)
    (bad / "llm.pt").write_bytes((tiny_model_dir / "llm.pt").read_bytes()[:1000])  # a truncated checkpoint
    return bad


def test_failed_preload_exits_3_and_says_why(corrupt_model_dir: Path, tmp_path: Path) -> None:
    server = start_server(corrupt_model_dir, tmp_path, wait_ready=False)
    answers: list[tuple[int, dict[str, Any]]] = []
    try:
        with httpx.Client(base_url=server.base_url, timeout=5.0) as c:
            end = time.monotonic() + 120
            while server.proc.poll() is None and time.monotonic() < end:
                try:
                    r = c.get("/health/startup")
                    answers.append((r.status_code, r.json()))
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        rc = server.proc.wait(30)
    finally:
        server.stop(grace_s=5)
    log = server.log()
    assert rc == 3, f"a failed preload must exit 3, got {rc}:\n{log[-3000:]}"
    assert "start-up failed" in log and "llm.pt" in log, log[-3000:]
    for status, body in answers:  # the failed state lasts ~0.1 s before uvicorn stops: seen or not
        assert status == 503, f"/health/startup said {status} for a model that cannot load: {body}"
        assert body["status"] in ("starting", "failed")
        if body["status"] == "failed":
            assert "llm.pt" in body["error"]


def test_failed_preload_is_reported_on_startup_in_process(corrupt_model_dir: Path) -> None:
    cfg = Settings.load(flags={"models": [f"bad={corrupt_model_dir}"]})
    with in_process(cfg, ready=False) as client:
        wait_until(
            lambda: client.get("/health/startup").json()["status"] != "starting", "the preload ended", LOAD_S
        )
        r = client.get("/health/startup")
        body = r.json()
        assert r.status_code == 503 and body["status"] == "failed"
        assert "llm.pt" in body["error"] and body["models"]["bad"]["state"] == "failed"
        assert body["models"]["bad"]["cause"]
        assert client.get("/health/ready").status_code == 503
        assert client.get("/health/live").status_code == 200


# --- client disconnect --------------------------------------------------------------------------------------


def test_client_disconnect_cancels_the_generation(server: ServerProcess) -> None:
    with server.client() as c:
        before = metric_samples(c)
        with c.stream("POST", "/v1/audio/speech", json=speech_body(LONG_TEXT * 2)) as r:
            assert r.status_code == 200
            first = next(r.iter_raw())
            assert first, "the stream sent no audio"
        # leaving the block closes the connection with most of the audio unsent
        end = time.monotonic() + 60
        while True:
            now = metric_samples(c)
            gone = count(now, "cosyserve_requests_total", outcome="client_gone") - count(
                before, "cosyserve_requests_total", outcome="client_gone"
            )
            cancelled = count(now, "cosyserve_engine_requests_total", outcome="cancelled") - count(
                before, "cosyserve_engine_requests_total", outcome="cancelled"
            )
            if gone == 1 and cancelled == 1 and in_flight(now, "tiny") == 0:
                break
            assert time.monotonic() < end, (
                f"after the disconnect: client_gone +{gone}, engine cancelled +{cancelled}, "
                f"in flight {in_flight(now, 'tiny')}\n{server.log()[-2000:]}"
            )
            time.sleep(0.1)
        ok = count(now, "cosyserve_engine_requests_total", outcome="ok")
        assert ok == count(before, "cosyserve_engine_requests_total", outcome="ok"), "it ran to the end"
        # the server is fine afterwards
        assert c.get("/health/ready").status_code == 200
        r = c.post("/v1/audio/speech", json={**speech_body("Hi there."), "stream": False})
        assert r.status_code == 200 and len(r.content) > 0


@pytest.mark.parametrize("fmt", ["wav", "mp3"])
def test_client_disconnect_cancels_a_non_streamed_request(server: ServerProcess, fmt: str) -> None:
    """A non-streamed response starts only once all its audio exists; a client that leaves before that (curl -m,
    an openai client's timeout) must stop the generation too, not leave it running to its end for nobody."""
    request_id = f"gone-{fmt}"
    body = {**speech_body(LONG_TEXT * 2), "stream": False, "response_format": fmt}
    with server.client() as c:
        before = metric_samples(c)
        sock = post_and_hold(server, "/v1/audio/speech", body, {"X-Request-Id": request_id})
        try:
            end = time.monotonic() + 60
            while in_flight(metric_samples(c), "tiny") != 1:
                assert time.monotonic() < end, f"the request never started:\n{server.log()[-2000:]}"
                time.sleep(0.02)
        finally:
            sock.close()  # long before its audio is complete
        end = time.monotonic() + 120
        while in_flight(now := metric_samples(c), "tiny") != 0:
            assert time.monotonic() < end, f"still in flight after the disconnect:\n{server.log()[-2000:]}"
            time.sleep(0.05)

        def delta(name: str, **labels: str) -> float:
            return count(now, name, **labels) - count(before, name, **labels)

        assert delta("cosyserve_engine_requests_total", outcome="ok") == 0, "it ran to its end for nobody"
        assert delta("cosyserve_engine_requests_total", outcome="cancelled") == 1
        assert delta("cosyserve_requests_total", status="499", outcome="client_gone") == 1, (
            "the request must be counted as client_gone (499), not as a 200"
        )
        line = next(ln for ln in server.log().splitlines() if f'"id": "{request_id}"' in ln)
        assert '"status": 499' in line and '"outcome": "client_gone"' in line, line
        r = c.post("/v1/audio/speech", json={**body, "input": "Hi there."})
        assert r.status_code == 200 and len(r.content) > 0, "the next request must be served"


# --- SIGTERM drain ------------------------------------------------------------------------------------------


def test_sigterm_drains_the_in_flight_stream_and_exits_0(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = start_server(tiny_model_dir, tmp_path, args=["--shutdown-grace", str(GRACE_S)])
    try:
        with server.client(timeout=GRACE_S) as c:
            alone = c.post("/v1/audio/speech", json=speech_body(DRAIN_TEXT))
            assert alone.status_code == 200 and len(alone.content) > 0
            with sigterm_mid_stream(
                c, server, speech_body(DRAIN_TEXT), "shutting down: readiness is 503 now"
            ) as (
                got,
                chunks,
            ):
                with httpx.Client(base_url=server.base_url, timeout=10.0) as probe:
                    ready = refused_or_503(probe, "GET", "/health/ready")
                    assert ready in ("refused", "draining")
                    refused_or_503(probe, "POST", "/v1/audio/speech", json=speech_body("Hi."))
                try:
                    got.extend(chunks)  # the rest of the stream, to its last byte
                except httpx.RemoteProtocolError as e:
                    raise AssertionError(f"the shutdown cut the in-flight stream: {e}") from e
            drained = b"".join(got)
        rc = server.proc.wait(GRACE_S)
    finally:
        server.stop(grace_s=5)
    log = server.log()
    assert rc == 0, f"a drained server must exit 0, got {rc}:\n{log[-3000:]}"
    assert len(drained) == len(alone.content), "the in-flight stream was cut short by the shutdown"
    finished_after = log[log.index("shutting down: readiness is 503 now") :]
    assert '"outcome": "ok"' in finished_after, "the stream ended before SIGTERM: nothing was drained"
    assert "all models released" in log
    assert "timeout graceful shutdown exceeded" not in log


def no_errors_in(log: str) -> None:
    for needle in ("ERROR", "Traceback", "Exception in ASGI application"):
        assert needle not in log, f"the shutdown or a cut stream logged {needle!r}:\n{log[-4000:]}"


def test_sigterm_keeps_answering_503_during_the_drain_delay(tiny_model_dir: Path, tmp_path: Path) -> None:
    """After SIGTERM, load balancers must see the drain: readiness and new requests get a 503 over HTTP (with
    Retry-After), not a refused connection, while the stream in flight goes on; a second signal ends the window."""
    server = start_server(
        tiny_model_dir, tmp_path, args=["--drain-delay", "600", "--shutdown-grace", str(GRACE_S)]
    )
    try:
        with server.client(timeout=GRACE_S) as c:
            alone = c.post("/v1/audio/speech", json=speech_body(DRAIN_TEXT))
            speaker = c.get("/v1/audio/voices").json()["voices"][0]["voice_id"]
            with sigterm_mid_stream(c, server, speech_body(DRAIN_TEXT), "the port stays open") as (
                got,
                chunks,
            ):
                with httpx.Client(base_url=server.base_url, timeout=10.0) as probe:
                    try:
                        ready = probe.get("/health/ready")
                        new = probe.post("/v1/audio/speech", json=speech_body("Hi."))
                        ref = probe.post("/inference_sft", data={"tts_text": "Hi.", "spk_id": speaker})
                    except httpx.TransportError as e:
                        raise AssertionError(f"the port closed during the drain delay: {e!r}") from e
                assert ready.status_code == 503 and ready.json()["status"] == "draining", ready.text
                for resp in (new, ref):
                    assert resp.status_code == 503, f"{resp.request.url.path}: {resp.status_code} {resp.text}"
                    assert resp.headers.get("retry-after", "").isdigit(), (
                        f"{resp.request.url.path}: a draining server's 503 must say when to retry: {resp.headers}"
                    )
                got.extend(chunks)
            assert len(b"".join(got)) == len(alone.content), "the drain delay cut the in-flight stream short"
        server.proc.send_signal(signal.SIGTERM)  # a second signal: no need to wait out the 600 s
        rc = server.proc.wait(GRACE_S)
    finally:
        server.stop(grace_s=5)
    log = server.log()
    assert rc == 0, f"a drained server must exit 0, got {rc}:\n{log[-3000:]}"
    assert "all models released" in log
    no_errors_in(log)


def test_grace_expiry_cuts_the_stream_and_ends_quietly(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A stream still running when the grace is over is cut so the client sees it (no final chunk), and the
    server says so in one WARNING: no ERROR, no CancelledError traceback, exit code 0."""
    server = start_server(tiny_model_dir, tmp_path, args=["--shutdown-grace", "1"])
    try:
        with server.client(timeout=GRACE_S) as c:
            with sigterm_mid_stream(c, server, speech_body(LONG_TEXT * 3)) as (_, chunks):
                with pytest.raises(httpx.RemoteProtocolError):
                    for _ in chunks:  # ~a minute of speech: far more than the 1 s grace
                        pass
        rc = server.proc.wait(GRACE_S)
    finally:
        server.stop(grace_s=5)
    log = server.log()
    assert rc == 0, f"a drained server must exit 0, got {rc}:\n{log[-3000:]}"
    assert "cutting 1 request(s) still running" in log, log[-3000:]
    assert '"outcome": "released"' in log, "the access line must say the stream was cut, not ok"
    no_errors_in(log)


# --- streams cut short ----------------------------------------------------------------------------------------


def test_a_stream_cut_by_the_deadline_is_incomplete_for_the_client(caplog: pytest.LogCaptureFixture) -> None:
    """Headers and audio are out when the deadline passes: the connection must end without the final chunk so
    the client's HTTP library raises, instead of a clean end that looks like complete audio; the metrics and the
    access line count a deadline, in one WARNING, with no ERROR or traceback.

    The app under a real uvicorn in this process, over the fake runtime: its ``endless`` text streams a chunk at
    once and goes on until the request is stopped, so only the deadline ends the stream, however fast or loaded
    the machine (the real model's first chunk came after a 10 s deadline on a busy machine). A real model's
    request cut at its deadline is tests/test_bounded_work.py's."""
    caplog.set_level(logging.INFO)
    with serve(FakeRuntime(token_s=0.01), request_timeout_s=2.0) as s, s.client() as c:
        with c.stream("POST", "/v1/audio/speech", json=speech_body("Hi there.")) as r:
            assert r.status_code == 200
            assert b"".join(r.iter_raw()), "a complete stream must end cleanly"
        before = metric_samples(c)
        with c.stream("POST", "/v1/audio/speech", json=speech_body("endless")) as r:
            assert r.status_code == 200, f"the first chunk came after the deadline: {r.read()!r}"
            with pytest.raises(httpx.RemoteProtocolError):
                for _ in r.iter_raw():  # a chunk every 10 ms until the deadline cuts it
                    pass
        now = metric_samples(c)
    cut = count(now, "cosyserve_requests_total", outcome="deadline") - count(
        before, "cosyserve_requests_total", outcome="deadline"
    )
    assert cut == 1, f"the metrics must count the cut stream as a deadline, got +{cut}"
    log = "\n".join(rec.getMessage() for rec in caplog.records)
    assert '"outcome": "deadline"' in log and "stream cut after" in log, log[-3000:]
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], log[-3000:]
    no_errors_in(log)


# --- metrics over several workers -------------------------------------------------------------------------------


def test_metrics_over_two_workers_count_the_whole_server(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Each scrape reaches one worker: its counters must still be the server's, never going backwards."""

    def scrape() -> dict[Any, float]:
        with httpx.Client(base_url=server.base_url, timeout=60.0) as fresh:  # a new connection, any worker
            return metric_samples(fresh)

    n = 8
    totals = []
    tmp = tmp_path / "tmp"  # where the master makes the workers' shared metrics directory
    tmp.mkdir()
    env = {"TMPDIR": str(tmp)}
    with running_server(
        tiny_model_dir, tmp_path, args=["--workers", "2"], env=env, ready_timeout_s=180
    ) as server:
        assert len(list(tmp.glob("cosyserve-metrics-*"))) == 1, "the workers share one metrics directory"
        for _ in range(n):
            with httpx.Client(base_url=server.base_url, timeout=120.0) as fresh:
                r = fresh.post("/v1/audio/speech", json={**speech_body("Hi."), "stream": False})
                assert r.status_code == 200, r.text
            totals += [count(scrape(), "cosyserve_requests_total") for _ in range(3)]
        last = scrape()
    assert totals == sorted(totals), f"requests_total went backwards across scrapes: {totals}"
    assert totals[-1] == n and count(last, "cosyserve_requests_total") == n, (
        f"{n} requests, scrapes said {totals}"
    )
    pids = {dict(labels).get("pid") for (name, labels) in last if name == "cosyserve_ready"}
    assert len(pids) == 2 and None not in pids, f"one scrape must show both workers' pools: {pids}"
    assert not list(tmp.glob("cosyserve-metrics-*")), (
        "the metrics directory must be removed when the server stops"
    )
