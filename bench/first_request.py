"""First request after READY vs steady state, with and without warm-up (fresh process per configuration).

    python bench/first_request.py --model out/full-bundle [--text "..."] [--threads 2] [--runs 3]

Each configuration starts a fresh process that loads the model (warm-up on or off), then times the same
one-shot synthesis (same text, same seed, so the same work) three times in a row: the first is "first request",
the median of the other two "steady state". Prints both and their ratio (target: first <= 1.1x steady).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

CODE = r"""
import time, torch
torch.set_num_threads({threads})
import cosyserve
m = cosyserve.load({model!r}, warmup={warmup}, strategy={strategy!r})
times = []
for _ in range(3):
    t = time.perf_counter()
    audio = m.synthesize_all({text!r}, m.speakers[0], seed=0)
    times.append(time.perf_counter() - t)
print("BENCH", *times, audio.size / m.sample_rate)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", default="Hello world.")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    configs = {
        "warm-up off, preload": (False, "preload"),
        "warm-up on, preload": (True, "preload"),
        "warm-up off, prefetch": (False, "prefetch"),
        "warm-up on, prefetch": (True, "prefetch"),
        "warm-up off, lazy": (False, "lazy"),
    }
    rows: dict[str, list[tuple[float, float]]] = {k: [] for k in configs}
    for _ in range(args.runs):
        for name, (warmup, strategy) in configs.items():
            code = CODE.format(
                threads=args.threads, model=args.model, warmup=warmup, strategy=strategy, text=args.text
            )
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
            if r.returncode != 0:
                raise SystemExit(r.stderr[-3000:])
            vals = [
                float(v)
                for v in next(ln for ln in r.stdout.splitlines() if ln.startswith("BENCH")).split()[1:]
            ]
            rows[name].append((vals[0], statistics.median(vals[1:3])))
            seconds = vals[3]
    print(
        f"\n'{args.text}' ({seconds:.2f} s of audio), {args.threads} threads, medians of {args.runs} processes"
    )
    print(f"{'configuration':<24} {'first s':>8} {'steady s':>9} {'first/steady':>13}")
    for name, vals in rows.items():
        first = statistics.median(v[0] for v in vals)
        steady = statistics.median(v[1] for v in vals)
        print(f"{name:<24} {first:8.2f} {steady:9.2f} {first / steady:12.2f}x")


if __name__ == "__main__":
    main()
