"""The ``cosyserve`` command line run in the test's own process: the CLI's ``main`` (everything the entry point
runs after ``python -m cosyserve`` has started), its exit status and what it printed, without a fresh interpreter
importing torch for each command. Its log records reach stderr as they do from the entry point (``main``'s own
``logging.basicConfig`` finds the root logger bare, as in a fresh process), and what ``main`` sets up for the
process it owns (``OMP_WAIT_POLICY``, the root and progress loggers, the collector held by ``serve``/``synth``,
torch's thread count) is put back after it, so the tests after it see the process as it was. A check of process-level behaviour (what happens before torch loads, the real entry
point's exit, signals) still needs a process of its own: :mod:`proc_util`."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

import pytest


@dataclass
class Run:
    """What one command left: its exit status and its output."""

    returncode: int
    stdout: str
    stderr: str


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> Run:
    """``cosyserve ARGV`` in this process; its stdout and stderr are read from ``capsys`` (nothing before it)."""
    from cosyserve.cli import main
    from cosyserve.system.gchold import release_gc

    root, progress = logging.getLogger(), logging.getLogger("cosyserve.progress")
    saved_root = (list(root.handlers), root.level)
    saved = (list(progress.handlers), progress.propagate, progress.level)
    root.handlers.clear()  # pytest's capture handlers: main's basicConfig then logs to stderr as a process would
    omp = os.environ.get("OMP_WAIT_POLICY")
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    capsys.readouterr()
    try:
        main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        release_gc()  # a synth that failed before its model loaded still holds the collector
        root.handlers[:] = saved_root[0]
        root.setLevel(saved_root[1])
        progress.handlers[:], progress.propagate = saved[0], saved[1]
        progress.setLevel(saved[2])
        if omp is None:
            os.environ.pop("OMP_WAIT_POLICY", None)
        else:
            os.environ["OMP_WAIT_POLICY"] = omp
        if threads is not None:
            sys.modules["torch"].set_num_threads(threads)
    out, err = capsys.readouterr()
    return Run(code, out, err)
