"""Run Python code in a fresh interpreter with this checkout's ``src`` on the path (start-path behaviour, module
imports and garbage-collector state are per process, so some checks need one of their own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
