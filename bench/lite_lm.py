"""The lite runtime's CosyVoice2/3 LM beside the torch runtime, in fresh processes: READY and LM ms/token.

Usage::

    cosyserve make-test-model full3 --family cosyvoice3 --size full
    cosyserve convert full3 full3-bundle
    python bench/lite_lm.py full3-bundle --model-dir full3 --rounds 3
    python bench/lite_lm.py --dry-run        # the same on a tiny random CosyVoice3 model (what the tests run)

A bundle converted without ``--runtime lite`` gets its LM graphs (float and int8) exported here, with
``--model-dir`` where the bundle stores an int8 LLM (the flow's and vocoder's: bench/lite_token2wav.py).

Each round runs, in alternating order, the floors (``python -c "import onnxruntime"`` and ``"import torch"``) and,
for each ``--quantize``, one fresh process per runtime:

- lite: imports, the lite manifest and tables, the step graph's session (no weight prepacking for the float graph,
  as the lite runtime opens it), one warm-up prefill and decode step: ``lm_ready_ms`` since the process started
  (what the lite runtime's READY will hold for these families: its flow and vocoder sessions open after READY);
- torch: ``cosyserve.load(bundle, runtime="torch")``: the whole runtime's READY (``ready_ms``), its LM warmed.

Then both measure the same LM work through the decode loop: a prefill of ``--text-tokens`` text ids
(``prefill_ms``) and ``--tokens`` teacher-forced steps (sampling included: ``ms_per_token``). Medians over the
rounds are printed, with their ratios; put the load average beside them (printed first).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from startup import byte_compile

CHILD = r"""
import json, resource, sys, time
import numpy as np
import cosyserve
from cosyserve.core.clock import process_start_time

which, bundle, threads, quantize, n_text, n_tokens = sys.argv[1:3] + [int(sys.argv[3]), sys.argv[4]] + [
    int(a) for a in sys.argv[5:7]
]
out = {}
if which == "lite":
    from cosyserve.runtime.lite.lm import lite_lm
    from cosyserve.runtime.lite.models import LiteBundle
    from cosyserve.runtime.lite import _warm_up_lm

    lb = LiteBundle(bundle, threads=threads, int8=quantize == "int8")
    lm = lite_lm(lb, lb.tables())
    lb.session("llm_step")
    _warm_up_lm(lm)
    out["lm_ready_ms"] = (time.time() - process_start_time()) * 1e3
    ids = np.asarray
else:
    import torch

    model = cosyserve.load(bundle, runtime="torch", threads=threads, llm_quantize=quantize)
    out["ready_ms"] = model.runtime.clock.points["ready"]
    model.runtime.join_background()  # its flow and vocoder warm-up: not beside the timed LM work
    lm = model.runtime.pipeline.llm
    ids = lambda a: torch.tensor(a, dtype=torch.int32)
from cosyserve.runtime.lm import OneShot, one_shot
from cosyserve.runtime.oneoff import teacher_forced

marker = [] if lm.rules.marker is None else [lm.rules.marker]
spec = one_shot(lm, {"text": ids([marker + list(range(100, 100 + n_text))])})
lm.reserve(1, spec.prompt.shape[1] + n_tokens + 1)
with lm.ops.no_grad():
    t = time.perf_counter()
    lm.extend(spec.prompt, 0, 0)
    out["prefill_ms"] = (time.perf_counter() - t) * 1e3
lm.release()
teacher = [int(x) for x in np.random.default_rng(0).integers(0, lm.rules.eos_token, n_tokens)]
t = time.perf_counter()
teacher_forced(lm, OneShot(spec.prompt, 0, n_tokens), teacher)
out["ms_per_token"] = ((time.perf_counter() - t) * 1e3 - out["prefill_ms"]) / n_tokens
try:  # this process's own peak (ru_maxrss keeps the parent's across exec)
    hwm = [ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:")][0]
    out["peak_rss_mb"] = int(hwm.split()[1]) / 1024
except OSError:
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
out["torch_loaded"] = sys.modules.get("torch") is not None
print(json.dumps(out))
"""


def _floor(module: str) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
    return (time.perf_counter() - t) * 1e3


def _run(which: str, bundle: Path, threads: int, quantize: str, text_tokens: int, tokens: int) -> dict:
    args = [which, str(bundle), str(threads), quantize, str(text_tokens), str(tokens)]
    p = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise SystemExit(f"{which} ({quantize}) failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _ensure_lite_lm(bundle: Path, model_dir: Path | None) -> None:
    """Export the bundle's lite LM graphs (float and int8) unless it has them."""
    manifest = bundle / "lite" / "manifest.json"
    if manifest.is_file() and "llm_step.int8.onnx" in json.loads(manifest.read_text())["files"]:
        return
    from cosyserve.bundle.lite.export import export_lite
    from cosyserve.bundle.loader import open_bundle

    parts = open_bundle(bundle).family.lite_parts
    print(f"exporting the lite graphs of {', '.join(parts)} (float and int8) into {bundle}", flush=True)
    export_lite(bundle, lambda msg: print(msg, flush=True), model_dir=model_dir, int8=True, parts=parts)


def _tiny_bundle(root: Path) -> tuple[Path, Path]:
    from cosyserve.bundle.convert import convert
    from cosyserve.families.testmodel import make_test_model

    model = root / "tiny-cv3"
    make_test_model(model, size="tiny", seed=0, family="cosyvoice3")
    return convert(model, root / "tiny-cv3-bundle", progress=False), model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", nargs="?", help="a CosyVoice2/3 bundle (`cosyserve convert MODEL_DIR BUNDLE`)")
    ap.add_argument(
        "--model-dir", type=Path, help="the model dir it came from (needed if it stores an int8 LLM)"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text-tokens", type=int, default=40, help="text ids in the prefill")
    ap.add_argument("--tokens", type=int, default=100, help="decode steps timed")
    ap.add_argument("--quantize", default="none,int8", help="llm_quantize values to run, comma-separated")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="one round, few tokens, on a tiny CosyVoice3 model (made, or the bundle given)",
    )
    ap.add_argument("--json", type=Path, help="also write the medians here")
    args = ap.parse_args()
    byte_compile()  # as pip install leaves it (bench/startup.py)
    quantize = [q.strip() for q in args.quantize.split(",") if q.strip()]
    if any(q not in ("none", "int8") for q in quantize):
        ap.error(f"--quantize takes none and int8, got {args.quantize!r}")
    tmp = None
    if args.dry_run:
        if args.bundle is None:
            tmp = tempfile.TemporaryDirectory(prefix="bench-lite-lm-")
            bundle, model_dir = _tiny_bundle(Path(tmp.name))
        else:  # a tiny bundle already made (the tests')
            bundle, model_dir = Path(args.bundle), args.model_dir
        args.rounds, args.tokens, args.text_tokens = 1, 12, 8
    elif args.bundle is None:
        ap.error("give a bundle, or --dry-run")
    else:
        bundle, model_dir = Path(args.bundle), args.model_dir
    _ensure_lite_lm(bundle, model_dir)
    print(f"load average {os.getloadavg()}")
    for f in sorted(bundle.rglob("*")):  # warm page cache
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass
    rows: dict[str, list] = {"floor onnxruntime": [], "floor torch": []}
    for r in range(args.rounds):
        rows["floor onnxruntime"].append(_floor("onnxruntime"))
        rows["floor torch"].append(_floor("torch"))
        for q in quantize:
            for which in ("lite", "torch") if r % 2 == 0 else ("torch", "lite"):
                got = _run(which, bundle, args.threads, q, args.text_tokens, args.tokens)
                rows.setdefault(f"{which} {q}", []).append(got)
                print(f"round {r} {which} {q}: {json.dumps(got)}", flush=True)
    med = statistics.median

    def m(name: str, key: str) -> float:
        return med([x[key] for x in rows[name]])

    floor_ort, floor_torch = med(rows["floor onnxruntime"]), med(rows["floor torch"])
    print(f"\nload average {os.getloadavg()}; medians over {args.rounds} rounds, {args.threads} threads")
    print(f"floor `import onnxruntime`: {floor_ort:.0f} ms; floor `import torch`: {floor_torch:.0f} ms")
    figures: dict = {"floor_onnxruntime_ms": floor_ort, "floor_torch_ms": floor_torch, "quantize": {}}
    for q in quantize:
        lite, tor = f"lite {q}", f"torch {q}"
        f = {
            "lite_lm_ready_ms": m(lite, "lm_ready_ms"),
            "torch_ready_ms": m(tor, "ready_ms"),
            "lite_prefill_ms": m(lite, "prefill_ms"),
            "torch_prefill_ms": m(tor, "prefill_ms"),
            "lite_ms_per_token": m(lite, "ms_per_token"),
            "torch_ms_per_token": m(tor, "ms_per_token"),
            "lite_peak_rss_mb": m(lite, "peak_rss_mb"),
            "torch_peak_rss_mb": m(tor, "peak_rss_mb"),
            "torch_in_lite_process": any(x["torch_loaded"] for x in rows[lite]),
        }
        f["ready_vs_torch"] = f["lite_lm_ready_ms"] / f["torch_ready_ms"]
        f["ready_vs_onnxruntime_floor"] = f["lite_lm_ready_ms"] / floor_ort
        f["ms_per_token_vs_torch"] = f["lite_ms_per_token"] / f["torch_ms_per_token"]
        figures["quantize"][q] = f
        print(f"\nllm_quantize={q}")
        print(f"  READY  lite LM {f['lite_lm_ready_ms']:.0f} ms, torch runtime {f['torch_ready_ms']:.0f} ms: "
              f"{f['ready_vs_torch']:.2f}x torch, {f['ready_vs_onnxruntime_floor']:.2f}x `import onnxruntime`")  # fmt: skip
        print(f"  prefill ({args.text_tokens} text ids)  lite {f['lite_prefill_ms']:.1f} ms, torch "
              f"{f['torch_prefill_ms']:.1f} ms")  # fmt: skip
        print(f"  LM ms/token  lite {f['lite_ms_per_token']:.2f}, torch {f['torch_ms_per_token']:.2f}: "
              f"{f['ms_per_token_vs_torch']:.2f}x")  # fmt: skip
        print(f"  peak RSS  lite {f['lite_peak_rss_mb']:.0f} MB, torch {f['torch_peak_rss_mb']:.0f} MB; torch "
              f"loaded in the lite process: {f['torch_in_lite_process']}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
