"""The page cache and the memory around it: what of a file is cached, reading it in ahead of use, mapping it into
the process, dropping it, and how much memory the process and its cgroup hold.

- residency: :func:`resident_map` / :func:`resident_pages` / :func:`resident_bytes` (mincore(2));
- reading in: :func:`read_ranges` (threads of ``os.preadv``), :func:`missing_ranges`, :func:`prefetch_files` and
  :func:`prefetch_bundles` (in the background, while the interpreter imports torch), :func:`cold_read_rate`;
- mapping in: :func:`madvise` (through ctypes, so the GIL is released), :func:`populate`, :func:`touch`,
  :func:`populate_mapped` (another library's mappings of a file);
- dropping: :func:`evict` (posix_fadvise DONTNEED);
- memory: :func:`memory_limit_bytes`, :func:`memory_usage` (cgroup v2, else the machine), :func:`rss_of_files`
  (/proc/self/smaps).

Imported on the start path before torch: only the standard library, and ``ctypes`` / ``mmap`` only when used.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "cold_read_rate",
    "evict",
    "libc",
    "madvise",
    "mapped_ranges",
    "memory_free",
    "memory_limit_bytes",
    "memory_usage",
    "missing_ranges",
    "populate",
    "populate_mapped",
    "prefetch_bundles",
    "prefetch_files",
    "read_range",
    "read_ranges",
    "resident_bytes",
    "resident_map",
    "resident_pages",
    "rss_of_files",
    "touch",
]

_MADV_POPULATE_READ = 22  # linux/mman.h; Python's mmap module names it from 3.12 on
_MADV_WILLNEED = 3
# per madvise/mincore call: each holds the process's address-space lock, which every mmap (thread stacks, large
# allocations) waits for; pieces keep each wait short
_LOCK_PIECE = 64 << 20
_LOW_BIT = bytes(b & 1 for b in range(256))


@functools.cache
def libc() -> Any:
    """The C library through ctypes (calls through it release the GIL), with ``errno`` kept."""
    import ctypes
    import ctypes.util

    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _pagesize() -> int:
    import mmap

    return mmap.PAGESIZE


# -- residency ------------------------------------------------------------------------------------------------


def resident_map(mm: Any, begin: int = 0, end: int | None = None) -> bytes:
    """Which pages of a file mapping are in the page cache (mincore(2); the calls release the GIL).

    Args:
        mm: a writable ``mmap.mmap`` of the file (``ctypes`` needs a writable buffer; ``ACCESS_COPY`` will do).
        begin: first byte, page-aligned.
        end: end byte (exclusive); default the end of the mapping.

    Returns:
        One byte per page of ``mm[begin:end]``: 1 where the file's page is in the page cache, mapped here or not,
        else 0. Raises OSError if mincore fails.
    """
    import ctypes

    page = _pagesize()
    end = len(mm) if end is None else end
    if end <= begin:
        return b""
    vec = (ctypes.c_ubyte * (-(-(end - begin) // page)))()
    buf = ctypes.c_char.from_buffer(mm)
    try:
        base = ctypes.addressof(buf) + begin
        for off in range(0, end - begin, _LOCK_PIECE):
            out = ctypes.byref(vec, off // page)
            length = ctypes.c_size_t(min(_LOCK_PIECE, end - begin - off))
            if libc().mincore(ctypes.c_void_p(base + off), length, out) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore failed: {os.strerror(err)}")
    finally:
        del buf
    return bytes(vec).translate(_LOW_BIT)  # only the lowest bit is defined


def resident_pages(path: str | os.PathLike[str]) -> bytes:
    """Which pages of a file are in the page cache: :func:`resident_map` over a throwaway mapping.

    Args:
        path: the file.

    Returns:
        One byte per page of the file: 1 where the page is cached, else 0. Raises OSError naming ``path``.
    """
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


def resident_bytes(paths: Iterable[str | os.PathLike[str]]) -> int:
    """Bytes of the files now in the page cache, counted in whole pages (mincore(2)).

    Args:
        paths: the files.

    Returns:
        The cached pages of all of them times the page size. Raises OSError for a file that cannot be read.
    """
    return sum(resident_pages(p).count(1) for p in paths) * _pagesize()


# -- reading into the page cache ------------------------------------------------------------------------------


def missing_ranges(resident: bytes, begin: int, end: int, piece: int | None = None) -> list[tuple[int, int]]:
    """The byte ranges of ``[begin, end)`` whose pages are not cached.

    Args:
        resident: one byte per page of ``[begin, end)`` as :func:`resident_map` gives it.
        begin: first byte, page-aligned.
        end: end byte (exclusive).
        piece: cut each range into parts of at most this many bytes (for several readers); None: no cut.

    Returns:
        ``(first byte, end byte)`` pairs in file order.
    """
    page = _pagesize()
    out: list[tuple[int, int]] = []
    i = resident.find(0)
    while i != -1:
        j = resident.find(1, i)
        j = len(resident) if j == -1 else j
        lo, hi = begin + i * page, min(begin + j * page, end)
        step = piece or hi - lo
        out.extend((b, min(b + step, hi)) for b in range(lo, hi, step))
        i = resident.find(0, j)
    return out


def read_range(fd: int, begin: int, end: int, buf: memoryview) -> int:
    """Read bytes ``[begin, end)`` of an open file into the page cache with ``os.preadv`` (which releases the GIL).

    Args:
        fd: the open file.
        begin: first byte.
        end: end byte (exclusive); reading stops early at the end of the file.
        buf: a scratch buffer; its size sets the size of each read.

    Returns:
        The bytes read. Raises OSError.
    """
    done = 0
    while begin < end and (n := os.preadv(fd, [buf[: min(len(buf), end - begin)]], begin)) > 0:
        begin += n
        done += n
    return done


def read_ranges(
    ranges: Iterable[tuple[str | os.PathLike[str], int, int]],
    workers: int = 1,
    block: int = 8 << 20,
    ignore_errors: bool = False,
) -> int:
    """Read byte ranges of files into the page cache, ``workers`` threads (this one among them) taking the next
    range as they finish one; returns when all are read.

    Args:
        ranges: ``(path, first byte, end byte)``; taken in order.
        workers: reading threads, this one included.
        block: bytes per ``os.preadv`` call: the GIL is released for each.
        ignore_errors: skip a range whose file cannot be opened or read (read-ahead is advice: whoever uses the
            file reports the error with its context); else the first error is raised here once all threads
            stop.

    Returns:
        The bytes read.
    """
    jobs = iter(ranges)
    lock = threading.Lock()
    done = [0]
    errors: list[OSError] = []

    def read() -> None:
        buf = memoryview(bytearray(block))
        while True:
            with lock:
                job = None if errors else next(jobs, None)
            if job is None:
                return
            path, begin, end = job
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    n = read_range(fd, begin, end, buf)
                finally:
                    os.close(fd)
            except OSError as e:
                if not ignore_errors:
                    with lock:
                        errors.append(e)
                continue
            with lock:
                done[0] += n

    helpers = [
        threading.Thread(target=read, name="cosyserve-readahead", daemon=True) for _ in range(workers - 1)
    ]
    for t in helpers:
        t.start()
    read()
    for t in helpers:
        t.join()
    if errors:
        raise errors[0]
    return done[0]


def prefetch_files(
    paths: Iterable[str | os.PathLike[str]], workers: int = 4, piece: int = 32 << 20, block: int = 8 << 20
) -> list[threading.Thread]:
    """Start reading into the page cache the parts of files that are not there yet, in the background.

    A daemon thread first asks mincore(2) what is cached, then reads the rest with :func:`read_ranges`. Several
    readers of large blocks: the main thread keeps running (the GIL is released for each read and retaken
    rarely), and a cold disk serves parallel reads faster than one sequential reader, while
    posix_fadvise(WILLNEED) reads only a first part of each file. Nothing holds the address-space lock for
    long (a populate of a throwaway mapping did, and stalled every mmap in the process, thread stacks
    included). Errors are ignored: the loader reports a missing or unreadable file with its context.

    Args:
        paths: the files, in the order to read them.
        workers: reading threads.
        piece: the most bytes one thread reads before taking the next range.
        block: bytes per read call.

    Returns:
        The thread doing it (a list, empty when there is nothing to read), for those who want to wait.
    """
    paths = [Path(p) for p in paths]
    if not paths:
        return []

    def run() -> None:
        jobs: list[tuple[Path, int, int]] = []
        for p in paths:
            try:
                pages = resident_pages(p)
                size = os.path.getsize(p)
            except (OSError, ValueError):
                continue
            jobs.extend((p, b, e) for b, e in missing_ranges(pages, 0, size, piece))
        if jobs:
            read_ranges(jobs, workers, block, ignore_errors=True)

    thread = threading.Thread(target=run, name="cosyserve-readahead", daemon=True)
    thread.start()
    return [thread]


def prefetch_bundles(
    paths: Iterable[str], strategy: str = "preload", runtime: str = "torch"
) -> list[threading.Thread]:
    """Start :func:`prefetch_files` on the weight files of each of ``paths`` that is a bundle, largest first,
    unless the load strategy is ``lazy``.

    Called at process start by ``cosyserve serve`` / ``synth`` before importing torch: on a cold page cache the
    disk reads then overlap the imports instead of following them.

    Args:
        paths: model arguments as given (bundles, model directories, hub ids: only bundles are read).
        strategy: the ``strategy`` setting the models will load with.
        runtime: the runtime that will map them: ``torch`` (the safetensors files) or ``lite`` (``lite/``'s
            graph weights and tables).

    Returns:
        The reading thread (see :func:`prefetch_files`); empty when nothing is read.
    """
    if strategy == "lazy":
        return []
    files: list[tuple[int, Path]] = []
    for p in paths:
        d = Path(p)
        if (d / "manifest.json").is_file():
            weights = d.glob("lite/*.data") if runtime == "lite" else d.glob("*.safetensors")
            for f in weights:
                try:
                    files.append((f.stat().st_size, f))
                except OSError:
                    continue
    return prefetch_files(f for _, f in sorted(files, reverse=True))  # the largest (the LLM) first


def cold_read_rate(paths: list[Path]) -> float:
    """How fast this machine reads the files from disk: the better of one sequential reader (16 MiB reads) and
    four threads sharing 32 MiB pieces (some disks read several times faster in parallel). Evicts the files
    before each way (:func:`evict`), so they are left cached by the second.

    Args:
        paths: the files (their pages must not be mapped by a live process, or eviction keeps them).

    Returns:
        Bytes per second. Raises OSError for a file that cannot be read.
    """
    piece = 32 << 20
    whole = [(p, 0, p.stat().st_size) for p in paths]
    pieces = [(p, b, min(b + piece, e)) for p, _, e in whole for b in range(0, e, piece)]
    rates = []
    for ranges, workers, block in ((whole, 1, 16 << 20), (pieces, 4, 4 << 20)):
        evict(paths)
        t = time.perf_counter()
        n = read_ranges(ranges, workers, block)
        rates.append(n / max(time.perf_counter() - t, 1e-9))
    return max(rates)


# -- dropping from the page cache ---------------------------------------------------------------------------------


def evict(paths: Iterable[str | os.PathLike[str]]) -> None:
    """Drop the files' pages from the page cache (pages that a live process maps stay).

    Args:
        paths: the files. Raises OSError for one that cannot be opened.
    """
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- mapping into the process ---------------------------------------------------------------------------------


def madvise(mm: Any, advice: int, begin: int = 0, end: int | None = None) -> None:
    """``madvise(2)`` over part of a mapping through ctypes, which releases the GIL for each call (``mmap.madvise``
    holds it: a cold populate would stall every other thread for the length of the disk read), in pieces that
    keep each hold of the address-space lock short.

    Args:
        mm: a writable ``mmap.mmap`` (``ACCESS_COPY`` will do).
        advice: an ``MADV_*`` value.
        begin: first byte; rounded down to its page.
        end: end byte (exclusive); default the end of the mapping.

    Raises OSError (e.g. EINVAL for an advice the kernel does not know), AttributeError where the C library
    has no madvise.
    """
    import ctypes

    end = len(mm) if end is None else end
    begin -= begin % _pagesize()
    buf = ctypes.c_char.from_buffer(mm)  # an export of the mapping, released below before anyone may close it
    try:
        base = ctypes.addressof(buf)
        _advise(base + begin, base + end, advice)
    finally:
        del buf


def _advise(start: int, end: int, advice: int, what: str = "") -> None:
    # madvise(2) over the addresses [start, end) of a mapping, one call per piece
    import ctypes

    for off in range(start, end, _LOCK_PIECE):
        length = ctypes.c_size_t(min(_LOCK_PIECE, end - off))
        if libc().madvise(ctypes.c_void_p(off), length, ctypes.c_int(advice)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise on {what}: {os.strerror(err)}" if what else os.strerror(err))


def touch(mm: Any, begin: int = 0, end: int | None = None) -> int:
    """Fault the pages of ``mm[begin:end]`` in by reading one slice per 256 pages. Holds the GIL throughout:
    :func:`madvise` with ``MADV_WILLNEED`` first makes the kernel read ahead in large blocks.

    Args:
        mm: the mapping.
        begin: first byte.
        end: end byte (exclusive); default the end of the mapping.

    Returns:
        The bytes covered.
    """
    step = _pagesize() * 256
    end = len(mm) if end is None else end
    total = 0
    for off in range(begin, end, step):
        # slicing copies 256 pages at a time into a throwaway bytes object: it faults each page once
        total += len(mm[off : min(off + step, end)])
    return total


def populate(mm: Any, begin: int = 0, end: int | None = None) -> None:
    """Map every page of ``mm[begin:end]`` into this process now, without copying: page-cache hits become mapped
    pages, misses are read from disk.

    ``MADV_POPULATE_READ`` (Linux 5.14+) fills the page tables in one call per piece, with the GIL released, so
    other threads build modules meanwhile, and much faster than faulting page by page. Older kernels: readahead
    advice, then :func:`touch`.

    Args:
        mm: a writable ``mmap.mmap`` (``ACCESS_COPY`` will do).
        begin: first byte, page-aligned.
        end: end byte (exclusive); default the end of the mapping.
    """
    try:
        madvise(mm, _MADV_POPULATE_READ, begin, end)
        return
    except (OSError, ValueError, AttributeError):
        pass
    try:
        madvise(mm, _MADV_WILLNEED, begin, end)
    except (OSError, ValueError, AttributeError):
        pass  # no readahead advice here: the touch below reads page by page
    touch(mm, begin, end)


def populate_mapped(path: str | os.PathLike[str]) -> int:
    """Map in every page of the mappings of ``path`` that this process holds already, made by another library
    (ONNX Runtime maps a graph's external weights itself), with ``MADV_POPULATE_READ``: one call per piece, the
    GIL released, no page faults left for their first reader (faulting them in one by one costs more: ~90 ms
    against ~60 for 1.4 GB of cached pages, 2-core Xeon).

    Args:
        path: the mapped file (its mappings are found in /proc/self/maps by the path, resolved).

    Returns:
        The bytes mapped in; 0 where the process holds no mapping of it, or cannot tell (no /proc/self/maps).

    Raises OSError where the kernel refuses (EINVAL before Linux 5.14), AttributeError where the C library has
    no madvise.
    """
    ranges = mapped_ranges(path)
    for start, end in ranges:
        _advise(start, end, _MADV_POPULATE_READ, f"{path} (MADV_POPULATE_READ)")
    return sum(end - start for start, end in ranges)


def mapped_ranges(path: str | os.PathLike[str]) -> list[tuple[int, int]]:
    """The address ranges ``[start, end)`` of this process's mappings of ``path`` (by its resolved path in
    /proc/self/maps); none where that is unreadable."""
    wanted = str(Path(path).resolve())
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].rstrip("\n") == wanted:
                    start, end = (int(x, 16) for x in parts[0].split("-"))
                    ranges.append((start, end))
    except OSError:
        return []
    return ranges


# -- memory of the process and its cgroup ------------------------------------------------------------------

_CGROUP = Path("/sys/fs/cgroup")


def _read_int(path: Path) -> int | None:
    try:
        raw = path.read_text().strip()
    except OSError:
        return None
    return int(raw) if raw.isdigit() else None  # "max" means no limit


def memory_limit_bytes() -> int:
    """The memory this process may use.

    Returns:
        The cgroup v2 limit (``memory.max``) when set and below physical memory, else physical memory, in bytes.
    """
    limit = _read_int(_CGROUP / "memory.max")
    phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(limit, phys) if limit else phys


def memory_usage() -> tuple[int, int]:
    """Memory in use against its limit.

    Returns:
        ``(bytes in use, limit)``: the cgroup's ``memory.current`` against ``memory.max`` when limited, else the
        machine's ``MemTotal - MemAvailable`` against ``MemTotal`` (/proc/meminfo).
    """
    limit = _read_int(_CGROUP / "memory.max")
    current = _read_int(_CGROUP / "memory.current")
    if limit and current is not None:
        return current, limit
    info: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
    total = info["MemTotal"]
    return total - info.get("MemAvailable", info.get("MemFree", 0)), total


def memory_free() -> int:
    """Bytes this process may still take: the limit less the use of :func:`memory_usage` (what the LM's packed
    copies, torch's and the lite runtime's, check for twice their size before they are made)."""
    used, limit = memory_usage()
    return limit - used


def rss_of_files(paths: Iterable[str | os.PathLike[str]]) -> int:
    """Resident bytes of this process's mappings of files.

    Args:
        paths: the files (compared by their resolved path).

    Returns:
        The sum of the ``Rss`` of every mapping of them in /proc/self/smaps; 0 where that is unreadable.
    """
    wanted = {str(Path(p).resolve()) for p in paths}
    if not wanted:
        return 0
    total = 0
    current = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                first = line.split(None, 1)[0]
                if "-" in first and not first.endswith(":"):  # a mapping header line
                    parts = line.split(None, 5)
                    current = len(parts) == 6 and parts[5].strip() in wanted
                elif current and first == "Rss:":
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total
