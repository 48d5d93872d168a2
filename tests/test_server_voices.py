"""The voices API over a real server with two tenants, and one-off cloning with ``ref_audio`` on the speech route.

A ``cosyserve serve`` with the tiny model, API keys for tenants ``a`` and ``b``, and a small upload limit; httpx
for the multipart and error paths, the ``openai`` client for what it speaks (``client.audio.voices`` and a custom
voice by ``{"id": ...}``). A tenant must never see, use or delete another's voice; every registration leaves a
consent record.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf

from server_util import ServerProcess, running_server

KEY_A = "key-voices-a-0001"
KEY_B = "key-voices-b-0002"
MAX_UPLOAD = 100_000  # a 2 s 16 kHz prompt (64 kB) fits, a 4 s one does not
TEXT = "Hello there, this is a test."
REF_TEXT = "A short prompt."


def prompt_wav(seconds: float = 2.0, rate: int = 16000) -> bytes:
    """A voice stand-in: a 220 Hz tone with a little noise, as a 16-bit WAV file."""
    t = np.arange(int(seconds * rate)) / rate
    x = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.02 * np.random.default_rng(0).standard_normal(t.size)
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    env = {"COSYSERVE_API_KEYS": f"{KEY_A}=a,{KEY_B}=b"}
    args = ["--max-upload-bytes", str(MAX_UPLOAD)]
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("voices"), env=env, args=args) as s:
        yield s


def client(server: ServerProcess, key: str) -> httpx.Client:
    return server.client(headers={"Authorization": f"Bearer {key}"})


def create(c: httpx.Client, name: str, audio: bytes | None = None, **fields: str) -> httpx.Response:
    data = {"name": name, "consent": "consent-rec-1", "ref_text": REF_TEXT} | fields
    data = {k: v for k, v in data.items() if v is not None}
    files = {"audio_sample": ("sample.wav", prompt_wav() if audio is None else audio, "audio/wav")}
    return c.post("/v1/audio/voices", data=data, files=files)


def assert_error(r: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert r.status_code == status, f"expected {status}, got {r.status_code}: {r.text[:300]}"
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and err["param"] == param, err
    return dict(err)


def access_log(server: ServerProcess, request_id: str) -> dict[str, Any]:
    for line in server.log().splitlines():
        if '"event": "request"' in line and request_id in line:
            rec = json.loads(line[line.index("{") :])
            if rec["id"] == request_id:
                return dict(rec)
    raise AssertionError(f"no access log line for request {request_id}")


def ws_session(server: ServerProcess, key: str, config: dict[str, Any], text: str) -> dict[str, Any]:
    """The first event of a WebSocket session that sends ``config`` and one utterance of ``text``."""
    from websockets.sync.client import connect

    url = server.base_url.replace("http", "ws", 1) + "/v1/audio/speech/stream"
    with connect(
        url, additional_headers={"Authorization": f"Bearer {key}"}, proxy=None, open_timeout=30
    ) as ws:
        ws.send(json.dumps({"type": "session.config", **config}))
        ws.send(json.dumps({"type": "input.text", "text": text}))
        ws.send(json.dumps({"type": "input.done"}))
        return dict(json.loads(ws.recv(timeout=60)))


def voices(c: httpx.Client) -> dict[str, dict[str, Any]]:
    r = c.get("/v1/audio/voices")
    assert r.status_code == 200, r.text
    return {v["voice_id"]: v for v in r.json()["voices"]}


# --- the voices API --------------------------------------------------------------------------------------------


def test_a_registered_voice_is_listed_used_and_deleted_by_its_tenant_only(server: ServerProcess) -> None:
    with client(server, KEY_A) as a, client(server, KEY_B) as b:
        r = create(a, "narrator", consent="signed-form-42")
        assert r.status_code == 200, r.text
        v = r.json()
        assert (v["id"], v["object"], v["name"], v["type"]) == (
            "narrator",
            "audio.voice",
            "narrator",
            "audio_sample",
        )
        assert v["consent"] == "signed-form-42" and v["ref_text"] == REF_TEXT and v["created_at"] > 0, v

        listed = voices(a)["narrator"]
        assert listed["kind"] == "registered" and listed["consent"] == "signed-form-42", listed
        assert listed["ref_text"] == REF_TEXT and listed["created_at"] == v["created_at"], listed
        assert "narrator" not in voices(b), "tenant b must not see tenant a's voice"

        body = {"input": TEXT, "voice": "narrator", "response_format": "pcm"}
        r = a.post("/v1/audio/speech", json=body)
        assert r.status_code == 200 and len(r.content) > 0, r.text
        rec = access_log(server, r.headers["x-request-id"])
        assert rec["mode"] == "zero_shot" and rec["voice"] == "narrator", rec
        assert_error(b.post("/v1/audio/speech", json=body), 400, "voice")
        # the WebSocket speaks it for its tenant too (it was voice_not_found there: its check had no tenant)
        start = ws_session(server, KEY_A, {"voice": "narrator"}, TEXT)
        assert (
            start["type"] == "audio.start" and start["voice"] == "narrator" and start["mode"] == "zero_shot"
        )
        refused = ws_session(server, KEY_B, {"voice": "narrator"}, TEXT)
        assert (refused["type"], refused["code"], refused["param"]) == ("error", "voice_not_found", "voice")

        assert_error(b.delete("/v1/audio/voices/narrator"), 404, "name")
        assert "narrator" in voices(a), "b's delete must not touch a's voice"
        r = a.delete("/v1/audio/voices/narrator")
        assert r.status_code == 200 and r.json() == {
            "id": "narrator",
            "object": "audio.voice.deleted",
            "deleted": True,
        }
        assert "narrator" not in voices(a)
        assert_error(a.delete("/v1/audio/voices/narrator"), 404, "name")
        assert_error(a.post("/v1/audio/speech", json=body), 400, "voice")


def test_consent_is_recorded_and_outlives_the_voice(server: ServerProcess) -> None:
    audio = prompt_wav(seconds=1.5)
    with client(server, KEY_B) as b:
        assert create(b, "ledger-voice", audio, consent="verbal, recorded 2024-05-01").status_code == 200
        assert b.delete("/v1/audio/voices/ledger-voice").status_code == 200
    ledgers = list((server.log_path.parent / "registry").rglob("consent.jsonl"))
    mine = [p for p in ledgers if p.parent.name == "b"]
    assert len(mine) == 1, f"one ledger for tenant b: {ledgers}"
    entries = [json.loads(line) for line in mine[0].read_text(encoding="utf-8").splitlines()]
    created = [e for e in entries if e["name"] == "ledger-voice" and e["event"] == "create"]
    deleted = [e for e in entries if e["name"] == "ledger-voice" and e["event"] == "delete"]
    assert len(created) == 1 and len(deleted) == 1, entries
    assert created[0]["consent"] == "verbal, recorded 2024-05-01" and created[0]["tenant"] == "b"
    assert created[0]["audio_sha256"] == hashlib.sha256(audio).hexdigest() and created[0][
        "audio_bytes"
    ] == len(audio)


def test_the_openai_client_creates_uses_and_deletes_a_voice(
    server: ServerProcess, request: pytest.FixtureRequest
) -> None:
    import openai
    from openai import OpenAI

    c = OpenAI(base_url=server.url("/v1"), api_key=KEY_A, max_retries=0, timeout=60)
    request.addfinalizer(c.close)  # else its pooled socket is left to the collector
    v = c.audio.voices.create(
        audio_sample=("sample.wav", prompt_wav(), "audio/wav"),
        consent="consent-id-7",
        name="openai-made",
        extra_body={"ref_text": REF_TEXT},
    )
    assert (
        v.id == "openai-made" and v.object == "audio.voice" and v.type == "audio_sample" and v.created_at > 0
    )
    speech = c.audio.speech.create(
        model="tts-1", voice={"id": "openai-made"}, input=TEXT, response_format="wav"
    )
    data, rate = sf.read(io.BytesIO(speech.content))
    assert rate == 24000 and len(data) > 0
    gone = c.audio.voices.delete("openai-made")
    assert gone.deleted is True and gone.id == "openai-made" and gone.object == "audio.voice.deleted"
    with pytest.raises(openai.NotFoundError):
        c.audio.voices.delete("openai-made")


@pytest.mark.parametrize(
    ("name", "audio", "fields", "status", "param"),
    [
        ("no-consent", None, {"consent": None}, 400, "consent"),
        ("blank-consent", None, {"consent": "  "}, 400, "consent"),
        ("no-text", None, {"ref_text": None}, 400, "ref_text"),
        ("too-big", prompt_wav(seconds=4.0), {}, 413, "audio_sample"),
        ("not-audio", b"this is not audio at all" * 100, {}, 400, "audio_sample"),
        ("a/b", None, {}, 400, "name"),
        ("x" * 65, None, {}, 400, "name"),
        ("alloy", None, {}, 400, "name"),
        ("中文女", None, {}, 400, "name"),
        ("by-prompt", None, {"type": "prompt"}, 400, "type"),
        ("odd-field", None, {"speaker_age": "40"}, 400, "speaker_age"),
        ("no-model", None, {"model": "nope"}, 404, "model"),
    ],
    ids=[
        "missing-consent",
        "blank-consent",
        "missing-ref-text",
        "over-upload-limit",
        "not-audio",
        "path-name",
        "long-name",
        "openai-name",
        "speaker-name",
        "prompt-type",
        "unknown-field",
        "unknown-model",
    ],
)
def test_a_bad_upload_is_refused_naming_its_field(
    server: ServerProcess, name: str, audio: bytes | None, fields: dict[str, Any], status: int, param: str
) -> None:
    with client(server, KEY_A) as a:
        assert_error(create(a, name, audio, **fields), status, param)
        assert voices(a).get(name, {}).get("kind") != "registered", "a refused upload must register nothing"


def test_uploads_are_multipart_named_once_and_speakers_stay(server: ServerProcess) -> None:
    with client(server, KEY_A) as a:
        r = a.post("/v1/audio/voices", json={"name": "j", "consent": "c", "ref_text": REF_TEXT})
        assert r.status_code == 415, r.text
        assert create(a, "twice").status_code == 200
        err = assert_error(create(a, "twice"), 400, "name")
        assert err["code"] == "voice_exists", err
        assert a.delete("/v1/audio/voices/twice").status_code == 200
        assert_error(a.delete("/v1/audio/voices/中文女"), 400, "name")
        assert "中文女" in voices(a)
    with server.client() as anonymous:
        assert anonymous.get("/v1/audio/voices").status_code == 401
        assert anonymous.delete("/v1/audio/voices/x").status_code == 401


# --- ref_audio: cloning for one request ----------------------------------------------------------------------------


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize(
    ("fields", "mode"),
    [
        ({"ref_audio": b64(prompt_wav()), "ref_text": REF_TEXT}, "zero_shot"),
        ({"ref_audio": "data:audio/wav;base64," + b64(prompt_wav())}, "cross_lingual"),
        ({"ref_audio": b64(prompt_wav()), "voice": "alloy"}, "cross_lingual"),
    ],
    ids=["base64-with-text", "data-url", "with-openai-voice"],
)
def test_ref_audio_clones_a_voice_for_one_request(
    server: ServerProcess, fields: dict[str, Any], mode: str
) -> None:
    with client(server, KEY_A) as a:
        r = a.post("/v1/audio/speech", json={"input": TEXT, "response_format": "pcm"} | fields)
        assert r.status_code == 200 and len(r.content) > 0, r.text
        assert access_log(server, r.headers["x-request-id"])["mode"] == mode


@pytest.mark.parametrize(
    ("fields", "status", "param", "says"),
    [
        ({"ref_audio": "https://example.com/voice.wav"}, 400, "ref_audio", "never fetches a URL"),
        ({"ref_audio": "file:///etc/passwd"}, 400, "ref_audio", "never fetches a URL"),
        ({"ref_audio": "data:audio/wav,RIFF"}, 400, "ref_audio", "base64"),
        ({"ref_audio": "not base64 !!"}, 400, "ref_audio", "base64"),
        ({"ref_audio": b64(b"not audio" * 50)}, 400, "ref_audio", ""),
        ({"ref_audio": b64(prompt_wav(seconds=4.0))}, 413, "ref_audio", str(MAX_UPLOAD)),
        ({"ref_audio": b64(prompt_wav()), "voice": "中文女"}, 400, "voice", "one of them"),
        ({"ref_text": REF_TEXT, "voice": "alloy"}, 400, "ref_text", "ref_audio"),
        ({"ref_audio": 42}, 400, "ref_audio", "string"),
    ],
    ids=[
        "http-url",
        "file-url",
        "data-url-not-base64",
        "not-base64",
        "not-audio",
        "too-big",
        "voice-too",
        "text-alone",
        "number",
    ],
)
def test_bad_ref_audio_is_refused_naming_its_field(
    server: ServerProcess, fields: dict[str, Any], status: int, param: str, says: str
) -> None:
    with client(server, KEY_A) as a:
        err = assert_error(a.post("/v1/audio/speech", json={"input": TEXT} | fields), status, param)
        assert says in err["message"], err
