"""Engine throughput: audio seconds per wall second at 1/2/4/8 concurrent requests, p50/p99 time to first
audio, and a model's reload after eviction against its first load.

    PYTHONPATH=src python bench/engine_throughput.py --model BUNDLE_OR_MODEL_DIR [--instances 2]

Without ``--model`` it builds the tiny random-weight test model (fast, meaningless audio; checks the wiring).
Each engine worker uses one torch thread (two OpenMP threads per worker on a 2-vCPU box spin against each
other and against any other process).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * len(s) + 0.5)) - 1))]


async def _level(
    pool: object, name: str, speaker: str, text: str, conc: int, per_client: int, stream: bool
) -> dict:
    from cosyserve.engine.engine import SynthesisRequest

    sr = pool.engine(name).sample_rate  # type: ignore[attr-defined]
    ttfa: list[float] = []
    audio = [0.0]

    async def client(i: int) -> None:
        for j in range(per_client):
            t0 = time.perf_counter()
            req = SynthesisRequest(text, speaker, stream=stream, seed=1000 * i + j)
            s = await pool.submit(name, req)  # type: ignore[attr-defined]
            first = True
            async for chunk in s:
                if first:
                    ttfa.append(time.perf_counter() - t0)
                    first = False
                audio[0] += len(chunk) / sr

    t = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(conc)))
    wall = time.perf_counter() - t
    return {
        "concurrency": conc,
        "requests": conc * per_client,
        "wall_s": wall,
        "audio_s": audio[0],
        "audio_s_per_s": audio[0] / wall,
        "ttfa_p50_ms": _quantile(ttfa, 0.5) * 1e3,
        "ttfa_p99_ms": _quantile(ttfa, 0.99) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", help="bundle or official model dir (default: the tiny test model)")
    ap.add_argument("--instances", type=int, default=1, help="model instances (MODEL_POOL_SIZE)")
    ap.add_argument("--concurrency", default="1,2,4,8", help="comma-separated concurrency levels")
    ap.add_argument("--requests", type=int, default=8, help="requests per level (at least one per client)")
    ap.add_argument("--text", default="Hello there, this is a test of the serving engine.", help="text")
    ap.add_argument("--stream", action="store_true", help="streaming synthesis (TTFA = first ~2 s chunk)")
    ap.add_argument("--reloads", type=int, default=3, help="evict/reload cycles to time")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from cosyserve.engine.pool import ModelPool, ModelSpec

    tmp = tempfile.TemporaryDirectory()
    model = args.model
    if model is None:
        from cosyserve.families.testmodel import make_test_model

        model = str(Path(tmp.name) / "tiny")
        make_test_model(model, size="tiny", seed=0)
        print(f"no --model: built the tiny test model in {model}")
    from cosyserve.api import resolve_bundle

    bundle = resolve_bundle(model)
    pool = ModelPool([ModelSpec("m", path=str(bundle), instances=args.instances, queue_limit=64)])

    t = time.perf_counter()
    engine = pool.start_load("m").result()
    first_load = time.perf_counter() - t
    reloads = []
    for _ in range(args.reloads):
        pool.evict("m").result()
        t = time.perf_counter()
        engine = pool.start_load("m").result()
        reloads.append(time.perf_counter() - t)
    reload = statistics.median(reloads)
    print(
        f"first load (incl. warm-up) {first_load * 1e3:.0f} ms; reload after eviction "
        f"{reload * 1e3:.0f} ms (median of {len(reloads)}); ratio {first_load / reload:.1f}x"
    )
    speaker = engine.runtime.speakers()[0]

    async def run() -> list[dict]:
        out = []
        for conc in [int(c) for c in args.concurrency.split(",")]:
            per = max(1, args.requests // conc)
            out.append(await _level(pool, "m", speaker, args.text, conc, per, args.stream))
        return out

    asyncio.run(_level(pool, "m", speaker, args.text, 1, 1, args.stream))  # warm
    rows = asyncio.run(run())
    print(f"instances={args.instances} stream={args.stream} torch threads per worker=1")
    print(
        f"{'conc':>4} {'reqs':>5} {'wall s':>8} {'audio s':>8} {'audio s/s':>10} {'TTFA p50 ms':>12} {'p99 ms':>8}"
    )
    for r in rows:
        print(
            f"{r['concurrency']:>4} {r['requests']:>5} {r['wall_s']:>8.2f} {r['audio_s']:>8.2f} "
            f"{r['audio_s_per_s']:>10.2f} {r['ttfa_p50_ms']:>12.0f} {r['ttfa_p99_ms']:>8.0f}"
        )
    pool.close_sync()
    tmp.cleanup()


if __name__ == "__main__":
    main()
