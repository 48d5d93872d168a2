"""First audio of a registered voice by the length of its sample, with and without its precomputed flow state, and
the memory each cached voice takes (issue 34, targets 2 and 6).

    python bench/voice_states.py --family cosyvoice2                 # full size, made once under --work
    python bench/voice_states.py --dry-run                           # tiny models: the same code (CI)
    python bench/voice_states.py --runtime lite --model /work/bench-models/full3-lite   # a lite bundle

One process loads the model twice from the same bundle (the weights' pages are shared): with the voice cache
(the default ``voice_cache_mb``) and without it (``voice_cache_mb=0``: every request computes its prompt's flow
frames itself, the uncached path); ``--runtime lite``: the same on the lite runtime (``--model``, a bundle converted
with ``--runtime lite``; by default the --work model, converted once). A 2 s and a 12 s voice (synthetic audio: the
random-weight model does not care) are registered on both; then, interleaved round by round, each (voice, model)
streams the same text and its first audio is timed from the call (the LM's prefill, which reads the voice's speech
tokens, included). Printed: the medians, the ratios the targets name (12 s / 2 s registered: <= 1.7; 12 s registered
/ 12 s uncached: <= 0.3), the bytes each voice's state holds in memory (and per second of sample), and the machine's
load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def prompt_wav(path: Path, seconds: float, seed: int) -> Path:
    """A voiced-sounding synthetic sample: a gliding harmonic tone with noise, 16 kHz mono PCM."""
    import soundfile as sf

    rate = 16000
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(seed)
    f0 = 120 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    audio = sum(np.sin(k * phase) / k for k in range(1, 6)) * 0.2 + rng.normal(0, 0.01, t.size)
    sf.write(path, audio.astype(np.float32), rate, subtype="PCM_16")
    return path


def first_audio(model: Any, voice: str, text: str) -> float:
    # a random-weight LM may draw its stop token before any speech (CosyVoice3's does, early): the first seed
    # that speaks is timed, the same one for every configuration
    for seed in range(20):
        t = time.perf_counter()
        it = model.synthesize(text, voice, stream=True, seed=seed)
        chunk = next(it, None)
        elapsed = time.perf_counter() - t
        it.close()
        if chunk is not None:
            return elapsed
    raise RuntimeError(f"{voice}: no seed of 20 made speech for {text!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="cosyvoice2", choices=("cosyvoice2", "cosyvoice3"))
    ap.add_argument("--model", help="a model dir or bundle (default: a random full-size one under --work)")
    ap.add_argument("--runtime", default="torch", choices=("torch", "lite"))
    ap.add_argument("--work", type=Path, default=Path("out/bench-models"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--text", default="Hello world, this is a test.")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dry-run", action="store_true", help="tiny models, one round: the same code (CI)")
    ap.add_argument("--json", type=Path, help="write every measurement here")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cosyserve
    from cosyserve.voices.voicestates import bytes_per_second
    from stream_chunks import lite_bundle, model_dir

    size = "tiny" if args.dry_run else "full"
    path = args.model or str(model_dir(args.family, size, args.work))
    if args.runtime == "lite" and not args.model:
        path = str(lite_bundle(Path(path), args.work))
    rounds = 1 if args.dry_run else args.rounds
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models = {
            name: cosyserve.load(
                path,
                runtime=args.runtime,
                threads=args.threads,
                registry_dir=str(work / name),
                voice_cache_mb=mb,
                warmup=True,
            )
            for name, mb in (("cached", 4096), ("uncached", 0))
        }
        for m in models.values():
            m.runtime.join_background()
        states = models["cached"].runtime.pipeline.voice_states
        held: dict[str, int] = {}
        for seconds in (2, 12):
            wav = prompt_wav(work / f"{seconds}s.wav", seconds, seconds)
            for name, m in models.items():
                before = states.nbytes
                m.add_speaker(f"v{seconds}", wav, "This is the transcript of the voice sample.")
                m.runtime.pipeline.voice_states.wait()  # computed in the background: done before timing
                if name == "cached":
                    held[f"{seconds} s"] = states.nbytes - before
        rows = {(v, m): [] for v in ("v2", "v12") for m in models}  # type: dict[tuple[str, str], list[float]]
        for name in models:  # a first request each: one-time costs out of the figures
            first_audio(models[name], "v2", args.text)
        for _ in range(rounds):
            for (voice, name), out in rows.items():
                out.append(first_audio(models[name], voice, args.text))
        med = {k: statistics.median(v) for k, v in rows.items()}
        load = os.getloadavg()
        print(
            f"{path} ({size}, {args.runtime} runtime), {rounds} round(s), medians; load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
        )
        for (voice, name), v in med.items():
            print(
                f"  {voice[1:]:>3} s voice, {name:<9} first audio {v:7.2f} s   (all: {rows[(voice, name)]})"
            )
        r1 = med[("v12", "cached")] / med[("v2", "cached")]
        r2 = med[("v12", "cached")] / med[("v12", "uncached")]
        print(
            f"12 s / 2 s registered: {r1:.2f}x (target <= 1.7); 12 s registered / uncached: {r2:.2f}x (<= 0.3)"
        )
        flow = models["cached"].runtime.pipeline.token2wav.flow
        per_s = bytes_per_second(flow)
        for k, b in held.items():
            print(f"voice state, {k} sample: {b / 2**20:.1f} MiB in memory")
        print(f"flow state per second of sample: {per_s / 2**20:.1f} MiB ({type(flow).__name__})")
        if args.json:
            result = {
                "first_audio_s": {f"{v}/{n}": r for (v, n), r in rows.items()},
                "ratios": {"12s_over_2s": r1, "registered_over_uncached": r2},
                "state_bytes": held,
                "bytes_per_second": per_s,
            }
            args.json.write_text(json.dumps(result, indent=1))
        for m in models.values():
            m.close()


if __name__ == "__main__":
    main()
