"""The hostile pass of issue 33, each case mended: what a client that stalls, speaks HTTP/1.0, sends a huge frame or
stops reading gets, and the settings and texts it found wrong.

The app under a real uvicorn in this process over the fake runtime (:func:`server_util.serve`), with raw sockets
where a library would hide what the server does (a body cut short, an HTTP/1.0 request, a client that never
reads). Every wait is for a state, bounded by ``WAIT_S``; none is timed.
"""

from __future__ import annotations

import base64
import json
import os
import select
import socket
import struct
from collections.abc import Iterator
from typing import Any

import pytest

from cosyserve.core.errors import SettingsError
from cosyserve.core.settings import Settings
from fake_runtime import FakeRuntime
from server_util import WAIT_S, WS_PATH, Served, serve, wait_until

BODY = json.dumps({"input": "Hello there.", "voice": "alice", "response_format": "pcm"}).encode()


def raw(s: Served) -> socket.socket:
    c = socket.create_connection(("127.0.0.1", s.port), timeout=WAIT_S)
    return c


def read_response(c: socket.socket) -> tuple[str, dict[str, str], bytes]:
    """(status line, headers, the rest) of an HTTP response, read until the server closes the connection."""
    data = b""
    while chunk := c.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return lines[0], headers, body


def post_head(length: int, version: str = "1.1") -> bytes:
    return (
        f"POST /v1/audio/speech HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


@pytest.fixture(scope="module")
def srv() -> Iterator[Served]:
    with serve(FakeRuntime(chunk_len=2400), body_timeout_s=0.5, max_pending_bodies=2) as s:
        yield s


# --- request bodies that stall ---------------------------------------------------------------------------------


def test_a_body_that_stalls_gets_408_and_its_connection_closed(srv: Served) -> None:
    """If this fails, a client that sends ten bytes of its body and then nothing holds its socket as long as it
    likes (past 70 s in the hostile pass)."""
    with raw(srv) as c:
        c.sendall(post_head(len(BODY)) + BODY[:10])
        status, headers, body = read_response(c)  # the server closes: read_response returns
    assert status.split()[1] == "408" and headers.get("connection") == "close", (status, headers)
    err = json.loads(body)["error"]
    assert err["code"] == "body_timeout" and "COSYSERVE_BODY_TIMEOUT" in err["message"], err
    wait_until(lambda: srv.state.pending_bodies == 0, "the stalled body is no longer counted")


def test_bodies_part_way_in_are_capped_and_one_more_is_refused_at_once(srv: Served) -> None:
    """If this fails, forty stalled bodies hold forty sockets: past ``max_pending_bodies`` (2 here) a body that
    arrives part way gets 503 with Retry-After at once, not after its own timeout."""
    held = [raw(srv) for _ in range(2)]
    try:
        for c in held:
            c.sendall(post_head(len(BODY)) + BODY[:10])
        wait_until(lambda: srv.state.pending_bodies == 2, "both stalled bodies are counted")
        with raw(srv) as c:
            c.sendall(post_head(len(BODY)) + BODY[:10])
            status, headers, body = read_response(c)
            assert srv.state.pending_bodies == 2, "the refusal came while the others still held their places"
        assert status.split()[1] == "503" and headers["retry-after"] == "1", (status, headers)
        assert headers.get("connection") == "close" and "COSYSERVE_MAX_PENDING_BODIES" in body.decode()
    finally:
        for c in held:
            c.close()
    wait_until(lambda: srv.state.pending_bodies == 0, "the held bodies are let go")
    with srv.client() as c:  # and a whole body is served as ever
        assert (
            c.post("/v1/audio/speech", content=BODY, headers={"Content-Type": "application/json"}).status_code
            == 200
        )


def test_an_http_1_0_client_gets_the_body_whole_with_its_length_not_chunked(srv: Served) -> None:
    """If this fails, an HTTP/1.0 client (which knows no chunked encoding) reads the chunk sizes as audio."""
    with raw(srv) as c:
        c.sendall(post_head(len(BODY), "1.0") + BODY)
        status, headers, body = read_response(c)
    assert status.split()[1] == "200", status
    assert "transfer-encoding" not in headers and int(headers["content-length"]) == len(body) > 0, headers
    assert len(body) == 2 * 3 * 2400, "the fake's three chunks as 16-bit PCM, nothing else"


# --- the WebSocket ---------------------------------------------------------------------------------------------


def handshake(s: Served) -> socket.socket:
    c = raw(s)
    key = base64.b64encode(os.urandom(16)).decode()
    c.sendall(
        f"GET {WS_PATH} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += c.recv(1)
    assert head.split(b" ")[1] == b"101", head
    return c


def frame(payload: bytes, opcode: int = 0x1) -> bytes:
    """A masked client frame."""
    mask = os.urandom(4)
    n = len(payload)
    size = (
        bytes([0x80 | n])
        if n < 126
        else bytes([0x80 | 126]) + struct.pack(">H", n)
        if n < 65536
        else bytes([0x80 | 127]) + struct.pack(">Q", n)
    )
    return bytes([0x80 | opcode]) + size + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def test_a_frame_over_the_limit_gets_close_code_1009_even_while_the_client_still_sends() -> None:
    """If this fails, a 30 MB frame drops the connection with no close code: the server closed while the client
    was still sending, and the reset that answers unread bytes can discard the close frame before the client
    reads it. The server reads and drops the rest of the frame, so the close frame (1009) is what it reads."""
    with serve() as s:
        with handshake(s) as c:
            size = 30 << 20
            c.sendall(bytes([0x81, 0x80 | 127]) + struct.pack(">Q", size) + os.urandom(4))
            zeros = bytes(1 << 20)
            for _ in range(size >> 20):
                c.sendall(zeros)  # a reset here would be the bug: the server must take the whole frame
            got = b""
            while len(got) < 4:
                chunk = c.recv(4096)
                assert chunk, f"the connection ended without a close frame: {got!r}"
                got += chunk
        assert got[0] == 0x88 and struct.unpack(">H", got[2:4])[0] == 1009, got[:40]


class _Endless(FakeRuntime):
    """Half a second of audio at once, then more every few milliseconds until the request is stopped."""

    def start(self, request: Any, should_stop: Any) -> Iterator[Any]:
        import numpy as np

        self.resolve(request)

        def chunks() -> Iterator[Any]:
            while not should_stop():
                yield np.full(12000, 0.1, np.float32)

        return chunks()


def test_a_websocket_client_cut_off_for_not_reading_has_its_socket_closed() -> None:
    """If this fails, a client that stops reading is 'cut off' while its socket stays open until it reads or
    goes away: the close frame waits behind audio it never takes. The server aborts the connection instead."""
    with serve(_Endless(), ws_idle_timeout_s=0.5) as s:
        c = handshake(s)
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            c.sendall(frame(json.dumps({"type": "session.config"}).encode()))
            c.sendall(frame(json.dumps({"type": "input.text", "text": "Speak on and on."}).encode()))
            wait_until(lambda: s.engine.in_flight == 1, "the utterance runs")
            wait_until(lambda: not s.state.ws_sessions, "the session ended: the client was cut off")
            p = select.poll()
            p.register(c, select.POLLERR | select.POLLHUP | select.POLLRDHUP)
            # reading nothing: the server's side is closed all the same (a reset), or this waits forever
            wait_until(lambda: bool(p.poll(0)), "the server closed the socket of a client that does not read")
            s.wait_until(lambda: s.engine.in_flight == 0, "its request ended")
        finally:
            c.close()


# --- settings and texts ----------------------------------------------------------------------------------------


def test_serve_takes_registry_dir_as_documented(tmp_path: Any) -> None:
    """If this fails, ``cosyserve serve --registry-dir DIR`` is a usage error though docs/settings.md documents it."""
    from cosyserve.cli.parser import build_parser, flags_of

    args = build_parser().parse_args(["serve", "--model", "m", "--registry-dir", str(tmp_path)])
    assert Settings.load(env={}, flags=flags_of(args)).registry_dir == tmp_path


def test_a_default_voice_with_a_leading_blank_is_refused_not_trimmed() -> None:
    """If this fails, ``--default-voice " 中文女"`` is silently taken as "中文女": a voice name is exact everywhere
    else (a request's " 中文女" is an unknown voice)."""
    with pytest.raises(SettingsError, match="--default-voice.*blanks at its start or end"):
        Settings.load(env={}, flags={"default_voice": " 中文女"})
    assert Settings.load(env={}, flags={"default_voice": "中文女"}).default_voice == "中文女"


def test_markup_alone_has_nothing_to_speak() -> None:
    """If this fails, ``<|endofprompt|>`` alone as input is spoken (200 with audio made of noise) instead of
    refused as text with nothing to speak."""
    from cosyserve.frontend.text import nothing_to_speak, text_normalize

    assert nothing_to_speak("<|endofprompt|>") and nothing_to_speak(" <|en|><|endofprompt|> ")
    assert not nothing_to_speak("<|endofprompt|>Hello") and not nothing_to_speak("Hi.")
    assert text_normalize("<|endofprompt|>") == [], "the 300M frontend keeps text with markup unnormalised"
    assert text_normalize("<|en|>Hello there.") == ["<|en|>Hello there."]
