"""The app under a real uvicorn on 127.0.0.1, in a thread of the test's process, over :class:`FakeRuntime`.

For the tests that need a real server (real sockets, a real WebSocket handshake, a browser) and also a look at the
engine and the runtime behind it, or a runtime that answers predictably::

    with serve(FakeRuntime(chunk_len=50), ws_idle_timeout_s=0.5) as s:
        with s.connect() as ws: ...  # a `websockets` client on /v1/audio/speech/stream
        s.wait_until(lambda: s.engine.in_flight == 0, "the request ended")
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from cosyserve.engine.pool import ModelPool, ModelSpec
from cosyserve.engine.quotas import Tenant
from cosyserve.server.app import create_app
from cosyserve.server.run import uvicorn_options
from cosyserve.settings import Settings
from fake_runtime import FakeRuntime

__all__ = ["WAIT_S", "WS_PATH", "Served", "serve"]

WAIT_S = 30.0  # bound on every wait for the server; each step takes milliseconds
WS_PATH = "/v1/audio/speech/stream"


class Served:
    """The app under uvicorn on 127.0.0.1 (model ``m``), its state, its event loop and its fake runtime."""

    def __init__(self, app: Any, fake: FakeRuntime, port: int) -> None:
        self.app = app
        self.state = app.state.cosy
        self.fake = fake
        self.port = port
        self.loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # the app, seen by uvicorn through this: the loop is the one its first call (the lifespan) runs on
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        await self.app(scope, receive, send)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the server's loop (as a signal handler would)."""
        assert self.loop is not None
        self.loop.call_soon_threadsafe(fn, *args)

    def tasks(self) -> int:
        """asyncio tasks alive on the server's loop."""
        assert self.loop is not None

        async def count() -> int:
            return len(asyncio.all_tasks())

        return asyncio.run_coroutine_threadsafe(count(), self.loop).result(WAIT_S)

    def url(self, path: str = WS_PATH, scheme: str = "ws") -> str:
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    @property
    def engine(self) -> Any:
        return self.state.pool.engine("m")

    def connect(self, **kwargs: Any) -> Any:
        """A `websockets` client connection to the WebSocket route (no proxy, no compression)."""
        from websockets.sync.client import connect

        kwargs.setdefault("open_timeout", WAIT_S)
        return connect(self.url(), proxy=None, compression=None, **kwargs)

    def wait_until(self, cond: Callable[[], bool], what: str) -> None:
        """Poll ``cond`` until it holds, for at most WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while not cond():
            assert time.monotonic() < deadline, f"never: {what}"
            time.sleep(0.01)


@contextlib.contextmanager
def serve(
    fake: FakeRuntime | None = None,
    *,
    tenants: tuple[Tenant, ...] = (),
    **settings: Any,
) -> Iterator[Served]:
    """Serve model ``m`` (``fake``, default a plain :class:`FakeRuntime`) with ``settings`` over the defaults
    (no environment), ready when this yields; stopped on exit."""
    fake = fake or FakeRuntime()
    pool = ModelPool(
        [ModelSpec("m", policy="preload")],
        tenants=tenants,
        load_model=lambda spec, reload: fake,
        memory_probe=None,
    )
    cfg = Settings.load(env={}).replace(**settings) if settings else Settings.load(env={})
    app = create_app(cfg, pool=pool)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    served = Served(app, fake, sock.getsockname()[1])
    opts = uvicorn_options(cfg) | {"log_level": "warning"}
    opts.pop("host"), opts.pop("port")
    server = uvicorn.Server(uvicorn.Config(served, **opts))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        served.wait_until(lambda: server.started and served.state.ready(), "the server was ready")
        yield served
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"
