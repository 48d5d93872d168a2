"""Build a directory beside its final place, swap it in atomically, and clean up after writers that were killed.

A writer (``cosyserve convert``, the bundle cache, the demo model) builds ``OUT`` in a temporary sibling
``.OUT.<tag>.<8 random characters>/`` that holds the build (``new/``) and a lock file. The writer holds an
exclusive ``flock`` on that lock file for its whole life. When the build is complete, :meth:`Staging.commit`
moves it into place in one rename: ``renameat2(RENAME_EXCHANGE)`` when ``OUT`` exists (old and new trade
places), ``RENAME_NOREPLACE`` when it does not. A crash at any moment therefore leaves either the old ``OUT`` or
the new one, complete. The temporary (holding the old ``OUT`` after an exchange) is deleted last.

A writer killed with SIGKILL leaves its temporary behind, and its lock dies with it. The next writer of the same
kind in the same folder calls :func:`clean_stale`, which removes only temporaries of our exact naming that hold
our lock file and whose lock it can take without waiting: their writer is dead. A ``flock`` is held by an open
file, not a pid, so the test also holds between containers that share a volume (separate pid namespaces).
Anything else, however similar its name, is never touched.

The same rules keep a private working directory (:class:`LockedDir`, e.g. the prefork server's metrics files in
the temp dir) for as long as its process, and the children it forked, live: :func:`clean_stale_dirs` removes one
whose holders were all killed, on the next start. Both cleaners remove only directories of the calling user.

Where the filesystem cannot exchange two directories (NFS, non-Linux), the swap is two renames: ``OUT`` into
the temporary, then the build into ``OUT``, with a marker written first; if the writer dies between the two,
:func:`clean_stale` puts the complete build (or else the old ``OUT``) back in place before removing the rest.

Files we create are given the mode the umask allows (:func:`file_mode`), as ``open()`` would: some writers
(``tempfile.mkstemp``, safetensors' ``save_file``) make them private (0600) whatever the umask.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import json
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["LOCK_NAME", "LockedDir", "Staging", "clean_stale", "clean_stale_dirs", "file_mode"]

logger = logging.getLogger(__name__)

LOCK_NAME = "cosyserve-writer.lock"
_BUILD = "new"
_OLD = "old"
_SWAPPING = "swapping"  # marker: the two-rename swap has begun (see the module docstring)
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def file_mode(base: int = 0o666) -> int:
    """``base`` less the process umask: the mode ``open()`` gives a new file."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return base & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)  # no /proc: reading the umask means setting it (briefly)
    os.umask(umask)
    return base & ~umask


def _temp_pattern(tag: str) -> re.Pattern[str]:
    # tempfile.mkdtemp's random part: 8 characters of [a-z0-9_]
    return re.compile(rf"\.(?P<name>.+)\.{re.escape(tag)}\.[a-z0-9_]{{8}}")


@functools.lru_cache(maxsize=1)
def _renameat2_fn() -> Any:
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


def _rename2(src: Path, dst: Path, flags: int) -> bool:
    """``renameat2(src, dst, flags)``: True when done, False where the platform or filesystem cannot."""
    import ctypes

    fn = _renameat2_fn()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


class Staging:
    """Build ``out`` beside it and move it into place atomically (see the module docstring).

    Use as a context manager: write into :attr:`path`, then call :meth:`commit`. Leaving the block without a
    commit (an exception) removes the temporary. Entering first removes stale temporaries of ``tag`` in
    ``out``'s folder.

    Args:
        out: the directory to create or replace.
        tag: names the kind of writer in the temporary's name (``.OUT.<tag>.xxxxxxxx``).
    """

    def __init__(self, out: str | os.PathLike[str], tag: str) -> None:
        self.out = Path(out)
        self.tag = tag
        self.tmp: Path | None = None
        self._lock_fd: int | None = None

    @property
    def path(self) -> Path:
        """Where to build (a fresh directory with the umask's mode)."""
        assert self.tmp is not None, "enter the Staging context first"
        return self.tmp / _BUILD

    def __enter__(self) -> Staging:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.discard()

    def start(self) -> Staging:
        """Clean stale temporaries, then make ours and lock it (what entering the context does)."""
        parent = self.out.parent
        parent.mkdir(parents=True, exist_ok=True)
        clean_stale(parent, self.tag)
        self.tmp, self._lock_fd = _make_locked(parent, f".{self.out.name}.{self.tag}.")
        try:
            os.mkdir(self.path)
        except BaseException:
            self.discard()
            raise
        return self

    def commit(self, *, replace: bool) -> None:
        """Move the build to ``out``. ``replace``: swap out an existing ``out`` (else FileExistsError)."""
        assert self.tmp is not None, "enter the Staging context first"
        if not os.path.lexists(self.out):
            try:
                if _rename2(self.path, self.out, _RENAME_NOREPLACE):
                    return
                if not os.path.lexists(self.out):
                    os.rename(self.path, self.out)
                    return
            except FileExistsError:  # another writer got there first
                pass
        if not replace:
            raise FileExistsError(errno.EEXIST, f"{self.out} already exists (use --force to replace it)")
        if _rename2(self.path, self.out, _RENAME_EXCHANGE):
            return
        (self.tmp / _SWAPPING).touch()
        os.rename(self.out, self.tmp / _OLD)
        os.rename(self.path, self.out)

    def discard(self) -> None:
        """Remove the temporary (after a commit, what it holds is the old ``out``) and release the lock."""
        # the lock is released last: until the temporary is gone, no cleaner may take it for stale
        try:
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
            self.tmp = None


class LockedDir:
    """A directory of this process in ``parent``, named ``prefix`` + 8 random characters, held (its lock file
    locked) for as long as this process and the children it forks live; :meth:`remove` deletes it.

    One left behind by a killed process is removed by :func:`clean_stale_dirs`, which making one first calls.

    Args:
        prefix: the start of its name (``cosyserve-metrics-``); only directories so named are ever cleaned.
        parent: where (default: the temp dir, ``tempfile.gettempdir()``).
    """

    def __init__(self, prefix: str, parent: str | os.PathLike[str] | None = None) -> None:
        where = Path(parent if parent is not None else tempfile.gettempdir())
        clean_stale_dirs(where, prefix)
        self.path, self._lock_fd = _make_locked(where, prefix)

    def remove(self) -> None:
        """Delete the directory, then release its lock (idempotent)."""
        if self._lock_fd is None:
            return
        try:
            shutil.rmtree(self.path, ignore_errors=True)
        finally:
            os.close(self._lock_fd)
            self._lock_fd = None


def _make_locked(parent: Path, prefix: str) -> tuple[Path, int]:
    """A fresh directory ``parent/prefix*`` holding our lock file, locked: (its path, the lock's fd)."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    fd = -1
    try:
        fd = os.open(tmp / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        # written only once locked: a cleaner that finds the file empty knows its writer is just starting
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.write(fd, json.dumps(info).encode())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the lock (if taken) is released last
        if fd >= 0:
            os.close(fd)
        raise
    return tmp, fd


def clean_stale(parent: str | os.PathLike[str], tag: str) -> list[Path]:
    """Remove the temporaries of ``tag`` in ``parent`` whose writer is dead (see the module docstring).

    Returns:
        The temporaries removed.
    """
    parent = Path(parent)
    return _clean(parent, _temp_pattern(tag), lambda m, tmp: _restore(parent / m["name"], tmp))


def clean_stale_dirs(parent: str | os.PathLike[str], prefix: str) -> list[Path]:
    """Remove the :class:`LockedDir` directories named ``prefix`` + 8 random characters in ``parent`` whose
    holders are all dead (see the module docstring).

    Returns:
        The directories removed.
    """
    return _clean(Path(parent), re.compile(rf"{re.escape(prefix)}[a-z0-9_]{{8}}"), None)


def _clean(parent: Path, pattern: re.Pattern[str], before: Any) -> list[Path]:
    # the directories in `parent` named by `pattern`, holding our lock file, of this user, whose lock can be taken
    # without waiting (their holders are dead): `before(match, dir)` runs with the lock held, then the removal
    removed: list[Path] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m is None or not entry.is_dir(follow_symlinks=False):
            continue
        tmp = Path(entry.path)
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue  # another user's: never ours to remove
            fd = os.open(tmp / LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:  # no lock file: not ours (or its writer is starting), keep it
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: its writer is alive
                continue
            if os.fstat(fd).st_size == 0 or os.fstat(fd).st_nlink == 0:
                continue  # a writer between creating and locking it, or another cleaner got there first
            if before is not None:
                before(m, tmp)
            shutil.rmtree(tmp, ignore_errors=True)
            if os.path.lexists(tmp):
                logger.warning("could not remove the stale temporary %s left by a killed writer", tmp)
            else:
                logger.info("removed the stale temporary %s left by a killed writer", tmp)
                removed.append(tmp)
        finally:
            os.close(fd)
    return removed


def _restore(out: Path, tmp: Path) -> None:
    # the writer died between the two renames of a swap: put the complete build, else the old one, back
    if not (tmp / _SWAPPING).exists() or os.path.lexists(out):
        return
    for part in (_BUILD, _OLD):
        if os.path.lexists(tmp / part):
            os.rename(tmp / part, out)
            logger.warning("restored %s from %s (its writer died while swapping it in)", out, tmp / part)
            return
