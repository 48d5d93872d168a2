"""Real-time factor of the full-size CosyVoice-300M flow model (random weights) on this machine's CPU.

Dims from the reference's examples/libritts/cosyvoice/conf/cosyvoice.yaml. Generates 160 tokens -> 275 mel
frames (3.19 s of audio at 22.05 kHz), no prompt, 10 Euler steps with CFG. Prints fp32 timing and, with
--bf16, bf16-autocast timing plus the mel drift against fp32 from the same noise.

    PYTHONPATH=src python bench/flow_rtf.py --threads 2 --bf16
"""

from __future__ import annotations

import argparse
import time

import torch

from cosyserve.families.cosyvoice.testmodel import model_config
from cosyserve.models.flow import (
    FlowConfig,
    MaskedDiffWithXvec,
    mel_length,
)


def full_config() -> FlowConfig:
    # the CosyVoice-300M release dimensions, as make-test-model --size full writes them
    return model_config("full").flow


def randomize_(model: torch.nn.Module, seed: int) -> None:
    # Scaled so activations stay O(1) through 6 encoder and ~20 decoder levels; the speed does not depend on it.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name or name.endswith("block.1.weight"):
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)


def run(
    model: MaskedDiffWithXvec, token: torch.Tensor, embedding: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    empty_prompt = torch.zeros(1, 0, dtype=torch.long)
    mel, _ = model.inference(
        token,
        torch.tensor([token.shape[1]]),
        empty_prompt,
        torch.tensor([0]),
        torch.zeros(1, 0, 80),
        torch.tensor([0]),
        embedding,
        torch.zeros(1, 80, 0, 2),
        noise=noise,
    )
    return mel


def timed(fn, repeats: int) -> tuple[float, torch.Tensor]:
    out = fn()  # warmup
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--tokens", type=int, default=160, help="speech tokens to synthesise")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs after one warmup (best is reported)"
    )
    parser.add_argument(
        "--bf16", action="store_true", help="also time bf16 autocast and report the mel drift"
    )
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    cfg = full_config()
    t0 = time.perf_counter()
    model = MaskedDiffWithXvec(cfg).eval()
    randomize_(model, seed=0)
    print(
        f"construct+init: {time.perf_counter() - t0:.2f} s, params {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M"
    )

    g = torch.Generator().manual_seed(1)
    frames = mel_length(args.tokens, cfg.input_frame_rate)
    token = torch.randint(0, cfg.vocab_size, (1, args.tokens), generator=g)
    embedding = torch.randn(1, cfg.spk_embed_dim, generator=g)
    noise = torch.randn(1, 80, frames, generator=g)
    audio_s = frames * 256 / 22050

    secs, mel = timed(lambda: run(model, token, embedding, noise), args.repeats)
    print(
        f"fp32: {args.tokens} tokens -> {mel.shape[2]} frames ({audio_s:.2f} s audio), threads={args.threads}"
    )
    print(f"fp32: {secs:.3f} s  RTF {secs / audio_s:.3f}  (best of {args.repeats})")

    if args.bf16:

        def run_bf16() -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return run(model, token, embedding, noise)

        secs16, mel16 = timed(run_bf16, args.repeats)
        drift = (mel16.float() - mel).abs()
        print(f"bf16 autocast: {secs16:.3f} s  RTF {secs16 / audio_s:.3f}")
        print(
            f"bf16 drift vs fp32: max abs {float(drift.max()):.4f}, mean abs {float(drift.mean()):.4f}, "
            f"mel std {float(mel.std()):.3f}"
        )


if __name__ == "__main__":
    main()
