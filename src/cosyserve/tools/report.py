"""``cosyserve startup-report``: where every millisecond of a start goes, measured on fresh processes.

Each run starts ``python -m cosyserve.tools._probe`` (the same load path a server takes) and, alternating with it, the
floor: a fresh ``python -c "import torch"``. Both report the wall-clock instant they got to (ready / torch
imported) against the spawn instant the parent passes in ``COSYSERVE_SPAWN_T0``, so the two are measured the
same way. ``--cold`` evicts the bundle's pages from the page cache before each start (posix_fadvise DONTNEED,
checked with mincore) and reports how many bytes the start then read.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cosyserve.core.clock import PHASES
from cosyserve.system.pagecache import cold_read_rate, evict, resident_bytes

if TYPE_CHECKING:
    from cosyserve.core.settings import Settings

__all__ = ["spawn_timed", "startup_report", "waterfall_svg"]

# the floor of each runtime: a fresh process that imports its engine and nothing else
_FLOOR_MODULE = {"torch": "torch", "lite": "onnxruntime"}
_FLOOR_CODE = "import time, {module}; print('COSYSERVE_FLOOR', time.time(), flush=True)"


def _bundle_files(bundle: Path, runtime: str = "torch") -> list[Path]:
    if runtime == "lite":
        return sorted(
            p for p in (bundle / "lite").iterdir() if p.is_file() and p.suffix in (".data", ".safetensors")
        )
    return sorted(p for p in bundle.iterdir() if p.is_file() and p.suffix == ".safetensors")


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


# -- the waterfall SVG -----------------------------------------------------------------------------------------
# Laid out for a person to read at a glance: one row per phase, each bar from the phase's (median) start, at
# least _MIN_BAR px wide; long stretches where nothing starts or ends (a slow import, the wait for the first
# request) are cut out of the time axis (a zigzag marks each cut); every label's width is estimated so that no
# two labels overlap and none leaves the picture: the time marks' labels go on as many lines as they need.

_FONT = 12  # px
_EM = (
    0.62  # estimated advance of one character in ems (sans-serif; DejaVu Sans digits are 0.64, Arial's 0.56)
)
_ROW, _MIN_BAR, _CUT_PX, _PAD = 26, 3.0, 26.0, 6.0
_COLORS = ["#8fb3d9", "#5b8cc6", "#f2c14e", "#f78154", "#b95f89", "#4d9078", "#a3c4bc", "#555", "#d7263d"]


def _text_w(text: str, size: float = _FONT, bold: bool = False) -> float:
    return len(text) * size * (_EM + (0.06 if bold else 0.0))


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _fmt_ms(ms: float) -> str:
    return f"{ms:.0f} ms" if ms < 10_000 else f"{ms / 1e3:.1f} s"


def _wrap(text: str, width: float, size: float, bold: bool = False) -> list[str]:
    lines: list[str] = []
    for word in text.split(" "):
        if lines and _text_w(lines[-1] + " " + word, size, bold) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


def _timeline(summary: dict[str, Any]) -> tuple[list[tuple[str, float, float]], list[tuple[str, float, str]]]:
    """(phase, start, duration) bars, by start, and (label, time, color) marks, in ms since process start. A phase
    without a recorded start follows the one before it, and the phases after READY in PHASES start at READY."""
    starts = summary.get("phase_starts_ms") or {}
    bars = []
    t = 0.0
    for p in PHASES:
        if p == "ready":
            t = max(t, summary["ready_ms"]["median"])
        if p not in summary["phases_ms"]:
            continue
        ms = summary["phases_ms"][p]["median"]
        start = starts[p]["median"] if p in starts else t
        bars.append((p, start, ms))
        t = start + ms
    bars.sort(key=lambda b: b[1])
    marks = [
        ("floor", summary["floor_ms"]["median"], "#888"),
        ("READY", summary["ready_ms"]["median"], "#222"),
    ]
    if summary.get("first_audio_ms"):
        marks.append(("first audio", summary["first_audio_ms"]["median"], "#d7263d"))
    return bars, marks


def _axis_cuts(times: list[float], max_cuts: int = 3, share: float = 0.4) -> list[tuple[float, float]]:
    """Stretches of the axis to cut: the longest gap between two event times while it is over ``share`` of
    what would remain shown."""
    times = sorted(set(times))
    gaps = sorted(((b - a, a, b) for a, b in zip(times, times[1:], strict=False)), reverse=True)
    cuts: list[tuple[float, float]] = []
    shown = times[-1] - times[0]
    for length, a, b in gaps[:max_cuts]:
        if length <= share * shown:
            break
        cuts.append((a, b))
        shown -= length
    return sorted(cuts)


def _scale(cuts: list[tuple[float, float]], span: float, x0: float, width: float) -> Any:
    """t (ms) -> x (px): linear over what is shown; each cut takes _CUT_PX."""
    shown = max(span - sum(b - a for a, b in cuts), 1e-9)
    k = (width - _CUT_PX * len(cuts)) / shown

    def x(t: float) -> float:
        pos, prev = x0, 0.0
        for a, b in cuts:
            if t <= a:
                break
            pos += (a - prev) * k
            if t < b:
                return pos + _CUT_PX * (t - a) / (b - a)
            pos += _CUT_PX
            prev = b
        return pos + (t - prev) * k

    return x


def _place(
    boxes: list[tuple[float, float, float, float]], w: float, h: float, xs: list[float], y: float
) -> Any:
    """The first of the candidate left edges ``xs`` on line ``y`` where a w x h box overlaps none of ``boxes``."""
    for x in xs:
        box = (x, y - h, x + w, y)
        if all(
            box[2] + _PAD <= o[0] or o[2] + _PAD <= box[0] or box[3] <= o[1] or o[3] <= box[1] for o in boxes
        ):
            return box
    return None


def _svg(summary: dict[str, Any], path: Path) -> None:
    path.write_text(waterfall_svg(summary), encoding="utf-8")


def _zigzag(x0: float, y0: float, y1: float) -> str:
    points = " ".join(
        f"{x0 + (4 if k % 2 else 0):.1f},{y}" for k, y in enumerate(range(int(y0), int(y1) + 1, 6))
    )
    return f'<polyline points="{points}" fill="none" stroke="#999"/>'


def waterfall_svg(summary: dict[str, Any], width: int = 900) -> str:
    """The start-up waterfall of a :func:`startup_report` summary as an SVG document."""
    bars, marks = _timeline(summary)
    title = (
        f"cosyserve start-up, median of {summary['runs']} runs ({'cold' if summary['cold'] else 'warm'} page "
        f"cache, {summary['strategy']}): READY {_fmt_ms(summary['ready_ms']['median'])} = "
        f"{summary['ratio_ready_to_floor']:.2f}x the floor (a fresh python -c 'import {summary.get('floor_module', 'torch')}')"
    )
    title_lines = _wrap(title, width - 20, _FONT + 1, bold=True)
    top = 12 + 18 * len(title_lines)
    left = 14 + max((_text_w(name) for name, _, _ in bars), default=60.0)
    plot_w = width - left - 12
    end = max([s + d for _, s, d in bars] + [t for _, t, _ in marks] + [1.0])
    cuts = _axis_cuts([0.0, end] + [t for _, t, _ in marks] + [v for _, s, d in bars for v in (s, s + d)])
    x = _scale(cuts, end, left, plot_w)
    shapes: list[str] = []  # drawn first, then the cuts over them, then every text on top
    texts: list[str] = []
    boxes: list[tuple[float, float, float, float]] = []  # every text's estimated box, to keep texts apart

    def text(
        x0: float, y: float, s: str, size: float = _FONT, anchor: str = "start", style: str = ""
    ) -> None:
        w = _text_w(s, size, "bold" in style)
        lo = x0 - w if anchor == "end" else x0
        boxes.append((lo, y - size, lo + w, y + 3))
        attrs = f' font-size="{size:g}"' * (size != _FONT) + f' text-anchor="{anchor}"' * (anchor != "start")
        texts.append(f'<text x="{x0:.1f}" y="{y:.1f}"{attrs}{style}>{_esc(s)}</text>')

    for i, line in enumerate(title_lines):
        text(10, 24 + 18 * i, line, _FONT + 1, style=' font-weight="bold"')
    rows_end = top + _ROW * len(bars)
    for i, (name, start, ms) in enumerate(bars):
        y = top + i * _ROW
        x1 = x(start)
        w = max(x(start + ms) - x1, _MIN_BAR)
        x1 = min(x1, left + plot_w - w)
        shapes.append(
            f'<rect class="phase" x="{x1:.1f}" y="{y + 5}" width="{w:.1f}" height="{_ROW - 10}" '
            f'fill="{_COLORS[i % len(_COLORS)]}"><title>{name}</title></rect>'
        )
        text(left - 8, y + 17, name, anchor="end")
        value, vw = _fmt_ms(ms), _text_w(_fmt_ms(ms))
        if x1 + w + 4 + vw <= width - 4:
            text(x1 + w + 4, y + 17, value)
        elif x1 - 4 - vw >= left:
            text(x1 - 4, y + 17, value, anchor="end")
        else:
            text(x1 + w - 4, y + 17, value, anchor="end", style=' fill="#fff"')
    cut_marks = []
    for a, b in cuts:  # a blank strip with zigzag edges across the rows where the axis is cut
        xa, xb = x(a) + 7, x(b) - 11
        cut_marks.append(
            f'<rect x="{xa:.1f}" y="{top}" width="{xb + 4 - xa:.1f}" height="{rows_end - top}" fill="#fff"/>'
            + _zigzag(xa, top, rows_end)
            + _zigzag(xb, top, rows_end)
        )
    # the time marks: a dashed line from the top of the rows down to its label; labels on more lines as needed
    line_y = rows_end + 20
    lowest = line_y
    for name, t, color in sorted(marks, key=lambda m: m[1]):
        label = f"{name} {_fmt_ms(t)}"
        w, xm = _text_w(label), x(t)
        candidates = [min(max(xm + 3, 2.0), width - 2 - w), min(max(xm - 3 - w, 2.0), width - 2 - w)]
        level = 0
        while (box := _place(boxes, w, _FONT, candidates, line_y + 16 * level)) is None:
            level += 1
        y = line_y + 16 * level
        lowest = max(lowest, y)
        shapes.append(
            f'<line class="mark" x1="{xm:.1f}" y1="{top - 2}" x2="{xm:.1f}" y2="{y - _FONT:.1f}" stroke="{color}" '
            f'stroke-dasharray="4 3"><title>{name}</title></line>'
        )
        text(box[0], y, label, style=f' fill="{color}"')
    notes = "Bars: each phase from its (median) start; a phase that runs in several threads sums their time."
    if cuts:
        notes += (
            " Zigzags: the time axis is cut there ("
            + ", ".join(_fmt_ms(b - a) for a, b in cuts)
            + " left out)."
        )
    y = lowest + 6
    for line in _wrap(notes, width - 20, _FONT - 1):
        y += 15
        text(10, y, line, _FONT - 1, style=' fill="#666"')
    height = int(y + 10)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'font-family="sans-serif" font-size="{_FONT}"><rect width="{width}" height="{height}" fill="#fff"/>'
        + "".join(shapes + cut_marks + texts)
        + "</svg>\n"
    )


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
    warmup: bool = True,
    settings: Settings | None = None,
) -> dict[str, Any]:
    """Time ``runs`` fresh starts of ``model`` and of the floor, print the report, return the summary dict.

    The starts load with the ``strategy`` and ``threads`` of ``settings`` (default: read from the environment);
    the other loading settings reach them through the environment they inherit.
    """
    from cosyserve.api import resolve_bundle
    from cosyserve.core.settings import Settings

    settings = settings if settings is not None else Settings.load()
    if flamegraph:
        _find_pyspy()
    bundle = resolve_bundle(model, cache_dir=settings.cache_dir)
    strategy, threads, runtime = settings.strategy, settings.threads, settings.runtime
    files = _bundle_files(bundle, runtime)
    env = {k: v for k, v in os.environ.items() if k != "COSYSERVE_SPAWN_T0"}
    opts = {
        "model": str(bundle),
        "strategy": strategy,
        "warmup": warmup,
        "threads": threads,
        "runtime": runtime,
    }
    probe_cmd = [sys.executable, "-m", "cosyserve.tools._probe", json.dumps(opts)]
    floor_cmd = [sys.executable, "-c", _FLOOR_CODE.format(module=_FLOOR_MODULE[runtime])]
    ready, floor, first_audio, rss = [], [], [], []
    precision: dict[str, str] = {}
    phases: dict[str, list[float]] = {}
    starts: dict[str, list[float]] = {}
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
        precision = rec.get("precision", {})
        for name, ms in rec["phases_ms"].items():
            phases.setdefault(name, []).append(ms)
        for name, ms in rec.get("starts_ms", {}).items():
            starts.setdefault(name, []).append(ms)
    summary: dict[str, Any] = {
        "runs": runs,
        "model": str(bundle),
        "strategy": strategy,
        "warmup": warmup,
        "cold": cold,
        "ready_ms": _stats(ready),
        "floor_ms": _stats(floor),
        "floor_module": _FLOOR_MODULE[runtime],
        "ratio_ready_to_floor": statistics.median(ready) / statistics.median(floor),
        "phases_ms": {p: _stats(phases[p]) for p in PHASES if p in phases},
        "phase_starts_ms": {p: _stats(starts[p]) for p in PHASES if p in starts},  # since process start
        "first_audio_ms": _stats(first_audio) if first_audio else None,
        "peak_rss_mb": _stats(rss),
        "precision": precision,
    }
    if cold:
        rate = cold_read_rate(files)
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
        f"ready / floor (python -c 'import {s.get('floor_module', 'torch')}'): {s['ratio_ready_to_floor']:.2f}x; peak RSS "
        f"{s['peak_rss_mb']['median']:.0f} MB"
    )
    if s.get("precision"):
        print("precision: " + ", ".join(f"{name} {p}" for name, p in s["precision"].items()))
    if "cold_read" in s:
        c = s["cold_read"]
        print(
            f"cold: {c['bytes_touched'] / 1e6:.0f} MB read during start at {c['read_rate_mb_s']:.0f} MB/s = "
            f"{c['read_ms']:.0f} ms; ready / (floor + read) = {c['ratio_ready_to_floor_plus_read']:.2f}x"
        )
