"""Staged directories (cosyserve.system.staging): moved into place atomically, and only our own temporaries of dead
writers cleaned up."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cosyserve.system import staging
from cosyserve.system.staging import LOCK_NAME, Staging, clean_stale, file_mode
from proc_util import SRC, killed_staging, run_python


@pytest.fixture
def umask() -> Iterator[None]:
    saved = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(saved)


def _lookalikes(parent: Path) -> list[Path]:
    """Things a user (or another program) might have with names like our temporaries; none is ours."""
    no_lock = parent / ".b.converting.userdir1"  # our exact naming, but no lock file
    no_lock.mkdir()
    (no_lock / "keep.txt").write_text("mine")
    a_file = parent / ".b.converting.userfil1"
    a_file.write_text("mine")
    linked_lock = parent / ".b.converting.userlnk1"  # a lock file that is a symlink: not ours
    linked_lock.mkdir()
    (parent / "target.txt").write_text("mine")
    (linked_lock / LOCK_NAME).symlink_to(parent / "target.txt")
    long_name = parent / ".b.converting.userdir12"  # one character too many for our naming
    long_name.mkdir()
    (long_name / LOCK_NAME).write_text('{"pid": 1}')
    other = parent / "b.converting.userdir1"  # no leading dot
    other.mkdir()
    (other / LOCK_NAME).write_text('{"pid": 1}')
    return [no_lock, a_file, linked_lock, long_name, other, parent / "target.txt"]


def test_only_stale_temporaries_of_our_naming_are_removed(tmp_path: Path) -> None:
    out = tmp_path / "b"
    live_here = Staging(tmp_path / "c", "converting").start()  # lock held by an open fd of this process
    holder = subprocess.Popen(  # and one held by another process
        [
            sys.executable,
            "-c",
            "import sys\nfrom cosyserve.system.staging import Staging\n"
            "s = Staging(sys.argv[1], 'converting').start()\nprint(s.tmp, flush=True)\nsys.stdin.read()\n",
            str(tmp_path / "d"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC},
    )
    try:
        assert holder.stdout is not None
        live_there = Path(holder.stdout.readline().strip())
        assert live_there.is_dir()
        # (made after the live writers started: starting cleans the folder too)
        stale = killed_staging(out, "converting")
        other_tag = killed_staging(out, "making")
        keep = _lookalikes(tmp_path)

        assert clean_stale(tmp_path, "converting") == [stale], "only the dead writer's temporary goes"
        assert not stale.exists()
        for p in [*keep, other_tag, live_here.tmp, live_there]:
            assert p is not None and os.path.lexists(p), (
                f"{p} was removed but is not a stale temporary of ours"
            )
        assert (tmp_path / ".b.converting.userdir1" / "keep.txt").read_text() == "mine"

        holder.kill()  # its writer dies: now its temporary is stale
        holder.wait(timeout=30)
        assert clean_stale(tmp_path, "converting") == [live_there]
        assert live_here.tmp is not None and live_here.tmp.exists(), "a live writer's temporary was removed"
    finally:
        holder.kill()
        holder.communicate(timeout=30)
        live_here.discard()
    assert all(os.path.lexists(p) for p in keep)


def test_commit_moves_the_build_into_place_and_replaces_only_when_asked(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with Staging(out, "converting") as s:
        (s.path / "f").write_text("one")
        s.commit(replace=False)
    assert (out / "f").read_text() == "one"
    with pytest.raises(FileExistsError), Staging(out, "converting") as s:
        (s.path / "f").write_text("two")
        s.commit(replace=False)
    assert (out / "f").read_text() == "one", "an existing output was replaced without replace=True"
    with Staging(out, "converting") as s:
        (s.path / "f").write_text("two")
        s.commit(replace=True)
    assert (out / "f").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "temporaries left behind"


def test_two_rename_swap_is_completed_after_a_crash_between_the_renames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # where the filesystem cannot exchange two directories, the swap is two renames; a writer killed between
    # them leaves no OUT at all until the next writer puts the complete build in place
    out = tmp_path / "out"
    out.mkdir()
    (out / "f").write_text("old")
    code = (
        "import os, signal, sys\n"
        "from cosyserve.system import staging\n"
        "staging._rename2 = lambda *a: False\n"
        "real = os.rename\n"
        "def rename(a, b):\n"
        "    real(a, b)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "s = staging.Staging(sys.argv[1], 'converting').start()\n"
        "(s.path / 'f').write_text('new')\n"
        "os.rename = rename\n"
        "s.commit(replace=True)\n"
    )
    r = run_python(code, str(out), timeout=60)
    assert r.returncode == -9, r.stderr
    assert not out.exists()
    clean_stale(tmp_path, "converting")
    assert (out / "f").read_text() == "new", "the complete build was not put in place"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    monkeypatch.setattr(staging, "_rename2", lambda *a: False)
    with Staging(out, "converting") as s:
        (s.path / "f").write_text("newer")
        s.commit(replace=True)
    assert (out / "f").read_text() == "newer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.usefixtures("umask")
@pytest.mark.parametrize(("mask", "dir_mode", "mode"), [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_modes_follow_the_umask(tmp_path: Path, mask: int, dir_mode: int, mode: int) -> None:
    os.umask(mask)
    assert file_mode() == mode
    with Staging(tmp_path / "out", "making") as s:
        assert s.path.stat().st_mode & 0o777 == dir_mode, "the build dir must have the umask's mode"
        s.commit(replace=False)
    assert (tmp_path / "out").stat().st_mode & 0o777 == dir_mode


def test_a_killed_writer_is_seen_dead_by_its_lock_not_its_pid(tmp_path: Path) -> None:
    # the pid in the lock file is for people; a reused pid (or another pid namespace) must not keep it alive
    stale = killed_staging(tmp_path / "b", "converting")
    (stale / LOCK_NAME).write_text(f'{{"pid": {os.getpid()}}}')
    assert clean_stale(tmp_path, "converting") == [stale]
