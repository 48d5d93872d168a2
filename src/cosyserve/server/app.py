"""The ASGI application: state, lifespan, health, auth, CORS and error handling; routes live beside it.

Starlette on uvicorn (not FastAPI): the server imports in a fraction of the time pydantic takes, its request
bodies are checked by :mod:`cosyserve.server.schemas` with messages that name the field, and the OpenAPI
document is written out in the same module.

Start-up order: the lifespan starts loading the preload models in background threads and returns at once,
so uvicorn opens the port right after the imports; ``/health/live`` answers from then on,
``/health/startup`` and ``/health/ready`` say 503 with each model's state until every preload model is READY.
A preload that fails makes ``/health/startup`` report the cause and stops the server with exit code 3.
With API keys, the open routes (health, metrics, ``/v1/startup``) name a model only to a key that may use it
(:meth:`ServerState.shown_models`); none of them shows a server path.
On SIGTERM readiness turns 503 at once and new synthesis requests get 503 with Retry-After, while the port stays
open for ``drain_delay_s`` so load balancers see the drain; then uvicorn closes the port and in-flight streams
get ``shutdown_grace_s`` to finish; what is still running then is cut (a stream ends without its final chunk),
the pool releases every model and the process exits 0. SIGINT (Ctrl+C) or a second signal skips the delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Route

from cosyserve.core.clock import PhaseClock
from cosyserve.core.errors import CosyserveError, LoadFailedError, UnknownModelError, cut, shown
from cosyserve.core.settings import DEMO_MODEL, ModelArg, Settings
from cosyserve.engine.streams import shared
from cosyserve.server.errors import (
    LastResortMiddleware,
    cosyserve_error_response,
    error_response,
    public_cause,
    status_of,
)
from cosyserve.system.gchold import release_gc

logger = logging.getLogger("cosyserve.server")

__all__ = ["ServerState", "create_app"]

STARTUP_FAILURE = 3
_STATIC = os.path.join(os.path.dirname(__file__), "static")


class ServerState:
    """What the routes share: the settings (``config``) and the limits of a request (``limits``), pool, API keys,
    metrics and the start-up/drain flags."""

    def __init__(self, config: Settings, pool: Any = None, worker: Any = None) -> None:
        from cosyserve.core.limits import Limits
        from cosyserve.engine.poolfile import build_pool, load_pool_config
        from cosyserve.runtime import RuntimeOptions
        from cosyserve.server.metrics import Metrics

        self.config = config
        self.limits = Limits.from_settings(config)
        self.clock = PhaseClock()
        self.started_wall = time.time()
        self.draining = False
        self.drain_started: float | None = None
        # when uvicorn was told to close the port: the grace runs from there
        self.stop_started: float | None = None
        self._stop_timer: asyncio.TimerHandle | None = None
        self._cut_timer: asyncio.TimerHandle | None = None
        self.startup_error: BaseException | None = None
        self.startup_done = False
        self.started: asyncio.Event | None = None  # set once startup_done is (made in the lifespan's loop)
        self.drain_event: asyncio.Event | None = None  # set once draining is (made in the lifespan's loop)
        # the open WebSocket sessions and Wyoming connections (cosyserve.server.transports.ws.Session,
        # cosyserve.server.transports.wyoming.Connection): a drain waits for the work they hold, a grace's end aborts it
        self.ws_sessions: set[Any] = set()
        self.pending_bodies = 0  # requests part way through their body (cosyserve.server.bodies)
        self._ws_wait: asyncio.Task[None] | None = None
        self._sessions_gone: asyncio.Event | None = None  # set when the last session closes, while stopping
        self.preload: list[str] = []
        self.demo = config.demo
        self._server: Any = None  # the uvicorn server, to stop it when start-up fails
        # a prefork worker's link to its master (cosyserve.server.prefork.WorkerLink): the template's runtimes,
        # the READY notice and the pool's state
        self.worker = worker
        if pool is None:
            # --model models are preloaded, with the same defaults as the pool config's models
            args = (ModelArg(DEMO_MODEL, DEMO_MODEL),) if self.demo else config.model_args()
            cfg = load_pool_config(config, preload=args)
            preloaded = worker.runtimes if worker is not None else None
            pool = build_pool(cfg, runtime_options=RuntimeOptions.from_settings(config), preloaded=preloaded)
            self.housekeeping_s: float | None = cfg.housekeeping_interval_s
        else:
            self.housekeeping_s = None
        self.pool = pool
        self.metrics = Metrics(self)
        self.pool.add_listener(self.metrics.on_pool_event)

    @property
    def model_names(self) -> list[str]:
        return list(self.pool.names)

    @property
    def default_model(self) -> str:
        names = self.model_names
        return self.preload[0] if self.preload else names[0]

    def tenant_of(self, conn: HTTPConnection) -> str | None:
        """The tenant of the caller's API key (None: the server has no keys); a WebSocket's too."""
        return getattr(conn.state, "tenant", None)

    def shown_models(self, request: Request) -> set[str] | None:
        """The models an open route may name to this caller; None: every model (the server has no API keys).

        With API keys, a caller is shown the models its key may use (as on ``/v1/models``) and no model without
        a key: an open route gives a keyless caller states and counts, never another tenant's model names.
        """
        if not self.config.api_keys:
            return None
        tenant = self.tenant_of(request)
        return set(self.pool.visible(tenant)) if tenant is not None else set()

    def resolve_model(self, name: str | None, tenant: str | None, param: str = "model") -> str:
        """A request's model name -> a pool model; OpenAI's names (tts-1, ...) mean the default model."""
        visible = self.pool.visible(tenant)
        if name is None or name == "" or name in ("tts-1", "tts-1-hd", "gpt-4o-mini-tts"):
            if not visible:
                raise UnknownModelError("no model is available to this API key", param=param)
            return self.default_model if self.default_model in visible else visible[0]
        if name not in visible:
            raise UnknownModelError(
                f"unknown model {shown(name)}; available: {', '.join(visible)}", param=param
            )
        return name

    def ready(self) -> bool:
        if self.draining or not self.startup_done or self.startup_error is not None:
            return False
        return all(self._state(n) == "ready" for n in self.preload)

    def _state(self, name: str) -> str:
        eng = self.pool.engine(name)
        if eng is None:
            return "failed" if self.pool.load_failure(name) is not None else "unloaded"
        return eng.state.value

    def describe_models(self, names: set[str] | None = None) -> dict[str, Any]:
        """State, load and failure of each model (of ``names`` only, when given), as the health routes show it."""
        out = {}
        for n in self.model_names:
            if names is not None and n not in names:
                continue
            eng = self.pool.engine(n)
            failure = self.pool.load_failure(n) if eng is None else None
            cause = failure.cause if failure is not None else (eng.cause if eng is not None else None)
            out[n] = {
                "state": self._state(n),
                "preload": n in self.preload,
                "in_flight": eng.in_flight if eng is not None else 0,
                "queue_depth": eng.queue_depth if eng is not None else 0,
                "cause": public_cause(cause) if cause is not None else None,
            }
            if failure is not None:  # when the pool loads it again, at the earliest
                out[n]["retry_in_s"] = round(max(0.0, failure.retry_at - self.pool.clock()), 1)
        return out

    def health(self, request: Request, status: str) -> dict[str, Any]:
        """The body of ``/health/ready`` and ``/health/startup``: the caller's models (:meth:`shown_models`),
        a count of every model by state, and the cause of a failed start-up, without server paths."""
        names = self.shown_models(request)
        states: dict[str, int] = {}
        for n in self.model_names:
            st = self._state(n)
            states[st] = states.get(st, 0) + 1
        body: dict[str, Any] = {
            "status": status,
            "models": self.describe_models(names),
            "model_states": states,
            "demo": self.demo,
        }
        if self.worker is not None:  # readiness is this worker's; the pool of workers is the master's view
            body["workers"] = self.worker.status()
        e = self.startup_error
        if e is not None:
            model = e.model if isinstance(e, LoadFailedError) else None
            if names is None or model in names:
                body["error"] = public_cause(e)
            else:
                body["error"] = "a preload model failed to load (a key that may use it is told which and why)"
        return body

    def begin_drain(self) -> None:
        if not self.draining:
            self.draining = True
            self.drain_started = time.monotonic()
            if self.drain_event is not None:
                self.drain_event.set()  # WebSocket sessions finish their utterance in flight, then close
            logger.info(
                "shutting down: readiness is 503 now; in-flight requests get %.0f s once the port closes",
                self.config.shutdown_grace_s,
            )

    def on_signal(self, signum: int, stop: Any) -> None:
        """SIGTERM/SIGINT, on the event loop: drain now; ``stop`` (uvicorn's handler) after the drain delay.

        SIGTERM keeps the port open ``drain_delay_s`` (readiness and new requests answer 503) so a load balancer
        sees the drain before connections are refused; SIGINT (Ctrl+C) and a signal during the delay stop at once;
        a signal after that goes straight to uvicorn (a second Ctrl+C forces its exit).
        """
        first = not self.draining
        self.begin_drain()
        if self._stop_timer is not None:
            self._stop_timer.cancel()
            self._stop_timer = None
        delay = self.config.drain_delay_s
        if first and signum == signal.SIGTERM and delay > 0:
            logger.info("the port stays open %g s so load balancers see readiness 503, then closes", delay)
            self._stop_timer = asyncio.get_running_loop().call_later(delay, self._stop, signum, stop)
        else:
            self._stop(signum, stop)

    def _stop(self, signum: int, stop: Any) -> None:
        self._stop_timer = None
        if self.stop_started is None:
            self.stop_started = time.monotonic()
            grace = self.config.shutdown_grace_s
            self._cut_timer = asyncio.get_running_loop().call_later(grace, self._cut_leftovers, grace)
        if self.ws_sessions and self._ws_wait is None:
            # uvicorn fails every open WebSocket at once (1012) when it stops: the sessions finish the utterance in
            # flight and close (1001) first, within the grace
            logger.info(
                "waiting for %d WebSocket session(s) and Wyoming connection(s) to finish their utterance",
                len(self.ws_sessions),
            )
            self._ws_wait = asyncio.ensure_future(self._stop_after_sessions(signum, stop))
            return
        if self._ws_wait is not None and not self._ws_wait.done():  # a second signal: no more waiting
            self._ws_wait.cancel()
            self._abort_sessions()
        stop(signum, None)

    async def _stop_after_sessions(self, signum: int, stop: Any) -> None:
        self._sessions_gone = asyncio.Event()
        try:
            if self.ws_sessions:
                await self._sessions_gone.wait()
        finally:
            stop(signum, None)

    def session_opened(self, session: Any) -> None:
        self.ws_sessions.add(session)

    def session_closed(self, session: Any) -> None:
        self.ws_sessions.discard(session)
        if not self.ws_sessions and self._sessions_gone is not None:
            self._sessions_gone.set()

    def _abort_sessions(self) -> None:
        for session in list(self.ws_sessions):
            asyncio.ensure_future(session.abort())

    def _cut_leftovers(self, grace: float) -> None:
        """The grace is over: stop what still runs through the engine (a stream then ends cut, see synth.py), so
        uvicorn's own, later timeout never has to cancel a request task (an ERROR with a traceback)."""
        self._cut_timer = None
        n = sum(int(m["in_flight"]) for m in self.describe_models().values())
        if n:
            logger.warning("shutdown grace of %g s is over: cutting %d request(s) still running", grace, n)
        self._abort_sessions()  # their text feeds end, so no worker waits on text that will not come
        self.pool.start_close(timeout=0)

    def cancel_timers(self) -> None:
        for t in (self._stop_timer, self._cut_timer):
            if t is not None:
                t.cancel()
        self._stop_timer = self._cut_timer = None
        if self._ws_wait is not None:
            self._ws_wait.cancel()

    async def run_startup(self) -> None:
        """Preload (in parallel, in threads), then mark READY; a failure stops the server."""
        self.preload = [n for n in self.model_names if self.pool.spec(n).policy == "preload"]
        futs = self.pool.start_preload()
        try:
            await asyncio.gather(*(shared(f) for f in futs))
        except asyncio.CancelledError:
            raise  # shutting down before the models were ready
        except BaseException as e:  # noqa: BLE001 - reported on /health/startup and by the exit code
            release_gc()
            self.startup_error = e
            self.startup_done = True
            if self.started is not None:
                self.started.set()
            logger.error("start-up failed: %s", e)
            if self._server is not None:
                self._server.should_exit = True
            return
        self.startup_done = True
        if self.started is not None:
            self.started.set()
        release_gc()  # the CLI held the collector since process start (cosyserve.system.gchold.hold_gc)
        ms = self.clock.mark("ready")
        self.metrics.on_ready(ms)
        if self.worker is not None:
            self.worker.notify_ready()
        logger.info(
            "ready in %.0f ms from process start: %s%s",
            ms,
            ", ".join(self.preload) or "(no preload models)",
            " (DEMO model: random weights, it makes noise, not speech)" if self.demo else "",
        )
        if self.housekeeping_s is not None:
            await self.pool.run_housekeeping(self.housekeeping_s)


def _install_drain_on_signals(state: ServerState) -> dict[int, Any]:
    """Route SIGTERM/SIGINT to :meth:`ServerState.on_signal`, which calls the previous handler (uvicorn's) later.

    The handler itself only hands the signal to the event loop (``call_soon_threadsafe`` is the one loop call
    that is safe while the loop may be mid-step); everything else runs there.
    """
    if threading.current_thread() is not threading.main_thread():
        return {}
    loop = asyncio.get_running_loop()
    previous: dict[int, Any] = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        prev = signal.getsignal(sig)
        if not callable(prev):
            continue  # nobody to stop (not under uvicorn): leave the default behaviour alone

        def handler(signum: int, frame: Any, prev: Any = prev) -> None:
            try:
                loop.call_soon_threadsafe(state.on_signal, signum, prev)
            except RuntimeError:  # the loop is closed: nothing left to drain
                prev(signum, frame)

        previous[sig] = prev
        signal.signal(sig, handler)
    return previous


def _lifespan(
    state: ServerState, wyoming: Any, ready_before_serving: bool
) -> Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]]:
    """The app's lifespan: the Wyoming server (if bound) and the models' start-up on its way in; on its way out the
    drain, the signal handlers restored, and the models released within the one grace period."""
    config = state.config

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.clock.mark("lifespan")
        state.started = asyncio.Event()
        state.drain_event = asyncio.Event()
        wyoming_server = None
        if wyoming is not None:
            from cosyserve.server.transports.wyoming import WyomingServer

            wyoming_server = WyomingServer(state, wyoming)
            try:
                await wyoming_server.start()
            except Exception as e:  # the announce failed: the start did (exit code 3)
                logger.error("start-up failed: the Wyoming server: %s", e)
                state.startup_error = e
                await wyoming_server.close()
                raise
        task = asyncio.ensure_future(state.run_startup())
        if ready_before_serving:
            await state.started.wait()  # the task itself goes on with the pool's housekeeping
            if state.startup_error is not None:
                await state.pool.close(timeout=0.0)
                raise RuntimeError(f"cosyserve: a preload model failed: {state.startup_error}")
        previous = _install_drain_on_signals(state)
        workers = state.metrics.workers
        publisher = asyncio.ensure_future(workers.publish_forever()) if workers is not None else None
        try:
            yield
        finally:
            state.begin_drain()
            if wyoming_server is not None:  # its connections ended already, unless the grace was cut short
                await wyoming_server.close()
            for t in (task, publisher):
                if t is not None:
                    t.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await t
            for sig, h in previous.items():
                with contextlib.suppress(Exception):
                    signal.signal(sig, h)
            state.cancel_timers()
            # one grace period in all: uvicorn already spent part of it waiting for open responses
            spent = time.monotonic() - (state.stop_started or time.monotonic())
            await state.pool.close(timeout=max(0.0, config.shutdown_grace_s - spent))
            logger.info("all models released")

    return lifespan


def _service_routes(state: ServerState) -> list[BaseRoute]:
    """The routes about the service itself: the page, health, metrics, the start-up report, the OpenAPI document."""

    async def live(request: Request) -> Response:
        return JSONResponse({"status": "alive", "uptime_s": round(time.time() - state.started_wall, 3)})

    async def startup(request: Request) -> Response:
        if state.startup_error is not None:
            return JSONResponse(state.health(request, "failed"), status_code=503)
        if not state.startup_done:
            body = state.health(request, "starting") | {"elapsed_ms": round(state.clock.now_ms(), 1)}
            return JSONResponse(body, status_code=503)
        body = state.health(request, "started") | {"ready_ms": state.clock.points.get("ready")}
        return JSONResponse(body)

    async def ready(request: Request) -> Response:
        ok = state.ready()
        status = "ready" if ok else ("draining" if state.draining else "not_ready")
        return JSONResponse(state.health(request, status), status_code=200 if ok else 503)

    async def index(request: Request) -> Response:
        return FileResponse(os.path.join(_STATIC, "index.html"), media_type="text/html")

    async def startup_report(request: Request) -> Response:
        report = state.metrics.startup_report()
        names = state.shown_models(request)
        if names is not None:
            report["models"] = {n: c for n, c in report["models"].items() if n in names}
        return JSONResponse(report)

    async def openapi(request: Request) -> Response:
        from cosyserve.server.openapi import openapi_document

        return JSONResponse(openapi_document(state.limits))

    return [
        Route("/", index, methods=["GET"]),
        Route("/health/live", live, methods=["GET"]),
        Route("/health/startup", startup, methods=["GET"]),
        Route("/health/ready", ready, methods=["GET"]),
        Route("/metrics", state.metrics.endpoint, methods=["GET"]),
        Route("/v1/startup", startup_report, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]


def _error_handlers(state: ServerState, params: dict[str, dict[str, str]]) -> dict[Any, Any]:
    """Errors as responses (cosyserve's with the route's names for the request's fields in ``params``), counted."""

    async def on_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, CosyserveError)
        path = getattr(request.scope.get("route"), "path", "unmatched")
        state.metrics.observe_error(path, status_of(exc), exc.code)
        return cosyserve_error_response(exc, params.get(path))

    async def on_starlette_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        path = cut(request.url.path)
        msg = {
            404: f"no route {path}",
            405: f"method {cut(request.method)} not allowed on {path}",
        }
        route = request.scope.get("route")
        state.metrics.observe_error(getattr(route, "path", "unmatched"), exc.status_code, "http")
        return error_response(exc.status_code, msg.get(exc.status_code, str(exc.detail)), headers=exc.headers)

    return {CosyserveError: on_error, HTTPException: on_starlette_error}


def _middleware(state: ServerState, paths: frozenset[str]) -> list[Middleware]:
    from cosyserve.server.auth import AuthMiddleware
    from cosyserve.server.bodies import BodyTimeout

    config = state.config
    middleware = [
        # outermost: a stalled body is timed out and counted whatever the route (cosyserve.server.bodies)
        Middleware(BodyTimeout, state=state),
        Middleware(AuthMiddleware, state=state, paths=paths),
        Middleware(LastResortMiddleware, metrics=state.metrics),
    ]
    if config.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        middleware.insert(
            1,
            Middleware(
                CORSMiddleware,
                allow_origins=list(config.cors_origins),
                allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                allow_headers=["Authorization", "Content-Type"],
                expose_headers=["X-Request-Id", "X-Sample-Rate", "Retry-After"],
            ),
        )
    return middleware


def create_app(
    config: Settings | None = None,
    *,
    pool: Any = None,
    worker: Any = None,
    ready_before_serving: bool = False,
    wyoming: Any = None,
) -> Starlette:
    """The cosyserve ASGI app (models load in the background once the lifespan starts).

    Args:
        config: the settings (default: read from the environment).
        pool: a ready-made pool (tests); default: built from the settings' pool config and models.
        worker: in a prefork worker, its :class:`cosyserve.server.prefork.WorkerLink` (the template's runtimes,
            the READY notice to the master, the workers' state on the health routes).
        ready_before_serving: the lifespan's startup waits until every preload model is READY and raises if one
            fails (a host that routes to the app once its startup returns, such as a Ray Serve replica); by
            default it returns at once and the health endpoints say when the models are ready.
        wyoming: a bound :class:`cosyserve.server.transports.wyoming.Listener`: the lifespan also serves the Wyoming
            protocol on it, from its start to its end (``cosyserve serve --wyoming-uri`` binds it).
    Returns:
        The Starlette app; its ``state.cosy`` is the :class:`ServerState`.
    """
    from cosyserve.server.transports import openai_api, reference_api, voices, ws

    config = config if config is not None else Settings.load()
    if wyoming is None and config.wyoming_uri is not None:
        # a host of the app that binds no Wyoming listener (a Ray Serve replica): the setting would do nothing
        logger.warning(
            "%s is set, but this host of the app serves HTTP only: `cosyserve serve` serves Wyoming",
            config.where("wyoming_uri"),
        )
    state = ServerState(config, pool=pool, worker=worker)

    openai_routes, reference_routes = openai_api.routes(state), reference_api.routes(state)
    voice_routes = voices.routes(state)
    routes: list[BaseRoute] = [
        *_service_routes(state),
        *openai_routes,
        *voice_routes,
        *ws.routes(state),
        *reference_routes,
    ]

    # each route's names for the request's fields, for the `param` of its errors
    params = (
        {r.path: openai_api.PARAMS for r in openai_routes}
        | {r.path: voices.PARAMS for r in voice_routes}
        | {r.path: reference_api.PARAMS for r in reference_routes}
    )

    app = Starlette(
        routes=routes,
        middleware=_middleware(state, frozenset(getattr(r, "path", "") for r in routes)),
        lifespan=_lifespan(state, wyoming, ready_before_serving),
        exception_handlers=_error_handlers(state, params),
    )
    app.state.cosy = state
    return app
