"""Wyoming (Home Assistant's protocol) beside HTTP: ``serve --wyoming-uri`` (cosyserve.server.transports.wyoming), driven by
the ``wyoming`` package's own client, as Home Assistant drives a Wyoming TTS server.

The protocol's cases run the app under a real uvicorn in this process over :class:`FakeRuntime` (which answers one
chunk per streamed piece as it arrives, so what comes when is predictable); a real ``cosyserve serve`` with the tiny
model of each family, started from the flag, checks ``describe``, one-shot and streamed synthesis (the first audio
before ``synthesize-stop``); another, started from the variable with ``--workers 2`` on a unix socket, the prefork
wiring. The limits of its fields are cells of tests/test_limits.py's table.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import warnings
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from cosyserve.core.errors import SettingsError
from cosyserve.core.settings import Settings
from fake_runtime import FakeRuntime
from server_util import WAIT_S, ServerProcess, running_server, serve, start_server

pytest.importorskip("wyoming")
with warnings.catch_warnings():  # wyoming.audio imports audioop, which warns of its removal
    warnings.simplefilter("ignore", DeprecationWarning)
    from wyoming.audio import AudioChunk, AudioStart
    from wyoming.client import AsyncClient
    from wyoming.error import Error
    from wyoming.event import Event, async_read_event
    from wyoming.info import Describe, Info
    from wyoming.ping import Ping
    from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeVoice

T = TypeVar("T")


def run(scenario: Callable[[], Awaitable[T]]) -> T:
    """A client's scenario on this test's own event loop (the server has its own, in its thread)."""
    return asyncio.run(asyncio.wait_for(scenario(), 2 * WAIT_S))  # type: ignore[arg-type]


async def read(client: AsyncClient) -> Event | None:
    return await asyncio.wait_for(client.read_event(), WAIT_S)


async def until(client: AsyncClient, *kinds: str) -> list[Event]:
    """The events up to the first of ``kinds`` (or an error), that one included; fails on the connection's end."""
    events = []
    while True:
        ev = await read(client)
        assert ev is not None, f"the connection ended after {[e.type for e in events]}, before {kinds}"
        events.append(ev)
        if ev.type in kinds or ev.type == "error":
            return events


async def error_then_end(client: AsyncClient) -> Error:
    """The error event the server answers, and then the end of the connection (Home Assistant waits for
    audio-stop otherwise)."""
    ev = await read(client)
    assert ev is not None and ev.type == "error", ev
    assert await read(client) is None, "the connection stayed open after its error"
    return Error.from_event(ev)


def pcm(events: list[Event]) -> bytes:
    return b"".join(AudioChunk.from_event(e).audio for e in events if e.type == "audio-chunk")


@pytest.fixture(scope="module")
def srv() -> Iterator[Any]:
    with serve(FakeRuntime(chunk_len=50), wyoming_uri="tcp://127.0.0.1:0", drain_delay_s=0) as s:
        yield s


def connect(s: Any) -> AsyncClient:
    return AsyncClient.from_uri(s.wyoming_uri)


# --- describe, one-shot, streamed ---------------------------------------------------------------------------


def test_describe_lists_the_models_voices_with_their_languages(srv: Any) -> None:
    """Home Assistant builds its voice picker from this: one TTS program that streams text, each voice with the
    model's languages (a voice without languages is offered for none)."""

    async def scenario() -> Info:
        async with connect(srv) as c:
            await c.write_event(Describe().event())
            ev = await read(c)
            assert ev is not None and Info.is_type(ev.type), ev
            return Info.from_event(ev)

    info = run(scenario)
    (program,) = info.tts
    assert program.name == "cosyserve" and program.installed and program.supports_synthesize_streaming
    assert [(v.name, v.languages, v.installed) for v in program.voices] == [
        ("alice", ["en", "zh"], True),
        ("bob", ["en", "zh"], True),
    ]


def test_synthesize_answers_16_bit_mono_pcm_at_the_models_rate(srv: Any) -> None:
    """One-shot, as Home Assistant asks (voice.name): audio-start states the rate, the chunks are the model's audio
    as 16-bit PCM, audio-stop ends it; the connection then serves the next request (a ping, here)."""

    async def scenario() -> list[Event]:
        async with connect(srv) as c:
            await c.write_event(Synthesize(text="Hello there.", voice=SynthesizeVoice(name="bob")).event())
            events = await until(c, "audio-stop")
            await c.write_event(Ping(text="still here").event())
            pong = await read(c)
            assert pong is not None and (pong.type, pong.data["text"]) == ("pong", "still here")
            return events

    events = run(scenario)
    assert [e.type for e in events] == ["audio-start"] + ["audio-chunk"] * 3 + ["audio-stop"]
    start = AudioStart.from_event(events[0])
    assert (start.rate, start.width, start.channels) == (FakeRuntime.sample_rate, 2, 1)
    samples = np.frombuffer(pcm(events), "<i2")
    expected = np.concatenate([np.full(50, float(i), np.float32) for i in range(3)])  # chunk i is i
    assert np.array_equal(samples, (expected * 32768).clip(-32768, 32767).astype("<i2"))


def test_streamed_text_is_spoken_as_it_arrives_and_ends_with_synthesize_stopped(srv: Any) -> None:
    """Text in synthesize-chunk events goes to the model as it comes, so audio arrives while the client still
    writes; the whole text that Home Assistant sends again as a synthesize inside the stream is not spoken twice."""
    fake = srv.fake

    async def scenario() -> list[Event]:
        async with connect(srv) as c:
            await c.write_event(SynthesizeStart(voice=SynthesizeVoice(name="alice")).event())
            await c.write_event(SynthesizeChunk(text="Hello there, ").event())
            first = await until(c, "audio-chunk")  # before the rest of the text is even sent
            assert [e.type for e in first] == ["audio-start", "audio-chunk"], first
            await c.write_event(SynthesizeChunk(text="and more.").event())
            await c.write_event(Synthesize(text="Hello there, and more.").event())
            await c.write_event(SynthesizeStop().event())
            return first + await until(c, "synthesize-stopped")

    events = run(scenario)
    assert [e.type for e in events] == [
        "audio-start",
        "audio-chunk",
        "audio-chunk",
        "audio-stop",
        "synthesize-stopped",
    ]
    assert fake.pieces[-1] == ["Hello there, ", "and more."], "the streamed text is not what the model read"


def test_a_stream_without_text_is_stopped_without_audio_or_a_request(srv: Any) -> None:
    async def scenario() -> list[Event]:
        async with connect(srv) as c:
            await c.write_event(SynthesizeStart().event())
            await c.write_event(SynthesizeChunk(text="").event())
            await c.write_event(SynthesizeStop().event())
            return await until(c, "synthesize-stopped")

    requests = len(srv.fake.pieces)
    assert [e.type for e in run(scenario)] == ["synthesize-stopped"]
    assert len(srv.fake.pieces) == requests, "an empty stream asked the engine for a request"


# --- errors -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("events", "code", "starts"),
    [
        (
            [Synthesize(text="Hi.", voice=SynthesizeVoice(name="nobody")).event()],
            "voice_not_found",
            "voice.name",
        ),
        ([SynthesizeStart(voice=SynthesizeVoice(name="nobody")).event()], "voice_not_found", "voice.name"),
        (
            [Synthesize(text="Hi.", voice=SynthesizeVoice(name="m2/alice")).event()],
            "voice_not_found",
            "voice.name",
        ),
        (
            [Synthesize(text="Hi.", voice=SynthesizeVoice(name="bob", speaker="x")).event()],
            None,
            "voice.speaker",
        ),
        ([Synthesize(text="Hi.", voice=SynthesizeVoice(language="de")).event()], None, "voice.language"),
        ([Event("synthesize", {"text": 5})], None, "text"),
        ([Event("synthesize", {"text": "<speak/>", "text_format": "ssml"})], None, "text_format"),
        ([SynthesizeChunk(text="Hi.").event()], "invalid_event", "synthesize-chunk"),
        ([SynthesizeStart().event(), SynthesizeStart().event()], "invalid_event", "synthesize-start"),
    ],
    ids=[
        "voice",
        "stream-voice",
        "model-voice",
        "speaker",
        "language",
        "text-type",
        "ssml",
        "chunk",
        "start",
    ],
)
def test_a_bad_request_gets_an_error_naming_its_field_then_the_connection_ends(
    srv: Any, events: list[Event], code: str | None, starts: str
) -> None:
    """Nothing reaches the model; the error's text starts with the field as Wyoming names it."""
    resolves = srv.fake.resolves

    async def scenario() -> Error:
        async with connect(srv) as c:
            for ev in events:
                await c.write_event(ev)
            return await error_then_end(c)

    err = run(scenario)
    assert err.text.startswith(starts), err.text
    if code is not None:
        assert err.code == code, err
    assert len(err.text) < 1000
    assert srv.fake.resolves - resolves <= 1, "refused after the model resolved it more than once"


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"not json\n", "invalid_event"),
        (b"[1, 2]\n", "invalid_event"),
        (b'{"type": "synthesize", "data_length": 999999999}\n', "payload_too_large"),
        (b'{"type": "synthesize", "data": [1]}\n', "invalid_event"),
    ],
    ids=["not-json", "not-an-object", "huge-data", "data-not-an-object"],
)
def test_bytes_that_are_not_an_event_get_an_error_before_anything_is_read(
    srv: Any, raw: bytes, code: str
) -> None:
    """A declared data_length is refused before the server reads (and holds) that many bytes."""

    async def scenario() -> Error:
        reader, writer = await asyncio.open_connection(*_host_port(srv.wyoming_uri))
        try:
            writer.write(raw)
            await writer.drain()
            ev = await asyncio.wait_for(async_read_event(reader), WAIT_S)
            assert ev is not None and ev.type == "error", ev
            return Error.from_event(ev)
        finally:
            writer.close()

    assert run(scenario).code == code


def _host_port(uri: str) -> tuple[str, int]:
    host, _, port = uri.removeprefix("tcp://").rpartition(":")
    return host, int(port)


def test_streamed_text_held_for_the_model_stays_within_its_limit() -> None:
    """The server reads a streamed text off the connection only while what the model has not read yet stays within
    max_buffered_text_chars: a client that writes faster than the model reads is held back by TCP."""
    from cosyserve.core.textfeed import TextFeed

    highest = [0]
    put = TextFeed.put

    def watched(self: TextFeed, text: str) -> None:
        put(self, text)
        highest[0] = max(highest[0], self.pending_chars)

    slow = FakeRuntime(chunk_len=10, delay=0.02)  # reads a piece each 20 ms
    with serve(slow, wyoming_uri="tcp://127.0.0.1:0", max_buffered_text_chars=64) as s:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(TextFeed, "put", watched)

            async def scenario() -> None:
                async with connect(s) as c:
                    await c.write_event(SynthesizeStart().event())
                    for i in range(40):  # 400 characters, sent at once
                        await c.write_event(SynthesizeChunk(text=f"piece {i:03d}.").event())
                    await c.write_event(SynthesizeStop().event())
                    await until(c, "synthesize-stopped")

            run(scenario)
        assert len(slow.pieces[-1]) == 40, "every piece was spoken"
    assert 0 < highest[0] <= 64, f"{highest[0]} characters waited for the model"


def test_a_streamed_request_that_fails_while_its_text_waits_for_room_ends_the_connection() -> None:
    """The request's deadline passes while the client's text waits for the model to take some: the error is sent
    and the connection ends (the text waiting for room is dropped, not put for a model that is gone)."""
    slow = FakeRuntime(chunk_len=10, delay=0.05)
    with serve(slow, wyoming_uri="tcp://127.0.0.1:0", max_buffered_text_chars=20, request_timeout_s=0.5) as s:

        async def scenario() -> Error:
            async with connect(s) as c:
                await c.write_event(SynthesizeStart().event())
                writes = [c.write_event(SynthesizeChunk(text=f"piece {i:03d}. ").event()) for i in range(200)]
                writer = asyncio.ensure_future(asyncio.gather(*writes))
                try:
                    events = await until(c, "error")
                finally:
                    writer.cancel()
                return Error.from_event(events[-1])

        assert run(scenario).code == "deadline_exceeded"
        s.wait_until(lambda: s.engine.in_flight == 0 and not s.state.ws_sessions, "the connection ended")


# --- ends: a client gone, idle, not reading; a drain ----------------------------------------------------------


@pytest.mark.parametrize("streamed", [False, True], ids=["one-shot", "streamed"])
def test_a_client_that_disconnects_mid_synthesis_frees_its_request(srv: Any, streamed: bool) -> None:
    """The request is cancelled in the engine (its slot, its worker thread) as soon as the client is gone."""

    async def scenario() -> None:
        c = connect(srv)
        await c.connect()
        if streamed:
            await c.write_event(SynthesizeStart().event())
            await c.write_event(SynthesizeChunk(text="Still speaking, ").event())
        else:
            await c.write_event(Synthesize(text="endless").event())
        await until(c, "audio-chunk")
        assert srv.engine.in_flight == 1
        await c.disconnect()

    run(scenario)
    srv.wait_until(
        lambda: srv.engine.in_flight == 0 and srv.fake.running == 0 and not srv.state.ws_sessions,
        "the request of the client gone ended, and its connection",
    )


def test_an_idle_connection_gets_an_error_and_is_closed() -> None:
    """A connection holding a streamed text open without sending any is freed after the idle timeout."""
    with serve(wyoming_uri="tcp://127.0.0.1:0", ws_idle_timeout_s=0.3) as s:

        async def scenario() -> Error:
            async with AsyncClient.from_uri(s.wyoming_uri) as c:
                await c.write_event(SynthesizeStart().event())
                await c.write_event(SynthesizeChunk(text="And then nothing ").event())
                await until(c, "audio-chunk")
                events = await until(c, "error")
                assert await read(c) is None
                return Error.from_event(events[-1])

        assert run(scenario).code == "idle_timeout"
        s.wait_until(lambda: s.engine.in_flight == 0 and not s.state.ws_sessions, "its request freed")


def test_a_client_that_stops_reading_is_cut_off_and_its_work_freed() -> None:
    """The audio of a client that reads nothing piles up in the socket buffers, then the server's write waits:
    after the idle timeout the connection is cut (reset: what it did not read is dropped) and its request
    cancelled."""
    fake = FakeRuntime(chunk_len=256 * 1024)
    with serve(fake, wyoming_uri="tcp://127.0.0.1:0", ws_idle_timeout_s=0.5) as s:
        with socket.create_connection(_host_port(s.wyoming_uri)) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            header = {"type": "synthesize", "data": {"text": "endless"}}
            sock.sendall(json.dumps(header).encode() + b"\n")  # and never reads
            s.wait_until(
                lambda: fake.yielded > 0 and s.engine.in_flight == 0 and not s.state.ws_sessions,
                "the unread connection's request ended and the connection is gone",
            )
            # its socket was reset, not left to hold the audio unsent until the client reads it all
            sock.settimeout(WAIT_S)
            with pytest.raises(ConnectionResetError):
                while sock.recv(1 << 16):
                    pass


def test_a_drain_finishes_the_synthesis_in_flight_then_closes() -> None:
    """SIGTERM: the listener closes, an idle connection closes at once, a streamed text in flight is spoken to its
    end (its synthesize-stopped), then its connection closes and the server may stop."""
    with serve(wyoming_uri="tcp://127.0.0.1:0", drain_delay_s=0) as s:
        stopped = threading.Event()

        async def scenario() -> list[Event]:
            async with connect(s) as busy, connect(s) as idle:
                await idle.write_event(Describe().event())
                await until(idle, "info")
                await busy.write_event(SynthesizeStart().event())
                await busy.write_event(SynthesizeChunk(text="Started before the drain, ").event())
                await until(busy, "audio-chunk")
                s.call(
                    s.state.on_signal, signal.SIGTERM, lambda *_: stopped.set()
                )  # uvicorn's stop: the test's
                assert await read(idle) is None, "a connection with nothing in flight closes at once"
                with pytest.raises(OSError):
                    await asyncio.open_connection(*_host_port(s.wyoming_uri))
                await busy.write_event(SynthesizeChunk(text="and finished after it.").event())
                await busy.write_event(SynthesizeStop().event())
                events = await until(busy, "synthesize-stopped")
                assert await read(busy) is None, "the connection stays open after its synthesis in a drain"
                return events

        events = run(scenario)
        assert [e.type for e in events] == ["audio-chunk", "audio-stop", "synthesize-stopped"]
        assert stopped.wait(WAIT_S), "the server must stop once its connections are done"
        assert s.fake.pieces[-1] == ["Started before the drain, ", "and finished after it."]


# --- settings -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "match"),
    [
        (
            {"COSYSERVE_WYOMING_URI": "http://0.0.0.0:10200"},
            "COSYSERVE_WYOMING_URI=.*expected tcp://HOST:PORT",
        ),
        ({"COSYSERVE_WYOMING_URI": "tcp://0.0.0.0"}, "COSYSERVE_WYOMING_URI=.*tcp://HOST:PORT"),
        ({"COSYSERVE_WYOMING_URI": "tcp://0.0.0.0:99999"}, "port from 0 to 65535"),
        ({"COSYSERVE_WYOMING_TENANT": "a b"}, "COSYSERVE_WYOMING_TENANT=.*letters, digits"),
    ],
)
def test_a_bad_wyoming_setting_is_refused_naming_it(env: dict[str, str], match: str) -> None:
    with pytest.raises(SettingsError, match=match):
        Settings.load(env=env)


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"wyoming_uri": "tcp://127.0.0.1:0", "api_keys": {"k": "a"}}, "--wyoming-tenant"),
        ({"wyoming_uri": "unix:///tmp/x.sock", "wyoming_zeroconf": "cosy"}, "zeroconf announces a TCP port"),
        ({"wyoming_tenant": "a"}, "needs a Wyoming server"),
    ],
    ids=["keys-without-tenant", "zeroconf-unix", "tenant-without-uri"],
)
def test_wyoming_settings_that_do_not_go_together_stop_the_start(values: dict[str, Any], match: str) -> None:
    """Wyoming has no API keys: a server that has some must say which tenant its Wyoming callers act as."""
    from cosyserve.server.run import bind_wyoming

    with pytest.raises(SettingsError, match=match):
        bind_wyoming(Settings.load(env={}).replace(**values))


def test_an_app_built_without_a_listener_says_it_serves_no_wyoming(caplog: pytest.LogCaptureFixture) -> None:
    """A Ray Serve replica builds the app from the environment and binds no Wyoming listener: the variable set there
    would do nothing, so the app says so (the listener is ``cosyserve serve``'s)."""
    from cosyserve.engine.pool import ModelPool, ModelSpec
    from cosyserve.server.app import create_app

    pool = ModelPool(
        [ModelSpec("m", policy="preload")], load_model=lambda *_: FakeRuntime(), memory_probe=None
    )
    with caplog.at_level("WARNING", logger="cosyserve.server"):
        create_app(Settings.load(env={"COSYSERVE_WYOMING_URI": "tcp://127.0.0.1:10200"}), pool=pool)
    assert "COSYSERVE_WYOMING_URI is set, but this host of the app serves HTTP only" in caplog.text


def test_a_unix_uri_never_replaces_a_file_that_is_not_a_socket(tmp_path: Path) -> None:
    from cosyserve.server.run import bind_wyoming

    victim = tmp_path / "notes.txt"
    victim.write_text("keep me")
    with pytest.raises(SettingsError, match="not a socket"):
        bind_wyoming(Settings.load(env={}).replace(wyoming_uri=f"unix://{victim}"))
    assert victim.read_text() == "keep me"


def test_a_taken_wyoming_address_fails_the_start_with_exit_code_3(tmp_path: Path) -> None:
    """Bound before anything loads: the start fails at once, naming the flag (no model is even read)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = start_server(
            tmp_path / "never-loaded",
            tmp_path,
            args=["--wyoming-uri", f"tcp://127.0.0.1:{port}"],
            wait_ready=False,
        )
        assert server.proc.wait(WAIT_S) == 3, server.log()
    assert f"--wyoming-uri tcp://127.0.0.1:{port} cannot be bound" in server.log()


def test_zeroconf_announces_the_wyoming_port_for_home_assistant() -> None:
    """Home Assistant discovers Wyoming servers by their ``_wyoming._tcp.local.`` service: announced on the
    listener's interface (loopback here) with its address and port, withdrawn at the end."""
    pytest.importorskip("zeroconf")
    from zeroconf.asyncio import AsyncZeroconf

    with serve(wyoming_uri="tcp://127.0.0.1:0", wyoming_zeroconf="cosy-test") as s:
        port = _host_port(s.wyoming_uri)[1]

        async def lookup() -> Any:
            zc = AsyncZeroconf(interfaces=["127.0.0.1"])
            try:
                return await zc.async_get_service_info(
                    "_wyoming._tcp.local.", "cosy-test._wyoming._tcp.local.", timeout=int(WAIT_S * 1000)
                )
            finally:
                await zc.async_close()

        info = run(lookup)
    assert info is not None, "not announced"
    assert (info.port, info.parsed_addresses()) == (port, ["127.0.0.1"])


# --- the serve process, real models ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def families(
    tiny_model_dir: Path, cv2_model_dir: Path, cv3_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, str]]:
    """One ``cosyserve serve --workers 2`` of the three families' tiny models, Wyoming from the variable on a unix
    socket (the flag's way in is the taken-address test's): the master binds it, both workers accept on it."""
    work = tmp_path_factory.mktemp("wyoming")
    uri = f"unix://{work / 'wyoming.sock'}"
    args = ["--model", f"cv2={cv2_model_dir}", "--model", f"cv3={cv3_model_dir}", "--workers", "2"]
    env = {"COSYSERVE_WYOMING_URI": uri}
    with running_server(f"v1={tiny_model_dir}", work, env=env, args=args, ready_timeout_s=180) as s:
        yield s, uri


MODELS = {"v1": 22050, "cv2": 24000, "cv3": 24000}


def _voices(uri: str) -> list[Any]:
    async def scenario() -> list[Any]:
        async with AsyncClient.from_uri(uri) as c:
            await c.write_event(Describe().event())
            ev = await read(c)
            assert ev is not None and Info.is_type(ev.type), ev
            return list(Info.from_event(ev).tts[0].voices)

    return run(scenario)


def _voice_of(uri: str, model: str) -> str:
    # the default model's (the first --model) voices are listed by name, another model's as MODEL/VOICE
    names = [v.name for v in _voices(uri)]
    return names[0] if model == "v1" else next(n for n in names if n.startswith(f"{model}/"))


def test_describe_lists_every_familys_voices_with_its_languages(families: tuple[ServerProcess, str]) -> None:
    _, uri = families
    voices = _voices(uri)
    langs = {v.name.partition("/")[0] if "/" in v.name else "v1": v.languages for v in voices}
    assert set(langs) == set(MODELS), [v.name for v in voices]
    assert "yue" in langs["v1"] and "de" not in langs["cv2"] and {"de", "fr", "ru"} <= set(langs["cv3"]), (
        langs
    )


@pytest.mark.parametrize("model", list(MODELS))
def test_each_family_speaks_a_synthesize_at_its_rate(families: tuple[ServerProcess, str], model: str) -> None:
    _, uri = families
    voice = _voice_of(uri, model)

    async def scenario() -> list[Event]:
        async with AsyncClient.from_uri(uri) as c:
            await c.write_event(Synthesize(text="Hello there.", voice=SynthesizeVoice(name=voice)).event())
            return await until(c, "audio-stop")

    events = run(scenario)
    assert events[0].type == "audio-start" and events[-1].type == "audio-stop", [e.type for e in events]
    assert AudioStart.from_event(events[0]).rate == MODELS[model]
    assert len(pcm(events)) > 0 and len(pcm(events)) % 2 == 0


@pytest.mark.parametrize("model", list(MODELS))
def test_each_family_speaks_streamed_text_before_synthesize_stop(
    families: tuple[ServerProcess, str], model: str
) -> None:
    """CosyVoice2/3 feed the LM text as it arrives, CosyVoice-300M speaks each sentence once its end arrives: the
    rest of the text is held back until the first audio-chunk comes, so a server that waited for synthesize-stop
    would never send it (and the test's bound ends it instead of a hang). The stream's end (synthesize-stopped) is
    the fake's case above: random weights speak each sentence to its cap, seconds this check does not need."""
    _, uri = families
    voice = _voice_of(uri, model)

    async def scenario() -> list[Event]:
        async with AsyncClient.from_uri(uri) as c:
            await c.write_event(SynthesizeStart(voice=SynthesizeVoice(name=voice)).event())
            await c.write_event(SynthesizeChunk(text="Hello there, this is the first sentence. ").event())
            await c.write_event(SynthesizeChunk(text="And a second one follows. ").event())
            return await until(c, "audio-chunk")  # then the client goes: its request is cancelled

    events = run(scenario)
    assert [e.type for e in events] == ["audio-start", "audio-chunk"], events
    assert AudioStart.from_event(events[0]).rate == MODELS[model] and AudioChunk.from_event(events[1]).audio


def test_the_socket_file_goes_with_the_server(families: tuple[ServerProcess, str]) -> None:
    """The last of the module's tests on ``families``: a SIGTERM drains both workers and the master removes the
    socket file it bound."""
    server, uri = families
    path = Path(uri.removeprefix("unix://"))
    assert path.is_socket()
    assert server.stop() == 0, server.log()[-3000:]
    assert not path.exists(), "the socket file outlived the server"
