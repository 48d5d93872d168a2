"""Start-up phase timing: one clock that the loader, the startup report and the server's metrics all read.

Phases are named spans in milliseconds since the process started. The process start is taken from the
``COSYSERVE_SPAWN_T0`` environment variable when a parent that spawned us set it (``time.time()`` just before
exec: exact), else from ``/proc/self/stat`` (clock-tick resolution, ~10 ms), else from the first import of
this module.
"""

from __future__ import annotations

import functools
import gc
import os
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "PHASES",
    "PhaseClock",
    "collect_frozen",
    "gc_held",
    "hold_gc",
    "libc",
    "process_start_time",
    "read_range",
    "release_gc",
    "resident_map",
]

# the phases of a start, in order; "ready" and "first_audio" are points measured from process start
PHASES = (
    "interpreter",
    "imports",
    "manifest",
    "construct",
    "map_assign",
    "verify",  # waiting for checksums still running after construction (files not verified before)
    "first_touch",
    "warmup",
    "ready",
    "first_audio",
    "text_tier",  # after READY, in the background (tokenizer, wetext), unless COSYSERVE_TEXT_TIER=lazy
    "warmup_token2wav",  # after READY, in the background: the flow's and the vocoder's warm-up
    "zero_shot_tier",  # after READY, in the background, when COSYSERVE_ZERO_SHOT_TIER=background
)

_MODULE_T0 = time.time()


def _proc_start_time() -> float | None:
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read().decode()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except OSError:
        return None
    # field 22 (starttime, clock ticks since boot) comes after the parenthesised command name
    fields = stat[stat.rindex(")") + 2 :].split()
    ticks = int(fields[19])
    hz = os.sysconf("SC_CLK_TCK")
    return time.time() - uptime + ticks / hz


def process_start_time() -> float:
    """Wall-clock time (``time.time()``) at which this process was started."""
    env = os.environ.get("COSYSERVE_SPAWN_T0")
    if env:
        try:
            return float(env)
        except ValueError:
            raise ValueError(f"COSYSERVE_SPAWN_T0 must be a float timestamp, got {env!r}") from None
    start = _proc_start_time()
    return start if start is not None and start <= _MODULE_T0 else _MODULE_T0


@functools.cache
def libc() -> Any:
    """The C library through ctypes (calls through it release the GIL), with ``errno`` kept."""
    import ctypes
    import ctypes.util

    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class PhaseClock:
    """Records phase durations (ms), when each phase first started and points in time (both ms since process
    start); thread-safe. A phase that runs in several threads or several times sums its durations."""

    def __init__(self, t0: float | None = None) -> None:
        self.t0 = process_start_time() if t0 is None else t0
        self.durations: dict[str, float] = {}
        self.starts: dict[str, float] = {}
        self.points: dict[str, float] = {}
        self._lock = threading.Lock()

    def now_ms(self) -> float:
        return (time.time() - self.t0) * 1e3

    def add(self, phase: str, ms: float, start_ms: float | None = None) -> None:
        """Add ``ms`` to ``phase``, a span that ends now (or that began at ``start_ms`` since process start)."""
        start = self.now_ms() - ms if start_ms is None else start_ms
        with self._lock:
            self.durations[phase] = self.durations.get(phase, 0.0) + ms
            self.starts[phase] = min(self.starts.get(phase, start), start)

    def mark(self, point: str) -> float:
        """Record that ``point`` (e.g. ``ready``) happened now; returns ms since process start."""
        ms = self.now_ms()
        with self._lock:
            self.points[point] = ms
        return ms

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start, t = self.now_ms(), time.perf_counter()
        try:
            yield
        finally:
            self.add(name, (time.perf_counter() - t) * 1e3, start)

    def as_dict(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {
                "phases_ms": dict(self.durations),
                "starts_ms": dict(self.starts),
                "points_ms": dict(self.points),
            }


# -- the cyclic garbage collector during a start -----------------------------------------------------------
# A start allocates a few hundred thousand long-lived objects (torch's modules, then ours); each one pushes the
# collector towards a full pass over all of them: ~80 ms of `import torch` and about half of module construction
# here. So a start holds the collector off, and when the last hold goes, freezes what the start built
# (gc.freeze: never scanned again, which also keeps later passes short on the request path) and turns it back on.

_gc_lock = threading.Lock()
_gc_holds = 0
_gc_was_enabled = False


def hold_gc() -> None:
    """Pause the cyclic garbage collector until the matching :func:`release_gc` (holds nest)."""
    global _gc_holds, _gc_was_enabled
    with _gc_lock:
        if _gc_holds == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_holds += 1


def release_gc() -> None:
    """Drop one hold; the last one freezes the objects alive now and re-enables the collector if it was on.
    A release without a hold does nothing (the server releases on READY whether or not the CLI held)."""
    global _gc_holds
    with _gc_lock:
        if _gc_holds == 0:
            return
        _gc_holds -= 1
        if _gc_holds == 0:
            gc.freeze()
            if _gc_was_enabled:
                gc.enable()


@contextmanager
def gc_held() -> Iterator[None]:
    hold_gc()
    try:
        yield
    finally:
        release_gc()


def collect_frozen() -> None:
    """Collect garbage among frozen objects (after a model is released): a frozen cycle is otherwise never
    freed. One full pass (~0.1 s with torch loaded), then the survivors are frozen again."""
    with _gc_lock:
        if gc.get_freeze_count() == 0 or _gc_holds:
            return
        gc.unfreeze()
        gc.collect()
        gc.freeze()


# -- reading the weights while the interpreter imports torch ------------------------------------------------


def resident_map(mm: Any, begin: int = 0, end: int | None = None) -> bytes:
    """One byte per page of ``mm[begin:end]`` (a writable file mapping; ``begin`` page-aligned): 1 where the file's
    page is in the page cache, mapped here or not, else 0 (mincore(2); the calls release the GIL)."""
    import ctypes
    import mmap

    end = len(mm) if end is None else end
    if end <= begin:
        return b""
    vec = (ctypes.c_ubyte * (-(-(end - begin) // mmap.PAGESIZE)))()
    buf = ctypes.c_char.from_buffer(mm)
    try:
        base = ctypes.addressof(buf) + begin
        step = 256 << 20  # per call: mincore holds the address-space lock, which every mmap waits for
        for off in range(0, end - begin, step):
            out = ctypes.byref(vec, off // mmap.PAGESIZE)
            length = ctypes.c_size_t(min(step, end - begin - off))
            if libc().mincore(ctypes.c_void_p(base + off), length, out) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore failed: {os.strerror(err)}")
    finally:
        del buf
    return bytes(vec).translate(_LOW_BIT)  # only the lowest bit is defined


def resident_pages(path: str | os.PathLike[str]) -> bytes:
    """One byte per page of the file: 1 where the page is in the page cache, else 0 (:func:`resident_map` over a
    throwaway mapping)."""
    import mmap

    size = os.path.getsize(path)
    if size == 0:
        return b""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # writable: ctypes.from_buffer wants that
    try:
        return resident_map(mm)
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror} ({path})") from e
    finally:
        mm.close()


_LOW_BIT = bytes(b & 1 for b in range(256))


def read_range(fd: int, begin: int, end: int, buf: memoryview) -> None:
    """Read bytes [begin, end) of the open file ``fd`` into the page cache (and into ``buf``, a scratch buffer whose
    size sets the read size) with ``os.preadv``, which releases the GIL. Raises OSError."""
    while begin < end and (n := os.preadv(fd, [buf[: min(len(buf), end - begin)]], begin)) > 0:
        begin += n


def prefetch_files(
    paths: Iterable[str | os.PathLike[str]], workers: int = 4, piece: int = 32 << 20, block: int = 8 << 20
) -> list[Any]:
    """Start reading into the page cache the ``piece``-sized parts of ``paths`` that are not there yet; returns
    the (daemon) thread doing it, which first asks mincore(2) what is cached (~15 ms per GB), then reads the
    rest with ``workers`` threads of ``os.preadv`` of ``block`` bytes (the GIL released for each read and
    retaken ~200 times for 1.7 GB, so the main thread is barely interrupted). Nothing holds the address-space
    lock for long (a populate of a throwaway mapping did, and stalled every mmap in the process, thread stacks
    included). Measured here, cold, 1.7 GB: four readers ~0.95 s; one sequential reader up to 3.6 s;
    posix_fadvise(WILLNEED) reads only the first ~25 MB. Errors are ignored: the loader reports a missing or
    unreadable file with its context."""
    import mmap

    paths = [Path(p) for p in paths]
    if not paths:
        return []
    jobs: list[tuple[Path, int, int]] = []
    lock = threading.Lock()

    def plan() -> None:
        per = max(piece // mmap.PAGESIZE, 1)
        for p in paths:
            try:
                pages = resident_pages(p)
                size = os.path.getsize(p)
            except (OSError, ValueError):
                continue
            for first in range(0, len(pages), per):
                if 0 in pages[first : first + per]:
                    off = first * mmap.PAGESIZE
                    jobs.append((p, off, min(piece, size - off)))

    def read() -> None:
        buf = memoryview(bytearray(block))
        while True:
            with lock:
                if not jobs:
                    return
                path, off, length = jobs.pop(0)
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                read_range(fd, off, off + length, buf)
            except OSError:
                pass
            finally:
                os.close(fd)

    def run() -> None:
        plan()
        if not jobs:
            return
        helpers = [
            threading.Thread(target=read, name="cosyserve-readahead", daemon=True) for _ in range(workers - 1)
        ]
        for t in helpers:
            t.start()
        read()
        for t in helpers:
            t.join()

    thread = threading.Thread(target=run, name="cosyserve-readahead", daemon=True)
    thread.start()
    return [thread]


def prefetch_bundles(paths: Iterable[str], strategy: str = "preload") -> list[Any]:
    """For each of ``paths`` that is a bundle, start :func:`prefetch_files` on its weight files, unless the load
    strategy is ``lazy``. Called at process start by ``cosyserve serve`` / ``synth`` before importing torch: on
    a cold page cache the disk reads then overlap the ~0.9 s of imports instead of following them.

    Args:
        paths: the models as given (only bundles are read).
        strategy: the ``strategy`` setting the models will load with.
    Returns:
        The reader threads.
    """
    if strategy == "lazy":
        return []
    files: list[tuple[int, Path]] = []
    for p in paths:
        d = Path(p)
        if (d / "manifest.json").is_file():
            for f in d.glob("*.safetensors"):
                try:
                    files.append((f.stat().st_size, f))
                except OSError:
                    continue
    return prefetch_files(f for _, f in sorted(files, reverse=True))  # the largest (the LLM) first
