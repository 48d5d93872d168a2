"""`cosyserve serve`: uvicorn around :func:`cosyserve.server.app.create_app`.

One worker runs in this process (exit code 0 after a SIGTERM drain, 3 when a preload model fails to load);
several workers run under uvicorn's process manager, each loading its own models (mapped from the same files,
their weights share the page cache's pages), and share their metrics through a private directory this process
makes and removes. Each worker receives the :class:`Settings` object itself: it travels inside uvicorn's
``Config``, which multiprocessing pickles to every spawned worker, and the worker builds its app from it.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import shutil
import signal
import tempfile
from typing import Any

from cosyserve.settings import Settings

__all__ = ["serve"]

_MULTIPROC = "PROMETHEUS_MULTIPROC_DIR"
# uvicorn's own grace timeout is a backstop only: the app cuts what still runs when the grace is over
# (ServerState._cut_leftovers), and the requests it cut need a moment to end
_BACKSTOP_S = 5


class _QuietStreamCuts(logging.Filter):
    """Drops uvicorn's "Exception in ASGI application" traceback for a :class:`~cosyserve.server.synth.StreamCut`.

    A stream that ends short raises it on purpose, so that uvicorn closes the connection without the final chunk;
    the request has already logged one WARNING saying why. Any other exception keeps its traceback.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        from cosyserve.server.synth import StreamCut

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BaseExceptionGroup):  # through a task group that did not collapse it
            return exc.split(StreamCut)[1] is not None
        return not isinstance(exc, StreamCut)


def _setup_logging(settings: Settings) -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(settings.serve_log_level.upper())
    uv = logging.getLogger("uvicorn.error")  # the logger uvicorn's HTTP protocols report app exceptions on
    if not any(isinstance(f, _QuietStreamCuts) for f in uv.filters):
        uv.addFilter(_QuietStreamCuts())


def _worker_app(settings: Settings) -> Any:
    """The app of one worker process (``--workers N``), built there from the settings the parent pickled."""
    from cosyserve.server.app import create_app

    _setup_logging(settings)  # a spawned worker starts with logging unconfigured
    return create_app(settings)


def serve(settings: Settings) -> int:
    """Run the server until SIGTERM/SIGINT.

    Args:
        settings: what to serve and how (host, port, workers, models, pool config, limits, ...).
    Returns:
        The process exit code: 0 after a drain, 3 when a preload model failed to load.
    """
    import uvicorn

    _setup_logging(settings)
    common: dict[str, Any] = dict(
        host=settings.host,
        port=settings.port,
        log_level=settings.serve_log_level,
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s) + _BACKSTOP_S,
        access_log=False,  # one structured line per synthesis request instead (cosyserve.access)
        log_config=None,
    )
    if settings.workers > 1:
        from uvicorn.supervisors import Multiprocess

        # set before any worker starts, hence before prometheus_client is imported there (it picks its value
        # class at import); always a fresh directory of ours: files left by another run would add to our counts
        metrics_dir = tempfile.mkdtemp(prefix="cosyserve-metrics-")
        saved = os.environ.get(_MULTIPROC)
        os.environ[_MULTIPROC] = metrics_dir
        try:
            # what uvicorn.run does for workers, with the app factory bound to the settings instead of named by
            # an import string: the partial (and the settings in it) is pickled to each spawned worker
            config = uvicorn.Config(
                functools.partial(_worker_app, settings), factory=True, workers=settings.workers, **common
            )
            Multiprocess(config, sockets=[config.bind_socket()]).run()
        except KeyboardInterrupt:
            pass
        finally:
            shutil.rmtree(metrics_dir, ignore_errors=True)
            if saved is None:
                os.environ.pop(_MULTIPROC, None)
            else:
                os.environ[_MULTIPROC] = saved
        return 0
    from cosyserve.server.app import STARTUP_FAILURE, create_app

    app = create_app(settings)
    state = app.state.cosy
    server = uvicorn.Server(uvicorn.Config(app, **common))  # type: ignore[arg-type]
    state._server = server
    # uvicorn re-raises the signal it caught once it has shut down; these no-op handlers are the ones it
    # restores, so a drained server exits 0 instead of dying of its own SIGTERM
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    if state.startup_error is not None:
        return STARTUP_FAILURE
    return 0
