"""Lite runtime vs torch runtime, side by side in fresh processes: READY, first streamed audio, RTF, peak RSS.

Usage (issue 35's targets, full-size CosyVoice3; any family's lite bundle works)::

    cosyserve make-test-model full3 --family cosyvoice3 --size full
    cosyserve convert full3 full3-lite --runtime lite
    cosyserve convert full3 full3-lite-int8 --runtime lite --quantize llm=int8
    python bench/lite.py full3-lite --int8-bundle full3-lite-int8 --rounds 3 --json lite.json
    python bench/lite.py --dry-run        # a tiny CosyVoice3 model, one round (what the tests run)

Each round runs the floor ``python -c "import torch"`` and, for each LM precision, one fresh process per runtime
in alternating order: ``fp32`` serves ``BUNDLE`` with ``llm_quantize=none`` on both; ``int8`` serves
``--int8-bundle`` with ``llm_quantize=int8`` on both (the lite runtime's int8 step graph, the torch runtime's int8
linears; a bundle with float weights and the int8 step graph has torch quantize in memory at load). Each process loads the bundle, notes READY (ms since its process started),
streams a short sentence (first audio since process start, and since the request), waits for the work each
runtime does after READY and streams it again (warm TTFA), then synthesizes ``--text`` one-shot (RTF: compute
seconds per audio second; random weights speak for as long as their LM samples). A model without pre-defined
speakers, and every request with ``--zero-shot``, speaks with a cloned voice (``--prompt-wav``, default a
generated 5 s voice-like signal). Medians over the rounds are printed with their ratios against the targets
(READY <= 0.5x torch and <= 3.5x `import onnxruntime`; first audio and RTF <= 1.1x torch); the bundle is read
again right before each process starts (warm page cache: this VM evicts pages untouched for ~60 s, and one round
takes longer), and each process's own figures are printed as they come, its start's phases before READY among
them. READY against `import onnxruntime` is taken per pair: a floor is timed right before each lite process, in
the same state of the machine (the cache just read, the other runtime's process just gone), and the median of the
pairs' ratios is the figure (the floor printed is the median of those floors). Put the load average beside the figures (printed first and last).
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
from zero_shot_ttfa import _voice  # a voice-like prompt for models without speakers

CHILD = r"""
import json, resource, sys, tempfile, time
import cosyserve
from cosyserve.core.clock import process_start_time
bundle, runtime, threads, text, quantize, prompt_wav, prompt_text, clone = sys.argv[1:9]
model = cosyserve.load(
    bundle, runtime=runtime, threads=int(threads), llm_quantize=quantize, registry_dir=tempfile.mkdtemp()
)
t0 = process_start_time()
clock = model.runtime.clock
ready = clock.points["ready"]
speakers = model.speakers
voice = {"speaker": speakers[0]} if speakers and clone != "1" else {
    "mode": "zero_shot", "prompt_wav": prompt_wav, "prompt_text": prompt_text}
t_req = time.time()
first = None
for chunk in model.synthesize("Hello there.", seed=1, stream=True, **voice):
    if first is None:
        first = time.time()
model.runtime.join_background()  # every session open: the steady state
t_warm = time.time()
for chunk in model.synthesize("Hello there.", seed=1, stream=True, **voice):
    warm = time.time() - t_warm
    break
t = time.time()
audio = model.synthesize_all(text, seed=2, **voice)
compute = time.time() - t
print(json.dumps({
    "ready_ms": ready,
    "first_audio_ms": (first - t0) * 1e3,
    "request_to_first_ms": (first - t_req) * 1e3,
    "warm_ttfa_ms": warm * 1e3,
    "rtf": compute / max(audio.size / model.sample_rate, 1e-9),
    "audio_s": audio.size / model.sample_rate,
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "torch_loaded": "torch" in sys.modules and sys.modules["torch"] is not None,
    # each phase before READY: [its start, its duration] (ms since process start)
    "phases_ms": {k: [round(clock.starts[k]), round(v)] for k, v in clock.durations.items() if clock.starts[k] < ready},
}))
"""

KEYS = ("ready_ms", "first_audio_ms", "request_to_first_ms", "warm_ttfa_ms", "rtf", "peak_rss_mb")
# issue 35's targets: lite / torch at most this much (READY also against the bare `import onnxruntime`)
TARGETS = {"ready_ms": 0.5, "first_audio_ms": 1.1, "rtf": 1.1}
READY_VS_ORT = 3.5


def _floor(module: str) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
    return (time.perf_counter() - t) * 1e3


def _run(bundle: Path, runtime: str, quantize: str, args: argparse.Namespace) -> dict:
    argv = [
        str(bundle),
        runtime,
        str(args.threads),
        args.text,
        quantize,
        str(args.prompt_wav),
        args.prompt_text,
        "1" if args.zero_shot else "0",
    ]
    p = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise SystemExit(f"{runtime} llm_quantize={quantize} run failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _dry_run_bundles(tmp: Path) -> tuple[Path, Path]:
    from cosyserve.bundle.convert import convert
    from cosyserve.families.testmodel import make_test_model

    make_test_model(tmp / "model", size="tiny", seed=0, family="cosyvoice3")
    fp32 = convert(tmp / "model", tmp / "lite", runtime="lite", progress=False)
    int8 = convert(tmp / "model", tmp / "lite-int8", runtime="lite", quantize="llm=int8", progress=False)
    return fp32, int8


def _warm_cache(bundles: list[Path]) -> None:
    for bundle in bundles:
        for f in sorted(bundle.rglob("*")):
            if f.is_file():
                with open(f, "rb") as fh:
                    while fh.read(1 << 24):
                        pass


def _report(rows: dict[str, list], passes: dict[str, tuple[Path, str]], args: argparse.Namespace) -> dict:
    med = statistics.median
    floor_ort, floor_torch = med(rows["floor onnxruntime"]), med(rows["floor torch"])
    print(f"\nload average {os.getloadavg()}; medians over {args.rounds} rounds, {args.threads} threads")
    print(f"floor `import onnxruntime`: {floor_ort:.0f} ms; floor `import torch`: {floor_torch:.0f} ms")
    figures: dict = {"floor_onnxruntime_ms": floor_ort, "floor_torch_ms": floor_torch, "llm": {}}
    for name, (bundle, quantize) in passes.items():
        lite = {k: med([x[k] for x in rows[f"lite {name}"]]) for k in KEYS}
        torch = {k: med([x[k] for x in rows[f"torch {name}"]]) for k in KEYS}
        f = {f"{side}_{k}": v for side, m in (("lite", lite), ("torch", torch)) for k, v in m.items()}
        f.update({f"{k}_vs_torch": lite[k] / torch[k] for k in KEYS})
        # per pair (each lite READY over the floor measured just before it), then the median
        f["ready_vs_onnxruntime_floor"] = med(
            [x["ready_ms"] / x["floor_onnxruntime_ms"] for x in rows[f"lite {name}"]]
        )
        f["torch_in_lite_process"] = any(x["torch_loaded"] for x in rows[f"lite {name}"])
        f["bundle"], f["llm_quantize"] = str(bundle), quantize
        figures["llm"][name] = f
        print(f"\nLM {name} ({bundle}, llm_quantize={quantize})")
        print(f"{'':8}" + "".join(f"{k:>21}" for k in KEYS))
        for side, m in (("lite", lite), ("torch", torch)):
            print(f"{side:8}" + "".join(f"{m[k]:>21.3f}" for k in KEYS))
        print(f"{'ratio':8}" + "".join(f"{f[k + '_vs_torch']:>21.3f}" for k in KEYS))
        for k, limit in TARGETS.items():
            verdict = "met" if f[k + "_vs_torch"] <= limit else "MISSED"
            print(f"target {k} lite/torch <= {limit}x: {f[k + '_vs_torch']:.2f}x {verdict}")
        verdict = "met" if f["ready_vs_onnxruntime_floor"] <= READY_VS_ORT else "MISSED"
        print(
            f"target READY <= {READY_VS_ORT}x `import onnxruntime`: {f['ready_vs_onnxruntime_floor']:.2f}x {verdict}"
        )
        print(f"peak RSS: lite {lite['peak_rss_mb']:.0f} MB, torch {torch['peak_rss_mb']:.0f} MB; torch loaded in "
              f"the lite process: {f['torch_in_lite_process']}")  # fmt: skip
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", nargs="?", type=Path, help="a bundle converted with --runtime lite (fp32 LM)")
    ap.add_argument(
        "--int8-bundle", type=Path,
        help="a bundle converted with --runtime lite --quantize llm=int8: the int8 pass (default: none)",
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--text", default="Hello world, this is a test of the lite runtime against the torch one."
    )
    ap.add_argument("--prompt-wav", type=Path, help="the cloned voice of a model without speakers")
    ap.add_argument(
        "--zero-shot",
        action="store_true",
        help="every request clones --prompt-wav (zero_shot), speakers or not",
    )
    ap.add_argument(
        "--prompt-text", default="You are a helpful assistant.<|endofprompt|>Hello, this is my voice."
    )
    ap.add_argument(
        "--dry-run", action="store_true", help="one round (a tiny CosyVoice3 model when no bundle)"
    )
    ap.add_argument("--json", type=Path, help="also write the medians and ratios here")
    args = ap.parse_args()
    byte_compile()  # as pip install leaves it (bench/startup.py)
    print(f"load average {os.getloadavg()}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-lite-"))
    if args.dry_run:
        args.rounds = 1
        if args.bundle is None:
            args.bundle, args.int8_bundle = _dry_run_bundles(tmp)
    elif args.bundle is None:
        ap.error("give a bundle, or --dry-run")
    if args.prompt_wav is None:
        args.prompt_wav = _voice(tmp / "prompt.wav")
    passes = {"fp32": (args.bundle, "none")}
    if args.int8_bundle is not None:
        passes["int8"] = (args.int8_bundle, "int8")
    rows: dict[str, list] = {"floor onnxruntime": [], "floor torch": []}
    for r in range(args.rounds):
        rows["floor torch"].append(_floor("torch"))
        for name, (bundle, quantize) in passes.items():
            for side in ("lite", "torch") if r % 2 == 0 else ("torch", "lite"):
                _warm_cache([bundle])
                # the lite READY's floor measured beside it, in the same state of the machine (cache just read,
                # the other runtime's process just gone): READY / floor is taken per pair
                floor = _floor("onnxruntime") if side == "lite" else None
                got = _run(bundle, side, quantize, args)
                if floor is not None:
                    got["floor_onnxruntime_ms"] = floor
                    rows["floor onnxruntime"].append(floor)
                rows.setdefault(f"{side} {name}", []).append(got)
                print(f"round {r} {side} {name}: {json.dumps(got)}", flush=True)
    figures = _report(rows, passes, args)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
