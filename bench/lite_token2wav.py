"""CosyVoice2/3 token2wav on the lite graphs beside the torch modules: sessions' open time, first streamed chunk, RTF.

Usage::

    cosyserve make-test-model full3 --family cosyvoice3 --size full
    cosyserve convert full3 full3-bundle --runtime lite
    python bench/lite_token2wav.py full3-bundle --rounds 3
    python bench/lite_token2wav.py --dry-run        # a tiny random CosyVoice3 model, one round (what the tests run)

One process (the torch side needs torch; the lite side's computations import none). The same speech tokens (random
ids, ``--tokens`` of them, no prompt) and the same vocoder noise go through the family's shared token2wav
(:class:`~cosyserve.families.cosyvoice2.token2wav.Token2Wav2` / ``Token2Wav3``, the reference's chunk policy) over:

- ``lite``: the bundle's ``lite/`` graphs (:mod:`cosyserve.runtime.lite.chunkflow`) as the lite runtime serves them
  (a streamed chunk computes its own frames: the flow keeps its per-step caches, CosyVoice3's vocoder its state);
- ``torch``: the bundle's torch modules as the torch runtime serves them (the same rule), the lite path's like for
  like;
- ``torch_cumulative``: the torch modules on the reference's rule (each chunk re-runs on everything so far).

Figures (medians over the rounds, rounds alternate the order): ``open_ms`` (lite: opening the flow and vocoder
sessions; torch: loading the flow and vocoder modules from the bundle), then after one short warm-up call:
``first_chunk_ms`` (the first streamed chunk), ``stream_s`` (the whole stream), ``rtf`` (one-shot compute seconds
per audio second). Put the load average
beside them (printed first).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def _t2w(bundle: Path, runtime: str, threads: int) -> tuple[Any, float, bool]:
    """(the family's token2wav over ``runtime``'s flow and vocoder, ms to make them, causal vocoder)."""
    from cosyserve.families.cosyvoice2.token2wav import Token2Wav2
    from cosyserve.families.cosyvoice3.token2wav import Token2Wav3

    t = time.perf_counter()
    if runtime == "lite":
        from cosyserve.runtime.lite.chunkflow import LiteCausalVocoder, LiteChunkFlow, LiteVocoder2
        from cosyserve.runtime.lite.models import LiteBundle

        lb = LiteBundle(bundle, verify="none", threads=threads)
        tables = lb.tables()
        causal = bool(lb.config["hift"].get("causal"))
        for name in ("flow_mu", "flow_mu_stream", "flow_estimator", "hift_f0", "hift_decode"):
            lb.session(name)
        flow, hift = LiteChunkFlow(lb, tables), (LiteCausalVocoder if causal else LiteVocoder2)(lb, tables)
    else:
        import torch

        from cosyserve.bundle.loader import LoadOptions, open_bundle

        torch.set_num_threads(threads)
        modules = open_bundle(bundle).load(LoadOptions(strategy="lazy", verify="none")).modules
        flow, hift = modules["flow"].float().eval(), modules["hift"].float().eval()
        causal = hasattr(hift, "causal_spectrum")
    ms = (time.perf_counter() - t) * 1e3
    incremental = runtime != "torch_cumulative"
    cls = Token2Wav3 if causal else Token2Wav2
    return cls(flow, hift, incremental=incremental), ms, causal


def _inputs(runtime: str, tokens: int, causal: bool, seed: int) -> dict[str, Any]:
    # the same tokens, embedding and vocoder noise for every runtime: numpy for lite, tensors for torch
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 6561, tokens).tolist()
    emb = rng.standard_normal((1, 192)).astype(np.float32)
    samples = (2 * tokens + 16) * 480
    if causal:
        noise = {
            "rand_ini": rng.random((1, 9), dtype=np.float32),
            "sine_waves": rng.random((1, samples, 9), dtype=np.float32),
        }
    else:
        noise = {}
    if runtime != "lite":
        import torch

        emb = torch.from_numpy(emb)
        noise = {k: torch.from_numpy(v) for k, v in noise.items()}
    return {"ids": ids, "embedding": emb, "noise": noise}


def _draws(runtime: str, causal: bool, noise: dict[str, Any], seed: int) -> dict[str, Any]:
    import itertools

    if causal:
        return {"draws": itertools.repeat(noise)}
    if runtime == "lite":
        import numpy as np

        return {"generator": np.random.default_rng(seed)}
    import torch

    return {"generator": torch.Generator().manual_seed(seed)}


def _measure(bundle: Path, runtime: str, tokens: int, threads: int, seed: int) -> dict[str, float]:
    t2w, open_ms, causal = _t2w(bundle, runtime, threads)
    x = _inputs(runtime, tokens, causal, seed)
    rate = 24000
    # one short call first: first-use costs (pages of the weights, allocator, kernels) are not the steady state
    list(t2w(x["ids"][:12], embedding=x["embedding"], **_draws(runtime, causal, x["noise"], seed)))
    t = time.perf_counter()
    first, n = None, 0
    for chunk in t2w(
        x["ids"], embedding=x["embedding"], stream=True, **_draws(runtime, causal, x["noise"], seed)
    ):
        first = first if first is not None else time.perf_counter() - t
        n += chunk.shape[-1]
    stream_s = time.perf_counter() - t
    t = time.perf_counter()
    audio = sum(
        c.shape[-1]
        for c in t2w(x["ids"], embedding=x["embedding"], **_draws(runtime, causal, x["noise"], seed))
    )
    compute = time.perf_counter() - t
    return {
        "open_ms": open_ms,
        "first_chunk_ms": (first or 0.0) * 1e3,
        "stream_s": stream_s,
        "rtf": compute / (audio / rate),
        "audio_s": audio / rate,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "bundle", nargs="?", type=Path, help="a CosyVoice2/3 bundle converted with --runtime lite"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=250, help="speech tokens (25 per second of audio)")
    ap.add_argument("--dry-run", action="store_true", help="a tiny CosyVoice3 model, one round, 60 tokens")
    ap.add_argument("--json", type=Path, help="also write the medians here")
    args = ap.parse_args()
    print(f"load average: {os.getloadavg()}", flush=True)
    if args.dry_run:
        from cosyserve.bundle.convert import convert
        from cosyserve.families.testmodel import make_test_model

        tmp = Path(tempfile.mkdtemp(prefix="lite-t2w-"))
        make_test_model(tmp / "model", size="tiny", seed=0, family="cosyvoice3")
        args.bundle = convert(tmp / "model", tmp / "bundle", runtime="lite", progress=False)
        args.rounds, args.tokens = 1, 60
    elif args.bundle is None:
        ap.error("give a bundle, or --dry-run")
    runtimes = ["lite", "torch", "torch_cumulative"]
    results: dict[str, list[dict[str, float]]] = {r: [] for r in runtimes}
    for i in range(args.rounds):
        for r in runtimes if i % 2 == 0 else runtimes[::-1]:
            results[r].append(_measure(args.bundle, r, args.tokens, args.threads, seed=i))
    medians = {r: {k: statistics.median(m[k] for m in ms) for k in ms[0]} for r, ms in results.items()}
    for r, m in medians.items():
        print(f"{r:17s} " + "  ".join(f"{k}={v:.3g}" for k, v in m.items()))
    for k in ("first_chunk_ms", "stream_s", "rtf"):
        print(f"lite/torch {k}: {medians['lite'][k] / medians['torch'][k]:.2f}x; lite/torch_cumulative: "
              f"{medians['lite'][k] / medians['torch_cumulative'][k]:.2f}x")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(medians, indent=1))


if __name__ == "__main__":
    main()
