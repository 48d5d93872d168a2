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
import logging
import os
import socket
import stat
from dataclasses import dataclass
from typing import Any

from cosyserve.core.errors import SettingsError
from cosyserve.server.transports.wyoming_conn import (
    PARAMS,
    ROUTE,
    SAMPLE_RATE,
    Connection,
    voice_name,
    wyoming_package,
)

logger = logging.getLogger("cosyserve.server")

__all__ = ["PARAMS", "ROUTE", "SAMPLE_RATE", "Listener", "WyomingServer", "bind", "voice_name"]

_SERVICE = "_wyoming._tcp.local."
_WILDCARDS = ("", "0.0.0.0", "::")


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
    wyoming_package()  # the same: a missing package stops the start at once
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
