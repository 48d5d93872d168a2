"""`cosyserve serve`: one server process (:mod:`cosyserve.server.run`), or ``--workers N`` forked from a template
that loaded the models (:mod:`cosyserve.server.prefork`, whose workers each run
:func:`~cosyserve.server.run.run_app`)."""

from __future__ import annotations

from cosyserve.core.settings import Settings
from cosyserve.server.run import bind_wyoming, run_app, setup_logging, wyoming_unbound

__all__ = ["serve"]


def serve(settings: Settings) -> int:
    """Run the server until SIGTERM/SIGINT.

    Args:
        settings: what to serve and how (host, port, workers, models, pool config, limits, ...).
    Returns:
        The process exit code (:data:`~cosyserve.server.run.EXIT_CODES`): 0 after a drain, 3 when the start failed.
    """
    setup_logging(settings)
    if settings.workers > 1:
        from cosyserve.server.prefork import serve_prefork

        return serve_prefork(settings)
    from cosyserve.server.app import create_app

    try:
        wyoming = bind_wyoming(settings)
    except OSError as e:
        return wyoming_unbound(e, settings)
    try:
        return run_app(create_app(settings, wyoming=wyoming), settings)
    finally:
        if wyoming is not None:
            wyoming.close()
