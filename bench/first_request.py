"""First request after READY vs steady state: warm-up on/off, text tier, idle gap (fresh process per configuration).

    python bench/first_request.py --model out/full-bundle [--text "..."] [--threads 2] [--runs 3] [--idle 1.0]

Each configuration starts a fresh process that loads the model, optionally waits ``--idle`` seconds (a server's
first request rarely arrives the instant it turns READY), then makes the same streaming request (same text,
same seed, so the same work) three times in a row: the first is "first request", the median of the other two
"steady state". Prints time to first audio and total time for both, and their ratios (target: first <= 1.1x).
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
time.sleep({idle})
vals = []
for _ in range(3):
    t = time.perf_counter()
    first = None
    n = 0
    for chunk in m.synthesize({text!r}, m.speakers[0], seed=0, stream=True):
        first = first or time.perf_counter() - t
        n += chunk.size
    vals += [first, time.perf_counter() - t]
print("BENCH", *vals, n / m.sample_rate)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", default="Hello world.")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--idle", type=float, default=1.0, help="seconds between READY and the first request")
    ap.add_argument("--only", default=None, help="run only the configurations whose name contains this")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    env.pop("COSYSERVE_TEXT_TIER", None)
    # name: (warm-up, strategy, idle seconds, text tier)
    configs = {
        "warm-up off, at once": (False, "preload", 0.0, "background"),
        "warm-up on, at once": (True, "preload", 0.0, "background"),
        "warm-up off, after idle": (False, "preload", args.idle, "background"),
        "warm-up on, after idle": (True, "preload", args.idle, "background"),
        "warm-up on, text lazy": (True, "preload", args.idle, "lazy"),
        "warm-up on, lazy pages": (True, "lazy", args.idle, "background"),
    }
    if args.only:
        configs = {k: v for k, v in configs.items() if args.only in k}
        if not configs:
            raise SystemExit(f"--only {args.only!r} matches no configuration")
    rows: dict[str, list[tuple[float, float, float, float]]] = {k: [] for k in configs}
    seconds = 0.0
    for _ in range(args.runs):
        for name, (warmup, strategy, idle, tier) in configs.items():
            code = CODE.format(
                threads=args.threads,
                model=args.model,
                warmup=warmup,
                strategy=strategy,
                text=args.text,
                idle=idle,
            )
            r = subprocess.run(
                [sys.executable, "-c", code],
                capture_output=True,
                text=True,
                env={**env, "COSYSERVE_TEXT_TIER": tier},
            )
            if r.returncode != 0:
                raise SystemExit(r.stderr[-3000:])
            v = [
                float(x)
                for x in next(ln for ln in r.stdout.splitlines() if ln.startswith("BENCH")).split()[1:]
            ]
            # (first TTFA, first total, steady TTFA, steady total)
            rows[name].append((v[0], v[1], statistics.median([v[2], v[4]]), statistics.median([v[3], v[5]])))
            seconds = v[6]
    print(
        f"\n'{args.text}' ({seconds:.2f} s of audio), streamed, {args.threads} threads, idle {args.idle:.1f} s "
        f"where said; medians of {args.runs} processes"
    )
    print(
        f"{'configuration':<26} {'TTFA first/steady ms':>21} {'ratio':>6} {'total first/steady s':>21} {'ratio':>6}"
    )
    for name, vals in rows.items():
        f_ttfa, f_tot, s_ttfa, s_tot = (statistics.median(v[i] for v in vals) for i in range(4))
        print(
            f"{name:<26} {f_ttfa * 1e3:10.0f} /{s_ttfa * 1e3:7.0f}  {f_ttfa / s_ttfa:5.2f}x "
            f"{f_tot:10.2f} /{s_tot:7.2f}  {f_tot / s_tot:5.2f}x"
        )


if __name__ == "__main__":
    main()
