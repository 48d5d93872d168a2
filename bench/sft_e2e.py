"""End-to-end SFT synthesis cost on this CPU: ms per LLM token, flow and vocoder real-time factor, peak RSS.

    python bench/sft_e2e.py --model out/full-model [--threads 2] [--runs 2] [--dtype float32|bfloat16]

Make the model first: `cosyserve make-test-model out/full-model --size full`. The LLM is timed alone over the
tokens it generates for the text (random weights: it runs to the max length, 20 tokens per text token), then
token2wav (one-shot) on those tokens with flow and vocoder timed separately. Prints medians over --runs.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", default="Hello world, this is a test.")
    ap.add_argument("--speaker", default="英文女")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()

    import torch

    import cosyserve

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = cosyserve.load(args.model)
    load_s = time.perf_counter() - t0
    pipe = model.runtime.pipeline
    if args.dtype == "bfloat16":
        for m in (pipe.llm, pipe.token2wav.flow, pipe.token2wav.hift):
            m.to(torch.bfloat16)
    flow, hift = pipe.token2wav.flow, pipe.token2wav.hift
    timers = {"flow": 0.0, "hift": 0.0}

    def timed(name, fn):  # type: ignore[no-untyped-def]
        def wrapper(*a, **k):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timers[name] += time.perf_counter() - t

        return wrapper

    flow.inference = timed("flow", flow.inference)
    hift.inference = timed("hift", hift.inference)
    emb = pipe.speakers[args.speaker]["embedding"]
    ids = torch.tensor([pipe.tokenizer.encode(args.text)], dtype=torch.int32)
    from cosyserve.runtime.lm import one_shot
    from cosyserve.runtime.oneoff import generate

    rows = []
    for run in range(args.runs):
        gen = torch.Generator().manual_seed(run)
        t = time.perf_counter()
        tokens = list(generate(pipe.llm, one_shot(pipe.llm, {"text": ids, "llm_embedding": emb}), run))
        llm_s = time.perf_counter() - t
        timers.update(flow=0.0, hift=0.0)
        audio = torch.cat(list(pipe.token2wav(tokens, embedding=emb, stream=False, generator=gen)), dim=1)
        seconds = audio.shape[1] / model.sample_rate
        rows.append((len(tokens), llm_s * 1e3 / max(len(tokens), 1), timers["flow"], timers["hift"], seconds))
        print(
            f"run {run}: {len(tokens)} tokens, {rows[-1][1]:.1f} ms/token, flow {timers['flow']:.2f} s, "
            f"hift {timers['hift']:.2f} s for {seconds:.2f} s of audio"
        )
    med = [statistics.median(r[i] for r in rows) for i in range(5)]
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    total = med[0] * med[1] / 1e3 + med[2] + med[3]
    print(f"\nmodel {args.model}, {args.dtype}, {args.threads} threads, load {load_s:.2f} s")
    print(f"LLM   {med[1]:.1f} ms/token ({med[0]:.0f} tokens)")
    print(f"flow  {med[2]:.2f} s, RTF {med[2] / med[4]:.3f}  (audio {med[4]:.2f} s)")
    print(f"hift  {med[3]:.2f} s, RTF {med[3] / med[4]:.3f}")
    print(f"total {total:.2f} s, RTF {total / med[4]:.2f}; peak RSS {peak_gb:.2f} GB")
    print(
        "reference here (fp32, same weights): 81 ms/token, flow 2.9 s, hift 0.7 s for 3.19 s, RTF 5.2, 4.95 GB"
    )


if __name__ == "__main__":
    main()
