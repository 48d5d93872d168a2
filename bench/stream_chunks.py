"""What each chunk of a long streamed utterance costs: wall time per audio second, chunk by chunk, through the
incremental path (each chunk computes its own frames) and, with ``--compare``, the cumulative one (the
reference's, and cosyserve's before issue 34: the flow, and CosyVoice3's vocoder, re-run on everything so far at
every chunk), interleaved in the same run.

    python bench/stream_chunks.py --family cosyvoice2 --seconds 32 --policy reference --pipeline   # target 1
    python bench/stream_chunks.py --family cosyvoice2 --seconds 32 --policy reference              # its token2wav
    python bench/stream_chunks.py --family cosyvoice3 --seconds 60 --compare                        # target 5
    python bench/stream_chunks.py --family cosyvoice2 --seconds 32 --policy reference --flow-context 8  # bounded
    python bench/stream_chunks.py --dry-run                                                         # tiny (CI)
    python bench/stream_chunks.py --family cosyvoice3 --seconds 60 --runtime lite --compare         # lite runtime

Random-weight models of the release's dimensions (``make-test-model --size full``, made once under ``--work``), or
``--model DIR`` (an official-layout dir), float32 unless ``--dtype``. Two modes:

- token2wav alone (the default): random speech tokens after a ``--prompt-seconds`` prompt, fed as the vc branch
  feeds them (all known at once), through the family's token2wav over the dir's flow and vocoder;
- ``--pipeline``: the served path, LM included: ``cosyserve.load`` of the dir and one streamed sft request whose
  text (words given one by one, as an LLM writes them: the LM's bistream) makes ``--seconds`` of speech (a random
  LM runs to its limit of 20 speech tokens per text token); a chunk's time is then from the previous chunk's
  arrival to its own, the LM's decoding of its tokens included, as a client sees it.

``--runtime lite`` runs the same on the lite runtime (ONNX Runtime + numpy): the dir converted with ``--runtime
lite`` once under ``--work`` (or ``--bundle``, such a bundle), the family's token2wav over its flow and vocoder
graphs (the lite runtime's own, as ``cosyserve.load`` builds them).

The table has one row per chunk; below it, the figures the targets name: the cost per audio second of the two
chunks before the final (full-attention) one over that of chunks 2-3 (target <= 1.3 on CosyVoice2, reference
chunks), and each path's total (``--compare``). The flow's state bytes per audio second are printed too, and the
state each chunk left (MiB, measured). ``--flow-context S`` bounds the flow's attention to the prompt and the last
S seconds of speech (the ``flow_context_seconds`` setting: no longer the reference's audio beyond the window; the
final call then chunk-causal through the state too). The machine's load is printed: figures from a busy machine
are not figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from cosyserve.core.settings import FIRST_HOP_DEFAULT


def model_dir(family: str, size: str, work: Path) -> Path:
    """An official-layout random-weight model of ``family`` and ``size``, made once under ``work``."""
    from cosyserve.families.testmodel import make_test_model

    out = work / f"{family}-{size}"
    if not (out / f"{family}.yaml").is_file():
        t = time.perf_counter()
        make_test_model(out, size=size, seed=0, family=family)
        print(f"made {out} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return out


def lite_bundle(path: Path, work: Path) -> Path:
    """The model dir ``path`` converted with ``--runtime lite``, once, under ``work``."""
    from cosyserve.bundle.convert import convert

    out = work / f"{path.name}-lite"
    if not (out / "lite" / "manifest.json").is_file():
        t = time.perf_counter()
        convert(path, out, runtime="lite", progress=False)
        print(f"converted {out} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return out


def token2wav(
    path: Path,
    policy_name: str,
    dtype: str,
    incremental: bool,
    flow_context: float = 0.0,
    runtime: str = "torch",
) -> Any:
    """The family's token2wav over the dir's flow and vocoder (loaded once per process), with ``policy_name`` and
    ``flow_context`` seconds of bounded flow context (0: unbounded); ``runtime`` lite: over a lite bundle's graphs
    (``path`` the bundle), as the lite runtime builds it."""
    if runtime == "lite":
        key = (str(path), policy_name, flow_context)
        if key not in _LOADED:
            import cosyserve

            _LOADED[key] = cosyserve.load(
                str(path),
                runtime="lite",
                chunk_policy=policy_name,
                threads=THREADS[0],
                warmup=False,
                flow_context_seconds=flow_context,
            )
        t2w = _LOADED[key].runtime.pipeline.token2wav  # a bench may reach in: the path under test is switched
        t2w.incremental = incremental
        return t2w
    from cosyserve.bundle.official import load_component
    from cosyserve.families.modelconfig import load_model_config
    from cosyserve.models.precision import cast_floating

    key = (str(path), dtype)
    if key not in _LOADED:
        cfg = load_model_config(path)
        parts = {n: load_component(path, n, getattr(cfg, n), cfg.family) for n in ("flow", "hift")}
        if dtype != "float32":
            for module in parts.values():
                cast_floating(module, getattr(torch, dtype))
        _LOADED[key] = (cfg, parts)
    cfg, parts = _LOADED[key]
    family = cfg.family_spec
    policy = family.stream_policy(cfg, parts["flow"], policy_name, FIRST_HOP_DEFAULT)
    t2w = family.token2wav(cfg, parts["flow"], parts["hift"], policy, None, flow_context=flow_context)
    t2w.incremental = incremental
    return t2w


_LOADED: dict[tuple[str, str, float], Any] = {}
THREADS: list[int | None] = [None]  # --threads, for the lite runtime's sessions


def stream(t2w: Any, seconds: float, prompt_seconds: float, seed: int) -> list[dict[str, float]]:
    """One streamed utterance: per chunk, its wall seconds, audio seconds and the MiB its state held after it."""
    g = torch.Generator().manual_seed(seed)
    rate = int(t2w.flow.cfg.input_frame_rate)
    p = int(prompt_seconds * rate)
    tokens = torch.randint(0, 4096, (int(seconds * rate),), generator=g).tolist()
    kw: dict[str, Any] = dict(
        embedding=torch.randn(1, 192, generator=g),
        prompt_token=torch.randint(0, 4096, (1, p), generator=g).to(torch.int32),
        prompt_feat=torch.randn(1, 2 * p, 80, generator=g) * 0.5 - 5,
    )
    if isinstance(t2w.flow, torch.nn.Module):
        kw["generator"] = torch.Generator().manual_seed(seed)
    else:  # the lite runtime's: numpy arrays, numpy's generator
        import numpy as np

        kw = {k: v.numpy() for k, v in kw.items()}
        kw["generator"] = np.random.default_rng(seed)
    kw["stream"] = True
    states: list[Any] = []
    made = t2w.new_stream  # a bench may reach in: the request's state is watched here

    def new_stream(*a: Any, **k: Any) -> Any:
        states.append(made(*a, **k))
        return states[-1]

    t2w.new_stream = new_stream
    rows, it = [], iter(t2w(iter(tokens), **kw))
    try:
        while True:
            t = time.perf_counter()
            try:
                chunk = next(it)
            except StopIteration:
                return rows
            wall = time.perf_counter() - t
            held = states[0].nbytes() if states else 0
            rows.append({"wall_s": wall, "audio_s": chunk.shape[1] / 24000, "state_mib": held / 2**20})
    finally:
        del t2w.new_stream


def pipeline_stream(model: Any, seconds: float, incremental: bool) -> list[dict[str, float]]:
    """One streamed sft request through the loaded model: per chunk, the wall seconds since the previous chunk
    (since the request for the first) and its audio seconds."""
    pipe = model.runtime.pipeline  # a bench may reach in: the path under test is switched here
    pipe.token2wav.incremental = incremental
    rate = int(pipe.token2wav.flow.cfg.input_frame_rate)
    # one text token per word: a random LM speaks 20 speech tokens for each (its limit), so words = tokens / 20
    words = ["hello"] * max(1, round(seconds * rate / 20))
    rows, last = [], time.perf_counter()
    for chunk in model.synthesize(iter(" " + w for w in words), model.speakers[0], stream=True, seed=0):
        now = time.perf_counter()
        rows.append({"wall_s": now - last, "audio_s": chunk.size / model.sample_rate})
        last = now
    return rows


def rate_of(flow: Any) -> int:
    """Mel frames a second of ``flow``'s output."""
    return int(flow.cfg.input_frame_rate) * int(flow.cfg.token_mel_ratio)


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    per = [r["wall_s"] / r["audio_s"] for r in rows]
    out = {"total_s": sum(r["wall_s"] for r in rows), "audio_s": sum(r["audio_s"] for r in rows)}
    if len(rows) >= 5:
        early = sum(r["wall_s"] for r in rows[1:3]) / sum(r["audio_s"] for r in rows[1:3])
        late = sum(r["wall_s"] for r in rows[-3:-1]) / sum(r["audio_s"] for r in rows[-3:-1])
        out.update(early_s_per_s=early, late_s_per_s=late, late_over_early=late / early)
    out["final_s_per_s"] = per[-1]
    return out


def stream_args(ap: argparse.ArgumentParser, seconds: float) -> None:
    """The arguments every streamed-token2wav bench takes: the model, the utterance, the chunk policy."""
    ap.add_argument("--family", default="cosyvoice2", choices=("cosyvoice2", "cosyvoice3"))
    ap.add_argument(
        "--model", type=Path, help="an official-layout model dir (default: a random full-size one)"
    )
    ap.add_argument("--work", type=Path, default=Path("out/bench-models"), help="where test models are made")
    ap.add_argument(
        "--seconds", type=float, default=seconds, help=f"speech after the prompt (default {seconds:g})"
    )
    ap.add_argument("--prompt-seconds", type=float, default=3.0)
    ap.add_argument("--policy", default="reference", choices=("reference", "low-latency"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stream_args(ap, 32.0)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--runtime", default="torch", choices=("torch", "lite"), help="the runtime that streams")
    ap.add_argument("--bundle", type=Path, help="with --runtime lite: a bundle converted with --runtime lite")
    ap.add_argument("--compare", action="store_true", help="also the cumulative path, interleaved")
    ap.add_argument("--pipeline", action="store_true", help="the served path, LM included (see above)")
    ap.add_argument(
        "--flow-context",
        type=float,
        default=0.0,
        metavar="S",
        help="bounded flow context: seconds of speech the flow attends to beyond the prompt (0: every frame)",
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--dry-run", action="store_true", help="tiny models, a short utterance: the same code (CI)"
    )
    ap.add_argument("--json", type=Path, help="write every measurement here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        THREADS[0] = args.threads
    size = "tiny" if args.dry_run else "full"
    seconds = min(args.seconds, 12.0) if args.dry_run else args.seconds
    if args.runtime == "lite" and args.dtype != "float32":
        ap.error("--runtime lite computes in float32 (the bundle's graphs)")
    if args.runtime == "lite" and args.bundle:
        path = args.bundle
    else:
        path = args.model or model_dir(args.family, size, args.work)
        path = lite_bundle(path, args.work) if args.runtime == "lite" else path
    paths = {"incremental": True, **({"cumulative": False} if args.compare else {})}
    runs: dict[str, list[list[dict[str, float]]]] = {name: [] for name in paths}
    if args.pipeline:
        import cosyserve

        dtypes = {f"{c}_dtype": args.dtype for c in ("llm", "flow", "hift")}
        if args.runtime == "lite":
            dtypes = {}
        model = cosyserve.load(
            str(path), runtime=args.runtime, chunk_policy=args.policy, threads=args.threads,
            flow_context_seconds=args.flow_context, **dtypes,
        )  # fmt: skip
        model.runtime.join_background()
        pipeline_stream(model, 2.0, True)  # warm-up
    else:
        stream(
            token2wav(path, args.policy, args.dtype, True, args.flow_context, args.runtime),
            2.0,
            args.prompt_seconds,
            0,
        )  # fmt: skip  (warm-up)
    for _ in range(args.rounds):
        for name, incremental in paths.items():
            if args.pipeline:
                runs[name].append(pipeline_stream(model, seconds, incremental))
            else:
                t2w = token2wav(path, args.policy, args.dtype, incremental, args.flow_context, args.runtime)
                runs[name].append(stream(t2w, seconds, args.prompt_seconds, 1))
    load = os.getloadavg()
    what = (
        "sft, words streamed, LM included" if args.pipeline else f"after a {args.prompt_seconds:.0f} s prompt"
    )
    context = f"flow context {args.flow_context:g} s" if args.flow_context else "exact flow context"
    print(
        f"{path} ({size}, {args.runtime}), {args.policy} chunks, {args.dtype}, {context}, {seconds:.0f} s {what}, "
        f"{torch.get_num_threads()} torch threads, {args.rounds} round(s); load {load[0]:.2f} {load[1]:.2f}"
    )
    best = {name: min(rs, key=lambda r: sum(x["wall_s"] for x in r)) for name, rs in runs.items()}
    print(
        f"{'chunk':>5} {'audio s':>8}"
        + "".join(f" {name + ' s/s':>16}" for name in best)
        + f" {'state MiB':>10}"
    )
    for i, row in enumerate(best["incremental"]):
        cells = "".join(f" {best[n][i]['wall_s'] / best[n][i]['audio_s']:>16.3f}" for n in best)
        print(f"{i + 1:>5} {row['audio_s']:>8.2f}" + cells + f" {row.get('state_mib', 0.0):>10.1f}")
    result: dict[str, Any] = {}
    for name, rows in best.items():
        s = summary(rows)
        result[name] = {"summary": s, "rounds": runs[name]}
        line = f"{name}: {s['total_s']:.1f} s for {s['audio_s']:.1f} s of audio"
        if "late_over_early" in s:
            line += (
                f"; chunks 2-3 {s['early_s_per_s']:.3f} s/s, the two before the final {s['late_s_per_s']:.3f} "
                f"s/s: {s['late_over_early']:.2f}x (target <= 1.3)"
            )
        final = "chunk-causal" if args.flow_context and name == "incremental" else "full attention"
        print(line + f"; final ({final}) {s['final_s_per_s']:.3f} s/s")
    if args.compare:
        a, b = result["incremental"]["summary"]["total_s"], result["cumulative"]["summary"]["total_s"]
        totals = [sum(x["wall_s"] for x in r) for r in runs["incremental"]]
        print(f"total: incremental {a:.1f} s vs cumulative {b:.1f} s ({a / b:.2f}x; median incr. "
              f"{statistics.median(totals):.1f} s)")  # fmt: skip
    flow = token2wav(path, args.policy, args.dtype, True, args.flow_context, args.runtime).flow
    if args.runtime == "lite":
        # per kept frame: keys and values of both CFG rows at every layer and Euler step, float32
        layers, heads, head_dim = flow.kv_shape
        per_s = 2 * 2 * layers * heads * head_dim * 4 * flow.n_timesteps * rate_of(flow)
    else:
        from cosyserve.voices.voicestates import bytes_per_second

        per_s = bytes_per_second(flow)
    if args.flow_context:
        peak = max(r.get("state_mib", 0.0) for r in best["incremental"])
        print(
            f"flow state: {per_s / 2**20:.1f} MiB per audio second kept, the window's {args.flow_context:g} s (+ "
            f"a chunk) and the prompt's; measured peak {peak:.0f} MiB (unbounded: {per_s * seconds / 2**30:.2f} GiB)"
        )
    else:
        print(
            f"flow state: {per_s / 2**20:.1f} MiB per audio second ({per_s * seconds / 2**30:.2f} GiB at the end)"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
