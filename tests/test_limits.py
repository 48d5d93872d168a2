"""One request path: every limit of a request, on every transport, through the one constructor (issue 32, item 1).

The table below crosses the limits (text, a streamed piece, a voice sample's transcript, an instruction, a voice
name, a sample's bytes and seconds, speed, format, sample rate) with the transports that take the field: POST
``/v1/audio/speech`` (audio and SSE), the reference's ``/inference_*``, the WebSocket, Wyoming (one-shot and
streamed), the voices API, the Python API and the CLI's ``synth``. Each cell sends one value just over its limit and expects the error to name the field
as that transport spells it; a cell missing from a transport that has the field is a check that lives in one route
and not another. The server is the app under a real uvicorn in this process over :class:`FakeRuntime` (which
speaks sft only: the over-limit fields are refused before any mode is asked of it). Also here: a tenant's
registered voice speaks on every route (and another tenant's is nobody's), a WebSocket session resolves its voice
once, and the hostile pass's WebSocket cases.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf

from cosyserve.api import CosyVoiceModel
from cosyserve.core.errors import ClientError
from cosyserve.core.limits import Limits
from cosyserve.core.settings import Settings
from fake_runtime import FakeRuntime
from server_util import WAIT_S, Served, serve

ws_client = pytest.importorskip("websockets.sync.client")

TEXT, BUFFERED, PROMPT_TEXT, INSTRUCTIONS, VOICE, UPLOAD, SECONDS = 40, 64, 30, 20, 10, 20_000, 0.5
LIMITS = {
    "max_text_chars": TEXT,
    "max_buffered_text_chars": BUFFERED,
    "max_prompt_text_chars": PROMPT_TEXT,
    "max_instructions_chars": INSTRUCTIONS,
    "max_voice_name_chars": VOICE,
    "max_upload_bytes": UPLOAD,
    "max_prompt_seconds": SECONDS,
}
KEYS = {"key-a": "a", "key-b": "b"}


def wav(seconds: float, rate: int = 16000) -> bytes:
    """A tone as a 16-bit WAV file (16 kHz: 32 kB a second)."""
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(
        buf, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, format="WAV", subtype="PCM_16"
    )
    return buf.getvalue()


SAMPLE = wav(0.3)  # within both limits
LONG_SAMPLE = wav(0.6)  # over the seconds, within the bytes
BIG_SAMPLE = wav(0.7) + bytes(UPLOAD)  # over the bytes
assert len(SAMPLE) < len(LONG_SAMPLE) < UPLOAD < len(BIG_SAMPLE)
OVER = {  # one character over each limit
    "text": "x" * (TEXT + 1),
    "prompt_text": "y" * (PROMPT_TEXT + 1),
    "instructions": "z" * (INSTRUCTIONS + 1),
    "voice": "v" * (VOICE + 1),
}


@pytest.fixture(scope="module")
def fake() -> FakeRuntime:
    return FakeRuntime(registered={"a": ("mine",)})


@pytest.fixture(scope="module")
def srv(fake: FakeRuntime) -> Iterator[Served]:
    # Wyoming has no keys: its callers act as tenant a
    with serve(fake, api_keys=KEYS, wyoming_uri="tcp://127.0.0.1:0", wyoming_tenant="a", **LIMITS) as s:
        yield s


# --- the transports ---------------------------------------------------------------------------------------------


def _error(r: httpx.Response) -> tuple[str | None, str]:
    assert r.status_code in (400, 413), f"expected a refusal, got {r.status_code}: {r.text[:300]}"
    err = r.json()["error"]
    return err["param"], err["message"]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def post(s: Served, key: str = "key-a", **fields: Any) -> httpx.Response:
    body = {"input": "Hi.", "voice": "alice", "response_format": "pcm"} | fields
    body = {k: v for k, v in body.items() if v is not None}
    with s.client(headers={"Authorization": f"Bearer {key}"}) as c:
        return c.post("/v1/audio/speech", json=body)


def sse(s: Served, **fields: Any) -> httpx.Response:
    return post(s, stream_format="sse", **fields)


def reference(
    s: Served, endpoint: str, key: str = "key-a", files: bytes | None = None, **data: str
) -> httpx.Response:
    upload = {"prompt_wav": ("p.wav", files, "audio/wav")} if files is not None else None
    with s.client(headers={"Authorization": f"Bearer {key}"}) as c:
        return c.post(f"/inference_{endpoint}", data=data, files=upload)


def voices(s: Served, audio: bytes = SAMPLE, **data: str) -> httpx.Response:
    form = {"name": "new", "consent": "c-1", "ref_text": "A prompt."} | data
    with s.client(headers={"Authorization": "Bearer key-a"}) as c:
        return c.post("/v1/audio/voices", data=form, files={"audio_sample": ("s.wav", audio, "audio/wav")})


def _ws(s: Served, key: str = "key-a") -> Any:
    return s.connect(additional_headers={"Authorization": f"Bearer {key}"})


def _recv(ws: Any) -> dict[str, Any]:
    msg = ws.recv(timeout=WAIT_S)
    assert isinstance(msg, str), f"expected an event, got {len(msg)} bytes"
    return dict(json.loads(msg))


def ws_config(s: Served, **config: Any) -> tuple[str | None, str]:
    with _ws(s) as ws:
        ws.send(json.dumps({"type": "session.config", **config}))
        ev = _recv(ws)
    assert ev["type"] == "error" and ev["fatal"] is False, ev
    return ev["param"], ev["message"]


def ws_text(s: Served, text: str) -> tuple[str | None, str]:
    with _ws(s) as ws:
        ws.send(json.dumps({"type": "session.config", "voice": "alice"}))
        ws.send(json.dumps({"type": "input.text", "text": text}))
        ev = _recv(ws)
    assert ev["type"] == "error", ev
    return ev["param"], ev["message"]


def wyoming(s: Served, *events: dict[str, Any]) -> tuple[str | None, str]:
    """The event a Wyoming client (the ``wyoming`` package's) gets back for ``events`` (type and data each): an
    error, whose text starts with the field as Wyoming names it."""
    with warnings.catch_warnings():  # wyoming.audio imports audioop, which warns of its removal
        warnings.simplefilter("ignore", DeprecationWarning)
        from wyoming.client import AsyncClient
        from wyoming.event import Event

    async def scenario() -> Any:
        async with AsyncClient.from_uri(s.wyoming_uri) as c:
            for ev in events:
                await c.write_event(Event(ev["type"], ev.get("data", {})))
            return await asyncio.wait_for(c.read_event(), WAIT_S)

    ev = asyncio.run(scenario())
    assert ev is not None and ev.type == "error", ev
    text = ev.data["text"]
    field = re.match(r"[\w.]+", text)
    return (field.group(0) if field else None), text


def _synthesize(text: str = "Hi.", voice: str = "mine") -> dict[str, Any]:
    return {"type": "synthesize", "data": {"text": text, "voice": {"name": voice}}}


def python(fake: FakeRuntime, **fields: Any) -> tuple[str | None, str]:
    model = CosyVoiceModel(fake, Limits.from_settings(Settings.load(env={}).replace(**LIMITS)))
    with pytest.raises(ClientError) as e:
        list(model.synthesize(**({"text": "Hi."} | fields)))
    return e.value.param, str(e.value)


def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any, *args: str) -> tuple[str | None, str]:
    from cosyserve.cli import main
    from cosyserve.system.gchold import release_gc

    for name, value in LIMITS.items():
        monkeypatch.setenv(f"COSYSERVE_{name.upper()}", str(value))
    try:
        with pytest.raises(SystemExit) as e:
            main(
                ["synth", "--model", str(tmp_path / "never-loaded"), "--out", str(tmp_path / "o.wav"), *args]
            )
    finally:
        release_gc()  # synth holds the collector until its model is loaded
    assert e.value.code == 1
    err = capsys.readouterr().err
    flag = err.split("error: ", 1)[1].split(" ", 1)[0].rstrip(":")  # the message starts with its flag
    return flag, err


def _file(tmp_path: Path, data: bytes) -> str:
    path = tmp_path / f"sample-{len(data)}.wav"
    path.write_bytes(data)
    return str(path)


# --- the table: limit x transport -> (the call, the field as that transport names it) ---------------------------

Cell = Callable[
    [Served, FakeRuntime, Path, pytest.MonkeyPatch, Any], "tuple[str | None, str] | httpx.Response"
]


def _sample_cells(limit: str, sample: bytes) -> dict[tuple[str, str], tuple[Cell, str]]:
    # a voice sample over a limit (its bytes, its seconds), on each transport that takes one
    b64 = _b64(sample)
    return {
        (limit, "post"): (lambda s, f, t, m, c: post(s, voice=None, ref_audio=b64), "ref_audio"),
        (limit, "sse"): (lambda s, f, t, m, c: sse(s, voice=None, ref_audio=b64), "ref_audio"),
        (limit, "reference"): (
            lambda s, f, t, m, c: reference(s, "cross_lingual", files=sample, tts_text="Hi."),
            "prompt_wav",
        ),
        (limit, "websocket"): (lambda s, f, t, m, c: ws_config(s, ref_audio=b64), "ref_audio"),
        (limit, "voices"): (lambda s, f, t, m, c: voices(s, audio=sample), "audio_sample"),
        (limit, "python"): (
            lambda s, f, t, m, c: python(f, mode="cross_lingual", prompt_wav=sample),
            "prompt_wav",
        ),
        (limit, "cli"): (
            lambda s, f, t, m, c: cli(
                t, m, c, "--text", "Hi.", "--mode", "cross_lingual", "--prompt-wav", _file(t, sample)
            ),
            "--prompt-wav",
        ),
    }


CELLS: dict[tuple[str, str], tuple[Cell, str]] = {
    # text, and a streamed piece of it
    ("text", "post"): (lambda s, f, t, m, c: post(s, input=OVER["text"]), "input"),
    ("text", "sse"): (lambda s, f, t, m, c: sse(s, input=OVER["text"]), "input"),
    ("text", "reference"): (
        lambda s, f, t, m, c: reference(s, "sft", tts_text=OVER["text"], spk_id="alice"),
        "tts_text",
    ),
    ("text", "websocket"): (lambda s, f, t, m, c: ws_text(s, OVER["text"]), "text"),
    ("text", "wyoming"): (lambda s, f, t, m, c: wyoming(s, _synthesize(OVER["text"])), "text"),
    ("text", "wyoming-streamed"): (
        lambda s, f, t, m, c: wyoming(
            s, {"type": "synthesize-start"}, {"type": "synthesize-chunk", "data": {"text": OVER["text"]}}
        ),
        "text",
    ),
    ("text", "python"): (lambda s, f, t, m, c: python(f, text=OVER["text"]), "text"),
    ("text", "python-streamed"): (lambda s, f, t, m, c: python(f, text=iter(["Hi. ", OVER["text"]])), "text"),
    ("text", "cli"): (lambda s, f, t, m, c: cli(t, m, c, "--text", OVER["text"]), "--text"),
    # a voice sample's transcript
    ("prompt_text", "post"): (
        lambda s, f, t, m, c: post(s, voice=None, ref_audio=_b64(SAMPLE), ref_text=OVER["prompt_text"]),
        "ref_text",
    ),
    ("prompt_text", "sse"): (
        lambda s, f, t, m, c: sse(s, voice=None, ref_audio=_b64(SAMPLE), ref_text=OVER["prompt_text"]),
        "ref_text",
    ),
    ("prompt_text", "reference"): (
        lambda s, f, t, m, c: reference(
            s, "zero_shot", files=SAMPLE, tts_text="Hi.", prompt_text=OVER["prompt_text"]
        ),
        "prompt_text",
    ),
    ("prompt_text", "websocket"): (
        lambda s, f, t, m, c: ws_config(s, ref_audio=_b64(SAMPLE), ref_text=OVER["prompt_text"]),
        "ref_text",
    ),
    ("prompt_text", "voices"): (lambda s, f, t, m, c: voices(s, ref_text=OVER["prompt_text"]), "ref_text"),
    ("prompt_text", "python"): (
        lambda s, f, t, m, c: python(f, mode="zero_shot", prompt_wav=SAMPLE, prompt_text=OVER["prompt_text"]),
        "prompt_text",
    ),
    ("prompt_text", "cli"): (
        lambda s, f, t, m, c: cli(
            t,
            m,
            c,
            "--text",
            "Hi.",
            "--mode",
            "zero_shot",
            "--prompt-wav",
            _file(t, SAMPLE),
            "--prompt-text",
            OVER["prompt_text"],
        ),
        "--prompt-text",
    ),  # fmt: skip
    # a style instruction
    ("instructions", "post"): (
        lambda s, f, t, m, c: post(s, instructions=OVER["instructions"]),
        "instructions",
    ),
    ("instructions", "sse"): (
        lambda s, f, t, m, c: sse(s, instructions=OVER["instructions"]),
        "instructions",
    ),
    ("instructions", "reference"): (
        lambda s, f, t, m, c: reference(
            s, "instruct", tts_text="Hi.", spk_id="alice", instruct_text=OVER["instructions"]
        ),
        "instruct_text",
    ),
    ("instructions", "websocket"): (
        lambda s, f, t, m, c: ws_config(s, voice="alice", instructions=OVER["instructions"]),
        "instructions",
    ),
    ("instructions", "python"): (
        lambda s, f, t, m, c: python(f, mode="instruct", speaker="alice", instruct_text=OVER["instructions"]),
        "instruct_text",
    ),
    ("instructions", "cli"): (
        lambda s, f, t, m, c: cli(
            t,
            m,
            c,
            "--text",
            "Hi.",
            "--mode",
            "instruct",
            "--speaker",
            "alice",
            "--instruct-text",
            OVER["instructions"],
        ),
        "--instruct-text",
    ),  # fmt: skip
    # a voice name
    ("voice", "post"): (lambda s, f, t, m, c: post(s, voice=OVER["voice"]), "voice"),
    ("voice", "sse"): (lambda s, f, t, m, c: sse(s, voice=OVER["voice"]), "voice"),
    ("voice", "reference"): (
        lambda s, f, t, m, c: reference(s, "sft", tts_text="Hi.", spk_id=OVER["voice"]),
        "spk_id",
    ),
    ("voice", "websocket"): (lambda s, f, t, m, c: ws_config(s, voice=OVER["voice"]), "voice"),
    ("voice", "wyoming"): (lambda s, f, t, m, c: wyoming(s, _synthesize(voice=OVER["voice"])), "voice.name"),
    ("voice", "voices"): (lambda s, f, t, m, c: voices(s, name=OVER["voice"]), "name"),
    ("voice", "python"): (lambda s, f, t, m, c: python(f, speaker=OVER["voice"]), "speaker"),
    ("voice", "cli"): (
        lambda s, f, t, m, c: cli(t, m, c, "--text", "Hi.", "--speaker", OVER["voice"]),
        "--speaker",
    ),
    **_sample_cells("audio_bytes", BIG_SAMPLE),
    **_sample_cells("audio_seconds", LONG_SAMPLE),
    ("audio_seconds", "python-source"): (
        lambda s, f, t, m, c: python(f, mode="vc", source_wav=LONG_SAMPLE, prompt_wav=SAMPLE, text=""),
        "source_wav",
    ),
    # speed
    ("speed", "post"): (lambda s, f, t, m, c: post(s, speed=4.5), "speed"),
    ("speed", "sse"): (lambda s, f, t, m, c: sse(s, speed=4.5), "speed"),
    ("speed", "websocket"): (lambda s, f, t, m, c: ws_config(s, speed=1.5), "speed"),
    ("speed", "python"): (lambda s, f, t, m, c: python(f, speed=0.1), "speed"),
    ("speed", "cli"): (lambda s, f, t, m, c: cli(t, m, c, "--text", "Hi.", "--speed", "9"), "--speed"),
    # format and sample rate
    ("format", "post"): (lambda s, f, t, m, c: post(s, response_format="ogg"), "response_format"),
    ("format", "sse"): (lambda s, f, t, m, c: sse(s, response_format="aiff"), "response_format"),
    ("format", "websocket"): (lambda s, f, t, m, c: ws_config(s, response_format="mp3"), "response_format"),
    # a rate the codec does not take (mp3's are MPEG's), or none at all
    ("sample_rate", "post"): (
        lambda s, f, t, m, c: post(s, response_format="mp3", sample_rate=44000),
        "sample_rate",
    ),
    ("sample_rate", "sse"): (lambda s, f, t, m, c: sse(s, sample_rate=10**7), "sample_rate"),
    ("sample_rate", "websocket"): (lambda s, f, t, m, c: ws_config(s, sample_rate=10**7), "sample_rate"),
    ("sample_rate", "websocket-nonsense"): (
        lambda s, f, t, m, c: ws_config(s, sample_rate=-5),
        "sample_rate",
    ),
}


@pytest.mark.parametrize(("limit", "transport"), list(CELLS), ids=[f"{a}-{b}" for a, b in CELLS])
def test_every_limit_is_applied_on_every_transport_naming_the_field(
    srv: Served,
    fake: FakeRuntime,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
    limit: str,
    transport: str,
) -> None:
    """A value over a limit is refused with an error naming the field as this transport spells it: a cell that
    fails is a route whose check differs from the others' (the WebSocket took a 1 MB ref_text that POST refused)."""
    call, field = CELLS[(limit, transport)]
    before = fake.resolves
    got = call(srv, fake, tmp_path, monkeypatch, capsys)
    param, message = _error(got) if isinstance(got, httpx.Response) else got
    assert param == field, f"the error names {param!r}, not {field!r}: {message[:300]}"
    assert len(message) < 1000, "a long value is echoed whole"
    if limit in ("text", "prompt_text", "instructions", "voice"):
        assert "limit is" in message, message[:300]
    if (limit, transport) not in _REACH_THE_MODEL:
        assert fake.resolves == before, "a request over a limit reached the model"


# cells whose request is resolved before the value over its limit comes: a session's text after its config, a
# streamed piece read as the request runs
_REACH_THE_MODEL = {
    ("text", "websocket"),
    ("text", "wyoming-streamed"),
    ("text", "python-streamed"),
}


def test_the_table_covers_every_transport_of_every_field() -> None:
    """Each limit has its cell on each transport that takes its field (a new transport or limit adds cells)."""
    takes = {
        "text": {
            "post",
            "sse",
            "reference",
            "websocket",
            "wyoming",
            "wyoming-streamed",
            "python",
            "python-streamed",
            "cli",
        },
        "prompt_text": {"post", "sse", "reference", "websocket", "voices", "python", "cli"},
        "instructions": {"post", "sse", "reference", "websocket", "python", "cli"},
        "voice": {"post", "sse", "reference", "websocket", "wyoming", "voices", "python", "cli"},
        "audio_bytes": {"post", "sse", "reference", "websocket", "voices", "python", "cli"},
        "audio_seconds": {
            "post",
            "sse",
            "reference",
            "websocket",
            "voices",
            "python",
            "python-source",
            "cli",
        },
        "speed": {"post", "sse", "websocket", "python", "cli"},
        "format": {"post", "sse", "websocket"},
        "sample_rate": {"post", "sse", "websocket", "websocket-nonsense"},
    }
    assert {(limit, t) for limit, ts in takes.items() for t in ts} == set(CELLS)


# --- one tenant's registered voice, on every route --------------------------------------------------------------


def _speaks(r: httpx.Response) -> None:
    assert r.status_code == 200 and r.content, f"{r.status_code}: {r.text[:300]}"


def ws_first(s: Served, key: str, voice: str) -> dict[str, Any]:
    with _ws(s, key) as ws:
        ws.send(json.dumps({"type": "session.config", "voice": voice}))
        ws.send(json.dumps({"type": "input.text", "text": "Hi."}))
        ws.send(json.dumps({"type": "input.done"}))
        return _recv(ws)


def wyoming_first(s: Served, voice: str) -> str:
    """The type of the first event a Wyoming synthesize with ``voice`` gets."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from wyoming.client import AsyncClient
        from wyoming.tts import Synthesize, SynthesizeVoice

    async def scenario() -> str:
        async with AsyncClient.from_uri(s.wyoming_uri) as c:
            await c.write_event(Synthesize(text="Hi.", voice=SynthesizeVoice(name=voice)).event())
            ev = await asyncio.wait_for(c.read_event(), WAIT_S)
            assert ev is not None
            return str(ev.type)

    return asyncio.run(scenario())


def test_a_tenants_registered_voice_speaks_on_every_route_and_is_nobody_elses(
    srv: Served, fake: FakeRuntime
) -> None:
    """Tenant a's voice speaks for a on POST, SSE, the reference routes, the WebSocket, Wyoming (whose callers act
    as a: --wyoming-tenant) and the Python API, and is
    voice_not_found for tenant b everywhere. Before, the WebSocket checked the voice without the caller's tenant:
    a's voice was voice_not_found there while it spoke over POST."""
    _speaks(post(srv, voice="mine"))
    _speaks(sse(srv, voice="mine"))
    _speaks(reference(srv, "sft", tts_text="Hi.", spk_id="mine"))
    start = ws_first(srv, "key-a", "mine")
    assert start["type"] == "audio.start" and start["voice"] == "mine", start
    assert wyoming_first(srv, "mine") == "audio-start", "Wyoming's tenant (a) did not speak its voice"
    model = CosyVoiceModel(fake)
    assert len(model.synthesize_all("Hi.", "mine", tenant="a")) > 0

    for r, field in (
        (post(srv, key="key-b", voice="mine"), "voice"),
        (post(srv, key="key-b", voice="mine", stream_format="sse"), "voice"),
        (reference(srv, "sft", key="key-b", tts_text="Hi.", spk_id="mine"), "spk_id"),
    ):
        assert r.status_code == 400 and r.json()["error"]["code"] == "voice_not_found", r.text
        assert r.json()["error"]["param"] == field
    ev = ws_first(srv, "key-b", "mine")
    assert (ev["type"], ev["code"], ev["param"]) == ("error", "voice_not_found", "voice"), ev
    with pytest.raises(ClientError, match="unknown speaker"):
        model.synthesize("Hi.", "mine", tenant="b")


def test_a_websocket_session_resolves_its_voice_once_for_all_its_utterances(
    srv: Served, fake: FakeRuntime
) -> None:
    """The session's config is resolved when it comes (the model is loaded) and each utterance is spoken with it:
    before, each utterance was resolved three times (the config's probe, the engine, the runtime)."""
    before = fake.resolves
    with _ws(srv) as ws:
        ws.send(json.dumps({"type": "session.config", "voice": "bob"}))
        for i in range(3):
            ws.send(json.dumps({"type": "input.text", "text": f"Utterance {i}."}))
            ws.send(json.dumps({"type": "input.done"}))
            kinds = []
            while not kinds or kinds[-1] != "session.done":
                msg = ws.recv(timeout=WAIT_S)
                if isinstance(msg, str):
                    kinds.append(json.loads(msg)["type"])
            assert kinds == ["audio.start", "audio.done", "session.done"], kinds
    assert fake.resolves - before == 1, (
        f"{fake.resolves - before} resolutions for one session of 3 utterances"
    )


def test_streamed_text_held_for_the_model_stays_within_its_limit() -> None:
    """The server reads an utterance's text off the socket only while what the model has not read yet stays within
    max_buffered_text_chars (or one piece): a client that writes faster than the model reads is held back by TCP,
    and the server's memory does not grow with what the client sends."""
    from cosyserve.core.textfeed import TextFeed

    highest = [0]
    put = TextFeed.put

    def watched(self: TextFeed, text: str) -> None:
        put(self, text)
        highest[0] = max(highest[0], self.pending_chars)

    slow = FakeRuntime(chunk_len=10, delay=0.02)  # reads a piece each 20 ms
    with serve(slow, max_buffered_text_chars=BUFFERED) as s, pytest.MonkeyPatch.context() as m:
        m.setattr(TextFeed, "put", watched)
        with s.connect() as ws:
            ws.send(json.dumps({"type": "session.config"}))
            for i in range(40):  # 400 characters, sent at once
                ws.send(json.dumps({"type": "input.text", "text": f"piece {i:03d}."}))
            ws.send(json.dumps({"type": "input.done"}))
            while not (
                isinstance(msg := ws.recv(timeout=WAIT_S), str) and json.loads(msg)["type"] == "session.done"
            ):
                pass
        assert len(slow.pieces[-1]) == 40, "every piece was spoken"
    assert 0 < highest[0] <= BUFFERED, f"{highest[0]} characters waited for the model"


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"type": "session.config", "ref_audio": _b64(SAMPLE), "ref_text": "r" * (1 << 20)}, "ref_text"),
        ({"type": "session.config", "ref_audio": _b64(SAMPLE), "ref_text": "r" * 5000}, "ref_text"),
        ({"type": "session.config", "instructions": "i" * 120_000}, "instructions"),
        ({"type": "input.text", "text": "hello " * 175_000}, "text"),
    ],
    ids=["1MB-ref_text", "5000-char-ref_text", "120k-instructions", "1MB-text-piece"],
)
def test_the_hostile_passs_websocket_messages_are_refused_by_the_default_limits(
    message: dict[str, Any], field: str
) -> None:
    """Found by a hostile pass against the WebSocket, which skipped every limit POST applies: a 1 MB ref_text
    wedged the server (RSS 0.9 -> 8 GB), 120k characters of instructions took 4.8 GB, a 1 MB text piece was
    normalised whole. With the default limits each is an error naming its field, and the session goes on."""
    fake = FakeRuntime()
    with serve(fake) as s, s.connect() as ws:
        if message["type"] == "input.text":
            ws.send(json.dumps({"type": "session.config"}))
        ws.send(json.dumps(message))
        ev = _recv(ws)
        assert (ev["type"], ev["param"], ev["fatal"]) == ("error", field, False), ev
        assert len(ev["message"]) < 1000
        if message["type"] == "session.config":
            ws.send(json.dumps({"type": "session.config"}))
        ws.send(json.dumps({"type": "input.text", "text": "Still here."}))
        ws.send(json.dumps({"type": "input.done"}))
        assert _recv(ws)["type"] == "audio.start", "the session did not go on"
    assert fake.pieces == [["Still here."]], "the refused text reached the model"


def test_the_python_api_takes_its_limits_from_the_settings_it_loads_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``cosyserve.load(..., max_text_chars=...)`` (or the settings it is given) sets the limits its requests are
    built within, as ``cosyserve serve`` sets the server's: else the Python API would have no limits, or others."""
    import cosyserve
    import cosyserve.runtime

    monkeypatch.setattr(cosyserve.runtime, "load_runtime", lambda *a, **k: FakeRuntime())
    model = cosyserve.load("demo", max_text_chars=12, max_voice_name_chars=5)
    assert (model.limits.text_chars, model.limits.voice_chars) == (12, 5)
    assert model.limits.prompt_text_chars == Settings.load(env={}).max_prompt_text_chars
    with pytest.raises(ClientError, match="text is 13 characters; the limit is 12"):
        model.synthesize("x" * 13)
    assert len(model.synthesize_all("x" * 12)) > 0
