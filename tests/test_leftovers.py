"""What a killed process leaves behind is removed by the next start, only where it is ours and stale; what we
never need is not made.

If these fail: a prefork master killed with SIGKILL leaves its metrics directory in the temp dir forever (or a
start removes a live server's), a ``speakers add`` killed at its rename leaves its temporary in the registry
forever (or a writer removes another's live temporary, or a file that only looks like ours), or a process of ours
that imports ONNX Runtime leaves its empty ``mat-debug-<pid>.log`` (and device-id file) in the temp dir.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cosyserve.system.staging import LOCK_NAME, LockedDir, clean_stale_dirs
from cosyserve.voices.registry import SpeakerRegistry
from proc_util import SRC, gone, run_python
from server_util import start_server, wait_until

PREFIX = "cosyserve-metrics-"


# -- the prefork master's metrics directory -----------------------------------------------------------------------


def _killed_holder(parent: Path) -> Path:
    """The directory a :class:`LockedDir` holder leaves when it is killed with SIGKILL."""
    code = (
        "import os, signal, sys\n"
        "from cosyserve.system.staging import LockedDir\n"
        "d = LockedDir(sys.argv[1], sys.argv[2])\n"
        "(d.path / 'counter_1.db').write_bytes(b'x' * 100)\n"
        "print(d.path, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    r = run_python(code, PREFIX, str(parent), timeout=60)
    assert r.returncode == -9, r.stderr
    path = Path(r.stdout.strip())
    assert path.is_dir() and path.parent == parent
    return path


def test_only_dead_holders_directories_of_our_naming_are_removed(tmp_path: Path) -> None:
    holder = subprocess.Popen(  # a live holder in another process, and the child it forked
        [
            sys.executable,
            "-c",
            "import os, sys\nfrom cosyserve.system.staging import LockedDir\n"
            "d = LockedDir(sys.argv[1], sys.argv[2])\nprint(d.path, flush=True)\n"
            "if os.fork() == 0:\n    sys.stdin.read()\n    os._exit(0)\n"
            "os._exit(0)\n",
            PREFIX,
            str(tmp_path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC},
    )
    try:
        assert holder.stdout is not None
        live_in_child = Path(holder.stdout.readline().strip())
        assert holder.wait(30) == 0  # the holder is gone; the child it forked holds the lock still
        live_here = LockedDir(PREFIX, tmp_path)
        stale = _killed_holder(tmp_path)
        no_lock = tmp_path / f"{PREFIX}userdir1"  # our naming, but no lock file: not ours
        no_lock.mkdir()
        other_name = tmp_path / "cosyserve-other-abcdefgh"
        other_name.mkdir()
        (other_name / LOCK_NAME).write_text('{"pid": 1}')
        too_long = tmp_path / f"{PREFIX}abcdefghi"
        too_long.mkdir()
        (too_long / LOCK_NAME).write_text('{"pid": 1}')

        assert clean_stale_dirs(tmp_path, PREFIX) == [stale]
        for p in (live_in_child, live_here.path, no_lock, other_name, too_long):
            assert p.exists(), f"{p} was removed but is not a dead holder's directory of ours"

        holder.stdin.close()  # type: ignore[union-attr] - the forked child ends: its directory is stale now
        wait_until(
            lambda: clean_stale_dirs(tmp_path, PREFIX) == [live_in_child],
            "removed once its last holder died",
            timeout_s=60,
        )
        live_here.remove()
        assert not live_here.path.exists()
    finally:
        holder.kill()
        holder.wait(30)
        for pipe in (holder.stdin, holder.stdout):
            if pipe is not None:
                pipe.close()


def test_a_prefork_master_killed_with_sigkill_leaves_a_directory_the_next_start_removes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {"TMPDIR": str(temp)}
    server = start_server(
        tiny_model_dir, tmp_path / "a", env=env, args=["--workers", "2"], ready_timeout_s=180
    )
    try:
        (run_dir,) = temp.glob(f"{PREFIX}*")
        with server.client() as c:
            pids = c.get("/health/ready").json()["workers"]["pids"]
        assert len(pids) == 2, pids
        # a start while this one serves keeps its directory
        bad = tmp_path / "not-a-model"
        bad.mkdir()
        (bad / "cosyvoice.yaml").write_text("nonsense: [", encoding="utf-8")
        other = start_server(bad, tmp_path / "b", env=env, args=["--workers", "2"], wait_ready=False)
        assert other.proc.wait(120) == 3, other.log()[-3000:]
        assert run_dir.is_dir(), "a start removed the directory of a server that runs"

        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(30)
        wait_until(lambda: all(gone(p) for p in pids), "every worker gone after its master's death", 60)
        assert run_dir.is_dir()  # what the kill leaves

        again = start_server(bad, tmp_path / "c", env=env, args=["--workers", "2"], wait_ready=False)
        assert again.proc.wait(120) == 3, again.log()[-3000:]
        assert not run_dir.exists(), f"the next start did not remove {run_dir}\n{again.log()[-3000:]}"
        assert list(temp.glob(f"{PREFIX}*")) == [], "a start that failed left its own directory"
    finally:
        server.stop()


# -- the speaker registry's temporaries -----------------------------------------------------------------------------


def _sft(seed: int) -> dict[str, np.ndarray]:
    return {"embedding": np.random.default_rng(seed).standard_normal((1, 192)).astype(np.float32)}


def test_a_speakers_add_killed_at_its_rename_leaves_a_temporary_the_next_add_removes(tmp_path: Path) -> None:
    root = tmp_path / "reg"
    reg = SpeakerRegistry(root, arrays="numpy")
    reg.add("anna", _sft(0))
    folder = root / "default"
    code = (
        "import os, signal, sys\nimport numpy as np\n"
        "from cosyserve.voices.registry import SpeakerRegistry\n"
        "os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # killed at its rename\n"
        "emb = np.ones((1, 192), np.float32)\n"
        "SpeakerRegistry(sys.argv[1], arrays='numpy').add('anna', {'embedding': emb}, overwrite=True)\n"
    )
    r = run_python(code, str(root), timeout=60)
    assert r.returncode == -9, r.stderr
    (left,) = folder.glob(".*.tmp")
    assert np.array_equal(reg.get("anna").features["embedding"], _sft(0)["embedding"])  # type: ignore[union-attr]

    # a writer at work right now (its shared lock on the folder held) and files that only look like ours
    live = folder / f".{'b' * 32}.safetensors.123.0123abcd.tmp"
    live.write_bytes(b"half")
    lookalikes = [folder / ".notes.tmp", folder / f".{'c' * 32}.safetensors.1.xyz.tmp", folder / "keep.txt"]
    for p in lookalikes:
        p.write_text("mine")
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        SpeakerRegistry(root, arrays="numpy").add("bert", _sft(1))
        assert left.exists() and live.exists(), "a temporary was removed while a writer was at work there"
    finally:
        os.close(fd)  # that writer is done (its temporary, had it died, is now stale too)

    SpeakerRegistry(root, arrays="numpy").add("carl", _sft(2))  # the next start's first write
    assert not left.exists() and not live.exists(), "a killed writer's temporary stays in the registry"
    assert all(p.read_text() == "mine" for p in lookalikes), "a file not of our naming was removed"
    reg2 = SpeakerRegistry(root, arrays="numpy")
    assert reg2.names() == ["anna", "bert", "carl"]
    assert np.array_equal(reg2.get("anna").features["embedding"], _sft(0)["embedding"])  # type: ignore[union-attr]


# -- ONNX Runtime's telemetry files ---------------------------------------------------------------------------------


def _ort_files(temp: Path) -> list[str]:
    return sorted(p.name for p in temp.iterdir() if p.name.startswith("mat-debug-") or p.name == ".ses")


def test_our_processes_that_import_onnxruntime_leave_no_telemetry_files(
    tiny_lite_bundle: Path, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ORT_DISABLE_TELEMETRY"}
    env["PYTHONPATH"] = SRC

    def run(*args: str) -> list[str]:
        temp = tmp_path / str(len(list(tmp_path.iterdir())))
        temp.mkdir()
        r = subprocess.run(
            [sys.executable, *args],
            env={**env, "TMPDIR": str(temp)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return _ort_files(temp)

    if not any(n.startswith("mat-debug-") for n in run("-c", "import onnxruntime")):
        pytest.skip("this onnxruntime writes no mat-debug log: nothing to prevent")
    api = "import sys, cosyserve\ncosyserve.load(sys.argv[1], runtime='lite', warmup=False)\nimport onnxruntime\n"
    assert run("-c", api, str(tiny_lite_bundle)) == [], "cosyserve.load left ONNX Runtime's telemetry files"
    cli = ("-m", "cosyserve", "speakers", "--model", str(tiny_lite_bundle), "--runtime", "lite")
    assert run(*cli) == [], "the CLI left ONNX Runtime's telemetry files"
