"""One server process: uvicorn around :func:`cosyserve.server.app.create_app` (:func:`run_app`).

``cosyserve serve`` (:func:`cosyserve.server.main.serve`) runs one in its own process, or, with ``--workers N``
(N > 1, Linux), forks N workers from a template that loaded the models (:mod:`cosyserve.server.prefork`), each
running :func:`run_app` on the socket the master bound. The exit codes are :data:`EXIT_CODES` (0 after a SIGTERM
drain, 3 when the start fails: a preload model that cannot load, a port that cannot be bound).
``--wyoming-uri`` binds the Wyoming listener here (the master, with workers), before anything loads: a taken
address fails the start at once (exit code 3); the app serves it (:mod:`cosyserve.server.transports.wyoming`).
"""

from __future__ import annotations

import logging
import math
import signal
import socket
from typing import Any

from cosyserve.core.settings import Settings

__all__ = [
    "EXIT_CODES",
    "bind_wyoming",
    "run_app",
    "setup_logging",
    "uvicorn_options",
    "wyoming_unbound",
]

# `cosyserve serve`'s exit codes, for its help and docs/http-api.md's table (written by scripts/settings_tables.py);
# 3 is uvicorn's own STARTUP_FAILURE (a port it cannot bind), which cosyserve.server.app.STARTUP_FAILURE shares for
# a preload model that fails to load
EXIT_CODES = (
    (0, "stopped by SIGTERM or SIGINT, after the drain (also when stopped before the models were loaded)"),
    (
        1,
        "a setting, flag value or file it cannot use (one line on stderr names it); with --workers, a failed fork; "
        "a preload model that needs torch where torch is not installed",
    ),
    (2, "a command-line usage error (an unknown flag, a flag without its value)"),
    (
        3,
        "the start failed: a preload model could not be loaded, or the port (or the Wyoming address) could not be "
        "bound (in use, no permission); with --workers, also a worker that failed its start, or ten in a row that "
        "died before READY",
    ),
)


# uvicorn's own grace timeout is a backstop only: the app cuts what still runs when the grace is over
# (ServerState._cut_leftovers), and the requests it cut need a moment to end
_BACKSTOP_S = 5


class _QuietStreamCuts(logging.Filter):
    """Drops uvicorn's "Exception in ASGI application" traceback for a :class:`~cosyserve.server.responses.StreamCut`.

    A stream that ends short raises it on purpose, so that uvicorn closes the connection without the final chunk;
    the request has already logged one WARNING saying why. Any other exception keeps its traceback.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        from cosyserve.server.responses import StreamCut

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BaseExceptionGroup):  # through a task group that did not collapse it
            return exc.split(StreamCut)[1] is not None
        return not isinstance(exc, StreamCut)


def setup_logging(settings: Settings) -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(settings.serve_log_level.upper())
    uv = logging.getLogger("uvicorn.error")  # the logger uvicorn's HTTP protocols report app exceptions on
    if not any(isinstance(f, _QuietStreamCuts) for f in uv.filters):
        uv.addFilter(_QuietStreamCuts())


# frames a WebSocket connection holds that its session has not read yet
WS_MAX_QUEUE = 4


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The uvicorn ``Config`` arguments of a worker (the server's own logging, no access log).

    A WebSocket frame may be as large as the largest speech request (a ``session.config`` carries ``ref_audio`` as
    that body does); a larger one closes the connection (1009). Frames are not compressed: PCM hardly compresses,
    and deflate would take a core's time per stream. The protocol holds at most :data:`WS_MAX_QUEUE` frames the
    session has not read (the websockets library's default, 32, is 32 frames of the largest size per connection):
    a session that stops reading its client's text while the model catches up keeps the rest in TCP's buffers.
    The protocol is uvicorn's own with a close code for a frame over the size and an abort for a client that
    stopped reading (:mod:`cosyserve.server.wsproto`).
    """
    from cosyserve.server.schemas import speech_body_limit
    from cosyserve.server.wsproto import WebSocketProtocol

    return dict(
        host=settings.host,
        port=settings.port,
        log_level=settings.serve_log_level,
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s) + _BACKSTOP_S,
        access_log=False,  # one structured line per synthesis request instead (cosyserve.access)
        log_config=None,
        ws=WebSocketProtocol,
        ws_max_size=speech_body_limit(settings),
        ws_max_queue=WS_MAX_QUEUE,
        ws_per_message_deflate=False,
    )


def run_app(app: Any, settings: Settings, sockets: list[socket.socket] | None = None) -> int:
    """Serve ``app`` (from :func:`~cosyserve.server.app.create_app`) until SIGTERM/SIGINT and its drain.

    Args:
        app: the app; its ``state.cosy`` is the :class:`~cosyserve.server.app.ServerState`.
        settings: the server's settings.
        sockets: listening sockets to accept on (a prefork worker's, bound by the master); None: bind
            ``settings.host``/``port``.
    Returns:
        The exit code: 0 after a drain, 3 when a preload model failed to load (uvicorn itself exits 3, through
        SystemExit, when it cannot bind the port).
    """
    import uvicorn

    from cosyserve.server.app import STARTUP_FAILURE

    state = app.state.cosy
    server = uvicorn.Server(uvicorn.Config(app, **uvicorn_options(settings)))
    state._server = server
    # uvicorn re-raises the signal it caught once it has shut down; these no-op handlers are the ones it
    # restores, so a drained server exits 0 instead of dying of its own SIGTERM
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=sockets)
    if state.startup_error is not None:
        return STARTUP_FAILURE
    return 0


def bind_wyoming(settings: Settings) -> Any:
    """The Wyoming listener ``--wyoming-uri`` asks for, bound (None: not asked for); see
    :func:`cosyserve.server.transports.wyoming.bind`."""
    if settings.wyoming_uri is None and settings.wyoming_tenant is None and settings.wyoming_zeroconf is None:
        return None  # the wyoming package is not imported at all
    from cosyserve.server.transports.wyoming import bind

    return bind(settings)


def wyoming_unbound(e: OSError, settings: Settings) -> int:
    """A Wyoming address that cannot be bound: one line, and the start failed (exit code 3)."""
    from cosyserve.server.app import STARTUP_FAILURE

    logging.getLogger("cosyserve.server").error(
        "start-up failed: %s %s cannot be bound: %s", settings.where("wyoming_uri"), settings.wyoming_uri, e
    )
    return STARTUP_FAILURE
