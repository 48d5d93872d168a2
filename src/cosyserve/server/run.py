"""`cosyserve serve`: uvicorn around :func:`cosyserve.server.app.create_app`.

One worker runs in this process (exit code 0 after a SIGTERM drain, 3 when a preload model fails to load);
several workers run under uvicorn's process manager, each loading its own models (mapped from the same files,
their weights share the page cache's pages), and share their metrics through a private directory this process
makes and removes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import tempfile

from cosyserve.server.config import ServerConfig

__all__ = ["app_from_env", "serve"]

_ENV = "COSYSERVE_SERVE_CONFIG"
_MULTIPROC = "PROMETHEUS_MULTIPROC_DIR"
# uvicorn's own grace timeout is a backstop only: the app cuts what still runs when the grace is over
# (ServerState._cut_leftovers), and the requests it cut need a moment to end
_BACKSTOP_S = 5


def _config_to_env(cfg: ServerConfig) -> str:
    d = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    d["models"] = [[m.name, m.source] for m in cfg.models]
    d["api_keys"] = dict(cfg.api_keys)
    d["cors_origins"] = list(cfg.cors_origins)
    return json.dumps(d)


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


def _setup_logging(config: ServerConfig) -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(config.log_level.upper())
    uv = logging.getLogger("uvicorn.error")  # the logger uvicorn's HTTP protocols report app exceptions on
    if not any(isinstance(f, _QuietStreamCuts) for f in uv.filters):
        uv.addFilter(_QuietStreamCuts())


def app_from_env():  # type: ignore[no-untyped-def]
    """uvicorn factory for worker processes (``--workers N``): the config travels in an env variable."""
    from cosyserve.server.app import create_app
    from cosyserve.server.config import ModelArg

    d = json.loads(os.environ[_ENV])
    d["models"] = tuple(ModelArg(n, s) for n, s in d["models"])
    d["cors_origins"] = tuple(d["cors_origins"])
    config = ServerConfig(**d)
    _setup_logging(config)  # a spawned worker starts with logging unconfigured
    return create_app(config)


def serve(config: ServerConfig) -> int:
    """Run the server until SIGTERM/SIGINT; returns the process exit code."""
    import uvicorn

    _setup_logging(config)
    common = dict(
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        timeout_graceful_shutdown=math.ceil(config.shutdown_grace_s) + _BACKSTOP_S,
        access_log=False,  # one structured line per synthesis request instead (cosyserve.access)
        log_config=None,
    )
    if config.workers > 1:
        # set before any worker starts, hence before prometheus_client is imported there (it picks its value
        # class at import); always a fresh directory of ours: files left by another run would add to our counts
        metrics_dir = tempfile.mkdtemp(prefix="cosyserve-metrics-")
        saved = os.environ.get(_MULTIPROC)
        os.environ[_MULTIPROC] = metrics_dir
        os.environ[_ENV] = _config_to_env(config)
        try:
            uvicorn.run("cosyserve.server.run:app_from_env", factory=True, workers=config.workers, **common)  # type: ignore[arg-type]
        finally:
            shutil.rmtree(metrics_dir, ignore_errors=True)
            if saved is None:
                os.environ.pop(_MULTIPROC, None)
            else:
                os.environ[_MULTIPROC] = saved
        return 0
    from cosyserve.server.app import STARTUP_FAILURE, create_app

    app = create_app(config)
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
