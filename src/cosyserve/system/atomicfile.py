"""Files written so that a crash leaves the old file or the new one, never a torn one, and the temporaries of
writers killed mid-write cleaned up.

Every write goes to a temporary file in the target's folder (``.<name>.<pid>.<8 hex>.tmp``), is fsynced and then
renamed over the target (and the folder fsynced). A writer holds a shared ``flock`` on the folder while its
temporary exists (:func:`writing`); a cleaner removes temporaries only when it can lock the folder exclusively
without waiting, i.e. when no writer is at work there: those were left by killed writers (a lock dies with its
process, whatever pid namespace it ran in).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

logger = logging.getLogger("cosyserve.voices.registry")

__all__ = ["atomic_replace", "atomic_write", "clean_stale_temporaries", "fsync_dir", "writing"]


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory fds: the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the data file itself was synced
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new one: temp file in the same
    folder, fsync, rename over ``path``, fsync the folder."""

    def write(tmp: Path) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask decides, as for open()
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
        finally:
            os.close(fd)

    atomic_replace(path, write)


def atomic_replace(path: Path, write: Callable[[Path], None]) -> None:
    """Make ``path`` with ``write(tmp)`` so that a crash leaves the old file or the new one: ``write`` makes a
    temp file in the same folder, which is fsynced and renamed over ``path``, and the folder fsynced."""
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def writing(folder: Path) -> Iterator[None]:
    """Hold a shared lock on ``folder`` while writing into it: no cleaner removes our temporary meanwhile."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # no directory fds here: no cleaner can lock it either
        yield
        return
    try:
        with contextlib.suppress(OSError):  # filesystems without flock: the same holds for the cleaner
            fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def clean_stale_temporaries(folder: Path, temporaries: re.Pattern[str]) -> list[Path]:
    """Remove the temporaries in ``folder`` whose names match ``temporaries`` and that killed writers left (see the
    module docstring).

    Returns:
        The files removed (none while a writer is at work in ``folder``).
    """
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return []
    removed: list[Path] = []
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:  # a writer is at work (or no flock here): its temporary may be live
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                logger.debug("cannot lock %s (%s): leftover temporaries stay", folder, e)
            return removed
        for entry in os.scandir(folder):
            if temporaries.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed.append(Path(entry.path))
                    logger.info("removed %s, left by a writer killed before its rename", entry.path)
    finally:
        os.close(fd)
    return removed
