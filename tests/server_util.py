"""Servers for the tests, one module for every way a test starts one, and the one poll they all wait with.

- :func:`running_server` / :func:`start_server`: a real ``python -m cosyserve serve`` process on 127.0.0.1 in a
  session of its own, always stopped with its whole process group (prefork workers included), by the test or, when
  the test fails or the run is interrupted, by conftest's finalizers (:func:`stop_servers`). One per test module
  keeps runs short::

      @pytest.fixture(scope="module")
      def server(tiny_model_dir, tmp_path_factory):
          with running_server(tiny_model_dir, tmp_path_factory.mktemp("srv"), args=["--max-text-chars", "50"]) as s:
              yield s

  The child gets a clean environment: the caller's, minus every ``COSYSERVE_*`` variable and the deployment names
  (``MODEL_POOL_SIZE``, ``USE_MMAP_LOADING``, ``PREWARM_MODELS``) except the cache dir, plus ``src`` on
  ``PYTHONPATH``, ``COSYSERVE_REGISTRY_DIR`` in the server's own folder unless given, ``COSYSERVE_DRAIN_DELAY=0``
  (a stop closes the port at once; the tests of the drain window pass ``--drain-delay``), then ``env``. While it
  waits for ``/health/ready`` it keeps the first 503 answers of the health routes
  (:attr:`ServerProcess.before_ready`), so a test can check what a probe sees before the model is loaded.
- :func:`serve`: the app under a real uvicorn in a thread of the test's process, over :class:`FakeRuntime` (real
  sockets, a real WebSocket handshake, a browser, and a look at the engine and the runtime behind it)::

      with serve(FakeRuntime(chunk_len=50), ws_idle_timeout_s=0.5) as s:
          with s.connect() as ws: ...  # a `websockets` client on /v1/audio/speech/stream
          s.wait_until(lambda: s.engine.in_flight == 0, "the request ended")
- :func:`in_process`: the app in-process under starlette's ``TestClient`` (its lifespan runs the preload), ready
  when it yields.
- :func:`wait_until`: poll a condition with a generous bound. Tests wait for states this way, never by sleeping a
  fixed time: a loaded machine makes every step slower, and only the bound (reached on failure alone) is timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from proc_util import stop_group

if TYPE_CHECKING:
    from starlette.testclient import TestClient

    from cosyserve.core.settings import Settings
    from cosyserve.engine.quotas import Tenant
    from fake_runtime import FakeRuntime

__all__ = [
    "LIVE",
    "LOAD_S",
    "WAIT_S",
    "WS_PATH",
    "ServerProcess",
    "Served",
    "decoded",
    "in_process",
    "free_port",
    "post_and_hold",
    "running_server",
    "serve",
    "start_server",
    "stop_servers",
    "wait_ready",
    "wait_until",
]

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 30.0  # bound on a wait for a state reached in milliseconds (it is reached only when a test fails)
LOAD_S = 120.0  # bound on a wait that includes a model load (a second or two on the tiny models)
WS_PATH = "/v1/audio/speech/stream"
_DROP = ("MODEL_POOL_SIZE", "USE_MMAP_LOADING", "PREWARM_MODELS")
_KEEP = ("COSYSERVE_CACHE_DIR",)


OPENAI_CLIENTS: list[
    Any
] = []  # closed after each test (conftest): an unclosed one leaves its socket to the collector


def openai_client(server: ServerProcess, key: str, timeout: float = 60.0) -> Any:
    """The ``openai`` client for ``server``'s ``/v1`` with ``key``, no retries; closed when the test ends."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url("/v1"), api_key=key, max_retries=0, timeout=timeout)
    OPENAI_CLIENTS.append(client)
    return client


def wait_until(
    cond: Callable[[], object],
    what: str | Callable[[], str] = "the condition held",
    timeout_s: float = WAIT_S,
    poll_s: float = 0.01,
) -> None:
    """Poll ``cond`` until it is true; fail naming ``what`` (a string, or a function giving one, called then) once
    ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what() if callable(what) else what}")
        time.sleep(poll_s)


def decoded(data: bytes) -> tuple[Any, int]:
    """(int16 samples, rate) of an encoded audio file: libsndfile where it reads the format, else FFmpeg through
    PyAV (aac; the test skips where PyAV is not installed)."""
    import io

    import soundfile as sf

    try:
        return sf.read(io.BytesIO(data), dtype="int16")
    except sf.LibsndfileError:
        import numpy as np
        import pytest

        av = pytest.importorskip("av", reason="aac is decoded with PyAV (the aac extra)")
        with av.open(io.BytesIO(data)) as f:
            frames = list(f.decode(audio=0))
        pcm = np.concatenate([fr.to_ndarray().reshape(-1) for fr in frames])
        return (np.clip(pcm, -1, 1) * 32767).astype(np.int16), frames[0].sample_rate


def free_port() -> int:
    """A port nobody listens on right now (bind port 0 and let it go)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    """A running server: its process, base URL, log file and what the health routes said before it was ready."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    before_ready: dict[str, Any] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def client(self, **kwargs: Any) -> httpx.Client:
        kwargs.setdefault("timeout", 60.0)
        return httpx.Client(base_url=self.base_url, **kwargs)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM to the server, then SIGKILL to its whole process group (its session: the server and any prefork
        workers) once it has exited or after ``grace_s``: a worker it left behind, or a wait cut short by an
        interrupt, never outlives the test. Returns the exit code (None if it had to be killed)."""
        try:
            return stop_group(self.proc, grace_s)
        finally:
            LIVE[:] = [s for s in LIVE if s is not self]


LIVE: list[ServerProcess] = []  # started by start_server and not stopped yet, oldest first


def stop_servers(since: int = 0, grace_s: float = 2.0) -> None:
    """Stop (:meth:`ServerProcess.stop`) every server still running that :func:`start_server` started after the
    first ``since`` of :data:`LIVE`, newest first: conftest's finalizers, after each test (those the test
    started) and at the end of the session (all of them, an interrupted run included)."""
    while len(LIVE) > since:
        LIVE[-1].stop(grace_s)


def post_and_hold(
    server: ServerProcess, path: str, body: Any, headers: Mapping[str, str] | None = None
) -> socket.socket:
    """POST ``body`` as JSON over a plain socket and leave the connection open, unread: the caller closes it
    (a client that goes away, as ``curl -m`` does) while the server is still working on the request."""
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    for k, v in (headers or {}).items():
        head += f"{k}: {v}\r\n"
    head += f"Content-Length: {len(data)}\r\n\r\n"
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(head.encode() + data)
    return sock


def _child_env(workdir: Path, env: Mapping[str, str] | None) -> dict[str, str]:
    out = {
        k: v
        for k, v in os.environ.items()
        if not ((k.startswith("COSYSERVE_") and k not in _KEEP) or k in _DROP)
    }
    out["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    out.setdefault("COSYSERVE_CACHE_DIR", str(workdir / "cache"))
    out["COSYSERVE_REGISTRY_DIR"] = str(workdir / "registry")
    out["PYTHONUNBUFFERED"] = "1"
    out["COSYSERVE_DRAIN_DELAY"] = "0"
    out.update(env or {})
    return out


def start_server(
    model: str | os.PathLike[str] | None,
    workdir: Path,
    *,
    env: Mapping[str, str] | None = None,
    args: Sequence[str] = (),
    ready_timeout_s: float = 90.0,
    wait_ready: bool = True,
    port: int | None = None,
) -> ServerProcess:
    """Spawn ``cosyserve serve`` (``model`` None: the demo model) in a session of its own and wait until
    ``/health/ready`` is 200.

    The caller stops it (:meth:`ServerProcess.stop`, or :func:`running_server`); one a test leaves running, failed
    or interrupted, is stopped with its whole process group by conftest's finalizers (:func:`stop_servers`). Raises RuntimeError with the
    server's log when it exits or is not ready within ``ready_timeout_s``; a port taken between picking and
    binding is retried with another one, unless ``port`` names the one to use.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    tries = 3 if port is None else 1
    for attempt in range(tries):
        at = free_port() if port is None else port
        log_path = workdir / f"server-{at}.log"
        cmd = [sys.executable, "-m", "cosyserve", "serve", "--host", "127.0.0.1", "--port", str(at)]
        if model is not None:
            cmd += ["--model", str(model)]
        cmd += list(args)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd,
                cwd=str(ROOT),
                env=_child_env(workdir, env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        server = ServerProcess(proc, at, log_path)
        LIVE.append(server)
        if not wait_ready:
            return server
        try:
            _wait_ready(server, ready_timeout_s)
            return server
        except BaseException as e:
            server.stop(grace_s=5)
            text = server.log()
            if attempt < tries - 1 and "address already in use" in text.lower():
                continue
            if isinstance(e, RuntimeError):
                raise RuntimeError(f"{e}\n--- server log ({log_path}) ---\n{text[-6000:]}") from None
            raise
    raise AssertionError("unreachable")


def _body(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return r.text


def _wait_ready(server: ServerProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=server.base_url, timeout=5.0) as c:
        while True:
            if server.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {server.proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready within {timeout_s:.0f} s")
            try:
                r = c.get("/health/ready")
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            if r.status_code == 200:
                return
            if "ready" not in server.before_ready:
                # what a probe sees while the model loads; taken at once, before the load can finish
                server.before_ready["ready"] = (r.status_code, _body(r))
                for path in ("/health/live", "/health/startup"):
                    rr = c.get(path)
                    server.before_ready[path.rsplit("/", 1)[1]] = (rr.status_code, _body(rr))
            time.sleep(0.05)


@contextlib.contextmanager
def running_server(
    model: str | os.PathLike[str] | None,
    workdir: Path,
    *,
    env: Mapping[str, str] | None = None,
    args: Sequence[str] = (),
    ready_timeout_s: float = 90.0,
) -> Iterator[ServerProcess]:
    """:func:`start_server` as a context manager: the process is stopped (killed if need be) on exit."""
    server = start_server(model, workdir, env=env, args=args, ready_timeout_s=ready_timeout_s)
    try:
        yield server
    finally:
        server.stop()


# --- the app in this process --------------------------------------------------------------------------------------


class Served:
    """The app under uvicorn on 127.0.0.1 (model ``m``), its state, its event loop and its fake runtime."""

    def __init__(self, app: Any, fake: FakeRuntime, port: int, wyoming: Any = None) -> None:
        self.app = app
        self.state = app.state.cosy
        self.fake = fake
        self.port = port
        self.wyoming = (
            wyoming  # the Wyoming listener (cosyserve.server.transports.wyoming.Listener), when served
        )
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

    def client(self, **kwargs: Any) -> httpx.Client:
        """An httpx client of the server's HTTP routes."""
        kwargs.setdefault("timeout", WAIT_S)
        return httpx.Client(base_url=self.url("", "http"), **kwargs)

    def connect(self, **kwargs: Any) -> Any:
        """A `websockets` client connection to the WebSocket route (no proxy, no compression)."""
        from websockets.sync.client import connect

        kwargs.setdefault("open_timeout", WAIT_S)
        return connect(self.url(), proxy=None, compression=None, **kwargs)

    def wait_until(self, cond: Callable[[], bool], what: str) -> None:
        """Poll ``cond`` until it holds, for at most WAIT_S."""
        wait_until(cond, what, poll_s=0.01)

    @property
    def wyoming_uri(self) -> str:
        """Where the Wyoming listener listens (``serve(..., wyoming_uri=...)``)."""
        assert self.wyoming is not None, "serve(..., wyoming_uri=...) serves Wyoming"
        return str(self.wyoming.address)


@contextlib.contextmanager
def serve(
    fake: FakeRuntime | None = None,
    *,
    tenants: tuple[Tenant, ...] = (),
    **settings: Any,
) -> Iterator[Served]:
    """Serve model ``m`` (``fake``, default a plain :class:`FakeRuntime`) with ``settings`` over the defaults
    (no environment), ready when this yields; stopped on exit. ``wyoming_uri`` among the settings (e.g.
    ``tcp://127.0.0.1:0``) serves Wyoming beside HTTP, bound as ``serve`` binds it (:attr:`Served.wyoming_uri`)."""
    import uvicorn

    from cosyserve.core.settings import Settings
    from cosyserve.engine.pool import ModelPool, ModelSpec
    from cosyserve.server.app import create_app
    from cosyserve.server.run import _QuietStreamCuts, uvicorn_options
    from fake_runtime import FakeRuntime

    # as `serve` sets its logging up (less the root handler and level, which are pytest's): a stream cut short
    # is one WARNING, without uvicorn's traceback
    uv = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _QuietStreamCuts) for f in uv.filters):
        uv.addFilter(_QuietStreamCuts())
    runtime = fake or FakeRuntime()
    pool = ModelPool(
        [ModelSpec("m", policy="preload")],
        tenants=tenants,
        load_model=lambda spec, reload: runtime,
        memory_probe=None,
    )
    cfg = Settings.load(env={}).replace(**settings) if settings else Settings.load(env={})
    from cosyserve.server.run import bind_wyoming

    wyoming = bind_wyoming(cfg)
    app = create_app(cfg, pool=pool, wyoming=wyoming)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    served = Served(app, runtime, sock.getsockname()[1], wyoming)
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
        if wyoming is not None:
            wyoming.close()
        assert not thread.is_alive(), "the server did not stop"


@contextlib.contextmanager
def in_process(
    settings: Settings | None = None, *, pool: Any = None, ready: bool = True, timeout_s: float = LOAD_S
) -> Iterator[TestClient]:
    """The app of ``settings`` (default: from the environment) in this process under starlette's ``TestClient``,
    whose lifespan starts the preload; with ``ready`` it yields once ``/health/ready`` answers 200 (failing with
    what ``/health/startup`` says after ``timeout_s``), else at once."""
    from starlette.testclient import TestClient

    from cosyserve.core.settings import Settings
    from cosyserve.server.app import create_app

    with TestClient(create_app(settings or Settings.load(), pool=pool)) as client:
        if ready:
            wait_ready(client, timeout_s)
        yield client


def wait_ready(client: TestClient | httpx.Client, timeout_s: float = LOAD_S) -> None:
    """Poll ``/health/ready`` until it answers 200; fail with what ``/health/startup`` says after ``timeout_s``."""
    wait_until(
        lambda: client.get("/health/ready").status_code == 200,
        lambda: f"ready: /health/startup says {client.get('/health/startup').json()}",
        timeout_s,
    )
