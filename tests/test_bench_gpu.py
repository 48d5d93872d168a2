"""bench/gpu.py cannot rot: its dry run (the GPU run's code on the CPU at tiny size) prints a table with every
measurement the GPU run reports, filled, and its offline install step reads the requirements right.

The dry run here serves one family (12-14 s with the load average at 4; 20-22 s when its levels sent up to 64
requests); the script's default dry run serves every default family, and the table's code is checked with several
families below without serving them."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from proc_util import run_in_session

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu.py"

# what issue 28 asks the benchmark to report (the rows), besides how long the models took to make
MEASURED = [
    "speech tokens per request (from its audio)",
    "process start -> READY, client (s)",
    "process start -> READY, server (s)",
    "first audio, 1 client, server p50 (ms)",
    "first audio, 1 client, server p95 (ms)",
    "first audio, 1 client, client p50 (ms)",
    "first audio, 1 client, client p95 (ms)",
    *[
        f"{c} client{'s' if c > 1 else ''}: {what}"
        for c in (1, 4, 16, 64)
        for what in ("audio s per wall s", "first audio p50 (ms)", "first audio p99 (ms)")
    ],
    "refused or failed requests",
    "GPU memory peak (MiB)",
]


def _bench() -> ModuleType:
    sys.path.insert(0, str(SCRIPT.parent))  # it imports load_test from beside it
    try:
        spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_gpu"] = module  # its dataclasses look their module up while it runs
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_dry_run_prints_every_row_filled(tmp_path: Path) -> None:
    """If this fails, bench/gpu.py no longer runs end to end (make, convert, serve, stream, parse the server's log and
    endpoints), or its table lost a measurement, or one came out empty."""
    out = tmp_path / "results.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = run_in_session(  # the servers it starts end with its process group, even if the test is interrupted
        [sys.executable, str(SCRIPT), "--dry-run", "--families", "cosyvoice", "--budget-s", "600", "--json", str(out)],
        timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split() == ["cosyvoice"])
    rows = {}
    for line in lines[header + 1 :]:
        m = re.match(r"^(.*?)\s{2,}(\S+)$", line)
        if m is None:
            break
        rows[m.group(1)] = m.group(2)
    assert [k for k in MEASURED if k not in rows] == [], rows
    assert rows["GPU memory peak (MiB)"] == "n/a"  # no nvidia-smi on the CPU
    numbers = {k: float(v) for k, v in rows.items() if k != "GPU memory peak (MiB)"}
    assert numbers["refused or failed requests"] == 0
    tokens = numbers["speech tokens per request (from its audio)"]
    assert tokens > 0 and tokens % 20 == 0, "random weights run to 20 speech tokens per text token"
    assert all(v > 0 for k, v in numbers.items() if k != "refused or failed requests"), numbers
    results = json.loads(out.read_text())["results"]["cosyvoice"]
    assert results["gpu_mib"] is None and results["phases_ms"]["warmup"] >= 0
    assert "startup phases of cosyvoice (ms): " in r.stdout


def test_table_has_a_column_per_family_and_every_row() -> None:
    """If this fails, a family (a column) or a measurement (a row) is left out of the table, or a skipped one is not
    shown as skipped."""
    bench = _bench()
    rows: dict[str, dict[str, Any]] = {
        "cosyvoice": {k: 1.5 for k, _ in bench.ROWS},
        "cosyvoice2": {k: 250.0 for k, _ in bench.ROWS} | {"c64_xrt": bench.SKIPPED},
        "cosyvoice3": {},
    }
    lines = bench.table(rows).splitlines()
    assert lines[0].split() == list(rows)
    labels = [label for _, label in bench.ROWS]
    assert [line[: len(label)] for line, label in zip(lines[1:], labels, strict=True)] == labels
    assert all(label in labels for label in MEASURED)
    c64 = lines[1 + labels.index("64 clients: audio s per wall s")].split()[-3:]
    assert c64 == ["1.50", "skipped", "n/a"]


def test_offline_install_reads_requirements_and_versions() -> None:
    """If this fails, the GPU machine's install step would skip a requirement it lacks (or whose version is too old)
    and the server would fail to import it there, or would try to install what it has (pip --no-index fails when the
    wheel was not carried)."""
    bench = _bench()
    reqs = bench.requirements()
    assert any(r.startswith("numpy") for r in reqs) and not any(r.startswith("torch") for r in reqs)
    assert bench.missing(reqs) == []  # this environment runs the tests: it has them all
    asked = [
        "numpy>=1.0",
        "numpy>=999",
        "NumPy>=1.0,<999",
        "numpy==0.1",
        "numpy!=0.1",
        "cosyserve-no-such-distribution>=1",
        "uvicorn[standard]>=0.1",
    ]
    assert bench.missing(asked) == ["numpy>=999", "numpy==0.1", "cosyserve-no-such-distribution>=1"]
