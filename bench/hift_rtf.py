"""HiFT vocoder speed on CPU: full-size CosyVoice-300M HiFT, random weights, one utterance.

    PYTHONPATH=src python bench/hift_rtf.py [--frames 275] [--threads 2] [--runs 8] [--bf16]

Prints construct/fold times and the latency and RTF of the fp32 model with weight norm as loaded
(parametrized, recomputed every call, as the reference runs) and folded (``remove_weight_norm()``); with
--bf16 also bf16 convolutions (f0 predictor, source and (i)STFT stay float32) and their drift from fp32 on the
same draws. Variants are timed interleaved and the minimum is reported: on a shared machine the median mostly
measures the neighbours.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cosyserve.models.hift import HiFTConfig, HiFTGenerator


def main() -> None:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--frames", type=int, default=275, help="mel frames (275 = 3.19 s at 22.05 kHz)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--runs", type=int, default=8, help="timed runs per variant (after one warmup)")
    p.add_argument("--bf16", action="store_true", help="also time bf16 convolutions and report the drift")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)  # random weights only; inference draws come from explicit generators

    cfg = HiFTConfig()  # defaults = the release yaml: base_channels 512, f0 cond_channels 512
    t0 = time.perf_counter()
    param = HiFTGenerator(cfg).eval()
    t_construct = time.perf_counter() - t0
    with torch.no_grad():  # f0 of random weights is ~0 Hz; scale it into a speech-like 0-300 Hz range
        param.f0_predictor.classifier.weight.mul_(2000.0)
        param.f0_predictor.classifier.bias.fill_(150.0)
    folded = HiFTGenerator(cfg).eval()  # (copy.deepcopy breaks torch parametrizations)
    folded.load_state_dict(param.state_dict(), strict=True)
    t0 = time.perf_counter()
    folded.remove_weight_norm()
    t_fold = time.perf_counter() - t0
    variants = {"fp32 parametrized": param, "fp32 folded": folded}
    if args.bf16:
        bf16 = HiFTGenerator(cfg).eval()
        bf16.load_state_dict(param.state_dict(), strict=True)
        bf16.remove_weight_norm()
        # f0 feeds a phase cumsum over the whole utterance and the source merge is 9 weights: keep both float32
        for name, child in bf16.named_children():
            if name not in ("f0_predictor", "m_source"):
                child.to(torch.bfloat16)
        variants["bf16 convs"] = bf16

    mel = torch.randn(1, 80, args.frames, generator=torch.Generator().manual_seed(1)) * 2 - 5
    audio_s = args.frames * cfg.upsample_factor / cfg.sampling_rate
    outputs = {
        k: m.inference(mel, generator=torch.Generator().manual_seed(0))[0] for k, m in variants.items()
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.runs):
        for k, m in variants.items():
            t0 = time.perf_counter()
            m.inference(mel, generator=torch.Generator().manual_seed(0))
            times[k].append(time.perf_counter() - t0)

    print(
        f"threads={torch.get_num_threads()} frames={args.frames} audio={audio_s:.2f}s torch={torch.__version__}"
    )
    print(f"construct {t_construct:.2f}s  fold weight norm {t_fold * 1e3:.1f} ms")
    for k, ts in times.items():
        best = min(ts)
        print(f"{k:18s} min {best:.3f}s (median {statistics.median(ts):.3f}s)  RTF {best / audio_s:.3f}")
    if args.bf16:
        ref = outputs["fp32 folded"]
        err = outputs["bf16 convs"] - ref
        snr = 10 * torch.log10(ref.pow(2).sum() / err.pow(2).sum())
        print(
            f"bf16 drift vs fp32: max abs {err.abs().max():.2e}  rms {err.pow(2).mean().sqrt():.2e}  "
            f"(signal rms {ref.pow(2).mean().sqrt():.2e}, SNR {snr:.1f} dB)"
        )


if __name__ == "__main__":
    main()
