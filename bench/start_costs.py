"""The one-time costs the start path is arranged around, each timed in fresh processes (medians).

    python bench/start_costs.py [--runs 5] [--mb 512] [--dir /tmp]

The code says why a start holds the garbage collector, keeps pydantic, inflect and sympy out, builds the
vocoder without weight-norm parametrizations, loads the text tier after READY and stamps checksums; this
script prints how much each of those costs on this machine, so the figures live here (and in
docs/performance.md) rather than in docstrings where they go stale:

- ``import torch`` with the collector on, and held as ``cosyserve serve`` holds it (cosyserve.system.gchold);
- the web stack: starlette + uvicorn, and FastAPI (pydantic) when installed;
- the text tier: the tokenizer (50k-entry vocabulary), wetext's normalisers, and importing inflect;
- module construction on meta: ``nn.Embedding`` of the text vocabulary without our ``empty_modules`` (whose
  ``normal_`` imports sympy) and with it; the full-size vocoder with and without weight-norm parametrizations;
- page cache, on a ``--mb`` file in ``--dir``: mincore (what is cached), populate from the page cache, sha256.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from startup import byte_compile

SRC = Path(__file__).resolve().parents[1] / "src"

# each snippet prints the seconds of what it times, on one line starting with COST
CASES: dict[str, str] = {
    "import torch, collector on": "import time; t = time.perf_counter(); import torch",
    "import torch, collector held": (
        "import time; from cosyserve.system.gchold import hold_gc; hold_gc(); t = time.perf_counter(); import torch"
    ),
    "import starlette + uvicorn": (
        "import time; t = time.perf_counter(); import starlette.applications, starlette.routing, uvicorn"
    ),
    "import fastapi (pydantic)": "import time; t = time.perf_counter(); import fastapi",
    "tokenizer build": (
        "import time; from cosyserve.frontend.tokenizer import get_tokenizer; t = time.perf_counter(); "
        "get_tokenizer()"
    ),
    "wetext normalisers": (
        "import time; from cosyserve.frontend.text import load_normalizers; t = time.perf_counter(); "
        "load_normalizers()"
    ),
    "import inflect": "import time; t = time.perf_counter(); import inflect",
    "nn.Embedding(51866, 1024) on meta": (
        "import time, torch; t = time.perf_counter()\n"
        "with torch.device('meta'): torch.nn.Embedding(51866, 1024)"
    ),
    "nn.Embedding(51866, 1024), empty_modules": (
        "import time, torch; from cosyserve.bundle.construct import empty_modules; t = time.perf_counter()\n"
        "with empty_modules(): torch.nn.Embedding(51866, 1024)"
    ),
    "full-size vocoder, weight-norm, meta": (
        "import time; from cosyserve.bundle.construct import empty_modules\n"
        "from cosyserve.models.hift import HiFTConfig, HiFTGenerator; t = time.perf_counter()\n"
        "with empty_modules(): HiFTGenerator(HiFTConfig(), weight_norm=True)"
    ),
    "full-size vocoder, plain convs, meta": (
        "import time; from cosyserve.bundle.construct import empty_modules\n"
        "from cosyserve.models.hift import HiFTConfig, HiFTGenerator; t = time.perf_counter()\n"
        "with empty_modules(): HiFTGenerator(HiFTConfig(), weight_norm=False)"
    ),
}

PAGE_CACHE = """
import hashlib, mmap, sys, time
from cosyserve.system import pagecache
path = sys.argv[1]
gb = pagecache.resident_bytes([path]) / 1e9
with open(path, "rb") as f:
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
t = time.perf_counter(); pagecache.resident_map(mm); mincore = time.perf_counter() - t
t = time.perf_counter(); pagecache.populate(mm); populate = time.perf_counter() - t
t = time.perf_counter(); hashlib.sha256(mm).digest(); sha = time.perf_counter() - t
print("COST", mincore / gb, populate / gb, sha / gb)
"""


def _run(code: str, *args: str) -> list[float] | None:
    env = {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=600
    )
    if r.returncode != 0:
        if "ModuleNotFoundError" in r.stderr:
            return None  # an optional package (fastapi) is not installed
        raise SystemExit(f"failed:\n{code}\n{r.stderr[-2000:]}")
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("COST "))
    return [float(x) for x in line.split()[1:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="fresh processes per case")
    ap.add_argument("--mb", type=int, default=512, help="size of the file the page-cache figures read")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where to write that file")
    args = ap.parse_args()
    byte_compile(SRC)  # as pip install leaves it (bench/startup.py)

    results: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.runs):  # the cases alternate, so a machine that drifts shifts them all alike
        for name, code in CASES.items():
            got = _run(code + "\nprint('COST', time.perf_counter() - t)")
            if got is not None:
                results[name].append(got[0])
    print(f"{'one-time cost':<42} {'median ms':>10}   ({args.runs} fresh processes each)")
    for name, values in results.items():
        shown = f"{statistics.median(values) * 1e3:10.0f}" if values else f"{'n/a':>10}"
        print(f"{name:<42} {shown}")

    with tempfile.NamedTemporaryFile(dir=args.dir, suffix=".bin") as f:
        block = os.urandom(1 << 20)
        for _ in range(args.mb):
            f.write(block)
        f.flush()
        rows = [_run(PAGE_CACHE, f.name) for _ in range(args.runs)]
    per_gb = [statistics.median(r[i] for r in rows if r) * 1e3 for i in range(3)]
    print(f"\npage cache ({args.mb} MiB file, cached), ms per GB:")
    for name, ms in zip(("mincore (what is cached)", "populate (map it in)", "sha256"), per_gb, strict=True):
        print(f"{name:<42} {ms:10.0f}")


if __name__ == "__main__":
    main()
