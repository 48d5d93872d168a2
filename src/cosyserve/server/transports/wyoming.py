"""Wyoming (Home Assistant's protocol) beside HTTP: ``cosyserve serve --wyoming-uri tcp://0.0.0.0:10200``.

The same process, pool and request path as HTTP serve a second listener: each connection reads Wyoming events with
the ``wyoming`` package (the ``wyoming`` extra) and answers them as wyoming-piper does:

- ``describe`` -> ``info``: one TTS program, ``cosyserve``, whose voices are the voices of the models that are
  loaded and visible to the Wyoming tenant: the pre-defined speakers, then the voices registered for the tenant,
  each with its model's languages (:meth:`cosyserve.runtime.Runtime.languages`). A voice of the default model is
  listed by its name; a voice of another model as ``MODEL/VOICE``. A ``describe`` before the start-up is over
  waits for it. ``supports_synthesize_streaming`` is true.
- ``synthesize`` (``text``; ``voice``: ``name``, else ``language``) -> ``audio-start``, ``audio-chunk``s,
  ``audio-stop``: 16-bit mono PCM at :data:`SAMPLE_RATE`, as the engine makes it. No ``voice``: the default voice
  of the default model. ``voice.language`` (without a name) must be one the model speaks; ``voice.speaker`` is
  refused (a cosyserve voice has no speakers: each is listed as a voice of its own).
- ``synthesize-start`` (``voice``) / ``synthesize-chunk`` (``text``) / ``synthesize-stop`` -> the audio of the
  whole streamed text as one ``audio-start`` .. ``audio-stop``, then ``synthesize-stopped``. The text goes to the
  engine as the WebSocket's does (a :meth:`cosyserve.core.limits.Limits.feed`, one request opened by the first chunk
  with text): CosyVoice2/3 feed their LM as it arrives, CosyVoice-300M speaks each sentence once its end arrives,
  so audio comes while text still does. A ``synthesize`` inside a stream (Home Assistant sends the whole text
  again for servers that do not stream) is ignored.
- ``ping`` -> ``pong``; any other event is ignored, as Wyoming servers drop what they do not know.

Every request is built by :func:`cosyserve.server.synth.order` (every limit: ``text`` and each chunk within
``max_text_chars``, the streamed text held within ``max_buffered_text_chars``, ``voice.name`` within
``max_voice_name_chars``) and run by :class:`~cosyserve.server.synth.Synthesis` (admission, quota, access log,
metrics on route ``wyoming``). An error is an ``error`` event (``code`` the HTTP routes', ``text`` naming the field
first: ``voice.name: unknown speaker 'x'; ...``), after which the server closes the connection, as wyoming-piper's
does: Home Assistant reads until ``audio-stop`` or ``synthesize-stopped`` and would wait for ever otherwise. An event
whose header line or data is larger than ``max_body_bytes`` is an error too, before it is read.

Tenant: Wyoming has no API keys; a caller acts as ``--wyoming-tenant`` (its models, registered voices and quota),
else as an HTTP caller of a server without keys (every model, the voices registered without a key). With API keys
set, ``--wyoming-tenant`` is required: whoever reaches the port speaks as that tenant.

Ends: a client that closes the connection (or only its sending side: a client must keep it open until it has read
its answer, as Home Assistant's and the ``wyoming`` package's clients do) cancels what it asked for at once; one
that sends nothing for ``ws_idle_timeout_s`` while nothing of its runs, or in the middle of a streamed text, gets an
``idle_timeout`` error; one that stops reading its audio is cut off once a write has waited as long. A drain
(SIGTERM) closes the listener, closes the idle connections and lets a synthesis in flight finish (a streamed one
until its ``synthesize-stop`` and its audio), then closes its connection; what still runs when the grace is over is
cut, as on every route.

Prefork (``--workers N``): the master binds the listener before it forks, and every worker accepts on it (the
kernel spreads the connections, as it does HTTP's); Home Assistant opens one connection per synthesis, so the
workers share that load too. The zeroconf announce (``--wyoming-zeroconf NAME``, the ``zeroconf`` library, as
Wyoming servers announce themselves: ``_wyoming._tcp.local.``) comes from one process: the single server, or the
worker in slot 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import stat
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
    SettingsError,
    shown,
)
from cosyserve.server.errors import error_object, status_of
from cosyserve.server.synth import Order, Synthesis, order

logger = logging.getLogger("cosyserve.server")

__all__ = ["PARAMS", "ROUTE", "SAMPLE_RATE", "Listener", "WyomingServer", "bind", "voice_name"]

ROUTE = "wyoming"  # the route of its requests in the access log and the metrics
# request fields -> Wyoming's names (errors name the field so)
PARAMS = {"text": "text", "speaker": "voice.name"}
# the rate asked of the one encoder for Wyoming's PCM: None, the model's (once the encoder resamples, a rate it gives,
# e.g. 24000); audio-start states the encoder's rate, whichever it is
SAMPLE_RATE: int | None = None
_WIDTH = 2  # bytes per sample: 16-bit PCM
PROGRAM = "cosyserve"
_ATTRIBUTION = ("FunAudioLLM CosyVoice", "https://github.com/FunAudioLLM/CosyVoice")
_SERVICE = "_wyoming._tcp.local."
_WILDCARDS = ("", "0.0.0.0", "::")


def _wyoming() -> Any:
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


# -- the listener ------------------------------------------------------------------------------------------------


@dataclass
class Listener:
    """The listening socket of a Wyoming URI (:func:`bind`), bound before the server starts: by the serve process,
    or the prefork master before it forks."""

    uri: str
    sock: socket.socket
    scheme: str  # tcp or unix
    host: str  # tcp: the host as given; unix: the socket file's path
    port: int  # tcp: the port bound (a URI's port 0: the one the kernel chose); unix: 0

    @property
    def address(self) -> str:
        """Where it listens, as a URI (the port the kernel chose for port 0)."""
        if self.scheme == "unix":
            return f"unix://{self.host}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    def close(self) -> None:
        """Close the socket (and remove a unix socket's file): the process that bound it, once it is done."""
        self.sock.close()
        if self.scheme == "unix":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.host)


def bind(settings: Any) -> Listener | None:
    """The Wyoming listener ``settings`` ask for (None: ``wyoming_uri`` unset), its settings checked first.

    Raises:
        SettingsError: API keys without ``wyoming_tenant``; zeroconf without a ``tcp://`` URI; a unix URI whose path
            is a file that is not a socket.
        ModuleNotFoundError: the ``wyoming`` package (or, for the announce, ``zeroconf``) is not installed.
        OSError: the address cannot be bound (in use, no permission): the start fails (exit code 3).
    """
    from cosyserve.core.casts import split_uri

    uri = settings.wyoming_uri
    if uri is None:
        for name in ("wyoming_tenant", "wyoming_zeroconf"):
            if getattr(settings, name) is not None:
                raise SettingsError(f"{settings.where(name)} needs a Wyoming server: set --wyoming-uri too")
        return None
    where = settings.where("wyoming_uri")
    if settings.api_keys and settings.wyoming_tenant is None:
        raise SettingsError(
            f"{where}: Wyoming has no API keys, and this server has some: name the tenant a Wyoming caller acts as "
            "(anyone who reaches the port) with --wyoming-tenant (COSYSERVE_WYOMING_TENANT)"
        )
    scheme, host, port = split_uri(uri)
    if settings.wyoming_zeroconf is not None:
        if scheme != "tcp":
            raise SettingsError(
                f"{settings.where('wyoming_zeroconf')}: zeroconf announces a TCP port; {where} is {uri!r}"
            )
        import zeroconf  # noqa: F401 - fail at the start, not after the models loaded
    _wyoming()  # the same: a missing package stops the start at once
    if scheme == "unix":
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(os.stat(host).st_mode):
                raise SettingsError(f"{where}: {host!r} exists and is not a socket: choose another path")
            os.unlink(host)  # a socket left by a server that is gone, as the wyoming package's server does
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(host)
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        return Listener(uri, sock, scheme, host, 0)
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return Listener(uri, sock, scheme, host, int(sock.getsockname()[1]))


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
        self.wy = _wyoming()
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


# -- the server --------------------------------------------------------------------------------------------------


class WyomingServer:
    """The Wyoming listener of a server process: accepts on ``listener`` (bound by the process that forks, or by
    this one) on the app's event loop, from the lifespan's start to its end.

    Args:
        state: the app's :class:`~cosyserve.server.app.ServerState`.
        listener: the bound socket (:func:`bind`).
    """

    def __init__(self, state: Any, listener: Listener) -> None:
        self.state = state
        self.listener = listener
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[Connection] = set()
        self._watch: asyncio.Task[None] | None = None
        self._zeroconf: Any = None

    async def start(self) -> None:
        """Accept connections from now on (the socket is bound already); announce it when asked."""
        state, lst = self.state, self.listener
        limit = int(state.config.max_body_bytes)  # a longer header line is refused (_BoundedReader)
        if lst.scheme == "unix":
            self._server = await asyncio.start_unix_server(self._accept, sock=lst.sock, limit=limit)
        else:
            self._server = await asyncio.start_server(self._accept, sock=lst.sock, limit=limit)
        self._watch = asyncio.ensure_future(self._close_on_drain())
        name = state.config.wyoming_zeroconf
        if name is not None and (state.worker is None or state.worker.slot == 0):
            self._zeroconf = await _announce(name, lst)
        logger.info("Wyoming: listening on %s", lst.address)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection(self.state, reader, writer)
        self._connections.add(conn)
        self.state.session_opened(conn)  # a drain waits for it as for a WebSocket session
        try:
            await conn.run()
        except Exception:
            logger.exception("wyoming %s: the connection failed unexpectedly", conn.peer)
        finally:
            conn._end()
            self._connections.discard(conn)
            self.state.session_closed(conn)

    async def _close_on_drain(self) -> None:
        # a drain accepts no new connection; those open finish what runs (Connection.run)
        assert self.state.drain_event is not None
        await self.state.drain_event.wait()
        self._stop_listening()

    def _stop_listening(self) -> None:
        if self._server is not None and self._server.is_serving():
            self._server.close()
            logger.info("Wyoming: no longer listening on %s (shutting down)", self.listener.address)

    async def close(self) -> None:
        """Stop listening, end every connection (what still runs is cancelled), withdraw the announce."""
        self._stop_listening()
        if self._watch is not None:
            self._watch.cancel()
        for conn in list(self._connections):
            await conn.abort()
        if self._zeroconf is not None:
            zc, self._zeroconf = self._zeroconf, None
            with contextlib.suppress(Exception):  # the network may be gone already: nothing left to withdraw
                await asyncio.wait_for(zc.async_close(), 5.0)


async def _announce(name: str, lst: Listener) -> Any:
    """Register ``name`` as a Wyoming service (``_wyoming._tcp.local.``) at the listener's address and port, as
    Wyoming servers do for Home Assistant's discovery; a wildcard host announces the address of the interface
    that reaches the mDNS group (on every interface), a given one itself (on its interface only: who cannot reach
    the address need not hear of it). Returns the ``AsyncZeroconf`` to close at the end."""
    from zeroconf import InterfaceChoice
    from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

    wildcard = lst.host in _WILDCARDS
    host = _local_address() if wildcard else lst.host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    info = AsyncServiceInfo(
        _SERVICE,
        f"{name}.{_SERVICE}",
        addresses=[socket.inet_pton(family, host)],
        port=lst.port,
    )
    zc = AsyncZeroconf(interfaces=InterfaceChoice.All if wildcard else [host])
    try:
        await zc.async_register_service(info)
    except BaseException:
        await zc.async_close()
        raise
    logger.info("Wyoming: announced as %r (zeroconf, %s port %d)", name, host, lst.port)
    return zc


def _local_address() -> str:
    # the address of the interface a packet to the mDNS group leaves by (no packet is sent)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("224.0.0.251", 5353))
        return str(s.getsockname()[0])
