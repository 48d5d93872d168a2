"""``cosyserve startup-report``: where every millisecond of a start goes, measured on fresh processes.

Each run starts ``python -m cosyserve._probe`` (the same load path a server takes) and, alternating with it, the
floor: a fresh ``python -c "import torch"``. Both report the wall-clock instant they got to (ready / torch
imported) against the spawn instant the parent passes in ``COSYSERVE_SPAWN_T0``, so the two are measured the
same way. ``--cold`` evicts the bundle's pages from the page cache before each start (posix_fadvise DONTNEED,
checked with mincore) and reports how many bytes the start then read.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from cosyserve.startup import PHASES

__all__ = ["evict", "resident_bytes", "spawn_timed", "startup_report"]

_FLOOR_CODE = "import time, torch; print('COSYSERVE_FLOOR', time.time(), flush=True)"


def _bundle_files(bundle: Path) -> list[Path]:
    return sorted(p for p in bundle.iterdir() if p.is_file() and p.suffix == ".safetensors")


def evict(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache (pages mapped by a live process stay)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(paths: list[Path]) -> int:
    """Bytes of the files now in the page cache (whole pages), by mincore(2)."""
    from cosyserve.startup import resident_pages

    return sum(resident_pages(p).count(1) for p in paths) * mmap.PAGESIZE


def _cold_read_rate(paths: list[Path]) -> float:
    """Bytes per second reading the (evicted) bundle files the fastest way measured: the better of one sequential
    reader (16 MiB reads) and four threads sharing 32 MiB pieces (this VM's disk reads ~4x faster in parallel)."""

    def sequential() -> int:
        n = 0
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                while block := f.read(1 << 24):
                    n += len(block)
        return n

    def parallel(workers: int = 4, piece: int = 32 << 20) -> int:
        jobs = [(p, off) for p in paths for off in range(0, p.stat().st_size, piece)]
        lock = threading.Lock()
        done = [0]

        def work() -> None:
            buf = memoryview(bytearray(4 << 20))
            while True:
                with lock:
                    if not jobs:
                        return
                    p, off = jobs.pop()
                with open(p, "rb", buffering=0) as f:
                    end = min(off + piece, p.stat().st_size)
                    while (
                        off < end and (n := os.preadv(f.fileno(), [buf[: min(len(buf), end - off)]], off)) > 0
                    ):
                        off += n
                        with lock:
                            done[0] += n

        threads = [threading.Thread(target=work) for _ in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return done[0]

    rates = []
    for read in (sequential, parallel):
        evict(paths)
        t = time.perf_counter()
        n = read()
        rates.append(n / max(time.perf_counter() - t, 1e-9))
    return max(rates)


def spawn_timed(cmd: list[str], env: dict[str, str], marker: str) -> tuple[float, str]:
    """Run ``cmd`` with ``COSYSERVE_SPAWN_T0`` set to the spawn instant; returns (that instant, the rest of its
    first stdout line that starts with ``marker``). Raises RuntimeError if it fails or prints no such line."""
    t0 = time.time()
    env = {**env, "COSYSERVE_SPAWN_T0": repr(t0)}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"start failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")
    for line in r.stdout.splitlines():
        if line.startswith(marker + " "):
            return t0, line[len(marker) + 1 :]
    raise RuntimeError(f"start printed no {marker} line: {r.stdout[-500:]} {r.stderr[-1500:]}")


def _stats(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _svg(summary: dict[str, Any], path: Path) -> None:
    phases = [(p, summary["phases_ms"][p]["median"]) for p in PHASES if p in summary["phases_ms"]]
    total = max(summary["ready_ms"]["median"], sum(v for _, v in phases), 1.0)
    if summary.get("first_audio_ms"):
        total = max(total, summary["first_audio_ms"]["median"])
    width, row, left = 900, 26, 140
    scale = (width - left - 90) / total
    colors = ["#8fb3d9", "#5b8cc6", "#f2c14e", "#f78154", "#b95f89", "#4d9078", "#a3c4bc", "#333", "#d7263d"]
    rows = []
    x = 0.0
    for i, (name, ms) in enumerate(phases):
        y = 30 + i * row
        rows.append(
            f'<text x="{left - 8}" y="{y + 16}" text-anchor="end">{name}</text>'
            f'<rect x="{left + x * scale:.1f}" y="{y + 4}" width="{max(ms * scale, 1):.1f}" height="{row - 8}" fill="{colors[i % len(colors)]}"/>'
            f'<text x="{left + (x + ms) * scale + 4:.1f}" y="{y + 16}">{ms:.0f} ms</text>'
        )
        x += ms
    marks = [
        ("floor", summary["floor_ms"]["median"], "#999"),
        ("ready", summary["ready_ms"]["median"], "#333"),
    ]
    if summary.get("first_audio_ms"):
        marks.append(("first audio", summary["first_audio_ms"]["median"], "#d7263d"))
    height = 30 + len(phases) * row + 40
    for name, ms, color in marks:
        xx = left + ms * scale
        rows.append(
            f'<line x1="{xx:.1f}" y1="20" x2="{xx:.1f}" y2="{height - 30}" stroke="{color}" stroke-dasharray="4 3"/>'
            f'<text x="{xx + 3:.1f}" y="{height - 16}" fill="{color}">{name} {ms:.0f} ms</text>'
        )
    title = (
        f"cosyserve start-up, median of {summary['runs']} runs ({'cold' if summary['cold'] else 'warm'} page cache, "
        f"{summary['strategy']}): ready {summary['ready_ms']['median']:.0f} ms = {summary['ratio_ready_to_floor']:.2f}x import torch"
    )
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">'
        f'<text x="10" y="16" font-weight="bold">{title}</text>{"".join(rows)}</svg>\n'
    )
    path.write_text(svg, encoding="utf-8")


def _find_pyspy() -> str:
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(pyspy).exists():
        # checked before the first start: a flame graph asked for is never skipped after minutes of runs
        raise ValueError(
            "--flamegraph needs py-spy, which is not installed: pip install 'cosyserve[profile]'"
        )
    return pyspy


def _flamegraph(cmd: list[str], env: dict[str, str], out: Path) -> str:
    pyspy = _find_pyspy()
    r = subprocess.run(
        [
            pyspy,
            "record",
            "--rate",
            "250",
            "--subprocesses",
            "--format",
            "flamegraph",
            "-o",
            str(out),
            "--",
            *cmd,
        ],
        capture_output=True,
        text=True,
        env={**env, "COSYSERVE_SPAWN_T0": repr(time.time())},
        timeout=900,
    )
    if r.returncode != 0:
        err = r.stderr.strip().splitlines()[-1:] or ["unknown error"]
        if "ptrace" in r.stderr.lower() or "permission" in r.stderr.lower():
            return f"flame graph skipped: py-spy may not trace processes here (ptrace refused): {err[0]}"
        return f"flame graph failed: {err[0]}"
    return f"flame graph written to {out}"


def startup_report(
    model: str,
    *,
    runs: int = 5,
    cold: bool = False,
    as_json: bool = False,
    svg: str | None = None,
    flamegraph: str | None = None,
    strategy: str | None = None,
    warmup: bool = True,
    threads: int | None = None,
) -> dict[str, Any]:
    """Time ``runs`` fresh starts of ``model`` and of the floor, print the report, return the summary dict."""
    from cosyserve.api import resolve_bundle
    from cosyserve.settings import load_strategy

    if flamegraph:
        _find_pyspy()
    bundle = resolve_bundle(model)
    strategy = strategy or load_strategy()
    files = _bundle_files(bundle)
    env = {k: v for k, v in os.environ.items() if k != "COSYSERVE_SPAWN_T0"}
    opts = {"model": str(bundle), "strategy": strategy, "warmup": warmup, "threads": threads}
    probe_cmd = [sys.executable, "-m", "cosyserve._probe", json.dumps(opts)]
    floor_cmd = [sys.executable, "-c", _FLOOR_CODE]
    ready, floor, first_audio, rss = [], [], [], []
    phases: dict[str, list[float]] = {}
    touched = []
    for _ in range(runs):
        t0, line = spawn_timed(floor_cmd, env, "COSYSERVE_FLOOR")
        floor.append((float(line) - t0) * 1e3)
        if cold:
            evict(files)
        _, line = spawn_timed(probe_cmd, env, "COSYSERVE_PROBE")
        rec = json.loads(line)
        if cold:
            touched.append(resident_bytes(files))
        ready.append(rec["points_ms"]["ready"])
        if rec.get("first_audio_ms") is not None:
            first_audio.append(rec["first_audio_ms"])
        rss.append(rec["peak_rss_mb"])
        for name, ms in rec["phases_ms"].items():
            phases.setdefault(name, []).append(ms)
    summary: dict[str, Any] = {
        "runs": runs,
        "model": str(bundle),
        "strategy": strategy,
        "warmup": warmup,
        "cold": cold,
        "ready_ms": _stats(ready),
        "floor_ms": _stats(floor),
        "ratio_ready_to_floor": statistics.median(ready) / statistics.median(floor),
        "phases_ms": {p: _stats(phases[p]) for p in PHASES if p in phases},
        "first_audio_ms": _stats(first_audio) if first_audio else None,
        "peak_rss_mb": _stats(rss),
    }
    if cold:
        rate = _cold_read_rate(files)
        med_touched = statistics.median(touched)
        read_ms = med_touched / rate * 1e3
        summary["cold_read"] = {
            "bytes_touched": med_touched,
            "read_rate_mb_s": rate / 1e6,
            "read_ms": read_ms,
            "ratio_ready_to_floor_plus_read": statistics.median(ready) / (statistics.median(floor) + read_ms),
        }
    notes = []
    if svg:
        _svg(summary, Path(svg))
        notes.append(f"waterfall written to {svg}")
    if flamegraph:
        notes.append(_flamegraph(probe_cmd, env, Path(flamegraph)))
    if as_json:
        print(json.dumps(summary, indent=1))
    else:
        _print_table(summary)
        for n in notes:
            print(n)
    return summary


def _print_table(s: dict[str, Any]) -> None:
    print(
        f"startup report: {s['model']} ({s['runs']} runs, {'cold' if s['cold'] else 'warm'} page cache, {s['strategy']})"
    )
    print(f"{'phase':<14} {'min':>9} {'median':>9} {'max':>9}   (ms)")
    for name, st in s["phases_ms"].items():
        print(f"{name:<14} {st['min']:9.1f} {st['median']:9.1f} {st['max']:9.1f}")
    for label, key in (("READY", "ready_ms"), ("first audio", "first_audio_ms"), ("floor", "floor_ms")):
        st = s.get(key)
        if st:
            print(f"{label:<14} {st['min']:9.1f} {st['median']:9.1f} {st['max']:9.1f}   since process start")
    print(
        f"ready / floor (python -c 'import torch'): {s['ratio_ready_to_floor']:.2f}x; peak RSS {s['peak_rss_mb']['median']:.0f} MB"
    )
    if "cold_read" in s:
        c = s["cold_read"]
        print(
            f"cold: {c['bytes_touched'] / 1e6:.0f} MB read during start at {c['read_rate_mb_s']:.0f} MB/s = "
            f"{c['read_ms']:.0f} ms; ready / (floor + read) = {c['ratio_ready_to_floor_plus_read']:.2f}x"
        )
