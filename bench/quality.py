"""The quality gate for several variants of one model, side by side (what the closing note's quality column shows).

    flock -s /tmp/cs-cpu.lock python bench/quality.py --model /work/benchm/full-bundle \
        [--against /tmp/full-bf16] [--option-set "flow_steps=5"] [--parts llm,token2wav,chunks] [--threads 2]

Each ``--against`` (a bundle of the same model) and each ``--option-set`` (comma-separated ``key=value`` load
options) is one variant; the fp32 path against itself always runs first (its figures must be exact, and its
chunk figures are the chunk policies' own). Prints one column per variant and the bound of each gated figure.
"""

from __future__ import annotations

import argparse
import os
import time

from cosyserve.tools.quality import BOUNDS, PARTS, parse_options, run_quality


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--against", action="append", default=[], help="a bundle of the same model (repeatable)")
    ap.add_argument(
        "--option-set", action="append", default=[], help="KEY=VALUE,... load options (repeatable)"
    )
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    variants: list[tuple[str, str | None, dict]] = [("fp32", None, {})]
    variants += [(path, path, {}) for path in args.against]
    variants += [(s, None, parse_options(s.split(","))) for s in args.option_set]
    columns: dict[str, dict[str, float]] = {}
    seconds: dict[str, float] = {}
    for label, against, options in variants:
        t = time.perf_counter()
        report = run_quality(args.model, against=against, options=options, threads=args.threads, parts=parts)
        seconds[label] = time.perf_counter() - t
        columns[label] = report.figures
    names = list(dict.fromkeys(k for figures in columns.values() for k in figures))
    labels = list(columns)
    width = max(12, *(len(label) for label in labels))
    print(f"{'figure':<36}" + "".join(f" {label[-width:]:>{width}}" for label in labels) + "  bound")
    for name in names:
        bound = BOUNDS.get(name)
        cells = "".join(
            f" {columns[label][name]:>{width}.4f}" if name in columns[label] else f" {'-':>{width}}"
            for label in labels
        )
        shown = "" if bound is None else f"{'<=' if bound.upper else '>='} {bound.limit:g}"
        print(f"{name:<36}{cells}  {shown}")
    print(f"{'seconds':<36}" + "".join(f" {seconds[label]:>{width}.1f}" for label in labels))
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
