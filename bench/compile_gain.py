"""What torch.compile would buy on this machine: compile cost (cold and with inductor's on-disk cache) and the
steady gain over eager, for the LLM's decode step and the flow estimator, full-size, fp32.

    python bench/compile_gain.py --bundle out/full-bundle [--threads 2] [--steps 20]

Two fresh processes share one empty inductor cache dir: the first compiles cold, the second finds the cache (what
a persistent cache beside the bundle would give a restart). Each process times, side by side and interleaved,
eager and compiled calls on the same inputs: the decode step (``TransformerLM.decode``, KV cache at
250 positions, the position moving each call, as in a request) and one flow estimator call at 80 and 300 frames
(a first chunk and a 3 s one-shot). ``dynamic=True`` so the moving position and the frame counts do not
recompile. Prints compile seconds (first call) and eager / compiled milliseconds per call (medians).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, statistics, sys, time
import torch
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
import cosyserve
m = cosyserve.load(args["bundle"], warmup=False)
mods = m.runtime.pipeline
llm = mods.llm
flow = mods.token2wav.flow
est = flow.decoder.estimator
out = {}

def bench(eager, compiled, inputs, steps):
    t = time.perf_counter(); compiled(*inputs(0)); first = time.perf_counter() - t
    e, c = [], []
    for i in range(steps):
        for fn, acc in ((eager, e), (compiled, c)):
            t = time.perf_counter(); fn(*inputs(i)); acc.append(time.perf_counter() - t)
    return first, statistics.median(e) * 1e3, statistics.median(c) * 1e3

with torch.inference_mode():
    llm.setup_caches(1, 512)
    tok = torch.tensor([7])
    def dec_inputs(i):
        p = 250 + i
        return tok, torch.tensor([p]), p + 1
    step = torch.compile(llm.decode, dynamic=True)
    out["decode"] = bench(llm.decode, step, dec_inputs, args["steps"])
    fwd = torch.compile(est.forward_packed, dynamic=True)
    for frames in (80, 300):
        h = torch.randn(2, est.in_channels, frames)
        t_in = torch.full((2,), 0.5)
        out[f"flow {frames} frames"] = bench(est.forward_packed, fwd, lambda i: (h, None, t_in), max(3, args["steps"] // 4))
print("RESULT " + json.dumps(out))
"""


def run_child(bundle: str, threads: int, steps: int, cache: str) -> dict[str, list[float]]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, PYTHONPATH="src")
    args = json.dumps({"bundle": bundle, "threads": threads, "steps": steps})
    proc = subprocess.run([sys.executable, "-c", CHILD, args], env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"child failed:\n{proc.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
        cold = run_child(a.bundle, a.threads, a.steps, cache)
        warm = run_child(a.bundle, a.threads, a.steps, cache)
    print(
        f"{'':22} {'compile cold s':>15} {'compile cached s':>17} {'eager ms':>9} {'compiled ms':>12} {'gain':>6}"
    )
    for name, (first, eager, comp) in cold.items():
        first2, eager2, comp2 = warm[name]
        e, c = min(eager, eager2), min(comp, comp2)
        print(f"{name:22} {first:15.1f} {first2:17.1f} {e:9.1f} {c:12.1f} {e / c:5.2f}x")
    print(f"load average: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
