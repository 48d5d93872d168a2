"""What the start-timing benches do first: byte-compile the cosyserve their child processes import.

``pip install`` leaves a package byte-compiled; a source tree (a clone, a ``git archive`` snapshot) run with
``PYTHONDONTWRITEBYTECODE=1`` (this project's VMs set it) compiles every module it imports again at each start:
~100 ms of a full-size lite READY on a 2-core Xeon (READY 305-364 ms byte-compiled against 353-506 from source,
its ``construct`` phase 12-16 ms against 39-62), which a user's installed server does not pay. Writing the
``__pycache__`` folders is explicit here, so the setting does not stop it.
"""

from __future__ import annotations

import compileall
import importlib.util
import sys
from pathlib import Path


def byte_compile(src: Path | None = None) -> Path:
    """Compile the ``cosyserve`` package the bench's child processes import.

    Args:
        src: the ``src`` folder the children get on ``PYTHONPATH``; None: the one this interpreter imports (a
            child started with its environment imports the same).

    Returns:
        The package's folder.
    """
    if src is not None:
        package = src / "cosyserve"
    else:
        spec = importlib.util.find_spec("cosyserve")
        if spec is None or spec.origin is None:
            raise SystemExit(
                "cosyserve is not importable here: install it, or set PYTHONPATH to its src folder"
            )
        package = Path(spec.origin).parent
    if not compileall.compile_dir(package, quiet=1):
        # e.g. a read-only install: time it as it is, and say so beside the figures
        print(
            f"warning: could not byte-compile {package}: its starts may include compiling it", file=sys.stderr
        )
    return package
