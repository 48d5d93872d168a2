"""The model-wide bound on streamed flow states (``stream_state_budget_mb``): several concurrent long streams with
and without it, interleaved in the same run, and what the bound costs the streams that pass it.

    python bench/stream_budget.py --family cosyvoice2 --streams 4 --seconds 20                 # full size, fp32
    python bench/stream_budget.py --family cosyvoice2 --streams 4 --seconds 20 --budget-mb 4096
    python bench/stream_budget.py --family cosyvoice2 --streams 4 --seconds 20 --stack         # + vocoder stacked
    python bench/stream_budget.py --dry-run                                                    # tiny (CI)

``--streams`` threads each stream ``--seconds`` of random speech tokens (after a ``--prompt-seconds`` prompt)
through the family's token2wav over one loaded flow and vocoder, all at once, as a served model's concurrent
requests do; once with no bound and once with ``--budget-mb`` (default: half of what the streams would hold
together at their end, so that some must pass it). Random-weight models of the release's dimensions
(``make-test-model --size full``, made once under ``--work``) or ``--model DIR``.

Per run it prints: the wall time, each stream's seconds per audio second, the streams that dropped their state
(they went on re-running the flow on every token, as the reference does), the peak bytes the streams' states held
together (accounted: what the bound bounds) and how far the run raised the process's peak RSS (bounded runs
first: a later run's rise is what it needs above the earlier peak). The machine's load is
printed: figures from a busy machine are not figures. ``--stack`` adds a run (no bound) whose vocoder calls run
stacked (:class:`~cosyserve.runtime.stacking.VocoderBatcher`, what ``batch_flow`` does on a CosyVoice2 model): its
wall time against the unstacked run's, and the calls per stacked run. On a CPU expect little (see stacking.py); it
is meant for GPUs (bench/gpu.py territory).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stream_chunks import model_dir, stream, stream_args, token2wav  # noqa: E402


def run(path: Path, args: argparse.Namespace, budget: int | None, stack: bool = False) -> dict[str, Any]:
    """``args.streams`` concurrent streams under ``budget`` bytes (None: no bound), with their vocoder calls
    stacked (``stack``: what ``batch_flow`` does for the families that stack their vocoder); their figures."""
    from cosyserve.runtime.stacking import VocoderBatcher
    from cosyserve.voices.voicestates import VoiceStates

    voices = VoiceStates(0, streams_max_bytes=budget)  # no voice cache: each stream computes its prompt
    results: list[Any] = [None] * args.streams
    hift = token2wav(path, args.policy, "float32", True).hift
    batcher = VocoderBatcher(hift, args.streams, name="bench vocoder") if stack else None

    def one(i: int) -> None:
        t2w = token2wav(path, args.policy, "float32", True)
        t2w.voices = voices
        if batcher is not None:
            t2w.hift = batcher
        results[i] = stream(t2w, args.seconds, args.prompt_seconds, seed=i + 1)

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(args.streams)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    if any(r is None for r in results):
        raise RuntimeError("a stream failed (see above)")
    per = [sum(c["wall_s"] for c in r) / sum(c["audio_s"] for c in r) for r in results]
    return {
        "budget_mb": None if budget is None else budget / 2**20,
        "wall_s": wall,
        "audio_s": sum(c["audio_s"] for r in results for c in r),
        "s_per_audio_s": per,
        "drops": voices.stream_drops,
        "peak_mb": voices.stream_peak / 2**20,
        "rss_growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024,
        "left_mb": voices.stream_bytes / 2**20,
        "vocoder_mean_batch": batcher.stats.mean_batch if batcher is not None else 1.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stream_args(ap, 20.0)
    ap.add_argument("--streams", type=int, default=4, help="concurrent streams (default 4)")
    ap.add_argument("--budget-mb", type=int, help="the bound (default: half of the streams' end state)")
    ap.add_argument(
        "--stack",
        action="store_true",
        help="also a run with the vocoder's calls stacked (CosyVoice2's batch_flow)",
    )
    ap.add_argument("--rounds", type=int, default=1, help="rounds, each run in turn")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default torch's)")
    ap.add_argument("--dry-run", action="store_true", help="tiny models, short streams: the same code (CI)")
    ap.add_argument("--json", type=Path, help="write every measurement here")
    args = ap.parse_args()
    if args.stack and args.family != "cosyvoice2":
        ap.error("--stack: only CosyVoice2 stacks its vocoder (CosyVoice3's keeps per-stream state)")
    if args.threads:
        torch.set_num_threads(args.threads)
    size = "tiny" if args.dry_run else "full"
    if args.dry_run:
        args.seconds = min(args.seconds, 6.0)
        args.streams = min(args.streams, 2)
    path = args.model or model_dir(args.family, size, args.work)
    from cosyserve.voices.voicestates import bytes_per_second

    per_s = bytes_per_second(token2wav(path, args.policy, "float32", True).flow)
    end = per_s * args.seconds * args.streams
    budget = args.budget_mb << 20 if args.budget_mb is not None else int(end // 2)
    if not args.dry_run:
        stream(token2wav(path, args.policy, "float32", True), 2.0, args.prompt_seconds, 0)  # warm-up
    # bounded first: the peak RSS only rises, so the later run's rise is what it adds above the first's peak
    runs: dict[str, list[dict[str, Any]]] = {
        "bounded": [],
        "unbounded": [],
        **({"stacked": []} if args.stack else {}),
    }
    for _ in range(args.rounds):
        runs["bounded"].append(run(path, args, budget))
        runs["unbounded"].append(run(path, args, None))
        if args.stack:
            runs["stacked"].append(run(path, args, None, stack=True))
    load = os.getloadavg()
    print(
        f"{path} ({size}), {args.streams} streams of {args.seconds:.0f} s after a {args.prompt_seconds:.0f} s "
        f"prompt, {args.policy} chunks, {torch.get_num_threads()} threads, {args.rounds} round(s); "
        f"load {load[0]:.2f} {load[1]:.2f}"
    )
    print(
        f"flow state {per_s / 2**20:.1f} MiB per audio second: the streams would hold {end / 2**20:.0f} MiB "
        f"together at their end; bound {budget / 2**20:.0f} MiB"
    )
    print(
        f"{'run':>10} {'wall s':>8} {'s/audio s per stream':>28} {'drops':>6} {'peak MiB':>9} {'RSS+ MiB':>9}"
    )
    for name, rs in runs.items():
        for r in rs:
            per = " ".join(f"{x:.2f}" for x in r["s_per_audio_s"])
            print(
                f"{name:>10} {r['wall_s']:>8.1f} {per:>28} {r['drops']:>6} {r['peak_mb']:>9.0f} "
                f"{r['rss_growth_mb']:>9.0f}"
            )
    best = {name: min(r["wall_s"] for r in rs) for name, rs in runs.items()}
    print(
        f"bounded over unbounded wall time: {best['bounded'] / best['unbounded']:.2f}x (best of {args.rounds})"
    )
    if args.stack:
        mean = max(r["vocoder_mean_batch"] for r in runs["stacked"])
        print(
            f"vocoder stacked (unbounded) over unstacked wall time: {best['stacked'] / best['unbounded']:.2f}x; "
            f"{mean:.2f} calls per vocoder run"
        )
    if args.json:
        args.json.write_text(json.dumps({"budget_mb": budget / 2**20, **runs}, indent=1))


if __name__ == "__main__":
    main()
