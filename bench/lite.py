"""Lite runtime vs torch runtime, side by side in fresh processes: start to READY, to first audio, RTF, peak RSS.

Usage::

    cosyserve make-test-model full300 --size full
    cosyserve convert full300 full300-bundle --runtime lite
    python bench/lite.py full300-bundle --rounds 3

Each round runs, in alternating order, the two floors (``python -c "import onnxruntime"``, ``python -c "import
torch"``) and one fresh process per runtime that loads the bundle, notes READY (ms since its process started),
streams a short sentence (first audio since process start, and since the request), waits for the work each
runtime does after READY and streams it again (warm TTFA), then synthesizes one sentence one-shot (RTF: compute seconds per audio second; random weights run every text to 20 speech tokens per text
token). Medians over the rounds are printed, and their ratios. The bundle is read once before the first round
(warm page cache, as the targets say). Put the load average beside the figures (printed first).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
t_main = time.time()
import cosyserve
from cosyserve.core.clock import process_start_time
bundle, runtime, threads, text, quantize = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
model = cosyserve.load(bundle, runtime=runtime, threads=threads, llm_quantize=quantize)
t0 = process_start_time()
ready = model.runtime.clock.points["ready"]
speaker = model.speakers[0]
t_req = time.time()
first = None
n = 0
for chunk in model.synthesize("Hello there.", speaker=speaker, seed=1, stream=True):
    if first is None:
        first = time.time()
    n += chunk.size
model.runtime.join_background()  # every session open: the steady state
t_warm = time.time()
for chunk in model.synthesize("Hello there.", speaker=speaker, seed=1, stream=True):
    warm = time.time() - t_warm
    break
t = time.time()
audio = model.synthesize_all(text, speaker=speaker, seed=2)
compute = time.time() - t
print(json.dumps({
    "ready_ms": ready,
    "first_audio_ms": (first - t0) * 1e3,
    "request_to_first_ms": (first - t_req) * 1e3,
    "warm_ttfa_ms": warm * 1e3,
    "rtf": compute / (audio.size / model.sample_rate),
    "audio_s": audio.size / model.sample_rate,
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "torch_loaded": "torch" in sys.modules and sys.modules["torch"] is not None,
}))
"""


def _floor(module: str) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
    return (time.perf_counter() - t) * 1e3


def _run(bundle: str, runtime: str, threads: int, text: str, quantize: str) -> dict:
    p = subprocess.run(
        [sys.executable, "-c", CHILD, bundle, runtime, str(threads), text, quantize],
        capture_output=True,
        text=True,
        check=False,
    )
    if p.returncode != 0:
        raise SystemExit(f"{runtime} run failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", help="a bundle converted with --runtime lite (it serves both runtimes)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text", default="Hello world, this is a test.")
    ap.add_argument(
        "--quantize", default="none", choices=("none", "int8"),
        help="llm_quantize for both runtimes (int8: a bundle converted with --runtime lite --quantize llm=int8)",
    )  # fmt: skip
    args = ap.parse_args()
    print(f"load average {os.getloadavg()}")
    for f in sorted(Path(args.bundle).rglob("*")):  # warm page cache
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass
    rows: dict[str, list] = {"floor onnxruntime": [], "floor torch": [], "lite": [], "torch": []}
    for r in range(args.rounds):
        order = ["lite", "torch"] if r % 2 == 0 else ["torch", "lite"]
        rows["floor onnxruntime"].append(_floor("onnxruntime"))
        rows["floor torch"].append(_floor("torch"))
        for name in order:
            rows[name].append(_run(args.bundle, name, args.threads, args.text, args.quantize))
            print(f"round {r} {name}: {json.dumps(rows[name][-1])}", flush=True)
    med = statistics.median
    print(
        f"\nload average {os.getloadavg()}; medians over {args.rounds} rounds, {args.threads} threads, "
        f"llm_quantize={args.quantize}"
    )
    print(f"floor `import onnxruntime`: {med(rows['floor onnxruntime']):.0f} ms (process start to exit)")
    print(f"floor `import torch`:       {med(rows['floor torch']):.0f} ms")
    keys = ["ready_ms", "first_audio_ms", "request_to_first_ms", "warm_ttfa_ms", "rtf", "peak_rss_mb"]
    print(f"{'':8}" + "".join(f"{k:>22}" for k in keys))
    for name in ("lite", "torch"):
        print(f"{name:8}" + "".join(f"{med([x[k] for x in rows[name]]):>22.3f}" for k in keys))
    print(f"{'ratio':8}" + "".join(
        f"{med([x[k] for x in rows['lite']]) / med([x[k] for x in rows['torch']]):>22.3f}" for k in keys
    ))  # fmt: skip
    print("torch loaded in the lite process:", any(x["torch_loaded"] for x in rows["lite"]))


if __name__ == "__main__":
    main()
