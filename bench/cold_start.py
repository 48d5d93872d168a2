"""Cold start, side by side in one run: the floor, the reference's naive load path, and cosyserve's bundle.

    python bench/cold_start.py --model-dir out/full-model --bundle out/full-bundle \
        [--bundle-bf16 out/full-bundle-bf16] [--runs 3] [--threads 2]

Every configuration is a fresh process, started in turn (round-robin, so drift hits all alike):
- floor: ``python -c "import torch"``;
- naive: what the reference does: build the modules with random initialisation, ``torch.load`` each .pt,
  ``load_state_dict`` (our modules, so the comparison is of the loading strategy alone);
- bundle fp32 / bf16, warm page cache and cold (pages evicted with posix_fadvise first): ``cosyserve.load``
  lazy without warm-up (the load phases alone), and fp32 with warm-up + preload, warm and cold (READY with
  every weight page mapped and every kernel warmed: what a server configured for no first-request penalty pays).
Prints, per configuration, the medians of start-to-READY (ms since exec) and of the load phases alone
(wall clock), peak RSS, and the ratios READY / floor and naive load / bundle load. Make the inputs with
``cosyserve make-test-model out/full-model --size full`` and ``cosyserve convert``.
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

from startup import byte_compile

NAIVE = r"""
import time, resource, sys
import torch
t_imp = time.time()
torch.set_num_threads({threads})
from cosyserve.families.modelconfig import load_model_config
from cosyserve.bundle.official import module_class
d = {model_dir!r}
cfg = load_model_config(d)
t0 = time.perf_counter()
mods = {{n: module_class(n)(getattr(cfg, n)) for n in ("llm", "flow", "hift")}}
t1 = time.perf_counter()
for n, m in mods.items():
    sd = torch.load(f"{{d}}/{{n}}.pt", map_location="cpu", weights_only=True)
    m.load_state_dict({{k.removeprefix("generator."): v for k, v in sd.items()}}, strict=True)
    m.eval()
t2 = time.perf_counter()
print("BENCH", time.time(), (t1 - t0) * 1e3, (t2 - t0) * 1e3, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""

BUNDLE = r"""
import time, resource
from cosyserve.system.gchold import hold_gc
hold_gc()  # as `cosyserve serve` does at process start (released when the load returns)
from cosyserve.system.pagecache import prefetch_bundles
if {strategy!r} != "lazy":
    prefetch_bundles([{bundle!r}])  # likewise: read a cold bundle while torch imports
import torch
torch.set_num_threads({threads})
import cosyserve
from cosyserve.core.clock import PhaseClock
clock = PhaseClock()
m = cosyserve.load({bundle!r}, warmup={warmup}, clock=clock, strategy={strategy!r}, verify="stamp")
from cosyserve.system.gchold import release_gc
release_gc()
ph = clock.durations
wall = ph["load_wall"]  # open + check + construct + map/assign (+ populate for preload), wall clock
print("BENCH", time.time(), ph.get("construct", 0), wall, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""

FLOOR = "import time, torch; print('BENCH', time.time(), 0, 0, 0)"


def run(code: str, env: dict[str, str]) -> tuple[float, float, float, float]:
    t0 = time.time()
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**env, "COSYSERVE_SPAWN_T0": repr(t0)},
    )
    if r.returncode != 0:
        raise SystemExit(f"benchmark process failed:\n{r.stderr[-3000:]}")
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("BENCH "))
    t_end, construct, weights, rss = map(float, line.split()[1:])
    return (t_end - t0) * 1e3, construct, weights, rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--bundle-bf16", default=None)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the raw results here")
    args = ap.parse_args()
    byte_compile(Path(__file__).resolve().parents[1] / "src")  # as pip install leaves it (bench/startup.py)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from cosyserve.system.pagecache import evict, prefetch_files

    env = dict(os.environ)
    env["PYTHONPATH"] = (
        str(Path(__file__).resolve().parents[1] / "src") + os.pathsep + env.get("PYTHONPATH", "")
    )
    env.pop("COSYSERVE_PRELOAD", None)
    bundles = {"fp32": args.bundle}
    if args.bundle_bf16:
        bundles["bf16"] = args.bundle_bf16
    # name: (code, files, cold): the files are evicted from the page cache before a cold start and read into it
    # before a warm one (a cold configuration earlier in the round, lazy ones read nothing, would leave a
    # "warm" start reading the disk)
    model_files = sorted(Path(args.model_dir).glob("*.pt"))
    configs: dict[str, tuple[str, list[Path], bool]] = {
        "floor (import torch)": (FLOOR, [], False),
        "naive (random init + torch.load)": (
            NAIVE.format(model_dir=args.model_dir, threads=args.threads),
            model_files,
            False,
        ),
    }
    for tag, b in bundles.items():
        files = sorted(Path(b).glob("*.safetensors"))
        code = BUNDLE.format(bundle=b, warmup=False, threads=args.threads, strategy="lazy")
        configs[f"bundle {tag} warm"] = (code, files, False)
        configs[f"bundle {tag} cold"] = (code, files, True)
    full = BUNDLE.format(bundle=args.bundle, warmup=True, threads=args.threads, strategy="preload")
    fp32_files = sorted(Path(args.bundle).glob("*.safetensors"))
    configs["bundle fp32 warm, warm-up+preload"] = (full, fp32_files, False)
    configs["bundle fp32 cold, warm-up+preload"] = (full, fp32_files, True)
    # first start of each bundle writes its verification stamp: do it once, outside the timings
    for b in bundles.values():
        run(BUNDLE.format(bundle=b, warmup=False, threads=args.threads, strategy="lazy"), env)
    results: dict[str, list[tuple[float, float, float, float]]] = {k: [] for k in configs}
    for _ in range(args.runs):
        for name, (code, files, cold) in configs.items():
            if cold:
                evict(files)
            else:
                for t in prefetch_files(files):
                    t.join()
            results[name].append(run(code, env))

    def med(name: str, i: int) -> float:
        return statistics.median(r[i] for r in results[name])

    print(f"\n{args.runs} runs each, {args.threads} torch threads; medians")
    print("load = construct + weights (+ page population for preload), wall clock, without imports/warm-up")
    print(f"{'configuration':<36} {'ready ms':>9} {'load ms':>9} {'peak RSS':>9}")
    for name in configs:
        print(f"{name:<36} {med(name, 0):9.0f} {med(name, 2):9.1f} {med(name, 3):8.0f}M")
    floor = med("floor (import torch)", 0)
    naive = "naive (random init + torch.load)"
    print()
    for name in configs:
        if name.startswith("bundle"):
            print(
                f"{name:<36} ready/floor {med(name, 0) / floor:5.2f}x   naive load / this load "
                f"{med(naive, 2) / max(med(name, 2), 1e-6):6.1f}x"
            )
    print(f"{naive:<36} ready/floor {med(naive, 0) / floor:5.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
