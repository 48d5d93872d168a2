"""Start a real ``python -m cosyserve serve`` process on 127.0.0.1 for tests, and always stop it.

Usage (one server per test module keeps runs short)::

    @pytest.fixture(scope="module")
    def server(tiny_model_dir, tmp_path_factory):
        with running_server(tiny_model_dir, tmp_path_factory.mktemp("srv"), args=["--max-text-chars", "50"]) as s:
            yield s

The child gets a clean environment: the caller's, minus every ``COSYSERVE_*`` variable and the deployment names
(``MODEL_POOL_SIZE``, ``USE_MMAP_LOADING``, ``PREWARM_MODELS``) except the cache dir, plus ``src`` on
``PYTHONPATH``, ``COSYSERVE_REGISTRY_DIR`` in the server's own folder unless given, ``COSYSERVE_DRAIN_DELAY=0`` (a
stop closes the port at once; the tests of the drain window pass ``--drain-delay``), then ``env``. While it waits
for ``/health/ready`` it keeps the first 503 answers of the health routes (:attr:`ServerProcess.before_ready`),
so a test can check what a probe sees before the model is loaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

__all__ = ["ServerProcess", "free_port", "post_and_hold", "running_server", "start_server"]

ROOT = Path(__file__).resolve().parents[1]
_DROP = ("MODEL_POOL_SIZE", "USE_MMAP_LOADING", "PREWARM_MODELS")
_KEEP = ("COSYSERVE_CACHE_DIR",)


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
        """SIGTERM, then SIGKILL after ``grace_s``; returns the exit code (None if it had to be killed)."""
        if self.proc.poll() is not None:
            return self.proc.returncode
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the server and any workers
            self.proc.wait(10)
            return None


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
) -> ServerProcess:
    """Spawn ``cosyserve serve`` (``model`` None: the demo model) and wait until ``/health/ready`` is 200.

    The caller must :meth:`ServerProcess.stop` it (or use :func:`running_server`). Raises RuntimeError with the
    server's log when it exits or is not ready within ``ready_timeout_s``; a port taken between picking and
    binding is retried with another one.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    for attempt in range(3):
        port = free_port()
        log_path = workdir / f"server-{port}.log"
        cmd = [sys.executable, "-m", "cosyserve", "serve", "--host", "127.0.0.1", "--port", str(port)]
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
        server = ServerProcess(proc, port, log_path)
        if not wait_ready:
            return server
        try:
            _wait_ready(server, ready_timeout_s)
            return server
        except BaseException as e:
            server.stop(grace_s=5)
            text = server.log()
            if attempt < 2 and "address already in use" in text.lower():
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
