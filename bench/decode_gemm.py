"""The torch LM's decode step in each product layout (cosyserve.models.gemm), side by side, by rows per step.

    python bench/decode_gemm.py --model CV2_BUNDLE [--rows 1,2,4,8] [--rounds 5] [--steps 8] [--requests 4]
    python bench/decode_gemm.py --dry-run          # a tiny CosyVoice2 model made here (CI: tests/test_gemm)

One process loads the model (default settings, no warm-up) and fills ``max(rows)`` cache rows with a prompt of
``--context`` positions. Then, round by round, for each row count and each layout in turn (``linear``: torch's
``x·Wᵀ``; ``transposed``: ``W·xᵀ``; ``auto``: the default), it runs ``--steps`` decode steps of that many rows
(each row at its own position past the prompt) and keeps the median step; printed: the minimum over rounds of
each (``auto``'s from the rounds after its first decisions), the ratio of the two layouts, and what ``auto`` chose
per weight shape. The first step of every series is not counted (it may page weights in). The decode steps are
the runtime's own (``pipeline.decoder.lm.decode``): every linear of the LM and its head, the attention over the
context, the log-softmax. Run on a quiet machine and name the CPU; the layouts' order differs by CPU, BLAS and row
count, which is why ``auto`` times them.

``--packed``: also ``packed`` (oneDNN-blocked copies of the LM's weights, made first: their size in memory).

``--runtime lite`` (a bundle converted with ``--runtime lite``): the lite runtime's steps, its LM batch graph
unpacked (the default) against prepacked (``llm_gemm=packed``), two loads in this process.

``--requests N``: then N interleaved pairs of lone requests on the same model, ``linear`` against ``auto`` (the
order swapped every pair; the LM's linears switched between them, ``auto``'s choices kept from its first
request): a streamed request's first audio and a one-shot request's wall time per audio second ("Hello there,
this is a test of the first audio of a lone request.", random weights: it speaks to the LM's length limit).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _cpu() -> str:
    from cosyserve.system.cpus import cpu_name

    return cpu_name() or platform.processor() or "unknown CPU"


def _series(lm: Any, rows: int, context: int, steps: int) -> float:
    xp = lm.ops.xp  # torch or numpy, as the runtime's LM computes
    tokens = xp.asarray([r % 100 for r in range(rows)], dtype=xp.int64)
    times = []
    for i in range(steps + 1):
        pos = xp.asarray([context + i] * rows, dtype=xp.int64)
        t = time.perf_counter()
        lm.decode(tokens, pos, context + i + 1, None)
        if i:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


TEXT = "Hello there, this is a test of the first audio of a lone request."


def _requests(m: Any, linears: list[Any], pairs: int, modes: tuple[str, ...]) -> dict[str, Any]:
    speaker = m.speakers[0] if m.speakers else None

    def first_audio(seed: int) -> float:
        t = time.perf_counter()
        chunks = m.synthesize(TEXT, speaker=speaker, stream=True, seed=seed)
        next(iter(chunks))
        chunks.close()
        return time.perf_counter() - t

    def per_audio_second(seed: int) -> float:
        t = time.perf_counter()
        audio = m.synthesize_all(TEXT, speaker=speaker, seed=seed)
        return (time.perf_counter() - t) / (audio.size / m.sample_rate)

    got: dict[str, dict[str, list[float]]] = {mode: {"first": [], "rtf": []} for mode in modes}
    for i in range(
        pairs + 1
    ):  # the first pair warms both (auto decides its row count there) and is not counted
        for mode in modes if i % 2 else modes[::-1]:
            for mod in linears:
                mod.mode = mode
            first, rtf = first_audio(10 + i), per_audio_second(10 + i)
            if i:
                got[mode]["first"].append(first)
                got[mode]["rtf"].append(rtf)
    out = {mode: {k: statistics.median(v) for k, v in d.items()} for mode, d in got.items()}
    a = out["linear"]
    print(f"lone requests, {pairs} interleaved pairs (medians): " + " / ".join(modes) + " (each / linear)")
    for what, key in (("first audio (s)", "first"), ("RTF (one-shot)", "rtf")):
        cells = "  ".join(f"{out[mode][key]:6.2f} ({out[mode][key] / a[key]:.2f})" for mode in modes)
        print(f"  {what:<20}  {cells}")
    return out


def _fill(lm: Any, rows: int, context: int) -> None:
    # every cache row holds ``context`` positions of speech-token embeddings (any ids: the cost is the same)
    x = lm.embed([("speech", [i % 100 for i in range(context)])])  # (1, context, C)
    for r in range(rows):
        lm.extend(x, r, 0)


def measure_lite(model: str, rows: list[int], rounds: int, steps: int, context: int) -> dict[str, Any]:
    """The lite runtime's decode steps with its LM batch graph unpacked (the default) and prepacked
    (``llm_gemm=packed``), two loads of ``model`` in this process, their series interleaved."""
    import cosyserve

    loads = {gemm: cosyserve.load(model, runtime="lite", llm_gemm=gemm) for gemm in ("auto", "packed")}
    lms = {gemm: m.runtime.pipeline.decoder.lm for gemm, m in loads.items()}
    for lm in lms.values():
        lm.reserve(max(rows), context + steps + 2)
        _fill(lm, max(rows), context)
    best: dict[tuple[int, str], float] = {}
    for _ in range(rounds):
        for n in rows:
            for gemm, lm in lms.items():
                t = _series(lm, n, context, steps)
                best[(n, gemm)] = min(best.get((n, gemm), float("inf")), t)
    print(f"{_cpu()}, lite runtime, load {os.getloadavg()[0]:.2f}; {model}")
    print(f"{'rows':>4}  {'unpacked ms':>11}  {'packed ms':>9}  ratio")
    out: dict[str, Any] = {"cpu": _cpu(), "load": os.getloadavg(), "runtime": "lite", "rows": {}}
    for n in rows:
        a, b = best[(n, "auto")] * 1e3, best[(n, "packed")] * 1e3
        print(f"{n:>4}  {a:>11.1f}  {b:>9.1f}  {b / a:5.2f}")
        out["rows"][n] = {"unpacked_ms": a, "packed_ms": b}
    for m in loads.values():
        m.close()
    return out


def measure(
    model: str,
    rows: list[int],
    rounds: int,
    steps: int,
    context: int,
    requests: int = 0,
    packed: bool = False,
) -> dict[str, Any]:
    import torch

    import cosyserve
    from cosyserve.models import gemm
    from cosyserve.models.gemm import DecodeLinear

    m = cosyserve.load(model, warmup=False)
    lm = m.runtime.pipeline.decoder.lm
    linears = [mod for mod in m.runtime.pipeline.llm.modules() if isinstance(mod, DecodeLinear)]
    if not linears:
        raise SystemExit("this model's LM has no float32 CPU linears to time (int8, or not on the CPU)")
    modes: tuple[str, ...] = ("linear", "transposed", "auto")
    if packed:
        for mod in linears:
            mod.pack()
        modes += ("packed",)
    with torch.inference_mode():
        lm.reserve(max(rows), context + steps + 2)
        _fill(lm, max(rows), context)
        best: dict[tuple[int, str], float] = {}
        for _ in range(rounds):
            for n in rows:
                for mode in modes:
                    for mod in linears:
                        mod.mode = mode
                    t = _series(lm, n, context, steps)
                    if mode != "auto" or gemm.decisions():  # auto's steps once it has decided something
                        best[(n, mode)] = min(best.get((n, mode), float("inf")), t)
    chosen = gemm.decisions()
    out: dict[str, Any] = {
        "cpu": _cpu(),
        "load": os.getloadavg(),
        "threads": torch.get_num_threads(),
        "rows": {},
    }
    print(f"{_cpu()}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}; {model}")
    print(
        f"{'rows':>4}  {'x·Wᵀ ms':>9}  {'W·xᵀ ms':>9}  ratio  {'auto ms':>9}  {'packed ms':>9}  "
        "auto chose (per weight shape)"
    )
    for n in rows:
        a, b = best[(n, "linear")] * 1e3, best[(n, "transposed")] * 1e3
        c = best.get((n, "auto"), float("nan")) * 1e3
        d = best.get((n, "packed"), float("nan")) * 1e3
        picks = sorted(
            f"{k[0]}x{k[1]}:{'T' if w == 'transposed' else 'L'}" for k, w in chosen.items() if k[2] == n
        )
        print(f"{n:>4}  {a:>9.1f}  {b:>9.1f}  {b / a:5.2f}  {c:>9.1f}  {d:>9.1f}  {' '.join(picks)}")
        out["rows"][n] = {"linear_ms": a, "transposed_ms": b, "auto_ms": c, "packed_ms": d, "auto": picks}
    if requests:
        lm.release()
        modes = ("linear", "auto", "packed") if packed else ("linear", "auto")
        out["requests"] = _requests(m, linears, requests, modes)
    m.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a bundle or model dir (full-size CosyVoice2 or 3 for real figures)")
    ap.add_argument("--rows", default="1,2,4,8", help="rows per step to time (default 1,2,4,8)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per series (default 8)")
    ap.add_argument("--context", type=int, default=200, help="prompt positions per row (default 200)")
    ap.add_argument(
        "--requests", type=int, default=0, help="then this many pairs of lone requests (default 0)"
    )
    ap.add_argument(
        "--packed", action="store_true", help="also llm_gemm=packed (packs the weights: +their size)"
    )
    ap.add_argument(
        "--runtime",
        choices=["torch", "lite"],
        default="torch",
        help="lite: its batch graph unpacked vs packed",
    )
    ap.add_argument("--dry-run", action="store_true", help="2 rounds of 2 steps on a tiny CosyVoice2 model")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    if not rows or min(rows) < 1:
        ap.error(f"--rows {args.rows}: expected positive integers")
    if args.dry_run:
        args.rounds, args.steps, args.context = 2, 2, 16
    with tempfile.TemporaryDirectory(prefix="decode-gemm-") as tmp:
        model = args.model
        if model is None:
            if not args.dry_run:
                ap.error("--model is required (or --dry-run)")
            from cosyserve.families.testmodel import make_test_model

            model = str(Path(tmp) / "cv2")
            make_test_model(model, size="tiny", seed=0, family="cosyvoice2")
        if args.runtime == "lite":
            out = measure_lite(model, rows, args.rounds, args.steps, args.context)
        else:
            out = measure(model, rows, args.rounds, args.steps, args.context, args.requests, args.packed)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
