"""One table of synthesis speed: LLM ms/token, flow and vocoder RTF, one-shot RTF, time to first audio, peak RSS,
for each configuration (storage dtype, compute dtypes, int8 LLM, chunk policy), measured side by side.

    python bench/speed.py --bundle out/full-bundle [--bundle-bf16 B] [--bundle-int8 B] [--threads 2] [--rounds 3]
        [--config NAME=key=value,key=value ...] [--reference-python /path/to/ref/python --model-dir out/full-model]

Every (configuration, round) is a fresh process, run interleaved round by round, so a noisy neighbour spreads
over all configurations instead of landing on one; the table shows the minimum over rounds (the median in
brackets for time to first audio). Each process:

1. loads the bundle with the configuration's options (``cosyserve.load(bundle, **options)``, settings at their
   defaults otherwise) and at once streams ``--short`` ("Hello there."): ``cold`` is process start -> its first
   audio, what a request waits for when a replica starts for it;
2. after the background warm-up, streams ``--short`` and ``--short-zh`` again: ``ttfa`` is the request's start
   -> its first chunk through the Python API (the server adds its HTTP hop);
3. synthesizes ``--text`` one-shot: ``rtf`` is wall / audio seconds; the LLM, flow and vocoder are timed inside
   the same call (``llm ms/tok`` is the time spent producing speech tokens, prefill included, per token);
4. streams ``--text`` whole: ``stream rtf`` is wall / audio seconds of the streamed utterance, every chunk's cost
   (what the chunk policy changes: more, shorter chunks; issue 34's target compares the default's against the
   reference policy's and the reference runtime's).

Random weights: the LLM never samples its end token, so every text runs to the maximum length (20 speech tokens
per text token); audio lengths are equal across configurations. ``--config`` adds a row, e.g.
``--config fast=flow_dtype=bfloat16,hift_dtype=bfloat16,llm_quantize=int8``; the values are settings or
:class:`cosyserve.runtime.RuntimeOptions` fields by name, as ``cosyserve.load`` takes them.

With ``--reference-python`` (the reference runtime's interpreter, see ../shared/reference/README.md) and
``--model-dir`` (the official-layout directory the bundle was converted from), and ``--ref-src`` (its source
checkout, default $COSYSERVE_REF_SRC, unless that interpreter imports ``cosyvoice`` already), one more row times the reference's
``CosyVoice(...).inference_sft`` (``CosyVoice2(...)`` / ``CosyVoice3(...)`` for a CosyVoice2 / CosyVoice3 dir, the
latter with ``You are a helpful assistant.<|endofprompt|>`` before each text, as its LM needs) on the same weights:
its one-shot RTF and first streamed chunk. A CosyVoice2/3 dir for the reference needs
``CosyVoice-BlankEN/model.safetensors`` (its constructor loads Qwen's weights before llm.pt replaces them all):
``bench/qwen_placeholder.py`` writes zeros.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
t_import = time.perf_counter()
import torch
torch.set_num_threads(int(sys.argv[2]))
import cosyserve
from cosyserve.core.clock import process_start_time

args = json.loads(sys.argv[1])
model = cosyserve.load(args["bundle"], threads=int(sys.argv[2]), **args["options"])
speaker = model.speakers[0]
since_start = lambda: time.time() - process_start_time()

def first_chunk(text):
    t = time.perf_counter()
    it = model.synthesize(text, speaker, seed=0, stream=True)
    next(it)
    first = time.perf_counter() - t
    for _ in it:
        pass
    return first

out = {}
it = model.synthesize(args["short"], speaker, seed=0, stream=True)
next(it)
out["cold"] = since_start()
for _ in it:
    pass
model.runtime.join_background()
out["ttfa"] = first_chunk(args["short"])
out["ttfa_zh"] = first_chunk(args["short_zh"])

pipe = model.runtime.pipeline
t2w = pipe.token2wav
spent = {"flow": 0.0, "hift": 0.0, "llm": 0.0, "tokens": 0}

def timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[name] += time.perf_counter() - t
    return wrapper

def counted(fn):
    def wrapper(*a, **k):
        gen = fn(*a, **k)
        while True:
            t = time.perf_counter()
            try:
                tok = next(gen)
            except StopIteration:
                spent["llm"] += time.perf_counter() - t
                return
            spent["llm"] += time.perf_counter() - t
            spent["tokens"] += 1
            yield tok
    return wrapper

t2w.flow.inference = timed("flow", t2w.flow.inference)
t2w.hift.inference = timed("hift", t2w.hift.inference)
pipe.decoder.generate = counted(pipe.decoder.generate)
t = time.perf_counter()
audio = model.synthesize_all(args["text"], speaker, seed=0)
wall = time.perf_counter() - t
seconds = audio.size / model.sample_rate
out.update(
    rtf=wall / seconds,
    audio_s=seconds,
    llm_ms=spent["llm"] * 1e3 / max(spent["tokens"], 1),
    tokens=spent["tokens"],
    flow_rtf=spent["flow"] / seconds,
    hift_rtf=spent["hift"] / seconds,
    peak_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
)
t = time.perf_counter()
n = sum(c.size for c in model.synthesize(args["text"], speaker, seed=0, stream=True))
out["stream_rtf"] = (time.perf_counter() - t) / (n / model.sample_rate)
out["peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print("BENCH " + json.dumps(out))
"""

REFERENCE_CHILD = r"""
import json, resource, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
args = json.loads(sys.argv[1])
import os
from cosyvoice.cli.cosyvoice import CosyVoice, CosyVoice2, CosyVoice3
try:  # offline text normalisation (../shared/reference/wetext_local.py, when on the path)
    import wetext_local
    wetext_local.apply()
except ImportError:
    pass
has = lambda name: os.path.exists(os.path.join(args["model_dir"], name))
family = CosyVoice3 if has("cosyvoice3.yaml") else CosyVoice2 if has("cosyvoice2.yaml") else CosyVoice
cv = family(args["model_dir"])
speaker = cv.list_available_spks()[0]
if family is CosyVoice3:  # its LM needs the marker in the text (cosyserve adds this default by itself)
    for key in ("short", "short_zh", "text"):
        args[key] = "You are a helpful assistant.<|endofprompt|>" + args[key]
out = {}
for key, text in (("ttfa", args["short"]), ("ttfa_zh", args["short_zh"])):
    t = time.perf_counter()
    first = None
    for _ in cv.inference_sft(text, speaker, stream=True):
        first = first or time.perf_counter() - t
    out[key] = first
t = time.perf_counter()
n = sum(o["tts_speech"].shape[1] for o in cv.inference_sft(args["text"], speaker, stream=False))
seconds = n / cv.sample_rate
out.update(rtf=(time.perf_counter() - t) / seconds, audio_s=seconds)
t = time.perf_counter()
n = sum(o["tts_speech"].shape[1] for o in cv.inference_sft(args["text"], speaker, stream=True))
out["stream_rtf"] = (time.perf_counter() - t) / (n / cv.sample_rate)
out["peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print("BENCH " + json.dumps(out))
"""

COLUMNS = [
    ("llm_ms", "LLM ms/tok", "{:.1f}"),
    ("flow_rtf", "flow RTF", "{:.3f}"),
    ("hift_rtf", "voc RTF", "{:.3f}"),
    ("rtf", "RTF", "{:.2f}"),
    ("stream_rtf", "stream RTF", "{:.2f}"),
    ("ttfa", "TTFA en s", "{:.2f}"),
    ("ttfa_zh", "TTFA zh s", "{:.2f}"),
    ("cold", "cold s", "{:.2f}"),
    ("peak_gib", "peak GiB", "{:.2f}"),
]


def parse_config(text: str) -> tuple[str, str | None, dict[str, object]]:
    """``NAME=k=v,k=v`` (``bundle=PATH`` picks another bundle) -> (name, bundle, options); values are JSON where
    they parse as JSON (numbers, true/false), else strings."""
    name, _, rest = text.partition("=")
    if not name:
        raise SystemExit(f"--config {text!r}: expected NAME=key=value,...")
    options: dict[str, object] = {}
    bundle = None
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--config {text!r}: {item!r} is not key=value")
        if key == "bundle":
            bundle = value
            continue
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return name, bundle, options


def run_child(code: str, payload: dict[str, object], threads: int, env: dict[str, str]) -> dict[str, float]:
    proc = subprocess.run(
        [payload.pop("python", sys.executable), "-c", code, json.dumps(payload), str(threads)],  # type: ignore[list-item]
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH "):
            return json.loads(line[6:])  # type: ignore[no-any-return]
    raise RuntimeError(f"child failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True, help="the float32 bundle")
    ap.add_argument("--bundle-bf16", help="a bfloat16 bundle of the same model (adds a row)")
    ap.add_argument("--bundle-int8", help="a bundle with the int8 LLM (adds a row)")
    ap.add_argument("--config", action="append", default=[], help="NAME=key=value,... (adds a row)")
    ap.add_argument("--no-default-configs", action="store_true", help="only the --config rows")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--text", default="Hello world, this is a test.")
    ap.add_argument("--short", default="Hello there.")
    ap.add_argument("--short-zh", default="你好，世界。")
    ap.add_argument("--reference-python", help="the reference runtime's python (adds a row)")
    ap.add_argument("--model-dir", help="the official-layout dir of the same weights, for the reference row")
    ap.add_argument(
        "--ref-src",
        default=os.environ.get("COSYSERVE_REF_SRC"),
        help="the reference source checkout (on PYTHONPATH)",
    )
    ap.add_argument("--json", action="store_true", help="also print every measurement as JSON")
    args = ap.parse_args()

    configs: list[tuple[str, str, dict[str, object]]] = []
    if not args.no_default_configs:
        configs += [
            ("fp32 reference-chunks", args.bundle, {"chunk_policy": "reference"}),
            ("fp32 low-latency", args.bundle, {"chunk_policy": "low-latency"}),
            ("fp32 defaults", args.bundle, {}),
        ]
        if args.bundle_bf16:
            configs.append(("bf16 bundle", args.bundle_bf16, {}))
        if args.bundle_int8:
            configs.append(("int8 LLM bundle", args.bundle_int8, {}))
    for text in args.config:
        name, bundle, options = parse_config(text)
        configs.append((name, bundle or args.bundle, options))
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    texts = {"text": args.text, "short": args.short, "short_zh": args.short_zh}
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in configs}
    reference = bool(args.reference_python and args.model_dir)
    if reference:
        results["reference (fp32)"] = []
    for rnd in range(args.rounds):
        for name, bundle, options in configs:
            payload = {"bundle": bundle, "options": options, **texts}
            results[name].append(run_child(CHILD, payload, args.threads, env))
            print(f"round {rnd + 1} {name}: {json.dumps(results[name][-1])}", file=sys.stderr)
        if reference:
            ref_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            if args.ref_src:
                ref_env["PYTHONPATH"] = args.ref_src
            payload = {"python": args.reference_python, "model_dir": args.model_dir, **texts}
            results["reference (fp32)"].append(run_child(REFERENCE_CHILD, payload, args.threads, ref_env))
    load = os.getloadavg()
    print(
        f"\n{args.bundle}, {args.threads} threads, {args.rounds} rounds (fresh process each), min over rounds; "
        f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    width = max(len(n) for n in results) + 2
    print("config".ljust(width) + "".join(f"{label:>12}" for _, label, _ in COLUMNS))
    for name, rows in results.items():
        cells = []
        for key, _, fmt in COLUMNS:
            values = [r[key] for r in rows if r.get(key) is not None]
            cells.append(fmt.format(min(values)) if values else "-")
        print(name.ljust(width) + "".join(f"{c:>12}" for c in cells))
        ttfa = [r["ttfa"] for r in rows if r.get("ttfa") is not None]
        if len(ttfa) > 1:
            print(" " * width + f"  (TTFA en median {statistics.median(ttfa):.2f} s)")
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
