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
