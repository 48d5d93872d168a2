"""One Wyoming connection: its events read (each within the size limit), its voices listed, its requests built
by the one request path and run one after another, their audio written (:mod:`cosyserve.server.transports.wyoming`
has the protocol as a whole, the listener and the server)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import struct
import warnings
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from cosyserve.core.errors import (
    ClientError,
    CosyserveError,
    InternalError,
    NotReadyError,
    PayloadTooLargeError,
    shown,
)
from cosyserve.server.errors import error_object, status_of
from cosyserve.server.synth import Order, Synthesis, order

logger = logging.getLogger("cosyserve.server")

__all__ = ["PARAMS", "PROGRAM", "ROUTE", "SAMPLE_RATE", "Connection", "voice_name", "wyoming_package"]

ROUTE = "wyoming"  # the route of its requests in the access log and the metrics
# request fields -> Wyoming's names (errors name the field so)
PARAMS = {"text": "text", "speaker": "voice.name"}
# the rate asked of the one encoder for Wyoming's PCM: None, the model's (once the encoder resamples, a rate it gives,
# e.g. 24000); audio-start states the encoder's rate, whichever it is
SAMPLE_RATE: int | None = None
_WIDTH = 2  # bytes per sample: 16-bit PCM
PROGRAM = "cosyserve"
_ATTRIBUTION = ("FunAudioLLM CosyVoice", "https://github.com/FunAudioLLM/CosyVoice")


def wyoming_package() -> Any:
    """The ``wyoming`` package's modules this server uses (imported on first use: ``import cosyserve`` and
    ``--help`` stay light). Its ``audio`` module imports the standard library's ``audioop``, which warns of its
    removal on every import: the warning is the package's to heed, not the server's log's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import wyoming.audio
        import wyoming.error
        import wyoming.event
        import wyoming.info
        import wyoming.ping
        import wyoming.tts
    return wyoming


# -- voices ----------------------------------------------------------------------------------------------------


def voice_name(model: str, voice: str, default: str) -> str:
    """A voice's name on Wyoming: its own for a voice of the default model, ``MODEL/VOICE`` for another model's
    (model names hold no ``/``; registered voice names none either)."""
    return voice if model == default else f"{model}/{voice}"


def _pick(state: Any, tenant: str | None, name: str | None) -> tuple[str, str | None]:
    """``(model, speaker)`` a Wyoming voice name stands for (None: the default model's default voice): a voice of
    the default model, else ``MODEL/VOICE`` of a model the tenant may use, else a name the default model is left to
    refuse (its error lists its voices)."""
    default = state.resolve_model(None, tenant, param="voice.name")
    if name is None:
        return default, None
    model, sep, voice = name.partition("/")
    if sep and model != default and model in state.pool.visible(tenant):
        eng = state.pool.engine(default)
        runtime = eng.runtime if eng is not None else None
        if runtime is None or runtime.voice(name, tenant or "default") is None:
            return model, voice
    return default, name


def _matches(language: str, languages: list[str]) -> bool:
    # "en-US", "en_us" and "EN" are English: the primary tag decides
    primary = language.replace("_", "-").split("-", 1)[0].lower()
    return primary in languages


# -- one connection ----------------------------------------------------------------------------------------------


def _internal() -> InternalError:
    return InternalError(
        "internal server error: the request failed unexpectedly (details are in the server log)"
    )


class _Gone(Exception):
    """The client went away, or stopped reading: the connection ends without another event."""


class _TooLarge(Exception):
    """An event's line, data or payload is over the limit (raised before it is read)."""


class _BoundedReader:
    """The connection's reader as the ``wyoming`` package reads events from it (``readline``, ``readexactly``),
    refusing a line, data or payload over ``limit`` bytes before reading it: the package reads what the client
    declares, however large."""

    def __init__(self, reader: asyncio.StreamReader, limit: int) -> None:
        self._reader = reader
        self.limit = limit

    async def readline(self) -> bytes:
        try:
            return await self._reader.readline()
        except ValueError:  # the line is longer than the stream's limit
            raise _TooLarge(f"an event's header line is over the limit of {self.limit} bytes") from None

    async def readexactly(self, n: int) -> bytes:
        if not isinstance(n, int) or n > self.limit:
            raise _TooLarge(
                f"an event declares {shown(n)} bytes of data or payload; the limit is {self.limit}"
            )
        return await self._reader.readexactly(n)

    def at_eof(self) -> bool:
        return self._reader.at_eof()

    def feed_eof(self) -> None:
        self._reader.feed_eof()


@dataclass
class _Stream:
    """A streamed text (``synthesize-start`` .. ``synthesize-stop``): what it asks for, its text feed, its request
    once the first chunk with text opened it."""

    order: Order
    feed: Any  # cosyserve.core.textfeed.TextFeed
    task: asyncio.Task[None] | None = None


class Connection:
    """One Wyoming connection (see the module docstring): reads its events, runs its requests one after another,
    writes their audio."""

    def __init__(self, state: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.wy = wyoming_package()
        self.state = state
        self.reader = _BoundedReader(reader, int(state.config.max_body_bytes))
        self.writer = writer
        self.tenant: str | None = state.config.wyoming_tenant
        self.idle_s = float(state.config.ws_idle_timeout_s)
        self.peer = writer.get_extra_info("peername") or "unix socket"
        self._task: asyncio.Task[None] | None = None  # the latest request's (each waits for the one before)
        self._stream: _Stream | None = None  # the open streamed text
        self._room = asyncio.Event()  # the model took text: a chunk waiting for room may go on
        self._loop = asyncio.get_running_loop()
        self._send_lock = asyncio.Lock()
        self._ended = False  # an error was sent, or the client is gone: nothing more is read or sent
        self._crashed = False  # a request failed unexpectedly (a bug, logged)

    # -- sending -----------------------------------------------------------------------------------------------

    async def _send(self, event: Any) -> None:
        # a write that waits longer than the idle timeout means a client that stopped reading: cut it off
        async with self._send_lock:
            if self._ended:
                raise _Gone("the connection ended")
            try:
                await asyncio.wait_for(self.wy.event.async_write_event(event, self.writer), self.idle_s)
            except TimeoutError:
                logger.warning(
                    "wyoming %s: the client has not taken the audio sent for %g s: cutting it off",
                    self.peer,
                    self.idle_s,
                )
                self._end(abort=True)
                raise _Gone("not reading") from None
            except (ConnectionError, OSError, RuntimeError) as e:  # closed under us
                self._end(abort=True)
                raise _Gone(str(e)) from None

    async def _error(self, e: CosyserveError) -> None:
        """``e`` as an ``error`` event (its text naming the field first), counted; then the connection ends."""
        obj = error_object(e, PARAMS)
        param, message = obj["param"], obj["message"]
        text = message if param is None or message.startswith(param) else f"{param}: {message}"
        self.state.metrics.observe_error(ROUTE, status_of(e), str(obj["code"] or "error"))
        with contextlib.suppress(_Gone):
            await self._send(self.wy.error.Error(text=text, code=obj["code"]).event())
        self._end()

    def _end(self, abort: bool = False) -> None:
        # close: what is written still goes out first; abort: a reset, what is unsent dropped at once (else the
        # kernel holds it for a client that does not read it, for as long as that client likes)
        self._ended = True
        if not abort:
            self.writer.close()
            return
        sock = self.writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()

    # -- the connection ----------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Read and answer events until the client leaves, an error ends the connection, or a drain does."""
        state = self.state
        reading: asyncio.Future[Any] = asyncio.ensure_future(self.wy.event.async_read_event(self.reader))
        draining = asyncio.ensure_future(state.drain_event.wait())
        try:
            while not self._ended:
                if self._crashed:
                    await self._error(_internal())
                    break
                if state.draining and not self._busy():
                    break
                waits: set[asyncio.Future[Any]] = {reading}
                if not draining.done():  # once it is, the check above sees state.draining
                    waits.add(draining)
                if self._task is not None and not self._task.done():
                    waits.add(self._task)
                # the server works and the client waits for its audio: no idle timeout
                working = self._stream is None and self._task is not None and not self._task.done()
                done, _ = await asyncio.wait(
                    waits, timeout=None if working else self.idle_s, return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    await self._error(
                        ClientError(
                            f"no event for {self.idle_s:g} s: the connection is closed (COSYSERVE_WS_IDLE_TIMEOUT)",
                            code="idle_timeout",
                        )
                    )
                    break
                if reading not in done:
                    continue  # a drain began, or a request ended: the checks above decide
                event = self._event(reading)
                if event is None:
                    break  # the client closed the connection: what it asked for is cancelled below
                await self._handle(event)
                reading = asyncio.ensure_future(self.wy.event.async_read_event(self.reader))
        except _TooLarge as e:
            await self._error(PayloadTooLargeError(str(e)))
        except CosyserveError as e:  # bytes that are not an event
            await self._error(e)
        except _Gone:
            pass
        except Exception:
            logger.exception("wyoming %s: the connection failed unexpectedly", self.peer)
            await self._error(_internal())
        finally:
            for t in (reading, draining):
                t.cancel()
            await self.abort()

    def _event(self, reading: asyncio.Future[Any]) -> Any:
        """The event read (None: the client closed the connection). Raises _TooLarge, or ClientError for bytes that
        are not a Wyoming event (the package reads a line that is not JSON as the end of the connection)."""
        try:
            event = reading.result()
        except (KeyError, AttributeError, TypeError):  # JSON, but not an event's header
            raise ClientError(
                "not a Wyoming event: a JSON object with a type expected", code="invalid_event"
            ) from None
        except (ConnectionError, asyncio.IncompleteReadError):
            return None
        if event is None and not self.reader.at_eof():
            raise ClientError("not a Wyoming event: a line of JSON expected", code="invalid_event")
        if event is not None and not isinstance(event.data, dict):
            raise ClientError(f"{event.type}: the event's data must be an object", code="invalid_event")
        return event

    def _busy(self) -> bool:
        # a streamed text open, or a request still running
        return self._stream is not None or (self._task is not None and not self._task.done())

    async def abort(self) -> None:
        """End the connection now: its requests cancelled (awaited), its text feed ended, the socket closed."""
        self._end()
        stream, self._stream = self._stream, None
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task})
        if stream is not None:
            stream.feed.abort()

    # -- events ------------------------------------------------------------------------------------------------

    async def _handle(self, event: Any) -> None:
        wy = self.wy
        try:
            kind = event.type
            if wy.info.Describe.is_type(kind):
                await self._describe()
            elif wy.tts.Synthesize.is_type(kind):
                # inside a stream it is the whole text again, for servers that do not stream: not spoken twice
                if self._stream is None:
                    await self._synthesize(event.data)
            elif wy.tts.SynthesizeStart.is_type(kind):
                await self._start(event.data)
            elif wy.tts.SynthesizeChunk.is_type(kind):
                await self._chunk(event.data)
            elif wy.tts.SynthesizeStop.is_type(kind):
                self._stop()
            elif wy.ping.Ping.is_type(kind):
                await self._send(wy.ping.Pong(text=event.data.get("text")).event())
            else:
                logger.debug("wyoming %s: ignored event %s", self.peer, shown(kind))
        except CosyserveError as e:
            await self._error(e)

    async def _describe(self) -> None:
        state = self.state
        assert state.started is not None
        await state.started.wait()  # the preload models' voices, not a list that is still empty
        if state.startup_error is not None:
            raise NotReadyError("the server failed to start: it serves nothing")
        await self._send(await asyncio.to_thread(self._info))

    def _info(self) -> Any:
        # in a thread: registered voices are read from the registry's folder
        from cosyserve.core.version import __version__

        info, state, tenant = self.wy.info, self.state, self.tenant
        attribution = info.Attribution(*_ATTRIBUTION)
        default = state.resolve_model(None, tenant)
        voices = []
        for model in state.pool.visible(tenant):
            eng = state.pool.engine(model)
            runtime = eng.runtime if eng is not None else None
            if runtime is None:  # not loaded: its voices are listed once it is
                continue
            languages = runtime.languages()
            for v in runtime.voices(tenant or "default"):
                voices.append(
                    info.TtsVoice(
                        name=voice_name(model, v.name, default),
                        description=f"{v.name} ({model})",
                        attribution=attribution,
                        installed=True,
                        version=None,
                        languages=languages,
                    )
                )
        program = info.TtsProgram(
            name=PROGRAM,
            description="CosyVoice text to speech (cosyserve)"
            + (": DEMO model, noise" if state.demo else ""),
            attribution=attribution,
            installed=True,
            version=__version__,
            voices=voices,
            supports_synthesize_streaming=True,
        )
        return info.Info(tts=[program]).event()

    async def _order(self, data: dict[str, Any], text: Any) -> Order:
        """What ``synthesize`` or ``synthesize-start`` asks for (``data``), with ``text``, within every limit."""
        voice = data.get("voice") or {}
        if not isinstance(voice, dict):
            raise ClientError(
                f"voice must be an object (name, language, speaker), got {shown(voice)}", param="voice"
            )
        name, language, speaker = (voice.get(k) for k in ("name", "language", "speaker"))
        for field, value in (("name", name), ("language", language), ("speaker", speaker)):
            if value is not None and not isinstance(value, str):
                raise ClientError(
                    f"voice.{field} must be a string, got {type(value).__name__}", param=f"voice.{field}"
                )
        if speaker:
            raise ClientError(
                f"voice.speaker {shown(speaker)}: a cosyserve voice has no speakers (each is a voice of its own in "
                "describe): name it in voice.name",
                param="voice.speaker",
            )
        fmt = data.get("text_format")
        if fmt not in (None, "text"):
            raise ClientError(
                f"text_format {shown(fmt)} is not supported: send plain text", param="text_format"
            )
        if isinstance(name, str):  # within its limit before it is looked up
            self.state.limits.check(names=PARAMS, speaker=name)
        model, speaker_name = _pick(self.state, self.tenant, name)
        if language is not None and name is None:
            engine = await self.state.pool.load(model)  # its languages: loaded, as its request would
            languages = engine.runtime.languages()
            if not _matches(language, languages):
                raise ClientError(
                    f"voice.language {shown(language)} is not one of the languages of model {model!r}: "
                    f"{', '.join(languages)}",
                    param="voice.language",
                )
        asked = order(
            self.state,
            tenant=self.tenant,
            params=PARAMS,
            model=model,
            model_param="voice.name",
            fmt="pcm",
            formats=("pcm",),
            sample_rate=SAMPLE_RATE,
            text=text,
            stream=True,
            mode=None,
            speaker=speaker_name,
        )
        eng = self.state.pool.engine(asked.model)
        if eng is not None and eng.runtime is not None:  # loaded: its voice resolved (refused) now
            asked = dataclasses.replace(asked, request=eng.resolve(asked.request))
        return asked

    async def _synthesize(self, data: dict[str, Any]) -> None:
        text = data.get("text")
        if not isinstance(text, str):
            raise ClientError(f"text must be a string, got {type(text).__name__}", param="text")
        self._chain(self._speak(await self._order(data, text), streamed=False))

    async def _start(self, data: dict[str, Any]) -> None:
        if self._stream is not None:
            raise ClientError(
                "synthesize-start inside a streamed text: send synthesize-stop first", code="invalid_event"
            )
        asked = await self._order(data, ())  # the text: the stream's feed, once its first chunk comes
        deadline = asked.request.deadline
        feed = self.state.limits.feed(deadline=deadline, on_take=self._on_take)
        self._stream = _Stream(asked, feed)

    async def _chunk(self, data: dict[str, Any]) -> None:
        stream = self._stream
        if stream is None:
            raise ClientError(
                "synthesize-chunk outside a streamed text: send synthesize-start first", code="invalid_event"
            )
        text = data.get("text")
        if not isinstance(text, str):
            raise ClientError(f"text must be a string, got {type(text).__name__}", param="text")
        self.state.limits.check(names=PARAMS, text=text)  # a chunk within max_text_chars, before anything
        if stream.task is None:
            if not text:
                return  # nothing to open the request with
            request = dataclasses.replace(stream.order.request, text=stream.feed)
            stream.task = self._chain(
                self._speak(dataclasses.replace(stream.order, request=request), streamed=True)
            )
        feed = stream.feed
        while not feed.has_room(len(text)) and not feed.closed:
            # the model reads slower than the client writes: stop reading the socket until it catches up
            self._room.clear()
            if feed.has_room(len(text)):
                break
            room = asyncio.ensure_future(self._room.wait())
            await asyncio.wait({room, stream.task}, return_when=asyncio.FIRST_COMPLETED)
            room.cancel()
            if stream.task.done():  # the request ended (its error is sent): nobody reads this text
                return
        if not feed.closed:
            feed.put(text)

    def _on_take(self) -> None:
        # in the runtime's worker thread, after it took a piece: a chunk waiting for room may go on
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self._loop.call_soon_threadsafe(self._room.set)

    def _stop(self) -> None:
        stream = self._stream
        if stream is None:
            raise ClientError(
                "synthesize-stop outside a streamed text: send synthesize-start first", code="invalid_event"
            )
        self._stream = None
        stream.feed.finish()
        if stream.task is None:  # no text at all: nothing to speak, nothing asked of the engine
            self._chain(self._send(self.wy.tts.SynthesizeStopped().event()))

    # -- a request ---------------------------------------------------------------------------------------------

    def _chain(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``work`` once the connection's previous request is over (one at a time, in order)."""
        previous = self._task

        async def after() -> None:
            try:
                if previous is not None:
                    await asyncio.wait({previous})
                await work
            except _Gone:
                pass
            except Exception:
                logger.exception("wyoming %s: a request failed unexpectedly", self.peer)
                self._crashed = True
            finally:
                work.close()  # cancelled before it started: never awaited

        self._task = asyncio.ensure_future(after())
        return self._task

    async def _speak(self, asked: Order, streamed: bool) -> None:
        run = Synthesis(self.state, ROUTE, asked)
        try:
            await run.start()
        except CosyserveError as e:  # refused, or failed before any audio (recorded)
            await self._error(e)
            return
        assert run.encoder is not None, "started"
        rate = run.encoder.out_rate  # the rate of the PCM it gives: what audio-start states
        audio = self.wy.audio
        error = await run.deliver(
            lambda data: self._send(
                audio.AudioChunk(rate=rate, width=_WIDTH, channels=1, audio=data).event()
            ),
            start=lambda: self._send(audio.AudioStart(rate=rate, width=_WIDTH, channels=1).event()),
            gone=(_Gone,),
        )
        if error is not None:
            await self._error(error)
            return
        await self._send(audio.AudioStop().event())
        if streamed:
            await self._send(self.wy.tts.SynthesizeStopped().event())
