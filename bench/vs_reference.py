"""Our flow and vocoder side by side with the reference's, on the same full-size weights, in one process.

    # side by side (the reference's venv runs both; our src and the reference's source on the path):
    PYTHONPATH=src /work/ref/venv/bin/python bench/vs_reference.py --ref-src /work/ref-src \
        [--model /work/benchm/full-model] [--threads 2] [--runs 5] [--only hift|flow]
    # ours only (any venv with torch; also what happens when the reference does not import):
    PYTHONPATH=src python bench/vs_reference.py

The reference runtime is built by /work/shared/reference/setup.sh (FunAudioLLM/CosyVoice at ace7c47); it is
never a dependency of cosyserve. ``--ref-src`` defaults to $COSYSERVE_REF_SRC.

Both implementations load the official-layout ``flow.pt`` / ``hift.pt`` of ``--model`` as they do when serving
(ours: :func:`cosyserve.bundle.official.load_component`, weight norm folded at load; the reference: its yaml
classes and ``load_state_dict`` as ``CosyVoiceModel.load`` does, weight norm left parametrized). Inputs: one
utterance of ``--tokens`` random speech tokens (160 -> 275 mel frames = 3.19 s) and a random x-vector for the
flow, a random log-mel of the same length for the vocoder. Both run under ``torch.inference_mode`` with the same
intra-op threads, timed interleaved (ours, reference, ours, ...); the minimum of ``--runs`` is reported, the
median beside it (on a shared machine the median mostly measures the neighbours). The outputs are compared on
the same random draws: the reference draws from torch's global generator, ours from an explicit generator
seeded alike, which yields the same numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cosyserve.bundle.official import load_component
from cosyserve.families.modelconfig import load_model_config
from cosyserve.models.flow import mel_length

SAMPLE_RATE, HOP = 22050, 256
# top-level yaml entries the flow and vocoder do not need (the LLM alone costs seconds and 1.2 GB to build)
_SKIP_YAML = ("llm:", "get_tokenizer:", "feat_extractor:", "allowed_special:")


def load_reference(ref_src: str, model_dir: Path) -> tuple[Any, Any] | str:
    """The reference's (flow, hift) with the weights of ``model_dir``, or why they cannot be built."""
    sys.path.insert(0, ref_src)
    try:
        from hyperpyyaml import load_hyperpyyaml
    except ImportError as e:
        return f"the reference's dependencies do not import ({e}): run with the reference venv's python"
    text = (model_dir / "cosyvoice.yaml").read_text(encoding="utf-8")
    blocks, keep = [], True
    for line in text.splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            keep = not line.startswith(_SKIP_YAML)
        if keep:
            blocks.append(line)
    try:
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
            f.write("\n".join(blocks))
            f.flush()
            with open(f.name, encoding="utf-8") as g:
                configs = load_hyperpyyaml(g)
    except Exception as e:  # the reference's own import errors: report and go on with ours only
        return f"cannot build the reference's modules from {ref_src}: {type(e).__name__}: {e}"
    flow, hift = configs["flow"], configs["hift"]
    flow.load_state_dict(
        torch.load(model_dir / "flow.pt", map_location="cpu", weights_only=True), strict=True
    )
    sd = torch.load(model_dir / "hift.pt", map_location="cpu", weights_only=True)
    hift.load_state_dict({k.replace("generator.", ""): v for k, v in sd.items()}, strict=True)
    return flow.eval(), hift.eval()


def interleaved(fns: dict[str, Callable[[], Any]], runs: int) -> dict[str, list[float]]:
    """Seconds per call of each fn, ``runs`` rounds, one call of each per round (after one warm-up round)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(runs):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times


def report(name: str, times: dict[str, list[float]], audio_s: float, diff: float | None) -> None:
    for k, ts in times.items():
        best = min(ts)
        print(
            f"{name:5s} {k:9s} min {best * 1e3:8.1f} ms  median {statistics.median(ts) * 1e3:8.1f} ms  "
            f"RTF {best / audio_s:.3f}"
        )
    if "reference" in times:
        ratio = min(times["ours"]) / min(times["reference"])
        print(f"{name:5s} ours / reference = {ratio:.3f}  max |ours - reference| = {diff:.3e}")


def bench_hift(ours: Any, ref: Any | None, frames: int, runs: int, seed: int) -> None:
    mel = torch.randn(1, 80, frames, generator=torch.Generator().manual_seed(seed)) * 2 - 5
    audio_s = frames * HOP / SAMPLE_RATE

    def run_ours() -> torch.Tensor:
        return ours.inference(mel, generator=torch.Generator().manual_seed(seed))[0]

    def run_ref() -> torch.Tensor:
        torch.manual_seed(seed)  # SineGen draws its phase and noise from the global generator
        return ref.inference(speech_feat=mel)[0]

    fns = {"ours": run_ours} | ({"reference": run_ref} if ref is not None else {})
    diff = float((run_ours() - run_ref()).abs().max()) if ref is not None else None
    report("hift", interleaved(fns, runs), audio_s, diff)


def bench_flow(ours: Any, ref: Any | None, tokens: int, runs: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    token = torch.randint(0, ours.cfg.vocab_size, (1, tokens), generator=g, dtype=torch.int64)
    embedding = torch.randn(1, ours.cfg.spk_embed_dim, generator=g)
    frames = mel_length(tokens, ours.input_frame_rate)
    audio_s = frames * HOP / SAMPLE_RATE
    args = (
        token,
        torch.tensor([tokens]),
        torch.zeros(1, 0, dtype=torch.int64),
        torch.tensor([0]),
        torch.zeros(1, 0, 80),
        torch.tensor([0]),
        embedding,
        torch.zeros(1, 80, 0, 2),
    )

    def run_ours() -> torch.Tensor:
        noise = torch.randn(1, 80, frames, generator=torch.Generator().manual_seed(seed))
        return ours.inference(*args, noise=noise)[0]

    def run_ref() -> torch.Tensor:
        torch.manual_seed(seed)  # ConditionalCFM draws randn_like(mu) from the global generator
        return ref.inference(*args)[0]

    fns = {"ours": run_ours} | ({"reference": run_ref} if ref is not None else {})
    diff = float((run_ours() - run_ref()).abs().max()) if ref is not None else None
    report("flow", interleaved(fns, runs), audio_s, diff)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("/work/benchm/full-model"), help="official model dir")
    p.add_argument("--ref-src", default=os.environ.get("COSYSERVE_REF_SRC"), help="reference source checkout")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--runs", type=int, default=5, help="timed rounds after one warm-up round")
    p.add_argument("--tokens", type=int, default=160, help="speech tokens (160 -> 275 mel frames, 3.19 s)")
    p.add_argument("--only", choices=("hift", "flow"), help="time one component only")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.runs < 1:
        p.error(f"--runs must be >= 1, got {args.runs}")
    if not (args.model / "cosyvoice.yaml").is_file():
        p.error(f"--model {args.model}: no cosyvoice.yaml there (an official-layout model dir is needed)")
    torch.set_num_threads(args.threads)

    ref_flow = ref_hift = None
    if args.ref_src:
        built = load_reference(args.ref_src, args.model)
        if isinstance(built, str):
            print(f"reference: {built}; timing ours only")
        else:
            ref_flow, ref_hift = built
    else:
        print("reference: no --ref-src (or COSYSERVE_REF_SRC); timing ours only")
    cfg = load_model_config(args.model)
    print(
        f"torch {torch.__version__} threads={torch.get_num_threads()} runs={args.runs} tokens={args.tokens} "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    with torch.inference_mode():
        if args.only in (None, "hift"):
            ours = load_component(args.model, "hift", cfg.hift)
            bench_hift(
                ours, ref_hift, mel_length(args.tokens, cfg.flow.input_frame_rate), args.runs, args.seed
            )
        if args.only in (None, "flow"):
            ours = load_component(args.model, "flow", cfg.flow)
            bench_flow(ours, ref_flow, args.tokens, args.runs, args.seed)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
