"""READY against the floor, many times over: fresh ``import torch`` and fresh ``cosyserve.load`` in pairs.

    python bench/ready_ratio.py --bundle out/full-bundle [--pairs 12]

Each pair starts ``python -c "import torch"`` (the floor), then a process that loads the bundle the way
``cosyserve serve`` does (GC held, bundle read ahead while torch imports, default strategy and warm-up) and
stops at READY; both report the instant they got there against the spawn instant passed in
``COSYSERVE_SPAWN_T0``. On a VM whose speed drifts by tens of percent between runs, many alternating pairs say
more than ``cosyserve startup-report`` (which also times a first request per start) can in the same minutes.
Prints the medians, their ratio, and the median of the per-pair ratios (target: <= 1.25x).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from startup import byte_compile

LOAD = """
import time
from cosyserve.system.gchold import hold_gc
hold_gc()
from cosyserve.system.pagecache import prefetch_bundles
prefetch_bundles([{bundle!r}])
import cosyserve
m = cosyserve.load({bundle!r})
print("READY", time.time(), flush=True)
"""
FLOOR = "import time, torch; print('READY', time.time(), flush=True)"


def _start(code: str, env: dict[str, str]) -> float:
    from cosyserve.tools.report import spawn_timed

    t0, rest = spawn_timed([sys.executable, "-c", code], env, "READY")
    return (float(rest) - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--pairs", type=int, default=12)
    args = ap.parse_args()
    src = str(Path(__file__).resolve().parents[1] / "src")
    sys.path.insert(0, src)
    byte_compile(Path(src))  # as pip install leaves it (bench/startup.py)
    env = {**os.environ, "PYTHONPATH": src}
    _start(LOAD.format(bundle=args.bundle), env)  # the first start of a bundle hashes it once: not timed
    floor, ready = [], []
    for _ in range(args.pairs):
        floor.append(_start(FLOOR, env))
        ready.append(_start(LOAD.format(bundle=args.bundle), env))
    f, r = statistics.median(floor), statistics.median(ready)
    ratios = [b / a for a, b in zip(floor, ready, strict=True)]
    print(
        f"{args.pairs} pairs: floor {f:.0f} ms, READY {r:.0f} ms (medians); ratio {r / f:.2f}x, ready - floor {r - f:.0f} ms"
    )
    print(
        f"per-pair ratio: median {statistics.median(ratios):.2f}x, range {min(ratios):.2f}-{max(ratios):.2f}x"
    )


if __name__ == "__main__":
    main()
