"""Run Python code in a fresh interpreter with this checkout's ``src`` on the path (start-path behaviour, module
imports and garbage-collector state are per process, so some checks need one of their own)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SRC = str(Path(__file__).resolve().parents[1] / "src")


def run_python(code: str, *args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -c code args...`` with ``env`` added to this environment; output captured as text."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC, **env},
        timeout=timeout,
    )


def run_bench(script: str, *args: str, cwd: Path) -> tuple[str, dict[str, Any]]:
    """``python bench/SCRIPT args... --threads 1 --json FIGURES`` (one OpenMP thread, in ``cwd``): its stdout and
    the figures it wrote; a failed run fails the test with its output's tail."""
    import json

    out = cwd / "figures.json"
    bench = Path(SRC).parent / "bench" / script
    r = subprocess.run(
        [sys.executable, str(bench), *args, "--threads", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": SRC},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout, json.loads(out.read_text())


def stop_group(proc: subprocess.Popen[Any], grace_s: float) -> int | None:
    """SIGTERM to ``proc`` (started in a session of its own), then SIGKILL to its whole process group once it has
    exited or after ``grace_s``: what it started (a server's prefork workers, a script's servers) never outlives
    it, and an interrupt during the wait still kills. Returns its exit code (None if it had to be killed)."""
    try:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace_s)
        return proc.returncode
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group's id is the leader's pid (start_new_session)
        proc.wait(10)


def run_in_session(
    cmd: Sequence[str], *, timeout: float, grace_s: float = 5.0, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)`` in a session of its own,
    ended with its whole process group (:func:`stop_group`) when it exits, times out or the test is interrupted:
    a command that starts servers (``cosyserve serve``, a bench script) leaves none running."""
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            stop_group(proc, grace_s)
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def gone(pid: int) -> bool:
    """The process has exited (a zombie counts: it holds no files; Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def killed_staging(out: Path, tag: str) -> Path:
    """The temporary a :class:`cosyserve.system.staging.Staging` writer of ``out`` leaves when it is killed with SIGKILL
    in the middle of its build (its lock file written, its lock gone with the process)."""
    code = (
        "import os, signal, sys\n"
        "from cosyserve.system.staging import Staging\n"
        "s = Staging(sys.argv[1], sys.argv[2]).start()\n"
        "(s.path / 'part.bin').write_bytes(b'x' * 1000)\n"
        "print(s.tmp, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    r = run_python(code, str(out), tag, timeout=60)
    assert r.returncode == -9, r.stderr
    tmp = Path(r.stdout.strip())
    assert tmp.is_dir() and tmp.parent == out.parent, tmp
    return tmp
