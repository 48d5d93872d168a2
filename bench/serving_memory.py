"""Memory while serving SFT: RSS at READY and its peak over requests, split into mapped weights and the rest.

    python bench/serving_memory.py --bundle out/full-bundle [--bundle out/full-bundle-bf16] [--threads 2]
        [--allocator /usr/lib/x86_64-linux-gnu/libjemalloc.so.2]

Each bundle (and each allocator: glibc's, then any given with --allocator, preloaded with LD_PRELOAD) runs in a
fresh process: ``cosyserve.load`` as a server does (preload, warm-up, text tier), then the same SFT request
three times one-shot and once streamed. Prints, at READY and after each request: peak RSS (VmHWM), RSS, and its
file-backed part (mostly the mapped weights, shared with the page cache and with forked workers) and anonymous
part (torch, the text tier, activations, allocator slack), in MiB, and the request's wall time. Make the bundles
with ``cosyserve make-test-model out/full-model --size full`` and ``cosyserve convert`` (``--dtype bfloat16``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CODE = r"""
import json, sys, time
import torch
torch.set_num_threads({threads})
import cosyserve

def mem():
    d = {{}}
    for line in open("/proc/self/status"):
        k, v = line.split(":", 1)
        if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            d[k] = int(v.split()[0]) // 1024
    return d

m = cosyserve.load({bundle!r})
for t in (m.runtime.text_thread, m.runtime.warmup_thread):
    if t is not None:
        t.join()
rows = [("ready", 0.0, mem())]
speaker = "英文女" if "英文女" in m.speakers else m.speakers[0]
for i in range(3):
    t = time.perf_counter()
    m.synthesize_all({text!r}, speaker, seed=0)
    rows.append((f"one-shot {{i + 1}}", time.perf_counter() - t, mem()))
t = time.perf_counter()
for _ in m.synthesize({text!r}, speaker, seed=0, stream=True):
    pass
rows.append(("streamed", time.perf_counter() - t, mem()))
print("BENCH " + json.dumps(rows))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", action="append", required=True, help="a bundle (repeat for several)")
    ap.add_argument("--allocator", action="append", default=[], help="a malloc library to LD_PRELOAD as well")
    ap.add_argument("--text", default="Hello world, this is a test.")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    for key in ("COSYSERVE_PRELOAD", "PREWARM_MODELS", "COSYSERVE_TEXT_TIER", "LD_PRELOAD"):
        env.pop(key, None)
    for bundle in args.bundle:
        for alloc in [None, *args.allocator]:
            if alloc is not None and not Path(alloc).is_file():
                raise SystemExit(f"--allocator {alloc}: no such file")
            code = CODE.format(bundle=bundle, text=args.text, threads=args.threads)
            run_env = env if alloc is None else {**env, "LD_PRELOAD": alloc}
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=run_env)
            if r.returncode != 0:
                raise SystemExit(f"benchmark process failed:\n{r.stderr[-3000:]}")
            rows = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("BENCH "))[6:])
            print(
                f"\n{bundle}, allocator {Path(alloc).name if alloc else 'glibc'}, {args.threads} threads (MiB)"
            )
            print(f"{'':<12} {'peak RSS':>9} {'RSS':>7} {'file':>7} {'anon':>7} {'wall s':>7}")
            for name, wall, m in rows:
                print(
                    f"{name:<12} {m['VmHWM']:9d} {m['VmRSS']:7d} {m['RssFile']:7d} {m['RssAnon']:7d} "
                    f"{wall:7.2f}"
                )


if __name__ == "__main__":
    main()
