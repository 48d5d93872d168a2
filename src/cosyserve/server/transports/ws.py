"""``/v1/audio/speech/stream``: text in over a WebSocket as it is written, audio out as it is spoken.

The protocol is vLLM-Omni's. The client sends JSON text frames, each an object with a ``type``:

- ``session.config``: first, and again between utterances to change what the next ones are spoken with (refused
  while an utterance has text open, so that no text is spoken with a config it was not sent under): ``model``,
  ``voice`` (a speaker, a registered voice or an OpenAI voice name), or ``ref_audio`` (base64 or a ``data:`` URL)
  with ``ref_text`` to clone one, ``instructions``, ``response_format`` (``pcm``, default, or ``wav``),
  ``sample_rate`` (default the model's; another is resampled to, by the one encoder), ``seed``, ``speed`` (1.0
  only: the audio is streamed), ``stream_audio`` (default true: binary frames as the audio is made; false: an
  utterance's audio in one binary frame at its end); checked as the HTTP routes' fields are, by the one
  constructor (:mod:`cosyserve.core.limits`), and its voice resolved once per config;
- ``input.text`` ``{"text": ...}``: a piece of the current utterance (the first opens it), at most
  ``max_text_chars`` characters;
- ``input.done``: the utterance is complete; the session stays open for the next one, with the same config;
- ``session.close``: the current utterance (if any) is completed, its audio sent, then the server closes (1000).

For each utterance the server sends ``audio.start`` (JSON: ``format``, ``sample_rate``, ``channels``,
``sample_format``, ``request_id``, ...), binary frames of 16-bit little-endian mono PCM (after a 44-byte WAV
header frame for ``wav``), ``audio.done`` (``total_bytes``, ``error: false``, ``usage``: characters, samples,
seconds) and ``session.done`` (the utterance is over: ``total_sentences`` 1, or 0 for one with no text); every
message about an utterance carries its ``utterance_index`` (counted from 0, one per ``input.done``: vLLM-Omni's
flush count) and ``sentence_index`` 0 (an utterance is one request here, spoken as its text arrives, so it is one
"sentence" in vLLM-Omni's terms). An utterance that fails gets an ``error`` instead of ``audio.done``, and
``session.done`` with ``"error": true`` and ``total_sentences`` 0 once its ``input.done`` arrives (the text sent
for it until then is dropped). ``error`` events carry the HTTP routes'
``code``, ``message``, ``param`` and ``status`` (the status table's), and ``fatal`` (the server then closes).
Bad messages (not JSON, no or an unknown ``type``, unknown fields, text after ``session.close``, a
``session.config`` while an utterance is open, binary frames) get an ``error`` and change nothing; a frame over
the size limit closes the connection with 1009 (the server reads and drops the rest of the frame first, so the
close frame reaches a client that is still sending: :mod:`cosyserve.server.run`).

Each utterance is one engine request (one slot, in the pool's admission and the tenant's quota like any request),
built from the session's config with its own text feed and run as every transport's request is
(:class:`~cosyserve.server.synth.Synthesis`): its text reaches the runtime as a
:class:`~cosyserve.core.textfeed.TextFeed`, read as it arrives; utterances of a session are spoken one after another.
Text is read from the socket only while the utterance's unread text stays within ``max_buffered_text_chars`` (or
one piece): TCP pushes back on a client that writes faster than the model reads.

Ends: a client that disconnects frees its work at once (the engine request is cancelled and its feed ended); a
client that sends nothing for ``ws_idle_timeout_s`` while it holds an utterance open, or between utterances, gets
an ``error`` (``idle_timeout``) and a close (1008); one that stops reading the audio is cut off once a send
has waited ``ws_idle_timeout_s`` (the kernel's socket buffers being full): its TCP connection is aborted, as no
close frame can reach it; a server drain (SIGTERM) lets the
utterance in flight finish, then closes (1001), and a handshake while it drains gets 503; a bug closes with 1011.
API keys are checked at the handshake (:mod:`cosyserve.server.auth`); so is a browser page's ``Origin``: the
server's own page and the CORS origins only (403), as browsers apply no CORS to WebSockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Coroutine
from typing import Any
from urllib.parse import urlsplit

from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from cosyserve.core.errors import ClientError, CosyserveError, NotReadyError, shown
from cosyserve.core.request import ResolvedRequest
from cosyserve.core.textfeed import TextFeed
from cosyserve.server.errors import error_object, error_response, retry_after, status_of
from cosyserve.server.schemas import SESSION_FORMATS, SessionConfig, json_object, parse_session_config
from cosyserve.server.synth import Order, Synthesis, caller, order, usage
from cosyserve.server.transports.openai_api import voice_fields

logger = logging.getLogger("cosyserve.server")

__all__ = ["PARAMS", "ROUTE", "Session", "routes"]

ROUTE = "/v1/audio/speech/stream"
SUBPROTOCOL = "cosyserve"  # what the server answers a browser that offered it (with its key, see auth.py)
# request fields -> this route's names
PARAMS = {
    "text": "text",
    "speaker": "voice",
    "instruct_text": "instructions",
    "prompt_wav": "ref_audio",
    "prompt_text": "ref_text",
}
_TYPES = ("session.config", "input.text", "input.done", "session.close")

# close codes (RFC 6455)
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # the server drains
CLOSE_POLICY = 1008  # idle, or not reading
CLOSE_INTERNAL = 1011


class _Gone(Exception):
    """The client went away, or stopped reading: the session ends without another message."""


class _Utterance:
    """One utterance: its text feed, its engine request's task, and whether its ``input.done`` came."""

    def __init__(self, index: int, feed: TextFeed) -> None:
        self.index = index
        self.feed = feed
        self.flushed = asyncio.Event()
        self.failed = False
        self.task: asyncio.Task[None] | None = None

    @property
    def speaking(self) -> bool:
        """Flushed and still making audio: the server works, the client waits."""
        return self.flushed.is_set() and self.task is not None and not self.task.done()


class Session:
    """One WebSocket connection (see the module docstring)."""

    def __init__(self, state: Any, ws: WebSocket) -> None:
        self.state = state
        self.ws = ws
        self.idle_s = float(state.config.ws_idle_timeout_s)
        self.config: SessionConfig | None = None
        self.order: Order | None = None  # what each utterance asks for (its text aside), from session.config
        # session.config messages taken: an utterance's order is that of the config it was opened under
        self.configs = 0
        self.current: _Utterance | None = None  # the open utterance (text still coming)
        self.last: _Utterance | None = None  # the latest utterance (open or flushed)
        self.next_index = 0
        self.closing = False  # session.close came: no more input
        self._send_lock = asyncio.Lock()
        self._room = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._ended = False  # closed, or the client is gone: nothing more is sent
        self._crashed = False  # an utterance's task failed unexpectedly (a bug, logged)
        self._utterances: list[_Utterance] = []  # not yet over

    # -- sending --------------------------------------------------------------------------------------------

    async def _send(self, message: Coroutine[Any, Any, None]) -> None:
        # a send that waits longer than the idle timeout means a client that stopped reading: cut it off
        async with self._send_lock:
            if self._ended:
                message.close()
                raise _Gone("the session ended")
            try:
                await asyncio.wait_for(message, self.idle_s)
            except TimeoutError:
                logger.warning(
                    "websocket %s: the client has not taken the audio sent for %g s: cutting it off",
                    self.ws.client,
                    self.idle_s,
                )
                self._ended = True
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.ws.close(CLOSE_POLICY, "not reading"), 1.0)
                raise _Gone("not reading") from None
            except (WebSocketDisconnect, OSError, RuntimeError) as e:  # closed under us
                self._ended = True
                raise _Gone(str(e)) from None

    async def send_event(self, event: dict[str, Any]) -> None:
        await self._send(self.ws.send_json(event))

    async def send_error(
        self, e: CosyserveError, utterance: _Utterance | None = None, fatal: bool = False
    ) -> None:
        """An ``error`` event: the HTTP routes' error object, its status, the utterance and whether it ends the
        session."""
        obj = error_object(e, PARAMS)
        event: dict[str, Any] = {
            "type": "error",
            "code": obj["code"],
            "message": obj["message"],
            "param": obj["param"],
            "error_type": obj["type"],
            "status": status_of(e),
            "fatal": fatal,
        }
        wait = retry_after(e)
        if wait is not None:
            event["retry_after"] = wait
        if utterance is not None:
            event["utterance_index"] = utterance.index
        await self.send_event(event)

    # -- the session ------------------------------------------------------------------------------------------

    async def run(self) -> None:
        offered = self.ws.scope.get("subprotocols") or ()
        await self.ws.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
        receiving: asyncio.Task[Any] = asyncio.ensure_future(self.ws.receive())
        draining = asyncio.ensure_future(self.state.drain_event.wait())
        code, reason = CLOSE_NORMAL, ""
        try:
            while True:
                if self._ended:  # the client stopped reading and was cut off
                    break
                if self._crashed:
                    code, reason = CLOSE_INTERNAL, await self._internal_error()
                    break
                if self.state.draining and not self._busy():
                    code, reason = CLOSE_GOING_AWAY, "the server is shutting down"
                    break
                if self.closing and not self._busy():
                    break
                waits: set[asyncio.Future[Any]] = {receiving}
                if not draining.done():  # once it is, the checks above see state.draining
                    waits.add(draining)
                if self.last is not None and self.last.task is not None and not self.last.task.done():
                    waits.add(self.last.task)
                timeout = (
                    None if (self.last is not None and self.last.speaking) or self.closing else self.idle_s
                )
                done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if not done:  # the client held the session idle
                    await self.send_error(
                        ClientError(
                            f"no message for {self.idle_s:g} s: the session is closed (COSYSERVE_WS_IDLE_TIMEOUT)",
                            code="idle_timeout",
                        ),
                        self.current,
                        fatal=True,
                    )
                    code, reason = CLOSE_POLICY, "idle"
                    break
                if receiving not in done:
                    continue  # a drain began, or an utterance ended: the checks above decide
                message = receiving.result()
                if message["type"] == "websocket.disconnect":
                    raise _Gone("disconnected")
                await self._on_message(message)
                receiving = asyncio.ensure_future(self.ws.receive())
        except _Gone:
            self._ended = True
        except Exception:
            logger.exception("websocket %s: the session failed unexpectedly", self.ws.client)
            code, reason = CLOSE_INTERNAL, await self._internal_error()
        finally:
            for t in (receiving, draining):
                t.cancel()
            await self.abort()
        if not self._ended:
            self._ended = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.ws.close(code, reason), self.idle_s)

    async def _internal_error(self) -> str:
        # a bug (logged where it happened): say so without details, then close with 1011
        reason = "internal error (details are in the server log)"
        with contextlib.suppress(_Gone):
            await self.send_event(
                {
                    "type": "error",
                    "code": "internal_error",
                    "message": f"internal server error: the session failed, {reason}",
                    "param": None,
                    "error_type": "server_error",
                    "status": 500,
                    "fatal": True,
                }
            )
        return reason

    def _busy(self) -> bool:
        # an utterance open, or one whose audio is still being sent
        last = self.last
        return last is not None and (
            not last.flushed.is_set() or (last.task is not None and not last.task.done())
        )

    async def abort(self) -> None:
        """End every utterance now: feeds ended, engine requests cancelled (their tasks awaited)."""
        utterances, self._utterances = self._utterances, []
        # the requests are cancelled first, their feeds ended after (by each task, on its way out): a runtime
        # whose text ends then sees should_stop(), and does not take the cut text for a finished utterance
        for utt in utterances:
            if utt.task is not None:
                utt.task.cancel()
        tasks = [u.task for u in utterances if u.task is not None]
        if tasks:
            await asyncio.wait(tasks)
        for utt in utterances:
            utt.feed.abort()

    # -- messages ---------------------------------------------------------------------------------------------

    async def _on_message(self, message: dict[str, Any]) -> None:
        if message.get("text") is None:
            await self.send_error(
                ClientError("binary frames are not accepted: send JSON text frames", code="invalid_frame")
            )
            return
        try:
            data = json_object(message["text"], "the message")
            kind = data.pop("type", None)
            if kind not in _TYPES:
                raise ClientError(
                    f"unknown message type {shown(kind)}; expected one of {', '.join(_TYPES)}",
                    param="type",
                    code="invalid_event",
                )
            if self.closing:
                raise ClientError(
                    f"{kind} after session.close: the session is closing", code="session_closed"
                )
            if kind == "session.config":
                await self._configure(data)
            elif kind == "input.text":
                await self._text(data)
            else:
                self._no_fields(kind, data)
                await self._flush(closing=kind == "session.close")
        except ClientError as e:
            await self.send_error(e)

    @staticmethod
    def _no_fields(kind: str, data: dict[str, Any], allowed: tuple[str, ...] = ()) -> None:
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise ClientError(
                f"{kind} takes {', '.join(allowed) or 'no other field'}; got {shown(unknown[0])}",
                param=str(unknown[0])[:64],
            )

    async def _configure(self, data: dict[str, Any]) -> None:
        if self.current is not None:
            raise ClientError(
                f"utterance {self.current.index} has text open: send input.done first, then session.config to "
                "change what the next utterances are spoken with",
                param="type",
                code="utterance_open",
            )
        cfg = parse_session_config(data, self.state.config.max_upload_bytes)
        asked = order(
            self.state,
            **caller(self.state, self.ws),
            params=PARAMS,
            model=cfg.model,
            fmt=cfg.response_format,
            formats=SESSION_FORMATS,
            sample_rate=cfg.sample_rate,
            streamed=cfg.stream_audio,
            text=(),  # each utterance's own feed
            stream=True,
            seed=cfg.seed,
            speed=cfg.speed,
            **voice_fields(self.state, cfg.voice, cfg.instructions, cfg.ref_audio, cfg.ref_text),
        )
        eng = self.state.pool.engine(asked.model)
        if eng is not None and eng.runtime is not None:
            # loaded: the voice resolved now, once for every utterance (else by the first one's admission)
            asked = dataclasses.replace(asked, request=eng.resolve(asked.request))
        self.config, self.order = cfg, asked
        self.configs += 1

    async def _text(self, data: dict[str, Any]) -> None:
        self._no_fields("input.text", data, ("text",))
        text = data.get("text")
        if not isinstance(text, str):
            raise ClientError(f"text must be a string, got {type(text).__name__}", param="text")
        if self.config is None:
            raise ClientError(
                "send session.config before input.text", param="type", code="session_not_configured"
            )
        self.state.limits.check(names=PARAMS, text=text)  # a piece within max_text_chars, before anything
        utt = self.current
        if utt is None:
            if not text:
                return  # nothing to open an utterance with
            utt = self._open()
        if utt.failed:
            return  # its error was sent: the rest of its text is dropped until its input.done
        while not utt.feed.has_room(len(text)) and not utt.feed.closed:
            # the model reads slower than the client writes: stop reading the socket until it catches up
            self._room.clear()
            if utt.feed.has_room(len(text)):
                break
            room = asyncio.ensure_future(self._room.wait())
            assert utt.task is not None
            await asyncio.wait({room, utt.task}, return_when=asyncio.FIRST_COMPLETED)
            room.cancel()
        if not utt.feed.closed:
            utt.feed.put(text)

    def _open(self) -> _Utterance:
        assert self.order is not None
        deadline = time.monotonic() + self.state.config.request_timeout_s
        feed = self.state.limits.feed(deadline=deadline, on_take=self._on_take)
        utt = _Utterance(self.next_index, feed)
        self.next_index += 1
        request = dataclasses.replace(
            self.order.request, text=feed, request_id=uuid.uuid4().hex[:16], deadline=deadline
        )
        previous = self.last.task if self.last is not None else None
        utt.task = asyncio.ensure_future(
            self._speak(utt, dataclasses.replace(self.order, request=request), previous, self.configs)
        )
        self.current = self.last = utt
        self._utterances.append(utt)
        return utt

    def _on_take(self) -> None:
        # in the runtime's worker thread, after it took a piece: a reader waiting for room may go on
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self._loop.call_soon_threadsafe(self._room.set)

    async def _flush(self, closing: bool) -> None:
        self.closing = self.closing or closing
        utt = self.current
        if utt is None:
            if not closing:  # an empty utterance: nothing to speak, nothing asked of the engine
                index = self.next_index
                self.next_index += 1
                await self.send_event(
                    {"type": "session.done", "utterance_index": index, "total_sentences": 0, "error": False}
                )
            return
        self.current = None
        utt.feed.finish()
        utt.flushed.set()

    # -- an utterance's request ---------------------------------------------------------------------------------

    async def _speak(
        self, utt: _Utterance, asked: Order, previous: asyncio.Task[None] | None, config: int
    ) -> None:
        try:
            if previous is not None:  # one utterance at a time, in order
                await asyncio.wait({previous})
            await self._speak_now(utt, asked, config)
        except _Gone:
            pass
        except Exception:
            logger.exception("websocket %s: utterance %d failed unexpectedly", self.ws.client, utt.index)
            self._crashed = True
        finally:
            utt.feed.abort()
            with contextlib.suppress(ValueError):
                self._utterances.remove(utt)

    async def _speak_now(self, utt: _Utterance, asked: Order, config: int) -> None:
        run = Synthesis(self.state, ROUTE, asked)
        try:
            await run.start()
        except CosyserveError as e:  # refused, or failed before any audio (recorded)
            await self._fail(utt, e)
            return
        rec = run.rec
        if (
            config == self.configs
            and self.order is not None
            and not isinstance(self.order.request, ResolvedRequest)
        ):
            # resolved by the first utterance of its config's admission: the next ones take the voice as it is
            self.order = dataclasses.replace(self.order, request=dataclasses.replace(run.request, text=()))
        whole: list[bytes] = []  # stream_audio false: the utterance's audio, sent in one frame at its end

        async def send(data: bytes) -> None:
            if asked.output.streamed:
                await self._send(self.ws.send_bytes(data))
            else:
                whole.append(data)

        try:  # audio.start, the header frame (wav), then the audio
            error = await run.deliver(send, start=lambda: self._start_audio(utt, run), gone=(_Gone,))
            if error is None and whole:
                await self._send(self.ws.send_bytes(b"".join(whole)))
        finally:
            utt.feed.abort()
        if error is not None:
            await self._fail(utt, error)
            return
        await self.send_event(
            {
                "type": "audio.done",
                "utterance_index": utt.index,
                "sentence_index": 0,
                "request_id": asked.request.request_id,
                "total_bytes": rec.bytes,
                "error": False,
                "usage": usage(rec),
            }
        )
        await self._done(utt.index, spoken=True)

    async def _done(self, index: int, spoken: bool) -> None:
        # vLLM-Omni's end of a flushed utterance: total_sentences counts what was spoken (an utterance is one)
        await self.send_event(
            {
                "type": "session.done",
                "utterance_index": index,
                "total_sentences": int(spoken),
                "error": not spoken,
            }
        )

    async def _start_audio(self, utt: _Utterance, run: Synthesis) -> None:
        await self.send_event(
            {
                "type": "audio.start",
                "utterance_index": utt.index,
                "sentence_index": 0,
                "request_id": run.request.request_id,
                "model": run.order.model,
                "voice": run.request.speaker,
                "mode": run.request.mode,
                "format": run.order.output.format,
                "sample_rate": run.rec.out_rate,
                "channels": 1,
                "sample_format": "s16le",
            }
        )

    async def _fail(self, utt: _Utterance, e: CosyserveError) -> None:
        # the utterance is over: its error now, its session.done once its input.done came
        utt.failed = True
        utt.feed.abort()
        await self.send_error(e, utt)
        await utt.flushed.wait()
        await self._done(utt.index, spoken=False)


def routes(state: Any) -> list[WebSocketRoute]:
    allowed = frozenset(state.config.cors_origins)

    async def endpoint(ws: WebSocket) -> None:
        if state.draining:
            e = NotReadyError("the server is shutting down")
            await _deny(ws, status_of(e), error_object(e, PARAMS), {"Retry-After": str(retry_after(e))})
            return
        origin = _foreign_origin(ws, allowed)
        if origin is not None:
            message = f"a page of origin {shown(origin)} may not open this WebSocket: list it in COSYSERVE_CORS_ORIGINS"
            await _deny(ws, 403, {"message": message, "param": None, "code": "origin_not_allowed"})
            return
        session = Session(state, ws)
        state.session_opened(session)
        try:
            await session.run()
        finally:
            state.session_closed(session)

    return [WebSocketRoute(ROUTE, endpoint)]


def _foreign_origin(ws: WebSocket, allowed: frozenset[str]) -> str | None:
    """The handshake's ``Origin`` when it is a browser page of another site than the server's and not one of the
    CORS origins (None: allowed). Browsers apply no CORS to WebSockets: without this, any site a user visits could
    open sessions on a server without keys from the user's browser. Clients that are not browsers send no Origin."""
    origin = ws.headers.get("origin")
    if origin is None or "*" in allowed or origin in allowed:
        return None
    if urlsplit(origin).netloc.lower() == ws.headers.get("host", "").lower():
        return None  # the server's own page
    return origin


async def _deny(
    ws: WebSocket, status: int, error: dict[str, Any], headers: dict[str, str] | None = None
) -> None:
    """Refuse a handshake with ``status`` and the OpenAI ``error`` as its HTTP answer (without the server's
    support for that, a close, which uvicorn answers with 403)."""
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        resp = error_response(
            status, error["message"], param=error["param"], code=error["code"], headers=headers
        )
        await ws.send_denial_response(resp)
    else:
        await ws.close(CLOSE_POLICY, error["message"][:120])
