"""Continuous batching: throughput at 1/2/4/8 concurrent requests on ONE model instance, with and without
batching of the LM (and of the flow), side by side in one run.

    PYTHONPATH=src python bench/batching_throughput.py [--model BUNDLE_OR_MODEL_DIR] [--threads 2] \
        [--concurrency 1,2,4,8] [--rounds 1] [--text ...] [--stream]

Without ``--model`` it builds the tiny random-weight test model (fast, meaningless audio; checks the wiring).
Per concurrency level N, N clients each send ``--rounds`` requests (different seeds) to:

- unbatched: ``Engine(batch_size=1)``: one worker; the requests wait for it in turn (today's behaviour);
- batched: ``Engine(batch_size=N)``: N workers share the model, their LM steps run as one batch, flow and
  vocoder run concurrently in the workers;
- +flow: ``Engine(batch_size=N, batch_flow=True)``: as batched, and the workers' flow and vocoder calls of
  equal shapes run stacked (every request here has the same text, so same-index windows match).

It prints total audio seconds per wall second for each, the gains over unbatched, the batched loop's mean
batch size and the flow / vocoder batchers' mean stacked batch (calls per run),
then LLM-only tokens/s (N requests through ``TransformerLM.inference`` one after another vs through a
:class:`BatchingLM` at once). Random weights generate to ``max_len`` (20 tokens per text token), so every
request makes the same amount of audio. Figures are wall-clock on a shared machine: noisy.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def _engine_level(
    bundle: str,
    batch_size: int,
    conc: int,
    rounds: int,
    text: str,
    stream: bool,
    threads: int,
    batch_flow: bool = False,
    gather_ms: float | None = None,
):
    import cosyserve
    from cosyserve.engine.engine import Engine, SynthesisRequest

    e = Engine(
        "m",
        lambda: cosyserve.load(bundle, warmup=True),
        batch_size=batch_size,
        batch_flow=batch_flow,
        queue_limit=64,
        torch_threads=threads,
    )
    e.load_sync(600)
    speaker = e.runtime.speakers()[0]
    sr = e.sample_rate or 22050
    list(e.synthesize_sync(SynthesisRequest(text, speaker, seed=0, stream=stream)))  # warm the workers' path
    batcher = e._instances[0].batcher
    steps0, rows0 = (batcher.stats.steps, batcher.stats.rows_decoded) if batcher is not None else (0, 0)
    stackers = [e._instances[0].flow_batcher, e._instances[0].vocoder_batcher]
    for b in stackers:
        if b is not None and gather_ms is not None:
            b.gather_s = gather_ms / 1000
    before = [(b.stats.calls, b.stats.runs) if b is not None else (0, 0) for b in stackers]

    def client(i: int) -> float:
        audio = 0.0
        for j in range(rounds):
            for chunk in e.synthesize_sync(
                SynthesisRequest(text, speaker, seed=1 + 100 * i + j, stream=stream)
            ):
                audio += len(chunk) / sr
        return audio

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(conc) as ex:
        audio = sum(ex.map(client, range(conc)))
    wall = time.perf_counter() - t
    mean_batch = 1.0
    if batcher is not None:  # of the timed requests only, not the warm-up
        mean_batch = (batcher.stats.rows_decoded - rows0) / max(1, batcher.stats.steps - steps0)
    # calls per flow / vocoder run (a stacked run counts once), timed requests only
    stacked = tuple(
        (b.stats.calls - c0) / max(1, b.stats.runs - r0) if b is not None else 1.0
        for b, (c0, r0) in zip(stackers, before, strict=True)
    )
    e.release_sync(60)
    return audio, wall, mean_batch, stacked


def _llm_level(lm: Any, args: tuple, conc: int, threads: int) -> tuple[float, float, float]:
    import torch

    from cosyserve.runtime.batching import BatchingLM

    torch.set_num_threads(threads)
    t = time.perf_counter()
    n = sum(len(list(lm.inference(*args, generator=torch.Generator().manual_seed(i)))) for i in range(conc))
    unbatched = n / (time.perf_counter() - t)

    b = BatchingLM(lm, conc, torch_threads=threads)
    counts = [0] * conc

    def run(i: int) -> None:
        counts[i] = len(list(b.inference(*args, generator=torch.Generator().manual_seed(i))))

    workers = [threading.Thread(target=run, args=(i,)) for i in range(conc)]
    t = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    batched = sum(counts) / (time.perf_counter() - t)
    mean = b.stats.mean_batch
    b.close()
    return unbatched, batched, mean


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", help="bundle or official model dir (default: the tiny test model)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker and for the decode loop")
    ap.add_argument("--concurrency", default="1,2,4,8", help="comma-separated concurrency levels")
    ap.add_argument("--rounds", type=int, default=1, help="requests per client per level")
    ap.add_argument("--text", default="Hello there, this is a test.", help="text of every request")
    ap.add_argument("--stream", action="store_true", help="streaming synthesis")
    ap.add_argument("--skip-engine", action="store_true", help="LLM-only figures only")
    ap.add_argument("--skip-llm", action="store_true", help="engine figures only")
    ap.add_argument("--no-flow", action="store_true", help="skip the +flow (batch_flow) column")
    ap.add_argument("--gather-ms", type=float, help="flow/vocoder batchers' gather window (default: theirs)")
    ap.add_argument("--skip-unbatched", action="store_true", help="batched columns only (gains vs batched)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    import cosyserve
    from cosyserve.api import resolve_bundle

    tmp = tempfile.TemporaryDirectory()
    model = args.model
    if model is None:
        from cosyserve.families.testmodel import make_test_model

        model = str(Path(tmp.name) / "tiny")
        make_test_model(model, size="tiny", seed=0)
        print(f"no --model: built the tiny test model in {model}")
    bundle = str(resolve_bundle(model))
    levels = [int(c) for c in args.concurrency.split(",")]

    print(
        f"model {model}; torch threads per worker/loop {args.threads}; stream={args.stream}; text {args.text!r}"
    )
    if not args.skip_engine:
        print(f"{'conc':>4} {'audio s':>8} | {'unbatched s':>11} {'audio s/s':>9} | {'batched s':>9} "
              f"{'audio s/s':>9} {'mean B':>6} {'gain':>5} | {'+flow s':>7} {'audio s/s':>9} {'flow/voc B':>10} "
              f"{'gain':>5}")  # fmt: skip
        for conc in levels:
            run = (conc, args.rounds, args.text, args.stream, args.threads)
            a2, w2, mb, _ = _engine_level(bundle, conc, *run)
            a1, w1, _, _ = (a2, w2, 0, 0) if args.skip_unbatched else _engine_level(bundle, 1, *run)
            line = (
                f"{conc:>4} {a1:>8.1f} | {w1:>11.2f} {a1 / w1:>9.2f} | {w2:>9.2f} {a2 / w2:>9.2f} {mb:>6.2f} "
                f"{(a2 / w2) / (a1 / w1):>4.2f}x"
            )
            if not args.no_flow and conc > 1:
                a3, w3, _, (fbm, vbm) = _engine_level(
                    bundle, conc, *run, batch_flow=True, gather_ms=args.gather_ms
                )
                line += (
                    f" | {w3:>7.2f} {a3 / w3:>9.2f} {fbm:>5.2f}/{vbm:>4.2f} {(a3 / w3) / (a1 / w1):>4.2f}x"
                )
            print(line, flush=True)
    if args.skip_llm:
        tmp.cleanup()
        return

    m = cosyserve.load(bundle, warmup=True)
    p = m.runtime.pipeline
    ids = torch.tensor([p.tokenizer.encode(args.text)], dtype=torch.int32)
    empty, zero = torch.zeros(1, 0, dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    emb = p.speakers[sorted(p.speakers)[0]]["embedding"]
    llm_args = (ids, torch.tensor([ids.shape[1]], dtype=torch.int32), empty, zero, empty, zero, emb)
    print(f"LLM only ({ids.shape[1]} text tokens -> up to {20 * ids.shape[1]} speech tokens per request)")
    print(f"{'conc':>4} {'unbatched tok/s':>15} {'batched tok/s':>13} {'mean B':>6} {'gain':>5}")
    for conc in levels:
        u, b, mb = _llm_level(p.llm, llm_args, conc, args.threads)
        print(f"{conc:>4} {u:>15.0f} {b:>13.0f} {mb:>6.2f} {b / u:>4.2f}x", flush=True)
    tmp.cleanup()


if __name__ == "__main__":
    main()
