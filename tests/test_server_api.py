"""The HTTP API over real HTTP: a `cosyserve serve` process on loopback with the tiny model, driven by httpx,
the `openai` client and a reference-style client (GET with a form body).

Three servers, one per fixture (module scope): ``server`` (no keys; --max-text-chars 50, small uploads; once on
each runtime: the torch one over the model dir, the lite one over its ``--runtime lite`` bundle),
``keyed`` (API keys for two tenants, a voice registered for one) and ``busy`` (queue limit 0, for overload).
Slow paths (SIGTERM drain, disconnects, schema fuzz, the web page) are tested elsewhere.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf

from server_util import ServerProcess, decoded, openai_client, post_and_hold, running_server, wait_until

MAX_CHARS = 50
MAX_UPLOAD = 100_000  # a 2 s 16 kHz prompt (64 kB) fits, a 4 s one does not
KEY_A = "key-tenant-a-0001"
KEY_B = "key-tenant-b-0002"
VOICE_A = "voice_of_a"
TEXT = "Hello there, this is a test."


def prompt_wav(seconds: float = 2.0, rate: int = 16000) -> bytes:
    """A voice stand-in: a 220 Hz tone with a little noise, as a 16-bit WAV file."""
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(0)
    x = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.02 * rng.standard_normal(t.size)
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture(scope="module", params=["torch", "lite"])
def server(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The server on each runtime: the model dir on torch, its --runtime lite bundle on the lite runtime."""
    args = ["--max-text-chars", str(MAX_CHARS), "--max-upload-bytes", str(MAX_UPLOAD)]
    if request.param == "lite":
        model, env = request.getfixturevalue("tiny_lite_bundle"), {"COSYSERVE_RUNTIME": "lite"}
    else:
        model, env = tiny_model_dir, {}
    with running_server(model, tmp_path_factory.mktemp("srv"), args=args, env=env) as s:
        if request.param == "lite":
            # the tests compare requests' audio byte for byte: wait for the prepacked sessions (phase ``upgrades``
            # of the start); a request before may run on the quick ones, whose sums round otherwise (+-1 in a few
            # samples)
            with s.client() as c:

                def phases() -> dict[str, float]:
                    models = c.get("/v1/startup").json()["models"]
                    return next(iter(models.values()), {}).get("phases_ms", {})

                wait_until(
                    lambda: "upgrades" in phases(), lambda: f"no upgrades yet: {phases()}", poll_s=0.05
                )
        yield s


@pytest.fixture(scope="module")
def keyed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    import cosyserve

    work = tmp_path_factory.mktemp("keyed")
    registry = work / "registry"
    model = cosyserve.load(tiny_model_dir, warmup=False, registry_dir=str(registry))
    model.add_speaker(VOICE_A, prompt_wav(), "A short prompt.", tenant="tenantA")
    env = {"COSYSERVE_API_KEYS": f"{KEY_A}=tenantA,{KEY_B}=tenantB", "COSYSERVE_REGISTRY_DIR": str(registry)}
    with running_server(tiny_model_dir, work, env=env) as s:
        yield s


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def speech(c: httpx.Client, **body: Any) -> httpx.Response:
    body.setdefault("input", TEXT)
    body.setdefault("voice", "alloy")
    return c.post("/v1/audio/speech", json=body)


def assert_error(r: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    """An OpenAI-shaped error with this status naming ``param``; returns the error object."""
    assert r.status_code == status, f"expected {status}, got {r.status_code}: {r.text[:300]}"
    assert r.headers["content-type"].startswith("application/json"), "errors must be JSON"
    err = r.json().get("error")
    assert isinstance(err, dict), f"not the OpenAI error shape: {r.text[:300]}"
    assert isinstance(err.get("message"), str) and err["message"], "an error needs a message"
    assert isinstance(err.get("type"), str) and err["type"], "an error needs a type"
    assert err.get("param") == param, f"param should name {param!r}: {err}"
    return err


def access_log(server: ServerProcess, request_id: str) -> dict[str, Any]:
    """The server's structured log line of one request (cosyserve.access)."""
    for line in server.log().splitlines():
        if '"event": "request"' in line and request_id in line:
            rec = json.loads(line[line.index("{") :])
            if rec["id"] == request_id:
                return rec
    raise AssertionError(f"no access log line for request {request_id}")


def int16(data: bytes) -> np.ndarray:
    assert len(data) % 2 == 0, f"raw int16 PCM must have an even byte count, got {len(data)}"
    return np.frombuffer(data, dtype="<i2")


# --- health, models, voices -----------------------------------------------------------------------------------


def test_health_before_and_after_load(server: ServerProcess, http: httpx.Client) -> None:
    seen = server.before_ready
    assert "ready" in seen, "the port should open before the model is loaded (no 503 was ever seen)"
    status, body = seen["ready"]
    assert status == 503 and body["status"] == "not_ready", f"readiness before load: {seen['ready']}"
    (model,) = body["models"]
    # "ready": the probe came between the model's load and the end of the server's start-up (a busy machine)
    assert body["models"][model]["state"] in ("new", "loading", "unloaded", "ready"), body
    assert seen["live"][0] == 200 and seen["live"][1]["status"] == "alive", "liveness must not wait for load"
    st, sb = seen["startup"]
    assert (st, sb["status"]) in ((503, "starting"), (200, "started")), f"startup probe before load: {sb}"

    r = http.get("/health/ready")
    assert r.status_code == 200 and r.json()["status"] == "ready"
    assert r.json()["models"][model]["state"] == "ready"
    r = http.get("/health/startup")
    assert r.status_code == 200 and r.json()["status"] == "started" and r.json()["ready_ms"] > 0
    r = http.get("/health/live")
    assert r.status_code == 200 and r.json()["status"] == "alive"


def test_models_and_voices(http: httpx.Client, tiny_model_dir: Path) -> None:
    r = http.get("/v1/models")
    assert r.status_code == 200
    data = r.json()
    assert data["object"] == "list"
    assert [m["id"] for m in data["data"]] == [tiny_model_dir.name], "the model is served under its dir name"
    assert data["data"][0]["state"] == "ready" and data["data"][0]["object"] == "model"
    assert data["data"][0]["demo"] is False, "a real --model is not the demo"

    r = http.get("/v1/audio/voices")
    assert r.status_code == 200
    v = r.json()
    names = [x["voice_id"] for x in v["voices"]]
    assert "中文女" in names and "英文男" in names, f"the model's spk2info speakers must be listed: {names}"
    assert all(x["kind"] == "pre-defined" for x in v["voices"]), "no voice is registered on this server"
    assert "alloy" in v["aliases"], "OpenAI voice names must be listed as aliases"
    assert_error(http.get("/v1/audio/voices", params={"model": "nope"}), 404, "model")


# --- /v1/audio/speech ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_pcm(http: httpx.Client) -> tuple[np.ndarray, int]:
    """The seeded utterance as raw PCM, whole (the other formats are compared with it: the same engine cuts)."""
    r = speech(http, voice="中文女", response_format="pcm", seed=7, stream=False)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "audio/pcm"
    rate = int(r.headers["x-sample-rate"])
    assert rate == 24000, "OpenAI's rate, resampled from the tiny model's 22.05 kHz"
    pcm = int16(r.content)
    assert pcm.size > rate // 10, "expected some audio"
    return pcm, rate


def test_pcm_is_24_khz_for_a_22_khz_model_within_one_percent(
    http: httpx.Client, reference_pcm: tuple[np.ndarray, int]
) -> None:
    """If this fails, the OpenAI routes' pcm is not OpenAI's 24 kHz for CosyVoice-300M (22.05 kHz): a client
    that plays it at 24 kHz (Pipecat, LiveKit, the openai client's player) plays it fast and high."""
    pcm, rate = reference_pcm
    r = speech(http, voice="中文女", response_format="pcm", seed=7, sample_rate=22050, stream=False)
    assert r.status_code == 200 and int(r.headers["x-sample-rate"]) == 22050, r.text
    native = int16(r.content).size
    assert abs(pcm.size - native * 24000 / 22050) <= 0.01 * pcm.size, (pcm.size, native)


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus", "aac"])
def test_every_format_decodes_to_the_same_audio(
    http: httpx.Client, reference_pcm: tuple[np.ndarray, int], fmt: str
) -> None:
    """Whole files (stream false): each format's decoded audio is the pcm's, at 24 kHz."""
    pcm, rate = reference_pcm
    r = speech(http, voice="中文女", response_format=fmt, seed=7, stream=False)
    assert r.status_code == 200, r.text
    assert int(r.headers["content-length"]) == len(r.content), "a whole body states its length"
    media = {
        "wav": "audio/wav",
        "flac": "audio/flac",
        "mp3": "audio/mpeg",
        "opus": "audio/ogg",
        "aac": "audio/aac",
    }
    assert r.headers["content-type"] == media[fmt]
    data, sr = decoded(r.content)
    assert sr == (48000 if fmt == "opus" and len(data) > 1.5 * len(pcm) else rate), sr
    if fmt in ("wav", "flac"):  # lossless: exactly the PCM samples
        np.testing.assert_array_equal(data, pcm, err_msg=f"{fmt} must carry the same samples as pcm")
    else:  # lossy: the same duration (mp3's LAME tag trims its delay; aac keeps 1024 samples of priming)
        expected = len(pcm) * sr / rate
        slack = {"mp3": 1152, "opus": 960, "aac": 2048 + 1024}[fmt]
        assert abs(len(data) - expected) <= 0.01 * expected + slack, (
            f"{fmt} length {len(data)} vs {expected:.0f}"
        )


@pytest.mark.parametrize("fmt", ["wav", "pcm", "opus", "mp3", "aac", "flac"])
def test_audio_streams_without_a_flag(keyed: ServerProcess, fmt: str) -> None:
    """As OpenAI's: the body streams (chunked) with no extra field, flac aside (encoded when the audio ends; a whole
    body's Content-Length, as ``stream: false`` gives every format: test_every_format_decodes_to_the_same_audio).
    The encoders are the server's, whatever the runtime: one server (torch) runs this."""
    body = {"input": TEXT, "voice": "中文女", "response_format": fmt, "seed": 3}
    with keyed.client(headers={"Authorization": f"Bearer {KEY_A}"}) as c:
        with c.stream("POST", "/v1/audio/speech", json=body) as r:
            assert r.status_code == 200, r.read()
            if fmt != "flac":
                assert r.headers.get("transfer-encoding") == "chunked", f"{fmt} must stream by default"
                assert "content-length" not in r.headers
            else:
                assert int(r.headers["content-length"]) > 0
            streamed = b"".join(r.iter_bytes())
    rate = int(r.headers["x-sample-rate"])
    assert rate == 24000
    if fmt == "pcm":
        n = int16(streamed).size
    else:
        data, sr = decoded(streamed)
        n = round(len(data) * rate / sr)
    assert n > rate // 10, f"streamed {fmt} decoded to only {n} samples"


def test_seed_gives_identical_audio(http: httpx.Client) -> None:
    a = speech(http, voice="英文女", response_format="wav", seed=1234)
    b = speech(http, voice="英文女", response_format="wav", seed=1234)
    assert a.status_code == b.status_code == 200
    assert a.content == b.content, "the same seed must give byte-identical audio"
    c = speech(http, voice="英文女", response_format="wav", seed=4321)
    assert c.status_code == 200 and c.content != a.content, "another seed should sample other audio"


def test_speed_shortens_audio(http: httpx.Client) -> None:
    normal = speech(http, voice="中文女", response_format="pcm", seed=5, speed=1.0)
    fast = speech(http, voice="中文女", response_format="pcm", seed=5, speed=1.5)
    assert normal.status_code == fast.status_code == 200
    n1, n15 = int16(normal.content).size, int16(fast.content).size
    assert n15 < 0.8 * n1, f"speed 1.5 should give ~2/3 of the samples: {n15} vs {n1}"


def test_openai_voice_names_stand_for_distinct_voices_alloy_the_default(
    server: ServerProcess, http: httpx.Client, reference_pcm: tuple[np.ndarray, int]
) -> None:
    first = http.get("/v1/audio/voices").json()["voices"][0]["voice_id"]
    assert first == "中文女", "the reference PCM was made with the first speaker"
    r = speech(http, voice="alloy", response_format="pcm", seed=7, stream=False)
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(
        int16(r.content), reference_pcm[0], err_msg="alloy must be the default voice"
    )
    rec = access_log(server, r.headers["x-request-id"])
    assert rec["voice"] == first and rec["mode"] == "sft", rec
    aliases = http.get("/v1/audio/voices").json()["aliases"]
    assert aliases["alloy"] == first and aliases["nova"] == "英文女" and aliases["echo"] == "英文男", aliases
    assert len(set(aliases.values())) == 7, "OpenAI's names go round all 7 speakers of the model"
    for name in ("nova", "echo"):  # other OpenAI names: the model's other voices, as the list says
        r = speech(http, voice=name, response_format="pcm", seed=7)
        assert r.status_code == 200, r.text
        assert access_log(server, r.headers["x-request-id"])["voice"] == aliases[name]


def test_instructions_use_instruct_mode(server: ServerProcess, http: httpx.Client) -> None:
    r = speech(http, voice="英文男", response_format="wav", instructions="Speak slowly and warmly.")
    assert r.status_code == 200, r.text
    data, sr = sf.read(io.BytesIO(r.content))
    assert sr == 24000 and len(data) > 0
    rec = access_log(server, r.headers["x-request-id"])
    assert rec["mode"] == "instruct" and rec["voice"] == "英文男", (
        f"instructions must select instruct mode: {rec}"
    )
    assert rec["outcome"] == "ok" and rec["bytes"] == len(r.content)


def test_request_id_header_is_echoed(http: httpx.Client) -> None:
    r = http.post(
        "/v1/audio/speech",
        json={"input": TEXT, "voice": "alloy", "response_format": "pcm"},
        headers={"X-Request-Id": "client-id-42"},
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-id-42"


# --- reference endpoints ---------------------------------------------------------------------------------------


def check_reference_pcm(server: ServerProcess, r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text[:300]
    pcm = int16(r.content)
    assert pcm.size > 0
    rec = access_log(server, r.headers["x-request-id"])
    rate = int(r.headers["x-sample-rate"])
    assert rec["bytes"] == len(r.content), "the client must get every byte the server sent"
    assert abs(pcm.size - rec["audio_s"] * rate) <= 0.001 * rate + 1, "PCM length must match the audio made"
    return pcm


def test_reference_sft_get_with_form_body(server: ServerProcess, http: httpx.Client) -> None:
    # the reference client: requests.request("GET", url, data=payload, stream=True)
    r = http.request("GET", "/inference_sft", data={"tts_text": TEXT, "spk_id": "中文女"})
    check_reference_pcm(server, r)
    assert access_log(server, r.headers["x-request-id"])["mode"] == "sft"
    r = http.post("/inference_sft", data={"tts_text": TEXT, "spk_id": "中文女"})  # POST works too
    check_reference_pcm(server, r)


@pytest.mark.parametrize("mode", ["zero_shot", "cross_lingual"])
def test_reference_prompt_wav_upload(server: ServerProcess, http: httpx.Client, mode: str) -> None:
    data = {"tts_text": TEXT}
    if mode == "zero_shot":
        data["prompt_text"] = "A short prompt."
    files = [("prompt_wav", ("prompt_wav", prompt_wav(), "application/octet-stream"))]
    r = http.request("GET", f"/inference_{mode}", data=data, files=files)
    check_reference_pcm(server, r)
    assert access_log(server, r.headers["x-request-id"])["mode"] == mode


def test_reference_instruct(server: ServerProcess, http: httpx.Client) -> None:
    data = {"tts_text": TEXT, "spk_id": "中文男", "instruct_text": "Speak happily."}
    r = http.request("GET", "/inference_instruct", data=data)
    check_reference_pcm(server, r)
    assert access_log(server, r.headers["x-request-id"])["mode"] == "instruct"


# --- error paths ------------------------------------------------------------------------------------------------


def test_malformed_json(http: httpx.Client) -> None:
    r = http.post(
        "/v1/audio/speech", content=b'{"input": "hi", ', headers={"Content-Type": "application/json"}
    )
    err = assert_error(r, 400, None)
    assert "JSON" in err["message"]
    r = http.post("/v1/audio/speech", content=b"[1, 2]", headers={"Content-Type": "application/json"})
    assert_error(r, 400, None)


def test_wrong_content_type(http: httpx.Client) -> None:
    r = http.post(
        "/v1/audio/speech",
        content=json.dumps({"input": "hi", "voice": "alloy"}),
        headers={"Content-Type": "text/plain"},
    )
    err = assert_error(r, 415, None)
    assert "application/json" in err["message"]


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        ({"voice": "alloy"}, "input", 400),
        ({"input": "", "voice": "alloy"}, "input", 400),
        ({"input": "   ", "voice": "alloy"}, "input", 400),
        ({"input": "x" * (MAX_CHARS + 1), "voice": "alloy"}, "input", 400),
        ({"input": 42, "voice": "alloy"}, "input", 400),
        ({"input": "hi"}, "voice", 400),
        ({"input": "hi", "voice": "no_such_voice"}, "voice", 400),
        ({"input": "hi", "voice": "../../etc/passwd"}, "voice", 400),
        ({"input": "hi", "voice": "alloy", "model": "no-such-model"}, "model", 404),
        ({"input": "hi", "voice": "alloy", "speed": 4.5}, "speed", 400),
        ({"input": "hi", "voice": "alloy", "speed": "fast"}, "speed", 400),
        ({"input": "hi", "voice": "alloy", "response_format": "aiff"}, "response_format", 400),
        ({"input": "hi", "voice": "alloy", "temperature": 0.5}, "temperature", 400),
        ({"input": "hi", "voice": "alloy", "seed": -1}, "seed", 400),
        ({"input": "hi", "voice": "alloy", "stream": "yes"}, "stream", 400),
        ({"input": "<|endofprompt|>", "voice": "alloy"}, "input", 400),
        (
            {"input": "hi", "voice": "alloy", "response_format": "opus", "sample_rate": 44100},
            "sample_rate",
            400,
        ),
    ],
    ids=[
        "missing-input",
        "empty-input",
        "blank-input",
        "long-input",
        "input-not-string",
        "missing-voice",
        "unknown-voice",
        "voice-path",
        "unknown-model",
        "speed-out-of-range",
        "speed-not-number",
        "bad-format",
        "unknown-field",
        "bad-seed",
        "bad-stream",
        "markup-alone",
        "opus-rate",
    ],
)
def test_speech_errors_name_the_field(
    http: httpx.Client, body: dict[str, Any], param: str, status: int
) -> None:
    err = assert_error(http.post("/v1/audio/speech", json=body), status, param)
    if param == "input" and "x" in str(body.get("input")):
        assert str(MAX_CHARS) in err["message"], "the length error must state the limit"


def test_reference_errors_name_the_field(http: httpx.Client) -> None:
    assert_error(http.post("/inference_sft", data={"spk_id": "中文女"}), 400, "tts_text")
    assert_error(http.post("/inference_sft", data={"tts_text": TEXT}), 400, "spk_id")
    assert_error(
        http.post("/inference_sft", data={"tts_text": "x" * (MAX_CHARS + 1), "spk_id": "中文女"}),
        400,
        "tts_text",
    )
    r = http.post("/inference_sft", json={"tts_text": TEXT, "spk_id": "中文女"})
    err = assert_error(r, 415, None)
    assert "form" in err["message"]
    assert_error(
        http.post("/inference_zero_shot", data={"tts_text": TEXT, "prompt_text": "p"}), 400, "prompt_wav"
    )
    assert_error(http.post("/inference_sft", data={"tts_text": TEXT, "spk_id": "nobody"}), 400, "spk_id")


def test_upload_too_large(http: httpx.Client) -> None:
    big = prompt_wav(seconds=4.0)
    assert len(big) > MAX_UPLOAD
    files = {"prompt_wav": ("prompt_wav", big, "application/octet-stream")}
    r = http.post("/inference_cross_lingual", data={"tts_text": TEXT}, files=files)
    err = assert_error(r, 413, "prompt_wav")
    assert str(MAX_UPLOAD) in err["message"], "the upload error must state the limit"


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing"), 404, None)
    assert_error(http.get("/v1/audio/speech"), 405, None)


# --- metrics ----------------------------------------------------------------------------------------------------


def scrape(c: httpx.Client) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """/metrics parsed by prometheus_client: sample name -> {sorted labels: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def value(m: dict[str, dict[Any, float]], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when there are none)."""
    return sum(v for k, v in m.get(name, {}).items() if set(labels.items()) <= set(k))


def test_metrics_count_what_happened(http: httpx.Client, tiny_model_dir: Path) -> None:
    model = tiny_model_dir.name
    route = "/v1/audio/speech"
    before = scrape(http)
    for seed in (1, 2, 3):
        assert speech(http, voice="中文女", response_format="pcm", seed=seed).status_code == 200
    r = http.request("GET", "/inference_sft", data={"tts_text": TEXT, "spk_id": "中文女"})
    assert r.status_code == 200
    assert http.post(route, content=b"{oops", headers={"content-type": "application/json"}).status_code == 400
    assert speech(http, voice="nobody-here").status_code == 400
    after = scrape(http)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    ok = {"route": route, "model": model, "status": "200", "outcome": "ok"}
    assert delta("cosyserve_requests_total", **ok) == 3, "three OpenAI requests were served"
    assert delta("cosyserve_requests_total", route="/inference_sft", status="200") == 1
    assert delta("cosyserve_time_to_first_audio_seconds_count", route=route, model=model) == 3
    # every request that reached the model's engine, the unknown voice refused at its admission among them
    assert delta("cosyserve_request_seconds_count", route=route, model=model) == 4
    assert delta("cosyserve_time_to_first_audio_seconds_bucket", route=route, le="+Inf") == 3
    assert delta("cosyserve_http_errors_total", route=route, status="400", code="invalid_json") == 1
    assert delta("cosyserve_http_errors_total", route=route, status="400", code="voice_not_found") == 1, (
        "refusals before synthesis must be counted by kind"
    )
    assert delta("cosyserve_audio_seconds_total", model=model) > 0, "audio seconds must grow with requests"
    assert value(after, "cosyserve_ready") == 1
    assert value(after, "cosyserve_model_state", model=model, state="ready") == 1
    assert value(after, "cosyserve_model_state", model=model, state="loading") == 0
    assert value(after, "cosyserve_in_flight_requests", model=model) == 0, "nothing is in flight now"
    assert value(after, "cosyserve_model_loads_total", model=model) == 1, "the model was loaded once"
    phases = {
        dict(k)["phase"]
        for k in after.get("cosyserve_startup_phase_seconds", {})
        if dict(k)["model"] == model
    }
    assert phases, "start-up phase gauges must be exported once the model is loaded"
    assert all(v >= 0 for v in after["cosyserve_startup_phase_seconds"].values())
    assert value(after, "cosyserve_startup_point_seconds", model="server", point="ready") > 0


# --- the openai client, API keys and tenants -------------------------------------------------------------------


def test_openai_client_speech(keyed: ServerProcess) -> None:
    client = openai_client(keyed, KEY_A)
    resp = client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format="wav")
    data, sr = sf.read(io.BytesIO(resp.content))
    assert sr == 24000 and len(data) > 0, "the openai client must get a playable WAV"

    chunks = []
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=TEXT, response_format="pcm"
    ) as resp:
        assert resp.headers.get("transfer-encoding") == "chunked", "the body streams, as OpenAI's"
        chunks.extend(resp.iter_bytes())
    assert int16(b"".join(chunks)).size > 0
    assert int(resp.headers["x-sample-rate"]) == 24000


def test_api_keys_are_required(keyed: ServerProcess) -> None:
    import openai

    with keyed.client() as c:
        r = c.post("/v1/audio/speech", json={"input": TEXT, "voice": "alloy", "response_format": "pcm"})
        err = assert_error(r, 401, None)
        assert "API key" in err["message"] and r.headers.get("www-authenticate") == "Bearer"
        r = c.post(
            "/v1/audio/speech",
            json={"input": TEXT, "voice": "alloy"},
            headers={"Authorization": "Bearer wrong-key-123"},
        )
        assert_error(r, 401, None)
        assert_error(c.get("/v1/models"), 401, None)
        assert_error(
            c.request("GET", "/inference_sft", data={"tts_text": TEXT, "spk_id": "中文女"}), 401, None
        )
        assert c.get("/health/ready").status_code == 200, "probes carry no key"
        assert c.get("/metrics").status_code == 200, "scrapers carry no key"
        r = c.get("/v1/models", headers={"Authorization": f"Bearer {KEY_B}"})
        assert r.status_code == 200 and r.json()["data"]
    with pytest.raises(openai.AuthenticationError) as exc:
        openai_client(keyed, "not-a-valid-key").audio.speech.create(model="tts-1", voice="alloy", input=TEXT)
    assert exc.value.status_code == 401
    assert isinstance(exc.value.body, dict) and exc.value.body.get("code") == "invalid_api_key"


def test_registered_voice_is_private_to_its_tenant(keyed: ServerProcess) -> None:
    body = {"input": TEXT, "voice": VOICE_A, "response_format": "pcm"}
    with keyed.client(headers={"Authorization": f"Bearer {KEY_A}"}) as a:
        voices = a.get("/v1/audio/voices").json()["voices"]
        mine = [v for v in voices if v["id"] == VOICE_A]
        assert mine and mine[0]["name"] == mine[0]["voice_id"] == VOICE_A and mine[0]["kind"] == "registered"
        r = a.post("/v1/audio/speech", json=body)
        assert r.status_code == 200, f"tenant A must be able to use its voice: {r.text}"
        assert int16(r.content).size > 0
        rec = access_log(keyed, r.headers["x-request-id"])
        assert rec["mode"] == "zero_shot" and rec["voice"] == VOICE_A
    with keyed.client(headers={"Authorization": f"Bearer {KEY_B}"}) as b:
        voices = b.get("/v1/audio/voices").json()["voices"]
        assert VOICE_A not in [v["voice_id"] for v in voices], "tenant B must not see tenant A's voice"
        r = b.post("/v1/audio/speech", json=body)
        assert 400 <= r.status_code < 500, f"tenant B must not use tenant A's voice: {r.status_code}"
        assert_error(r, r.status_code, "voice")
        r = b.request("GET", "/inference_sft", data={"tts_text": TEXT, "spk_id": VOICE_A})
        assert_error(r, 400, "spk_id")


# --- overload ---------------------------------------------------------------------------------------------------


def test_overload_is_refused_at_once_with_retry_after(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    env = {"COSYSERVE_QUEUE_LIMIT": "0", "MODEL_POOL_SIZE": "1"}
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("busy"), env=env) as s:

        def one(i: int) -> httpx.Response:
            with s.client(timeout=30.0) as c:
                return speech(
                    c, input="A somewhat longer sentence to keep it busy.", response_format="pcm", seed=i
                )

        with concurrent.futures.ThreadPoolExecutor(6) as ex:
            results = list(ex.map(one, range(6)))
        codes = sorted(r.status_code for r in results)
        assert 200 in codes, f"one request at a time must still be served: {codes}"
        refused = [r for r in results if r.status_code != 200]
        assert refused, f"with no queue, concurrent requests must be refused: {codes}"
        for r in refused:
            assert_error(r, 503, None)
            assert 1 <= int(r.headers["retry-after"]) <= 60, "say when to retry, within a minute"
        with s.client() as c:
            m = scrape(c)
        assert value(m, "cosyserve_requests_total", status="503") == len(refused), "refusals must be counted"


def test_tenant_max_concurrent_is_enforced_over_http(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A tenant with max_concurrent = 1: while its one request runs, every other of its requests gets 429 with
    Retry-After at once (not a place in the queue); once that request ends, the next one is served."""
    work = tmp_path_factory.mktemp("quota")
    config = work / "pool.toml"
    config.write_text(
        f'[models.tiny]\npath = {json.dumps(str(tiny_model_dir))}\npolicy = "preload"\n\n'
        '[tenants.acme]\nmodels = ["tiny"]\nmax_concurrent = 1\n',
        encoding="utf-8",
    )
    auth = {"Authorization": "Bearer key-acme-0001"}
    env = {"COSYSERVE_API_KEYS": "key-acme-0001=acme"}
    with running_server(None, work, env=env, args=["--config", str(config)]) as s:
        # tens of seconds of synthesis on the tiny model: long after the burst
        long_text = "Hello there, this is a long sentence to speak. " * 12
        body = {"input": long_text, "voice": "alloy", "response_format": "wav"}
        held = post_and_hold(s, "/v1/audio/speech", body, auth)
        try:
            with s.client(headers=auth) as c:  # with API keys, a scrape names the models of its key only
                end = time.monotonic() + 60
                while value(scrape(c), "cosyserve_in_flight_requests", model="tiny") != 1:
                    assert time.monotonic() < end, f"the first request never started:\n{s.log()[-2000:]}"
                    time.sleep(0.02)

            def one(i: int) -> httpx.Response:
                with s.client(timeout=20.0, headers=auth) as c:
                    try:
                        return speech(c, response_format="pcm", seed=i)
                    except httpx.TimeoutException:
                        raise AssertionError("the tenant's second request was queued, not refused") from None

            with concurrent.futures.ThreadPoolExecutor(5) as ex:
                burst = list(ex.map(one, range(5)))
            for r in burst:
                err = assert_error(r, 429, None)
                assert err["type"] == "rate_limit_error" and "max_concurrent=1" in err["message"], err
                assert 1 <= int(r.headers["retry-after"]) <= 60, r.headers
        finally:
            held.close()  # the first request ends (its client went away)
        with s.client(headers=auth) as c:
            end = time.monotonic() + 60
            while value(scrape(c), "cosyserve_in_flight_requests", model="tiny") != 0:
                assert time.monotonic() < end, "the first request did not end"
                time.sleep(0.05)
            r = speech(c, response_format="pcm")
            assert r.status_code == 200 and r.content, f"the tenant's slot must be free again: {r.text[:300]}"
            assert value(scrape(c), "cosyserve_requests_total", status="429") == 5, "refusals must be counted"
