"""Zero-shot time to first audio, with and without a registered speaker: the extraction cost a registry saves.

    python bench/zero_shot_ttfa.py --model out/full-model [--runs 5] [--threads 1] [--prompt-wav F --prompt-text T]

Make a model first: `cosyserve make-test-model out/full-model --size full` (or `--size tiny` for a smoke run).
Without --prompt-wav a 5 s voice-like 16 kHz signal is generated. The speaker is registered in a temporary
registry (the user's is not touched). Each run times, from the request to the first streamed chunk:
- inline: ``synthesize(text, mode="zero_shot", prompt_wav=..., prompt_text=...)``: decode + resample the prompt,
  whisper log-mel + speech tokenizer, fbank + campplus, prompt mel, then LLM + flow + vocoder;
- registered: ``synthesize(text, speaker=<registered>)``: the stored features, then the same synthesis;
and the preparation alone (everything before the LLM) for both. The ONNX sessions are created before timing
(their load time is printed separately). Prints medians over --runs and the difference.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def _voice(path: Path, seconds: float = 5.0, sr: int = 16000) -> Path:
    import numpy as np
    import soundfile

    t = np.arange(int(seconds * sr)) / sr
    phase = 2 * np.pi * np.cumsum(140 + 20 * np.sin(2 * np.pi * 3 * t)) / sr
    x = sum(np.sin(k * phase) / k for k in range(1, 6)) * (0.6 + 0.4 * np.sin(2 * np.pi * 2 * t))
    x = 0.3 * x / np.abs(x).max() + 0.01 * np.random.default_rng(0).standard_normal(t.size)
    soundfile.write(path, x.astype(np.float32), sr, subtype="PCM_16")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", required=True, help="model dir or bundle (with campplus.onnx, speech_tokenizer_v1.onnx)"
    )
    ap.add_argument("--text", default="Hello world, this is a test of voice cloning.")
    ap.add_argument("--prompt-wav", default=None, help="prompt recording (default: a generated 5 s signal)")
    ap.add_argument("--prompt-text", default="Hello there, this is the voice I would like you to clone.")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    import torch

    import cosyserve

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="cosyserve-ttfa-"))
    prompt = Path(args.prompt_wav) if args.prompt_wav else _voice(tmp / "prompt.wav")
    t0 = time.perf_counter()
    model = cosyserve.load(args.model, registry_dir=str(tmp / "registry"))
    load_s = time.perf_counter() - t0
    pipe = model.runtime.pipeline

    from cosyserve.frontend.text import load_normalizers

    t = time.perf_counter()
    load_normalizers()  # (normally loaded in the background after READY)
    tn_s = time.perf_counter() - t
    t = time.perf_counter()
    pipe.frontend().load_sessions()
    onnx_s = time.perf_counter() - t
    t = time.perf_counter()
    model.add_speaker("bench-voice", prompt, args.prompt_text)
    add_s = time.perf_counter() - t

    inline = dict(mode="zero_shot", prompt_wav=prompt, prompt_text=args.prompt_text)
    registered = dict(speaker="bench-voice")

    def first_chunk(kwargs: dict, seed: int) -> tuple[float, int]:  # type: ignore[type-arg]
        t = time.perf_counter()
        gen = model.synthesize(args.text, stream=True, seed=seed, **kwargs)
        chunk = next(gen)
        elapsed = time.perf_counter() - t
        gen.close()
        return elapsed, chunk.size

    def prepare(kwargs: dict) -> float:  # type: ignore[type-arg]
        t = time.perf_counter()
        pipe.prepare(model.request(text=args.text, **{"mode": "zero_shot", **kwargs}))
        return time.perf_counter() - t

    first_chunk(inline, 0)  # warm-up: kernels, text normaliser, registry read
    first_chunk(registered, 0)
    rows: dict[str, list[float]] = {"inline": [], "registered": [], "prep_inline": [], "prep_registered": []}
    for run in range(args.runs):
        for name, kwargs in (("inline", inline), ("registered", registered)):
            rows["prep_" + name].append(prepare(kwargs))
            s, samples = first_chunk(kwargs, run)
            rows[name].append(s)
        print(
            f"run {run}: first chunk inline {rows['inline'][-1] * 1e3:.0f} ms, registered "
            f"{rows['registered'][-1] * 1e3:.0f} ms ({samples / model.sample_rate:.2f} s of audio); prepare inline "
            f"{rows['prep_inline'][-1] * 1e3:.1f} ms, registered {rows['prep_registered'][-1] * 1e3:.2f} ms"
        )
    med = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
    import soundfile

    print(
        f"\nmodel {args.model}, {args.threads} thread(s), load {load_s:.2f} s, text normaliser {tn_s:.2f} s, "
        f"ONNX sessions {onnx_s * 1e3:.0f} ms, "
        f"add_speaker {add_s * 1e3:.0f} ms; prompt {soundfile.info(str(prompt)).duration:.2f} s"
    )
    print(
        f"time to first audio, zero-shot with prompt wav     {med['inline']:8.1f} ms  (prepare {med['prep_inline']:.1f} ms)"
    )
    print(
        f"time to first audio, zero-shot registered speaker  {med['registered']:8.1f} ms  (prepare {med['prep_registered']:.2f} ms)"
    )
    print(
        f"saved by the registry                             {med['inline'] - med['registered']:8.1f} ms "
        f"(prepare difference {med['prep_inline'] - med['prep_registered']:.1f} ms)"
    )


if __name__ == "__main__":
    main()
