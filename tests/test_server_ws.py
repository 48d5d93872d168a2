"""The WebSocket route ``/v1/audio/speech/stream``, its text feed, and its auth, over real sockets.

The protocol tests run the app under a real uvicorn on 127.0.0.1 in a thread of this process (so a test can look
at the engine and the fake runtime behind it), with :class:`FakeRuntime` as the model: it reads a request's text
pieces as they come and answers one chunk per piece, which makes every frame predictable. A real
``cosyserve serve`` with the tiny model checks auth at the handshake and, once the runtime reads text as it
arrives, a whole utterance. The client is the ``websockets`` library's.
"""

from __future__ import annotations

import base64
import gc
import json
import os
import signal
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cosyserve.core.errors import ClientError
from cosyserve.core.request import SynthesisRequest
from cosyserve.core.textfeed import TextFeed
from cosyserve.engine.quotas import Tenant, TenantQuota
from cosyserve.server.run import uvicorn_options
from cosyserve.server.transports.ws import Session
from fake_runtime import FakeRuntime
from server_util import WAIT_S, Served, ServerProcess, running_server, serve

ws_client = pytest.importorskip("websockets.sync.client")
from websockets.exceptions import ConnectionClosed, InvalidStatus  # noqa: E402

CHUNK = 50  # samples per fake chunk
PATH = "/v1/audio/speech/stream"


# --- the text feed --------------------------------------------------------------------------------------------


def test_feed_hands_pieces_to_another_thread_as_they_come_and_ends_on_finish() -> None:
    feed = TextFeed()
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.extend(feed))
    reader.start()
    feed.put("Hello, ")
    deadline = time.monotonic() + WAIT_S
    while got != ["Hello, "]:  # read before the utterance ends: the reader does not wait for the whole text
        assert time.monotonic() < deadline, f"the reader did not get the first piece: {got}"
        time.sleep(0.005)
    feed.put("")  # nothing: no piece
    feed.put("world.")
    feed.finish()
    reader.join(WAIT_S)
    assert not reader.is_alive() and got == ["Hello, ", "world."], got
    assert feed.chars == 13 and feed.pending_chars == 0
    with pytest.raises(RuntimeError, match="closed"):
        feed.put("more")
    with pytest.raises(TypeError, match="str"):
        TextFeed().put(b"bytes")  # type: ignore[arg-type]


def test_feed_abort_ends_a_blocked_reader_and_drops_what_was_not_read() -> None:
    """A cancelled request must not leave its worker blocked on text that will never come."""
    taken: list[int] = []
    feed = TextFeed(on_take=lambda: taken.append(1))
    feed.put("first")
    assert next(feed) == "first" and taken == [1]
    ended = threading.Event()

    def read() -> None:
        for _ in feed:
            pass
        ended.set()

    threading.Thread(target=read, daemon=True).start()
    feed.put("never read? maybe")  # it may be read or dropped: the abort below must end the reader either way
    time.sleep(0.01)
    feed.abort()
    assert ended.wait(WAIT_S), "abort() did not end the reader"
    assert feed.aborted and feed.pending_chars == 0
    feed.abort()  # idempotent


def test_feed_ends_at_its_deadline_without_the_producer() -> None:
    now = [100.0]
    feed = TextFeed(deadline=5.0, clock=lambda: now[0])  # already past
    with pytest.raises(StopIteration):
        next(feed)
    assert feed.aborted
    feed = TextFeed(deadline=time.monotonic() + 0.05)
    t0 = time.monotonic()
    assert list(feed) == []
    assert time.monotonic() - t0 < WAIT_S


def test_a_request_takes_text_as_pieces_and_still_checks_a_string() -> None:
    feed = TextFeed()
    req = SynthesisRequest(text=feed, stream=True)
    assert req.text is feed and "text" in req.present()
    assert SynthesisRequest(text=iter(["a", "b"])).present() == {"text"}
    for bad in (b"bytes", 42):
        with pytest.raises(ClientError, match="text must be a string or an iterable") as e:
            SynthesisRequest(text=bad)  # type: ignore[arg-type]
        assert e.value.param == "text"
    with pytest.raises(ClientError, match="text is empty"):
        SynthesisRequest(text="   ")
    with pytest.raises(ClientError, match="vc"):
        SynthesisRequest(text=feed, mode="vc", prompt_wav=b"x", source_wav=b"y")


# --- a real uvicorn in this process (server_util.serve), over the fake runtime - -------------------------------


@pytest.fixture(scope="module")
def srv() -> Iterator[Served]:
    with serve(FakeRuntime(chunk_len=CHUNK)) as s:
        yield s


def recv_json(ws: Any) -> dict[str, Any]:
    msg = ws.recv(timeout=WAIT_S)
    assert isinstance(msg, str), f"expected a JSON event, got a binary frame of {len(msg)} bytes"
    data = json.loads(msg)
    assert isinstance(data, dict) and isinstance(data.get("type"), str), data
    return dict(data)


def send(ws: Any, type: str, **fields: Any) -> None:
    ws.send(json.dumps({"type": type, **fields}))


def utterance(ws: Any) -> tuple[dict[str, Any], list[bytes], dict[str, Any], dict[str, Any]]:
    """audio.start, the binary frames, audio.done and session.done of one utterance."""
    start = recv_json(ws)
    assert start["type"] == "audio.start", start
    frames: list[bytes] = []
    while True:
        msg = ws.recv(timeout=WAIT_S)
        if isinstance(msg, bytes):
            frames.append(msg)
            continue
        done = json.loads(msg)
        break
    assert done["type"] == "audio.done", done
    session_done = recv_json(ws)
    assert session_done["type"] == "session.done", session_done
    return start, frames, done, session_done


def error_event(ws: Any, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    ev = recv_json(ws)
    assert ev["type"] == "error", ev
    assert isinstance(ev["message"], str) and ev["message"] and isinstance(ev["status"], int), ev
    if code is not None:
        assert ev["code"] == code, ev
    assert ev["param"] == param, f"param should name {param!r}: {ev}"
    return ev


def close_code(ws: Any) -> int:
    with pytest.raises(ConnectionClosed) as e:
        while True:
            ws.recv(timeout=WAIT_S)
    rcvd = e.value.rcvd
    assert rcvd is not None, "the server must close with a code"
    return int(rcvd.code)


# --- the protocol --------------------------------------------------------------------------------------------


def test_text_pieces_become_audio_as_they_arrive_and_the_session_serves_the_next_utterance(
    srv: Served,
) -> None:
    with srv.connect() as ws:
        send(ws, "session.config", voice="alice", seed=0, response_format="pcm")
        send(ws, "input.text", text="Hello ")
        start = recv_json(ws)  # before input.done: the model reads the text as it comes
        assert start["type"] == "audio.start" and start["utterance_index"] == 0, start
        assert (start["format"], start["sample_rate"], start["channels"], start["sample_format"]) == (
            "pcm",
            FakeRuntime.sample_rate,
            1,
            "s16le",
        )
        assert start["voice"] == "alice" and start["model"] == "m", start
        first = ws.recv(timeout=WAIT_S)
        assert isinstance(first, bytes), "the first piece's audio must come before the utterance ends"
        send(ws, "input.text", text="world, ")
        send(ws, "input.text", text="how are you?")
        send(ws, "input.done")
        frames = [first]
        while isinstance(msg := ws.recv(timeout=WAIT_S), bytes):
            frames.append(msg)
        done = json.loads(msg)
        assert done["type"] == "audio.done" and done["utterance_index"] == 0, done
        assert len(frames) == 3 and all(len(f) == 2 * CHUNK for f in frames), [len(f) for f in frames]
        pcm = [
            np.frombuffer(f, "<i2") for f in frames
        ]  # the fake's chunk i is all seed + i (0, then clipped 1s)
        assert not pcm[0].any() and (pcm[1] == 32767).all(), "the frames are the chunks, in order"
        assert done["total_bytes"] == sum(map(len, frames))
        u = done["usage"]
        assert u["audio_samples"] == 3 * CHUNK and u["input_characters"] == len(
            "Hello world, how are you?"
        ), u
        assert (
            u["audio_seconds"] == pytest.approx(3 * CHUNK / FakeRuntime.sample_rate, abs=1e-3)
            and u["sample_rate"] == FakeRuntime.sample_rate
        )
        assert done["sentence_index"] == 0 and done["error"] is False, "vLLM-Omni's audio.done fields"
        assert recv_json(ws) == {
            "type": "session.done",
            "utterance_index": 0,
            "total_sentences": 1,
            "error": False,
        }
        assert srv.fake.pieces[-1] == ["Hello ", "world, ", "how are you?"], (
            "the runtime read every piece, in order"
        )

        send(ws, "input.text", text="Again.")
        send(ws, "input.done")
        start, frames, done, sdone = utterance(ws)
        assert start["utterance_index"] == done["utterance_index"] == sdone["utterance_index"] == 1
        assert len(frames) == 1 and srv.fake.pieces[-1] == ["Again."]
        send(ws, "session.close")
        assert close_code(ws) == 1000
    srv.wait_until(lambda: srv.engine.in_flight == 0, "every request ended")


def test_sample_rate_resamples_and_stream_audio_false_sends_the_utterance_in_one_frame(srv: Served) -> None:
    """If this fails, a WebSocket client that asks for another rate is refused (it was: "the server does not
    resample") or gets the model's, or ``stream_audio: false`` (vLLM-Omni's default) is refused or still framed
    chunk by chunk."""
    with srv.connect() as ws:
        send(ws, "session.config", sample_rate=16000, response_format="pcm")
        for piece in ("Hello ", "world, ", "how are you?"):
            send(ws, "input.text", text=piece)
        send(ws, "input.done")
        start, frames, done, _ = utterance(ws)
        assert start["sample_rate"] == done["usage"]["sample_rate"] == 16000, start
        n = sum(map(len, frames)) // 2
        assert n == done["usage"]["audio_samples"] and abs(n - 3 * CHUNK * 16000 / 24000) <= 1, n
        send(ws, "session.config", stream_audio=False, response_format="wav")  # between utterances: taken
        for piece in ("Hello ", "world, ", "how are you?"):
            send(ws, "input.text", text=piece)
        send(ws, "input.done")
        start, frames, done, _ = utterance(ws)
        assert len(frames) == 1 and frames[0][:4] == b"RIFF", [len(f) for f in frames]
        assert len(frames[0]) == done["total_bytes"] == 44 + 2 * 3 * CHUNK and start["sample_rate"] == 24000


def test_wav_sends_a_header_frame_first(srv: Served) -> None:
    with srv.connect() as ws:
        send(ws, "session.config", response_format="wav")
        send(ws, "input.text", text="One piece.")
        send(ws, "input.done")
        start, frames, done, _ = utterance(ws)
        assert start["format"] == "wav"
        assert frames[0][:4] == b"RIFF" and frames[0][8:12] == b"WAVE" and len(frames[0]) == 44, frames[0]
        assert [len(f) for f in frames[1:]] == [2 * CHUNK]
        assert done["total_bytes"] == 44 + 2 * CHUNK


def test_openai_voice_names_mean_the_default_voice_and_an_empty_flush_asks_nothing(srv: Served) -> None:
    before = len(srv.fake.pieces)
    with srv.connect() as ws:
        send(ws, "session.config", voice="alloy")
        send(ws, "input.done")  # nothing to speak: no request
        assert recv_json(ws) == {
            "type": "session.done",
            "utterance_index": 0,
            "total_sentences": 0,
            "error": False,
        }
        send(ws, "input.text", text="")  # nothing either
        send(ws, "input.text", text="Hi.")
        send(ws, "input.done")
        start, _, _, _ = utterance(ws)
        assert start["voice"] == "alice" and start["utterance_index"] == 1, "alloy is the first speaker"
    assert len(srv.fake.pieces) == before + 1, "an empty utterance must not reach the engine"


@pytest.mark.parametrize(
    ("frame", "code", "param"),
    [
        ("{oops", "invalid_json", None),
        ("[1, 2]", "invalid_json", None),
        (json.dumps({"text": "no type"}), "invalid_event", "type"),
        (json.dumps({"type": "response.create"}), "invalid_event", "type"),
        (json.dumps({"type": "input.text", "text": 42}), "invalid_value", "text"),
        (json.dumps({"type": "input.text", "text": "x", "voice": "bob"}), "invalid_value", "voice"),
        (json.dumps({"type": "input.done", "text": "x"}), "invalid_value", "text"),
        (json.dumps({"type": "session.config", "temperature": 0.7}), "invalid_value", "temperature"),
        (json.dumps({"type": "session.config", "voice": "nobody"}), "voice_not_found", "voice"),
        (json.dumps({"type": "session.config", "model": "nope"}), "model_not_found", "model"),
        (json.dumps({"type": "session.config", "speed": 1.5}), "invalid_value", "speed"),
        (json.dumps({"type": "session.config", "sample_rate": 10**7}), "invalid_value", "sample_rate"),
        (
            json.dumps({"type": "session.config", "response_format": "mp3"}),
            "invalid_value",
            "response_format",
        ),
        (
            json.dumps({"type": "session.config", "ref_audio": "https://example.com/a.wav"}),
            "invalid_value",
            "ref_audio",
        ),
        (json.dumps({"type": "session.config", "ref_text": "orphan"}), "invalid_value", "ref_text"),
        (
            json.dumps({"type": "session.config", "instructions": "Whisper."}),
            "mode_unavailable",
            "instructions",
        ),
        (b"\x00\x01binary", "invalid_frame", None),
    ],
    ids=[
        "not-json",
        "not-object",
        "no-type",
        "unknown-type",
        "text-not-string",
        "unknown-text-field",
        "done-with-field",
        "unknown-config-field",
        "unknown-voice",
        "unknown-model",
        "speed",
        "sample-rate",
        "format",
        "url-ref-audio",
        "ref-text-alone",
        "unavailable-mode",
        "binary",
    ],
)
def test_a_bad_message_gets_an_error_and_changes_nothing(
    srv: Served, frame: Any, code: str, param: Any
) -> None:
    with srv.connect() as ws:
        ws.send(frame)
        ev = error_event(ws, code, param)
        assert ev["fatal"] is False and 400 <= ev["status"] < 500, ev
        if param == "ref_audio":
            assert "never fetches" in ev["message"], ev
        # the session goes on as if the bad message had not come
        send(ws, "session.config", voice="bob")
        send(ws, "input.text", text="Still here.")
        send(ws, "input.done")
        start, frames, _, _ = utterance(ws)
        assert start["voice"] == "bob" and len(frames) == 1


def test_session_rules_config_between_utterances_text_needs_config_nothing_after_close(srv: Served) -> None:
    """As vLLM-Omni's: session.config again between utterances changes the next ones; while an utterance has text
    open it is refused (its text was sent under the config before)."""
    with srv.connect() as ws:
        send(ws, "input.text", text="too early")
        error_event(ws, "session_not_configured", "type")
        send(ws, "session.config")
        send(ws, "session.config", voice="bob")  # between utterances: taken
        send(ws, "input.text", text="   ")  # opens an utterance (blanks: nothing spoken yet)
        send(ws, "session.config", voice="alice")
        error_event(ws, "utterance_open", "type")
        send(ws, "input.text", text="Last words ")
        send(ws, "session.close")  # completes the open utterance, then closes
        send(ws, "input.text", text="after close")
        events = []
        while True:
            try:
                msg = ws.recv(timeout=WAIT_S)
            except ConnectionClosed as e:
                assert e.rcvd is not None and e.rcvd.code == 1000, e
                break
            if isinstance(msg, str):
                events.append(json.loads(msg))
        kinds = [e["type"] for e in events]
        assert "audio.done" in kinds and kinds[-1] == "session.done", kinds
        (err,) = [e for e in events if e["type"] == "error"]
        assert err["code"] == "session_closed", err
        (start,) = [e for e in events if e["type"] == "audio.start"]
        assert start["voice"] == "bob", "the second config's voice"
    assert srv.fake.pieces[-1] == ["   ", "Last words "], "text after session.close must not be spoken"


def test_an_oversized_frame_closes_the_connection() -> None:
    # small limits, so that the frame is sent whole before the server answers (a large one meets a reset)
    with serve(max_upload_bytes=1024, max_body_bytes=1024) as s:
        limit = uvicorn_options(s.state.config)["ws_max_size"]
        assert limit < 8192, limit
        with s.connect() as ws:
            send(ws, "session.config")
            ws.send(json.dumps({"type": "input.text", "text": "x" * limit}))
            assert close_code(ws) == 1009
        assert s.fake.pieces == [], "the frame was not read"


def test_an_utterance_that_fails_says_so_and_the_session_goes_on(srv: Served) -> None:
    with srv.connect() as ws:
        send(ws, "session.config")
        send(
            ws, "input.text", text="boom"
        )  # the fake fails inside the model on this piece (a bug of the model)
        ev = error_event(ws, "internal_error", None)
        assert ev["utterance_index"] == 0 and ev["status"] == 500 and ev["fatal"] is False, ev
        assert "kaboom" not in ev["message"], "a failure's own text may name server paths: never sent"
        send(ws, "input.text", text="dropped, the utterance failed")
        send(ws, "input.done")
        assert recv_json(ws) == {
            "type": "session.done",
            "utterance_index": 0,
            "total_sentences": 0,
            "error": True,
        }
        send(ws, "input.text", text="   ")  # nothing to speak: refused as the runtimes refuse it
        send(ws, "input.done")
        error_event(ws, "invalid_value", "text")
        assert recv_json(ws) == {
            "type": "session.done",
            "utterance_index": 1,
            "total_sentences": 0,
            "error": True,
        }
        send(ws, "input.text", text="Fine now.")
        send(ws, "input.done")
        start, _, _, _ = utterance(ws)
        assert start["utterance_index"] == 2


def test_a_disconnect_mid_utterance_cancels_its_request_and_ends_its_feed(srv: Served) -> None:
    fake, engine = srv.fake, srv.engine
    with srv.connect() as ws:
        send(ws, "session.config")
        send(ws, "input.text", text="Half a sentence ")
        assert recv_json(ws)["type"] == "audio.start"
        assert isinstance(ws.recv(timeout=WAIT_S), bytes)
        assert engine.in_flight == 1 and fake.running == 1, "the utterance holds its slot while text may come"
    # the socket is gone without input.done: the worker waiting for text must be let go at once
    srv.wait_until(
        lambda: engine.in_flight == 0 and fake.running == 0, "the request ended after the disconnect"
    )
    assert engine.stats.outcomes.get("cancelled", 0) >= 1, engine.stats.outcomes


def test_a_client_that_stays_silent_is_closed_and_frees_its_slot() -> None:
    with serve(ws_idle_timeout_s=0.5) as s:
        with s.connect() as ws:
            send(ws, "session.config")
            send(ws, "input.text", text="I will say no more")
            assert recv_json(ws)["type"] == "audio.start"
            assert isinstance(ws.recv(timeout=WAIT_S), bytes)
            ev = error_event(ws, "idle_timeout", None)
            assert ev["fatal"] is True and ev["utterance_index"] == 0, ev
            assert close_code(ws) == 1008
        s.wait_until(
            lambda: s.engine.in_flight == 0 and s.fake.running == 0, "the idle session's request ended"
        )
        with s.connect() as ws:  # between utterances too: a connection is not kept for nothing
            send(ws, "session.config")
            error_event(ws, "idle_timeout", None)
            assert close_code(ws) == 1008


def test_a_client_that_stops_reading_is_cut_off_and_its_work_freed() -> None:
    """The audio of a client that reads nothing piles up in the kernel's socket buffers, then the server's send
    waits: after the idle timeout the session is cut (1008) and its request cancelled, its memory bounded."""
    # 512 KiB of PCM per piece, made in 10 ms: the socket buffers fill in a few tenths of a second
    fake = FakeRuntime(chunk_len=256 * 1024, delay=0.01)
    with serve(fake, ws_idle_timeout_s=0.5) as s:
        with s.connect(max_queue=1, close_timeout=1) as ws:  # its reader stops at one frame: TCP pushes back
            send(ws, "session.config")
            for i in range(200):
                send(ws, "input.text", text=f"piece {i} ")
            s.wait_until(
                lambda: s.engine.in_flight == 0 and fake.running == 0 and not s.state.ws_sessions,
                "the unread session's request ended and the session is gone",
            )
            assert fake.yielded < 200, "the request must stop before its text is done, not run for nobody"


def test_a_tenant_quota_counts_utterances_like_any_request() -> None:
    acme = Tenant("acme", frozenset({"m"}), TenantQuota(max_concurrent=1))
    with serve(tenants=(acme,), api_keys={"key-acme-0001": "acme"}) as s:
        auth = {"Authorization": "Bearer key-acme-0001"}
        with s.connect(additional_headers=auth) as a, s.connect(additional_headers=auth) as b:
            send(a, "session.config")
            send(a, "input.text", text="Holding the slot ")
            assert recv_json(a)["type"] == "audio.start"
            send(b, "session.config")
            send(b, "input.text", text="Me too.")
            ev = error_event(b, "quota_exceeded", None)
            assert ev["status"] == 429 and 1 <= ev["retry_after"] <= 60 and ev["utterance_index"] == 0, ev
            send(b, "input.done")
            assert recv_json(b) == {
                "type": "session.done",
                "utterance_index": 0,
                "total_sentences": 0,
                "error": True,
            }
            send(a, "input.done")
            kinds = []
            while not kinds or kinds[-1] != "session.done":
                msg = a.recv(timeout=WAIT_S)
                if isinstance(msg, str):
                    kinds.append(json.loads(msg)["type"])
            assert kinds == ["audio.done", "session.done"], kinds
            send(b, "input.text", text="My turn now.")  # the slot is free again
            send(b, "input.done")
            assert utterance(b)[0]["utterance_index"] == 1


def test_a_drain_lets_the_utterance_in_flight_finish_then_closes_with_1001() -> None:
    with serve() as s:
        with s.connect() as busy, s.connect() as idle:
            send(busy, "session.config")
            send(busy, "input.text", text="Started before the drain, ")
            assert recv_json(busy)["type"] == "audio.start"
            send(idle, "session.config")
            stopped = threading.Event()
            s.call(s.state.on_signal, signal.SIGTERM, lambda *_: stopped.set())  # uvicorn's stop: the test's
            assert close_code(idle) == 1001, "a session with nothing in flight closes at once"
            with pytest.raises(InvalidStatus) as refused:
                s.connect()
            assert refused.value.response.status_code == 503, "no new session while draining"
            assert refused.value.response.headers.get("Retry-After") == "1"
            send(busy, "input.text", text="and finished after it.")
            send(busy, "input.done")
            kinds = []
            with pytest.raises(ConnectionClosed) as e:
                while True:
                    msg = busy.recv(timeout=WAIT_S)
                    if isinstance(msg, str):
                        kinds.append(json.loads(msg)["type"])
            assert kinds[-2:] == ["audio.done", "session.done"], kinds
            assert e.value.rcvd is not None and e.value.rcvd.code == 1001
            assert stopped.wait(WAIT_S), "the server must stop once its sessions are done"
            assert s.fake.pieces[-1] == ["Started before the drain, ", "and finished after it."]


# what the memory count leaves out: the fake runtime's record of every request's pieces (a test double's log) and
# the engine's stats windows (bounded at 1024 requests, still filling)
_NOT_LEFT_BEHIND = [
    tracemalloc.Filter(False, "*/fake_runtime.py"),
    tracemalloc.Filter(False, "*/engine/stats.py"),
]
# bytes the Python heap may grow by over 100 sessions (one session left behind holds ~30 KiB)
HEAP_SLACK = 32 * 1024


def _counts(srv: Served) -> dict[str, int]:
    # what a session could leave behind: threads, tasks, file descriptors, Session objects and Python heap bytes
    # (traced since the count began, less _NOT_LEFT_BEHIND)
    gc.collect()
    heap = tracemalloc.take_snapshot().filter_traces(_NOT_LEFT_BEHIND)
    return {
        "threads": threading.active_count(),
        "tasks": srv.tasks(),
        "fds": len(os.listdir("/proc/self/fd")),
        "sessions": sum(type(o) is Session for o in gc.get_objects()),
        "heap": sum(t.size for t in heap.traces),
    }


def _rss_kib() -> int:
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))


def _idle(srv: Served) -> bool:
    return srv.state.ws_sessions == set() and srv.engine.in_flight == 0


def _heap_grown_by(srv: Served, session: Callable[[int], None], n: int) -> int:
    """``session(i)`` for i < n; fails if a thread, task, file descriptor or Session stays behind, else returns
    the bytes the Python heap grew by."""
    before = _counts(srv)
    for i in range(n):
        session(i)
    after: dict[str, int] = {}

    def settled() -> bool:
        after.update(_counts(srv))
        return _idle(srv) and all(after[k] <= before[k] for k in ("threads", "tasks", "fds", "sessions"))

    srv.wait_until(settled, f"no thread, task, fd or Session left behind: before {before}, after {after}")
    return after["heap"] - before["heap"]


def assert_nothing_left_behind(srv: Served, session: Callable[[int], None], n: int = 100) -> None:
    """``session(i)`` for i < n, twice: the first loop warms up (lazy imports, pools, freelists, caches), the
    second must leave no thread, task, file descriptor, Session or Python heap behind. When the heap grew, a
    third loop is counted instead: growth that happens once (a dict resized for a moment when more streams were
    alive at once, as on a busy machine) does not come back, a leak does."""
    tracemalloc.start()
    try:
        for i in range(n):
            session(i)
        srv.wait_until(lambda: _idle(srv), "the warm-up's sessions closed")
        rss = _rss_kib()
        grown = _heap_grown_by(srv, session, n)
        if grown >= HEAP_SLACK:
            grown = _heap_grown_by(srv, session, n)
        # RSS is shown, not asserted: this process also runs the clients and pytest; the heap is counted exactly
        top = tracemalloc.take_snapshot().filter_traces(_NOT_LEFT_BEHIND).statistics("lineno")[:8]
        assert grown < HEAP_SLACK, (
            f"{n} sessions left {grown} bytes of Python heap behind (RSS {_rss_kib() - rss:+d} KiB); the largest "
            "allocations:\n" + "\n".join(map(str, top))
        )
    finally:
        tracemalloc.stop()


def test_many_sessions_leave_no_thread_task_file_descriptor_or_memory_behind(srv: Served) -> None:
    def session(i: int) -> None:
        with srv.connect() as ws:
            send(ws, "session.config")
            if i % 2:  # a whole utterance (the client then leaves without session.close)
                send(ws, "input.text", text="hi")
                send(ws, "input.done")
                utterance(ws)

    assert_nothing_left_behind(srv, session)


def test_sessions_left_mid_utterance_leave_no_memory_behind() -> None:
    """A client that leaves while its utterance is open cancels its request: the stream's cancel-on-drop finaliser
    (engine/streams.py) must not keep the job, and through its text feed the whole session, alive."""
    with serve(FakeRuntime(chunk_len=CHUNK)) as s:

        def session(i: int) -> None:
            with s.connect() as ws:  # its end closes the connection: a disconnect, the utterance still open
                send(ws, "session.config")
                send(ws, "input.text", text="hi ")
                assert recv_json(ws)["type"] == "audio.start"
                assert isinstance(ws.recv(timeout=WAIT_S), bytes)

        assert_nothing_left_behind(s, session)


# --- auth at the handshake -------------------------------------------------------------------------------------


def _key_protocol(key: str) -> str:
    return "bearer." + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


def test_a_key_is_checked_at_the_handshake_before_any_work() -> None:
    with serve(api_keys={"key-a-0001": "a"}) as s:
        for kwargs in (
            {},
            {"additional_headers": {"Authorization": "Bearer wrong-key"}},
            {"subprotocols": ["cosyserve", _key_protocol("wrong-key")]},
        ):
            with pytest.raises(InvalidStatus) as e:
                s.connect(**kwargs)
            resp = e.value.response
            assert resp.status_code == 401, resp
            assert json.loads(resp.body)["error"]["code"] == "invalid_api_key", resp.body
        assert s.fake.pieces == [] and s.engine.stats.requests == 0, "a refused handshake must start no work"
        with s.connect(additional_headers={"Authorization": "Bearer key-a-0001"}) as ws:
            send(ws, "session.config")
            send(ws, "input.text", text="By header.")
            send(ws, "input.done")
            utterance(ws)
        # a browser: the key as a subprotocol, which the server never echoes
        with s.connect(subprotocols=["cosyserve", _key_protocol("key-a-0001")]) as ws:
            assert ws.subprotocol == "cosyserve"
            send(ws, "session.config")
            send(ws, "input.text", text="By subprotocol.")
            send(ws, "input.done")
            utterance(ws)


def test_a_page_of_another_site_may_open_a_session_only_when_cors_allows_it(srv: Served) -> None:
    """Browsers apply no CORS to WebSockets: any site could drive a server without keys from its visitors'
    browsers, unless the handshake's Origin is checked."""
    with pytest.raises(InvalidStatus) as e:
        srv.connect(origin="http://evil.example")
    assert e.value.response.status_code == 403
    assert json.loads(e.value.response.body)["error"]["code"] == "origin_not_allowed"
    with srv.connect(origin=f"http://127.0.0.1:{srv.port}") as ws:  # the server's own page
        send(ws, "session.config")
        send(ws, "session.close")
        assert close_code(ws) == 1000
    with serve(cors_origins="http://app.example") as s:
        with s.connect(origin="http://app.example") as ws:
            send(ws, "session.close")
            assert close_code(ws) == 1000
        with pytest.raises(InvalidStatus):
            s.connect(origin="http://evil.example")


@pytest.fixture(scope="module")
def keyed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    env = {"COSYSERVE_API_KEYS": "key-real-0001=acme"}
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("ws-keyed"), env=env) as s:
        yield s


def test_a_real_server_refuses_a_missing_or_wrong_key_at_the_handshake(keyed: ServerProcess) -> None:
    url = f"ws://127.0.0.1:{keyed.port}{PATH}"
    for headers in ({}, {"Authorization": "Bearer nope"}):
        with pytest.raises(InvalidStatus) as e:
            ws_client.connect(url, proxy=None, additional_headers=headers, open_timeout=WAIT_S)
        assert e.value.response.status_code == 401
        assert e.value.response.headers.get("WWW-Authenticate") == "Bearer"
    assert f'"route": "{PATH}"' not in keyed.log(), "a refused handshake must not reach the route"


def test_a_real_model_speaks_text_streamed_in_word_by_word(keyed: ServerProcess) -> None:
    url = f"ws://127.0.0.1:{keyed.port}{PATH}"
    with ws_client.connect(
        url, proxy=None, additional_headers={"Authorization": "Bearer key-real-0001"}, open_timeout=WAIT_S
    ) as ws:
        send(ws, "session.config", voice="英文女", seed=3)
        for word in "Hello there, this is a streamed test.".split():
            send(ws, "input.text", text=word + " ")
        send(ws, "input.done")
        start, frames, done, _ = utterance(ws)
        assert start["sample_rate"] == 22050
        assert sum(map(len, frames)) == 2 * done["usage"]["audio_samples"] > 0
