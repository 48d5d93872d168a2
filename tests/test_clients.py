"""The clients people point at cosyserve, each with its own request shape, against a real ``cosyserve serve``.

- Pipecat's ``OpenAITTSService``: the ``openai`` client's ``with_streaming_response`` with ``response_format="pcm"``
  and an OpenAI voice name (it accepts no other), read as 24 kHz 16-bit mono as it comes;
- LiveKit Agents' OpenAI TTS plugin: the same helper with mp3 (its default), ``speed=1.0`` always sent, a 5 s read
  timeout between bytes, and over Server-Sent Events (``stream_format="sse"``);
- Open WebUI (a base URL other than OpenAI's): ``GET {base}/audio/models`` and ``GET {base}/audio/voices`` without
  a key, read as ``{"models": [{"id"}]}`` and ``{"voices": [{"id", "name"}]}``, then ``POST {base}/audio/speech``
  with ``input``, a listed voice ``id`` and a listed model, no format (mp3), the whole body read.

And, over the fake runtime, the promise under them: with no extra field, every format's first bytes leave before
the synthesis ends (the fake holds its second chunk until the test has them).
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from fake_runtime import FakeRuntime
from server_util import ServerProcess, decoded, running_server, serve, wait_until

# two sentences: a stream still being made when its first bytes arrive (the rest of the first, all of the second)
TWO = "The first sentence is here. And the second ends it."
SHORT = "Hello there, this is a test."


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("clients")) as s:
        yield s


def in_flight(server: ServerProcess) -> int:
    with server.client() as c:
        return sum(m["in_flight"] for m in c.get("/health/ready").json()["models"].values())


def test_pipecat_gets_24_khz_pcm_as_it_is_made(server: ServerProcess) -> None:
    """If this fails, Pipecat's OpenAITTSService plays CosyVoice-300M 8.8% fast and high (22.05 kHz read as 24),
    or gets its first byte when the synthesis ends."""
    from openai import AsyncOpenAI

    async def pipecat(extra: dict[str, Any]) -> tuple[bytes, dict[str, str], int]:
        client = AsyncOpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)
        busy_at_first_byte = -1
        chunks = []
        async with client.audio.speech.with_streaming_response.create(
            input=TWO, model="gpt-4o-mini-tts", voice="alloy", response_format="pcm", extra_body=extra
        ) as r:
            assert r.status_code == 200
            async for chunk in r.iter_bytes(1024):
                if busy_at_first_byte < 0:
                    busy_at_first_byte = await asyncio.to_thread(in_flight, server)
                chunks.append(chunk)
            headers = dict(r.headers)
        await client.close()
        return b"".join(chunks), headers, busy_at_first_byte

    pcm, headers, busy = asyncio.run(pipecat({"seed": 5}))
    assert headers["x-sample-rate"] == "24000" and headers["transfer-encoding"] == "chunked", headers
    assert busy == 1, "the first bytes came once the synthesis had ended: the body was not streamed"
    native, headers, _ = asyncio.run(pipecat({"seed": 5, "sample_rate": 22050}))
    assert headers["x-sample-rate"] == "22050"
    n, n_native = len(pcm) // 2, len(native) // 2
    assert abs(n - n_native * 24000 / 22050) <= 0.01 * n, f"{n} samples at 24 kHz for {n_native} at 22.05 kHz"


def test_livekit_gets_mp3_as_it_is_made_plain_and_over_sse(server: ServerProcess) -> None:
    """If this fails, LiveKit's OpenAI plugin (mp3 by default, read with a 5 s timeout between bytes) gets its mp3
    as one delta at the very end, or audio it cannot decode."""
    import openai

    async def livekit(**extra: Any) -> tuple[list[bytes], str]:
        client = openai.AsyncClient(
            max_retries=0,
            api_key="none",
            base_url=server.url("/v1"),
            http_client=httpx.AsyncClient(timeout=httpx.Timeout(connect=15.0, read=5.0, write=5.0, pool=5.0)),
        )
        parts = []
        async with client.audio.speech.with_streaming_response.create(
            input=SHORT,
            model="gpt-4o-mini-tts",
            voice="ash",
            response_format="mp3",
            speed=1.0,
            timeout=httpx.Timeout(30, connect=15.0),
            **extra,
        ) as stream:
            media = stream.headers["content-type"]
            async for data in stream.iter_bytes():
                parts.append(data)
        await client.close()
        return parts, media

    parts, media = asyncio.run(livekit())
    assert media == "audio/mpeg"
    audio, rate = decoded(b"".join(parts))
    assert rate == 24000 and len(audio) > rate // 10
    parts, media = asyncio.run(livekit(stream_format="sse"))
    assert media.startswith("text/event-stream")
    events = [
        json.loads(line[5:]) for line in b"".join(parts).decode().splitlines() if line.startswith("data:")
    ]
    deltas = [base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta"]
    assert events[-1]["type"] == "speech.audio.done" and len(deltas) >= 2, "mp3 deltas as the audio is made"
    audio, rate = decoded(b"".join(deltas))
    assert rate == 24000 and len(audio) > rate // 10


def test_open_webui_lists_models_and_voices_and_speaks_a_listed_voice(server: ServerProcess) -> None:
    """If this fails, Open WebUI falls back to tts-1 and OpenAI's six voices (its three calls, as its
    backend makes them: the lists without a key), and no CosyVoice voice can be picked."""
    base = server.url("/v1")
    models = httpx.get(f"{base}/audio/models").json().get("models", [])
    voices = {v["id"]: v["name"] for v in httpx.get(f"{base}/audio/voices").json().get("voices", [])}
    assert [m["id"] for m in models] == [server_model(server)] and "英文女" in voices, (models, voices)
    r = httpx.post(
        f"{base}/audio/speech",
        json={"input": SHORT, "voice": "英文女", "model": models[0]["id"]},
        headers={"Content-Type": "application/json", "Authorization": "Bearer unused"},
        timeout=60,
    )
    assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg", r.text[:300]
    audio, rate = decoded(r.content)
    assert rate == 24000 and len(audio) > rate // 10


def server_model(server: ServerProcess) -> str:
    with server.client() as c:
        return str(c.get("/v1/models").json()["data"][0]["id"])


def test_open_webui_with_api_keys_falls_back_to_openai_names_that_speak() -> None:
    """Open WebUI's backend sends no key for its two lists: with API keys they answer 401 and it offers tts-1 and
    OpenAI's six voices, which must then speak (with the key it does send on the speech call)."""
    with serve(FakeRuntime(), api_keys={"key-webui-0001": "t"}) as s, s.client() as c:
        assert c.get("/v1/audio/models").status_code == 401 and c.get("/v1/audio/voices").status_code == 401
        for voice in ("alloy", "echo", "fable", "onyx", "nova", "shimmer"):
            r = c.post(
                "/v1/audio/speech",
                json={"input": SHORT, "voice": voice, "model": "tts-1"},
                headers={"Authorization": "Bearer key-webui-0001"},
            )
            assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg", (voice, r.text[:200])


# --- the first bytes before the end, every format, no extra field --------------------------------------------


class _FirstThenHeld(FakeRuntime):
    """Half a second of a tone at once, then the rest only once ``go`` is set (the test's, after its first
    bytes): a stream's first bytes can only have left before the synthesis ended."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def start(self, request: Any, should_stop: Any) -> Iterator[np.ndarray]:
        self.resolve(request)
        t = np.arange(self.sample_rate // 2) / self.sample_rate
        tone = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)

        def chunks() -> Iterator[np.ndarray]:
            yield tone
            while not self.go.wait(0.01):
                if should_stop():
                    return
            yield tone
            yield tone

        return chunks()


@pytest.fixture(scope="module")
def held() -> Iterator[Any]:
    fake = _FirstThenHeld()
    with serve(fake) as s:
        yield s, fake


@pytest.mark.parametrize("sse", [False, True], ids=["audio", "sse"])
@pytest.mark.parametrize("fmt", ["pcm", "wav", "mp3", "opus", "aac"])
def test_every_format_sends_its_first_bytes_before_the_synthesis_ends(held: Any, fmt: str, sse: bool) -> None:
    """If this fails, a client gets its first byte of ``fmt`` (or SSE delta) only when synthesis ends (3.15 s of
    3.15 s on the tiny 300M model in the issue): the fake holds the rest of its audio until the first bytes
    are here."""
    s, fake = held
    fake.go.clear()
    body = {"input": SHORT, "voice": "alloy", "response_format": fmt} | (
        {"stream_format": "sse"} if sse else {}
    )
    with s.client() as c, c.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200, r.read()
        received = r.iter_bytes()
        first = next(received)
        assert first and not fake.go.is_set()
        assert s.engine.in_flight == 1, "the synthesis is still running"
        fake.go.set()
        rest = b"".join(received)
    data = first + rest
    if sse:
        events = [json.loads(ln[5:]) for ln in data.decode().splitlines() if ln.startswith("data:")]
        assert events[0]["type"] == "speech.audio.delta" and events[-1]["type"] == "speech.audio.done"
        data = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    if fmt == "pcm":
        assert len(data) == 2 * 3 * 12000, "three half-second chunks at 24 kHz"
    else:
        audio, rate = decoded(data)
        assert abs(len(audio) / rate - 1.5) < 0.15, f"{fmt}: {len(audio)} samples at {rate} Hz"
    wait_until(lambda: s.engine.in_flight == 0, "the request ended")
