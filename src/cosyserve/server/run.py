"""`cosyserve serve`: uvicorn around :func:`cosyserve.server.app.create_app`.

One worker runs in this process (exit code 0 after a SIGTERM drain, 3 when a preload model fails to load);
several workers run under uvicorn's process manager, each loading its own models (the prefork issue shares
their weight pages).
"""

from __future__ import annotations

import json
import logging
import os
import signal

from cosyserve.server.config import ServerConfig

__all__ = ["app_from_env", "serve"]

_ENV = "COSYSERVE_SERVE_CONFIG"


def _config_to_env(cfg: ServerConfig) -> str:
    d = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    d["models"] = [[m.name, m.source] for m in cfg.models]
    d["api_keys"] = dict(cfg.api_keys)
    d["cors_origins"] = list(cfg.cors_origins)
    return json.dumps(d)


def app_from_env():  # type: ignore[no-untyped-def]
    """uvicorn factory for worker processes (``--workers N``): the config travels in an env variable."""
    from cosyserve.server.app import create_app
    from cosyserve.server.config import ModelArg

    d = json.loads(os.environ[_ENV])
    d["models"] = tuple(ModelArg(n, s) for n, s in d["models"])
    d["cors_origins"] = tuple(d["cors_origins"])
    return create_app(ServerConfig(**d))


def serve(config: ServerConfig) -> int:
    """Run the server until SIGTERM/SIGINT; returns the process exit code."""
    import uvicorn

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(config.log_level.upper())
    common = dict(
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        timeout_graceful_shutdown=int(config.shutdown_grace_s) or None,
        access_log=False,  # one structured line per synthesis request instead (cosyserve.access)
        log_config=None,
    )
    if config.workers > 1:
        os.environ[_ENV] = _config_to_env(config)
        uvicorn.run("cosyserve.server.run:app_from_env", factory=True, workers=config.workers, **common)  # type: ignore[arg-type]
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
