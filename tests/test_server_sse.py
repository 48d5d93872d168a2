"""``stream_format: "sse"`` on ``/v1/audio/speech``: OpenAI's Server-Sent Events, read by the real ``openai`` client.

A real ``cosyserve serve`` with the tiny model, and the ``openai`` client's streaming helper
(``client.audio.speech.with_streaming_response.create(..., stream_format="sse")``, whose lines a program reads as
OpenAI documents). Each format's deltas must add up to the very bytes the same seeded request returns as audio;
errors before the first audio stay HTTP errors, and an error after it is the stream's last event.
"""

from __future__ import annotations

import base64
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
from starlette.testclient import TestClient

from cosyserve.core.settings import Settings
from cosyserve.engine.pool import ModelPool, ModelSpec
from cosyserve.server.app import create_app
from cosyserve.server.audiofile import FORMATS
from fake_runtime import FakeRuntime
from server_util import ServerProcess, decoded, openai_client, running_server

TEXT = "Hello there, this is a streamed test."
KEY = "key-sse-0001"
WAIT_S = 60.0


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    env = {"COSYSERVE_API_KEYS": f"{KEY}=acme"}
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("sse"), env=env) as s:
        yield s


def sse_events(lines: Iterator[str]) -> list[dict[str, Any]]:
    """The events of a text/event-stream, each checked: an ``event:`` line naming the JSON ``data:``'s type."""
    events, name = [], None
    for line in lines:
        if line.startswith("event:"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("data:"):
            data = json.loads(line.split(":", 1)[1])
            assert data["type"] == name, f"the event line says {name!r}, the data {data['type']!r}"
            events.append(data)
            name = None
        else:
            assert line == "", f"not an SSE line: {line!r}"
    return events


@pytest.mark.parametrize("fmt", FORMATS)
def test_openai_client_reads_sse_and_the_deltas_are_the_audio(server: ServerProcess, fmt: str) -> None:
    client = openai_client(server, KEY, timeout=WAIT_S)
    with client.audio.speech.with_streaming_response.create(
        model="tts-1",
        voice="alloy",
        input=TEXT,
        response_format=fmt,  # type: ignore[arg-type]
        stream_format="sse",
        extra_body={"seed": 11},
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream"), resp.headers
        assert resp.headers.get("cache-control") == "no-cache"
        events = sse_events(resp.iter_lines())
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert deltas and events[-1]["type"] == "speech.audio.done", [e["type"] for e in events]
    assert len(deltas) == len(events) - 1, "only deltas before done"
    assert all(d["format"] == fmt for d in deltas)
    got = b"".join(base64.b64decode(d["audio"]) for d in deltas)
    # the same request as audio bytes: an event stream carries exactly those bytes
    with httpx.Client(
        base_url=server.base_url, timeout=WAIT_S, headers={"Authorization": f"Bearer {KEY}"}
    ) as c:
        r = c.post(
            "/v1/audio/speech",
            json={"input": TEXT, "voice": "alloy", "response_format": fmt, "stream": True, "seed": 11},
        )
    assert r.status_code == 200, r.text
    if fmt == "opus":  # each Ogg stream draws its own serial number: the same audio, other bytes in the pages
        np.testing.assert_array_equal(sf.read(io.BytesIO(got))[0], sf.read(io.BytesIO(r.content))[0])
    elif fmt == "aac":  # FFmpeg's encoder is not bit-exact from run to run: the same length
        assert len(decoded(got)[0]) == len(decoded(r.content)[0])
    else:
        assert got == r.content, f"{fmt}: the deltas must add up to the audio response's bytes"
    usage = events[-1]["usage"]
    rate = int(r.headers["x-sample-rate"])
    assert rate == 24000, "OpenAI's rate, resampled from the 300M model's 22.05 kHz"
    assert usage["sample_rate"] == rate and usage["input_characters"] == len(TEXT), usage
    if fmt == "pcm":
        assert usage["audio_samples"] == len(got) // 2 > 0
    else:
        data, sr = decoded(got)
        assert len(data) > 0 and sr in (rate, 48000), (len(data), sr)  # Opus may decode at 48 kHz
    assert usage["audio_seconds"] == pytest.approx(usage["audio_samples"] / rate, abs=1e-3)
    if fmt != "flac":
        assert len(deltas) >= 2, f"{fmt} streams: more than one delta (the first chunk, then the rest)"
    else:
        assert len(deltas) == 1, f"{fmt} is not streamed: one delta with the whole file"


def test_errors_before_the_audio_are_http_errors(server: ServerProcess) -> None:
    import openai

    client = openai_client(server, KEY, timeout=WAIT_S)
    with pytest.raises(openai.BadRequestError) as e:
        with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="nobody-here", input=TEXT, stream_format="sse"
        ):
            pass
    assert e.value.status_code == 400 and isinstance(e.value.body, dict), e.value
    assert e.value.body["code"] == "voice_not_found" and e.value.body["param"] == "voice", e.value.body
    with pytest.raises(openai.BadRequestError) as e:  # one whole body, as an event stream: which?
        client.audio.speech.create(
            model="tts-1", voice="alloy", input=TEXT, stream_format="sse", extra_body={"stream": False}
        )
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "stream", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(
            model="tts-1",
            voice="alloy",
            input=TEXT,
            extra_body={"stream_format": "json"},  # type: ignore[dict-item]
        )
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "stream_format", e.value.body


def test_access_log_counts_the_event_stream(server: ServerProcess) -> None:
    with httpx.Client(
        base_url=server.base_url, timeout=WAIT_S, headers={"Authorization": f"Bearer {KEY}"}
    ) as c:
        r = c.post(
            "/v1/audio/speech",
            json={"input": TEXT, "voice": "alloy", "response_format": "pcm", "stream_format": "sse"},
            headers={"X-Request-Id": "sse-log-1"},
        )
    assert r.status_code == 200
    line = next(ln for ln in server.log().splitlines() if '"id": "sse-log-1"' in ln)
    rec = json.loads(line[line.index("{") :])
    assert rec["outcome"] == "ok" and rec["stream"] is True and rec["bytes"] == len(r.content), rec


class _OneChunkThenWait(FakeRuntime):
    """One chunk at once, the next once the request is told to stop: a stream that is under way when the test
    acts (waiting for the stop itself, not for the test's signal: else, on a busy machine, the second chunk could
    end the stream before the release's cancel reached it)."""

    def __init__(self) -> None:
        super().__init__(chunk_len=50)

    def start(self, request: Any, should_stop: Any) -> Iterator[np.ndarray]:
        self.resolve(request)

        def chunks() -> Iterator[np.ndarray]:
            yield np.zeros(50, np.float32)
            deadline = time.monotonic() + WAIT_S
            while not should_stop() and time.monotonic() < deadline:
                time.sleep(0.005)
            yield np.zeros(50, np.float32)

        return chunks()


def test_an_error_after_the_first_audio_is_the_last_event() -> None:
    """Once events flow the status is out: the stream must end with ``speech.audio.error`` (the OpenAI error
    object) instead of a ``done`` a client would take for complete audio."""
    fake = _OneChunkThenWait()
    pool = ModelPool([ModelSpec("m", policy="preload")], load_model=lambda s, r: fake, memory_probe=None)
    with TestClient(create_app(Settings.load(env={}), pool=pool)) as client:
        deadline = time.monotonic() + WAIT_S
        while client.get("/health/ready").status_code != 200:
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.01)
        body = {"input": "Hi.", "voice": "alloy", "response_format": "pcm", "stream_format": "sse"}
        with client.stream("POST", "/v1/audio/speech", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = sse_events(iter([next(lines), next(lines), next(lines)]))
            assert first[0]["type"] == "speech.audio.delta"
            pool.start_close(timeout=0)  # the model is released while the request runs (a shutdown's cut)
            events = sse_events(lines)
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "speech.audio.error" and "speech.audio.done" not in kinds, kinds
    err = events[-1]["error"]
    assert err["code"] == "engine_dead" and err["type"] == "service_unavailable" and err["message"], err
