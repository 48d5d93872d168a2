"""`cosyserve serve --workers N`: a template loads the models once, N workers forked from it serve them.

The serve process itself is the template and then the master (Linux: fork without exec). Its workers share the
template's pages copy-on-write: the imported code and its objects, the runtimes' modules and their mapped
weights, the warmed-up caches. What is made where, and why:

Before the fork, in the template (one thread from start to fork; a check refuses to fork with more):
  - the imports: torch and the runtime's modules, starlette, uvicorn, prometheus_client (whose multiprocess mode
    is chosen at import from ``PROMETHEUS_MULTIPROC_DIR``, so the shared metrics directory is made first);
  - each preload model's runtimes (its ``instances``), loaded with ``fork_template``: weights mapped (and paged
    in for the ``preload`` strategy), the LM and the flow/vocoder warmed up and the text tier built, all in the
    calling thread and on ONE intra-op thread: a libgomp team made before fork() leaves its children waiting
    forever on threads they do not have;
  - the listening socket, bound once: every worker accepts on it (the kernel spreads the connections); so is the
    Wyoming listener's (``--wyoming-uri``), on which every worker's app serves Wyoming;
  - the garbage collector: held off since process start (``cosyserve.system.gchold``) and ``gc.freeze()`` right before
    each fork, so no collection in a worker writes the template's objects' headers (each write would make a
    page private: ~96 MB per worker without it).
Nothing in the template holds a lock, an event loop, an ONNX session (its own thread pools) or a connection.

After the fork, in each worker: ``Runtime.after_fork`` (the intra-op threads: ``--threads``, else the cores
divided among the workers, see :func:`worker_threads`; the zero-shot tier's ONNX
sessions when asked for in the background), the app (pool, engines and their threads, metrics files), the event
loop and uvicorn's signal handlers; on READY a byte on a pipe tells the master. A worker dies with its master
(``PR_SET_PDEATHSIG``).

The master (the template, after its first fork) runs one thread: a loop over signals and the workers' pipes. It
replaces a worker that dies with a fresh fork at once (after a back-off, growing to 5 s, while workers keep dying
before READY; a worker that fails its start-up with exit code 3, or the tenth in a row to die before READY, stops
the server with code 3; one not READY within ``--worker-ready-timeout`` is killed and counts as such a
death; SIGTERM while the template loads exits 0 without forking), keeps the pool's
state in a file every worker's health routes show (``workers``: wanted, alive, ready, restarts), and on
SIGTERM/SIGINT closes its copy of the socket, passes SIGTERM to every worker (each drains as a single server
does), waits for them and exits 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import gc
import json
import logging
import os
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cosyserve.core.settings import Settings
from cosyserve.server.run import bind_wyoming, run_app, uvicorn_options, wyoming_unbound
from cosyserve.system.staging import LockedDir

if TYPE_CHECKING:
    from cosyserve.runtime import Runtime

logger = logging.getLogger("cosyserve.prefork")

__all__ = ["WorkerLink", "serve_prefork", "worker_threads"]

_MULTIPROC = "PROMETHEUS_MULTIPROC_DIR"
_RUN_DIR_PREFIX = "cosyserve-metrics-"  # in the temp dir: the metrics files and the pool's state
_STATUS = "workers.json"
_MAX_BACKOFF_S = 5.0
_MAX_EARLY_DEATHS = 10  # workers in a row that die before READY (~20 s of back-off): the start is broken
_PR_SET_PDEATHSIG = 1


class WorkerLink:
    """A forked worker's side of the master: the template's runtimes, the READY notice, the pool's state.

    Args:
        slot: the worker's index (0 .. N-1; a replacement takes the slot of the worker it replaces).
        runtimes: the template's runtimes by model name (the worker's pool takes them as ``preloaded``).
        ready_fd: the pipe to the master (one byte on READY).
        status_path: the master's file of the pool's state.
    """

    def __init__(
        self, slot: int, runtimes: dict[str, list[Runtime]], ready_fd: int, status_path: str
    ) -> None:
        self.slot = slot
        self.runtimes = runtimes
        self._ready_fd = ready_fd
        self._status_path = status_path

    def notify_ready(self) -> None:
        """Tell the master this worker is READY (once)."""
        if self._ready_fd >= 0:
            with contextlib.suppress(OSError):
                os.write(self._ready_fd, b"R")
                os.close(self._ready_fd)
            self._ready_fd = -1

    def status(self) -> dict[str, Any]:
        """The pool of workers as the master last wrote it, plus this worker's pid and slot."""
        try:
            with open(self._status_path, encoding="utf-8") as f:
                out: dict[str, Any] = json.load(f)
        except (OSError, ValueError):
            out = {}
        out.update(pid=os.getpid(), slot=self.slot)
        return out


@dataclass
class _Worker:
    slot: int
    pid: int
    fd: int  # read end of its READY pipe
    forked: float  # monotonic
    ready_ms: float | None = None
    stop_sent: bool = False


@dataclass
class _Master:
    settings: Settings
    sock: socket.socket | None
    runtimes: dict[str, list[Runtime]]
    run_dir: str
    wyoming: Any = None  # the Wyoming listener (cosyserve.server.transports.wyoming.Listener), when asked for
    workers: dict[int, _Worker] = field(default_factory=dict)  # by pid
    restarts: int = 0
    early_deaths: int = 0  # deaths before READY since the last READY
    stopping: float | None = None  # monotonic, once SIGTERM/SIGINT came
    exit_code: int = 0
    respawn_at: dict[int, float] = field(default_factory=dict)  # slot -> monotonic
    signals: list[int] = field(default_factory=list)
    baseline_threads: int = 1

    @property
    def status_path(self) -> str:
        return os.path.join(self.run_dir, _STATUS)

    # -- forking ---------------------------------------------------------------------------------------------

    def fork(self, slot: int, wake: int, sel: selectors.BaseSelector) -> None:
        assert self.sock is not None
        _check_threads(self.baseline_threads)
        r, w = os.pipe()
        gc.freeze()  # what the template built is never scanned in the worker: its pages stay shared
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                os.close(r)
                sel.close()
                signal.set_wakeup_fd(-1)
                os.close(wake)
                for other in self.workers.values():
                    os.close(other.fd)
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
                    signal.signal(sig, signal.SIG_DFL)
                _die_with_parent()
                code = _worker_main(
                    self.settings,
                    self.sock,
                    WorkerLink(slot, self.runtimes, w, self.status_path),
                    self.wyoming,
                )
            except BaseException:  # noqa: BLE001 - the worker's last word, then its exit code
                logger.exception("worker %d failed", os.getpid())
            finally:
                logging.shutdown()
                os._exit(code)
        os.close(w)
        self.workers[pid] = _Worker(slot, pid, r, time.monotonic())
        sel.register(r, selectors.EVENT_READ, pid)
        logger.info("worker %d (slot %d) forked", pid, slot)
        self.write_status()

    # -- events ----------------------------------------------------------------------------------------------

    def on_ready_pipe(self, pid: int, sel: selectors.BaseSelector) -> None:
        w = self.workers.get(pid)
        if w is None:
            return
        try:
            data = os.read(w.fd, 16)
        except OSError:
            data = b""
        sel.unregister(w.fd)
        if data and w.ready_ms is None:
            w.ready_ms = (time.monotonic() - w.forked) * 1e3
            self.early_deaths = 0
            logger.info("worker %d ready %.1f ms after its fork", pid, w.ready_ms)
            self.write_status()

    def kill_stuck(self, now: float) -> None:
        """Kill a worker not READY within ``worker_ready_timeout_s`` of its fork (a hang in its start-up: a
        deadlock, a lost pipe); its death is then handled like any death before READY (a fresh fork after a
        back-off, the server stops after too many in a row)."""
        limit = self.settings.worker_ready_timeout_s
        for w in self.workers.values():
            if w.ready_ms is None and not w.stop_sent and now - w.forked > limit:
                logger.error("worker %d not READY %.0f s after its fork: killing it", w.pid, limit)
                w.stop_sent = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGKILL)

    def reap(self, sel: selectors.BaseSelector) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            w = self.workers.pop(pid, None)
            if w is None:
                continue
            with contextlib.suppress(KeyError, ValueError):
                sel.unregister(w.fd)
            os.close(w.fd)
            code = os.waitstatus_to_exitcode(status)
            if self.stopping is not None:
                logger.info("worker %d exited (%s)", pid, _describe(code))
                self.write_status()
                continue
            self.on_death(w, code)

    def on_death(self, w: _Worker, code: int) -> None:
        from cosyserve.server.app import STARTUP_FAILURE

        if w.ready_ms is None:
            self.early_deaths += 1
        if w.ready_ms is None and (code == STARTUP_FAILURE or self.early_deaths >= _MAX_EARLY_DEATHS):
            logger.error(
                "worker %d died before READY (%s; %d in a row): stopping the server",
                w.pid,
                _describe(code),
                self.early_deaths,
            )
            self.exit_code = STARTUP_FAILURE
            self.begin_stop(signal.SIGTERM)
            return
        delay = 0.0
        if w.ready_ms is None:
            delay = min(_MAX_BACKOFF_S, 0.05 * 2 ** (self.early_deaths - 1))
        self.restarts += 1
        logger.warning(
            "worker %d (slot %d) died (%s); a fresh fork replaces it%s",
            w.pid,
            w.slot,
            _describe(code),
            f" in {delay:.2f} s" if delay else "",
        )
        self.respawn_at[w.slot] = time.monotonic() + delay
        self.write_status()

    def begin_stop(self, signum: int) -> None:
        first = self.stopping is None
        if first:
            self.stopping = time.monotonic()
            self.respawn_at.clear()
            logger.info(
                "%s: draining %d worker(s), then exiting", signal.Signals(signum).name, len(self.workers)
            )
            if self.sock is not None:
                self.sock.close()  # the port closes once the last worker closes its copy
                self.sock = None
            if self.wyoming is not None:
                self.wyoming.sock.close()  # the same for the Wyoming listener
        for w in self.workers.values():
            # SIGTERM for either signal: each worker drains as a single server does (a worker that got Ctrl+C
            # from the terminal itself already stops at once; a SIGTERM after it changes nothing)
            if first or not w.stop_sent:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGTERM)
                w.stop_sent = True
        self.write_status()

    def write_status(self) -> None:
        body = {
            "wanted": self.settings.workers,
            "alive": len(self.workers),
            "ready": sum(1 for w in self.workers.values() if w.ready_ms is not None),
            "restarts": self.restarts,
            "stopping": self.stopping is not None,
            "pids": sorted(self.workers),
        }
        tmp = f"{self.status_path}.tmp"
        with contextlib.suppress(OSError):
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(body, f)
            os.replace(tmp, self.status_path)

    # -- the loop --------------------------------------------------------------------------------------------

    def run(self) -> int:
        sel = selectors.DefaultSelector()
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        sel.register(wake_r, selectors.EVENT_READ, None)
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)}
        signal.signal(signal.SIGTERM, lambda signum, _: self.signals.append(signum))
        signal.signal(signal.SIGINT, lambda signum, _: self.signals.append(signum))
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the loop through the wakeup fd
        old_wake = signal.set_wakeup_fd(wake_w)
        s = self.settings
        # past this the master kills what still runs: the drain delay, the grace, uvicorn's backstop and a margin
        kill_after = s.drain_delay_s + s.shutdown_grace_s + 15.0
        try:
            for slot in range(s.workers):
                self.fork(slot, wake_r, sel)
            while self.workers or (self.stopping is None and self.respawn_at):
                now = time.monotonic()
                timeout = 1.0
                if self.respawn_at:
                    timeout = max(0.0, min(timeout, min(self.respawn_at.values()) - now))
                for key, _ in sel.select(timeout):
                    if key.data is None:
                        with contextlib.suppress(BlockingIOError):
                            while os.read(wake_r, 512):
                                pass
                    else:
                        self.on_ready_pipe(key.data, sel)
                while self.signals:
                    self.begin_stop(self.signals.pop(0))
                self.reap(sel)
                now = time.monotonic()
                if self.stopping is None:
                    self.kill_stuck(now)
                for slot, at in list(self.respawn_at.items()):
                    if at <= now and self.stopping is None:
                        del self.respawn_at[slot]
                        self.fork(slot, wake_r, sel)
                if self.stopping is not None and now - self.stopping > kill_after:
                    for w in self.workers.values():
                        logger.error(
                            "worker %d still runs %.0f s after the stop: killing it", w.pid, kill_after
                        )
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(w.pid, signal.SIGKILL)
                    self.stopping = now  # the next kill, if any, after as long again
        finally:
            signal.set_wakeup_fd(old_wake)
            for sig, h in previous.items():
                signal.signal(sig, h)
            sel.close()
            os.close(wake_r)
            os.close(wake_w)
            if self.sock is not None:
                self.sock.close()
        logger.info("all workers stopped")
        return self.exit_code


def _describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit code {code}"


def _die_with_parent() -> None:
    """SIGTERM this worker when the master dies (even by SIGKILL): no orphan keeps serving the port."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
    if os.getppid() == 1:  # the master died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)


def _threads() -> list[str]:
    """The names of this process's OS threads (native ones included), from /proc."""
    out = []
    for tid in sorted(os.listdir("/proc/self/task")):
        try:
            out.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
        except OSError:
            continue  # ended between the listing and the read
    return out


def _check_threads(baseline: int) -> None:
    """Refuse to fork from a template that runs a thread of its own: its locks would stay held in the worker.

    ``baseline``: the OS threads the imports alone leave (numpy's OpenBLAS keeps a pool, which it stops itself
    before a fork, from a ``pthread_atfork`` handler); any more (a libgomp team, an ONNX Runtime pool) refuses.
    """
    for t in threading.enumerate():
        if t is not threading.main_thread():
            t.join(60.0)  # e.g. the CLI's read-ahead of the bundles: bounded by reading them once
    alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    names = _threads()
    if alive or len(names) > baseline:
        raise RuntimeError(
            f"the prefork template runs {len(names)} threads ({', '.join(alive or names)}; the imports leave "
            f"{baseline}): forking it would hang its workers. Something started a thread before the fork: load "
            "with fork_template, and start threads in Runtime.after_fork"
        )


def _worker_main(settings: Settings, sock: socket.socket, link: WorkerLink, wyoming: Any = None) -> int:
    from cosyserve.server.app import create_app

    for runtimes in link.runtimes.values():
        for rt in runtimes:
            rt.after_fork()
    # the models this worker loads itself (lazy ones, reloads) get the same share of the cores
    settings = dataclasses.replace(settings, threads=worker_threads(settings))
    return run_app(create_app(settings, worker=link, wyoming=wyoming), settings, sockets=[sock])


class _Stopped(BaseException):
    """SIGTERM/SIGINT while the template loads: nothing to drain yet."""


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    def stop(signum: int, frame: Any) -> None:
        raise _Stopped(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


def worker_threads(settings: Settings) -> int:
    """Each worker's torch threads: ``--threads``, else the cores this process may use divided among the workers.

    Every worker taking every core (torch's default) oversubscribes them as soon as two workers compute: their
    OpenMP teams spin against each other (full-size, 2 workers on 2 cores: each request ~4-8x slower than alone,
    bench/prefork.py). A lone request then runs on its worker's share only.
    """
    if settings.threads is not None:
        return int(settings.threads)
    return max(1, len(os.sched_getaffinity(0)) // settings.workers)


def _load_template(settings: Settings) -> dict[str, list[Any]]:
    """The template's runtimes: every preload model's instances, loaded in this thread with ``fork_template``."""
    from cosyserve.core.settings import DEMO_MODEL, ModelArg
    from cosyserve.engine.poolfile import build_pool, load_pool_config
    from cosyserve.runtime import RuntimeOptions

    args = (ModelArg(DEMO_MODEL, DEMO_MODEL),) if settings.demo else settings.model_args()
    cfg = load_pool_config(settings, preload=args)
    options = RuntimeOptions.from_settings(settings, fork_template=True, threads=worker_threads(settings))
    pool = build_pool(cfg, runtime_options=options)
    t0 = time.perf_counter()
    out = {name: pool.load_instances(name) for name in pool.names if pool.spec(name).policy == "preload"}
    logger.info(
        "template loaded %s in %.0f ms; forking %d workers",
        ", ".join(f"{n} x{len(r)}" for n, r in out.items()) or "no preload model",
        (time.perf_counter() - t0) * 1e3,
        settings.workers,
    )
    return out


async def _no_app(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("the template serves nothing")


def _bind(settings: Settings) -> socket.socket:
    """The listening socket, bound by uvicorn's own code (address family, SO_REUSEADDR; a taken port: its error
    message and SystemExit(3)); its protocol modules imported on the way, as each worker's start would."""
    import uvicorn

    config = uvicorn.Config(_no_app, **uvicorn_options(settings))
    config.load()  # the HTTP, websocket and lifespan modules it picks: imported once, here, not per worker
    return config.bind_socket()


def serve_prefork(settings: Settings) -> int:
    """Load the models once, fork ``settings.workers`` workers that share them, supervise them until SIGTERM.

    Args:
        settings: the server's settings (``workers`` > 1).
    Returns:
        The exit code: 0 after the workers drained, 3 when a preload model failed to load (in the template, or
        in a worker's start-up).
    """
    from cosyserve.core.errors import SettingsError
    from cosyserve.server.app import STARTUP_FAILURE

    if not sys.platform.startswith("linux"):
        raise SettingsError(
            f"--workers {settings.workers} forks workers from a template process, which needs Linux (this is "
            f"{sys.platform}); run --workers 1 per process behind a load balancer instead"
        )
    # before prometheus_client is imported (it picks its value class at import); always a fresh directory of
    # ours: files left by another run would add to our counts. It stays locked while this process or a worker
    # lives, so that one left by a master killed with SIGKILL is removed by the next start (cosyserve.system.staging)
    owned = LockedDir(_RUN_DIR_PREFIX)
    run_dir = str(owned.path)
    saved = os.environ.get(_MULTIPROC)
    os.environ[_MULTIPROC] = run_dir
    try:
        # numpy's BLAS pool is a thread the template may hold (see _check_threads); so is the one native thread
        # that importing ONNX Runtime starts, imported here when a model may run on the lite runtime (the
        # setting, or a pool file, which may name it per model): forked workers do without that thread, and open
        # their sessions after the fork. A torch-only template leaves it to the workers that need it.
        import numpy  # noqa: F401

        if settings.runtime == "lite" or settings.pool_config is not None:
            import onnxruntime  # noqa: F401
        import prometheus_client  # noqa: F401 - imported once, in the template, in multiprocess mode

        import cosyserve.server.app  # noqa: F401 - the app's modules are the template's too
        import cosyserve.server.metrics  # noqa: F401
        import cosyserve.server.transports.openai_api  # noqa: F401
        import cosyserve.server.transports.reference_api  # noqa: F401

        # the native threads the imports leave (Python's own, e.g. the CLI's read-ahead of the bundles, end first)
        baseline = len(_threads()) - (threading.active_count() - 1)
        sock = _bind(settings)  # first: a taken port fails the start before the load, not after
        try:
            wyoming = bind_wyoming(settings)
        except OSError as e:
            sock.close()
            return wyoming_unbound(e, settings)
        except BaseException:
            sock.close()
            raise
        try:
            with _stop_on_signals():  # until the master's loop takes the signals over
                try:
                    runtimes = _load_template(settings)
                except Exception as e:  # noqa: BLE001 - the cause is logged; the exit code says start-up failed
                    sock.close()
                    logger.error("start-up failed: %s", e, exc_info=logger.isEnabledFor(logging.DEBUG))
                    return STARTUP_FAILURE
                master = _Master(
                    settings, sock, runtimes, run_dir, baseline_threads=baseline, wyoming=wyoming
                )
                return master.run()
        except _Stopped as e:
            sock.close()
            logger.info("%s during the start: stopped before any worker started", e)
            return 0
        finally:
            if wyoming is not None:
                wyoming.close()
    except OSError as e:
        if e.errno == errno.EAGAIN:
            logger.error("fork failed: %s", e)
            return 1
        raise
    finally:
        owned.remove()
        if saved is None:
            os.environ.pop(_MULTIPROC, None)
        else:
            os.environ[_MULTIPROC] = saved
