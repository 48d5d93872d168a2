"""Time to first audio with the reference and the low-latency chunk policies, side by side, and what the
low-latency policy costs at its seams.

    flock -x /tmp/cs-cpu.lock python bench/first_chunk.py --model /work/benchm/full-bundle [--runs 5]

One process loads the model twice (the same mapped weights), once per policy, warms both up, then streams the same
sentence (same seed, so the same tokens) through the Python API (``cosyserve.load(...).synthesize(stream=True)``)
alternating between the policies, and times from the call to the first audio chunk. Prints min and median over
``--runs``, the first chunk's audio length, and (unless ``--no-quality``) the streamed vs one-shot distances of
both policies from :func:`cosyserve.tools.quality.chunk_distances`, with the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import cosyserve

POLICIES = ("reference", "low-latency")


def first_audio(model: cosyserve.CosyVoiceModel, text: str, speaker: str) -> tuple[float, float]:
    """(seconds to the first chunk, seconds of audio in it); the request is closed after its first chunk."""
    t = time.perf_counter()
    chunks = model.synthesize(text, speaker, stream=True, seed=0)
    try:
        first = next(chunks)
        return time.perf_counter() - t, first.size / model.sample_rate
    finally:
        chunks.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", default="Hello there.")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument(
        "--first-hop", type=int, default=None, help="the low-latency first hop (default: setting)"
    )
    ap.add_argument("--no-quality", action="store_true", help="skip the seam distances")
    args = ap.parse_args()
    load_before = os.getloadavg()
    hop = {} if args.first_hop is None else {"first_hop_tokens": args.first_hop}
    models = {
        name: cosyserve.load(args.model, threads=args.threads, chunk_policy=name, text_tier="lazy", **hop)
        for name in POLICIES
    }
    speaker = models[POLICIES[0]].speakers[0]
    for m in models.values():
        m.runtime.join_background()  # type: ignore[attr-defined]
        first_audio(m, args.text, speaker)  # warm: text tier, first-call costs
    times: dict[str, list[float]] = {name: [] for name in POLICIES}
    audio: dict[str, float] = {}
    for i in range(args.runs):
        order = POLICIES if i % 2 == 0 else POLICIES[::-1]
        for name in order:
            seconds, audio[name] = first_audio(models[name], args.text, speaker)
            times[name].append(seconds)
    load_after = os.getloadavg()
    first_hop = models["low-latency"].runtime.options.first_hop  # type: ignore[attr-defined]
    print(
        f"{args.text!r}, {args.threads} threads, {args.runs} runs each, interleaved; low-latency first hop {first_hop}"
    )
    print(f"{'policy':<12} {'min s':>7} {'median s':>9} {'1st chunk audio s':>18}")
    for name in POLICIES:
        print(
            f"{name:<12} {min(times[name]):>7.3f} {statistics.median(times[name]):>9.3f} {audio[name]:>18.3f}"
        )
    ratio = statistics.median(times["low-latency"]) / statistics.median(times["reference"])
    print(f"low-latency / reference (median): {ratio:.2f}")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    if not args.no_quality:
        from cosyserve.tools.quality import chunk_distances

        runtime = models["low-latency"].runtime
        print(
            f"\nstreamed vs one-shot ({'log-mel L1':>10}, LSD dB), {'seams':>5}, tokens of the first flow call"
        )
        for name in POLICIES:
            policy = models[name].runtime.pipeline.token2wav.policy  # type: ignore[attr-defined]
            c = chunk_distances(runtime, policy)
            print(
                f"{name:<12} seam {c.seam.mel_l1:.3f} {c.seam.lsd_db:5.2f}  overall {c.overall.mel_l1:.3f} "
                f"{c.overall.lsd_db:5.2f}  {c.seams:>5}  {c.first_window}"
            )


if __name__ == "__main__":
    main()
