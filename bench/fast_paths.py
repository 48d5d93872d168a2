"""Fast paths side by side, per component, on a full-size bundle: time and drift against fp32.

- ``llm``: ms per decoded token for fp32, bf16 and int8 (weight-only linears, :mod:`cosyserve.models.precision`),
  interleaved, min over ``--runs``; then, teacher-forced on the fp32 run's tokens, the top-1 agreement and mean
  |d log p| of each against fp32.
- ``flow``: one-shot flow time for fp32 and bf16 at ``--steps`` Euler steps (default 10 and 5), same tokens and
  noise; max / mean |d mel| against fp32 at the model's step count.
- ``hift``: vocoder time fp32 vs bf16 on the fp32 flow's mel, same draws; max / mean |d audio|.
- ``kernels``: one linear layer's time, decode-shaped (1 row) and prefill-shaped, cycling through 24 distinct
  weights so they come from memory as in a real decode (one weight would sit in cache): fp32, bf16, int8pack
  (bf16 activations), dequantize-then-linear, our :class:`Int8Linear`, and torch.ao dynamic int8 when present.

Run each part on its own under the exclusive lock (each stays under ~3 minutes at the defaults):

    flock -x /tmp/cs-cpu.lock python bench/fast_paths.py llm --bundle /work/benchm/full-bundle
"""

from __future__ import annotations

import argparse
import copy
import os
import time
import warnings
from collections.abc import Callable

import torch

from cosyserve.bundle.loader import LoadOptions, open_bundle
from cosyserve.models.precision import Int8Linear, cast_floating, quantize_llm, quantize_per_channel

MEL_FRAMES_PER_S = 22050 / 256


def _min_of(fn: Callable[[], object], runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _interleaved(fns: dict[str, Callable[[], object]], runs: int) -> dict[str, float]:
    # one run of each variant per round, so a busy moment hits them alike; min over rounds
    for fn in fns.values():
        fn()  # warm-up
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(runs):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def _variants(module: torch.nn.Module, names: list[str]) -> dict[str, torch.nn.Module]:
    out: dict[str, torch.nn.Module] = {}
    for name in names:
        if name == "fp32":
            out[name] = module
        elif name == "bf16":
            out[name] = cast_floating(copy.deepcopy(module), torch.bfloat16)
        elif name == "int8":
            out[name] = quantize_llm(copy.deepcopy(module))
        elif name == "int8+bf16":
            out[name] = quantize_llm(cast_floating(copy.deepcopy(module), torch.bfloat16))
    return out


# -- LLM ----------------------------------------------------------------------------------------------------------


def bench_llm(modules: dict[str, torch.nn.Module], opts: argparse.Namespace) -> None:
    g = torch.Generator().manual_seed(0)
    text_len = 8
    text = torch.randint(0, 51866, (1, text_len), generator=g, dtype=torch.int32)
    model_input = {"text": text, "llm_embedding": torch.randn(1, 192)}
    models = _variants(modules["llm"], opts.llm_variants.split(","))

    def generate(model: torch.nn.Module, n: int) -> tuple[list[int], float]:
        from cosyserve.runtime.lm import one_shot
        from cosyserve.runtime.oneoff import generate

        ratio = n / text_len  # min == max: exactly n tokens
        with torch.inference_mode():
            row = one_shot(model, model_input, min_ratio=ratio, max_ratio=ratio)
        gen = generate(model, row, 1)
        stamps, tokens = [], []
        for tok in gen:
            stamps.append(time.perf_counter())
            tokens.append(tok)
        return tokens, (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)

    for model in models.values():
        generate(model, 4)  # warm-up: allocator, caches, position table
    best = dict.fromkeys(models, float("inf"))
    tokens: list[int] = []
    for _ in range(opts.runs):
        for name, model in models.items():
            toks, per_token = generate(model, opts.tokens)
            best[name] = min(best[name], per_token)
            if name == "fp32":
                tokens = toks
    base = best.get("fp32")
    print(f"LLM decode, {opts.tokens} tokens, min of {opts.runs} (interleaved):")
    for name, t in best.items():
        ratio = f"  x{base / t:.2f} vs fp32" if base else ""
        print(f"  {name:10s} {t * 1e3:7.1f} ms/token{ratio}")
    if "fp32" not in models or not tokens:
        return
    if opts.drift_tokens > len(tokens):  # more positions than the timed runs made (untimed)
        tokens, _ = generate(models["fp32"], opts.drift_tokens)
    from cosyserve.runtime.lm import one_shot
    from cosyserve.runtime.oneoff import teacher_forced

    def forced(model: torch.nn.Module) -> torch.Tensor:
        return teacher_forced(model, one_shot(model, model_input), tokens).logprobs

    teacher = torch.tensor(tokens)
    with torch.inference_mode():
        ref = forced(models["fp32"])
        print(f"  drift vs fp32, teacher-forced on {teacher.numel()} positions:")
        for name, model in models.items():
            if name == "fp32":
                continue
            got = forced(model)
            agree = (got.argmax(-1) == ref.argmax(-1)).float().mean()
            top = ref.topk(25, dim=-1).indices
            d = (got - ref).abs()
            print(
                f"  {name:10s} top-1 agreement {agree:.1%}, mean |d log p| {d.mean():.4f}, "
                f"mean |d log p| over fp32 top-25 {d.gather(-1, top).mean():.4f}"
            )


# -- flow and vocoder ---------------------------------------------------------------------------------------------


def _flow_inputs(flow: torch.nn.Module, n_tokens: int) -> tuple[tuple, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    token = torch.randint(0, 4096, (1, n_tokens), generator=g, dtype=torch.int32)
    empty = torch.zeros(1, 0, dtype=torch.int32)
    zero = torch.tensor([0], dtype=torch.int32)
    args = (
        token,
        torch.tensor([n_tokens], dtype=torch.int32),
        empty,
        zero,
        torch.zeros(1, 0, 80),
        zero,
        torch.randn(1, 192, generator=g),
        torch.zeros(1, 80, 0, 2),
    )
    noise = flow.draw_noise(n_tokens, 0, torch.Generator().manual_seed(2))
    return args, noise.float()


def _flow_mel(flow: torch.nn.Module, args: tuple, noise: torch.Tensor, steps: int) -> torch.Tensor:
    with torch.inference_mode():
        mel, _ = flow.inference(*args, noise=noise, n_timesteps=steps)
    return mel


def bench_flow(modules: dict[str, torch.nn.Module], opts: argparse.Namespace) -> None:
    flows = _variants(modules["flow"], ["fp32", "bf16"])
    args, noise = _flow_inputs(modules["flow"], opts.flow_tokens)
    steps = [int(s) for s in opts.steps.split(",")]
    fns = {
        f"{name} {n} steps": (lambda f=f, n=n: _flow_mel(f, args, noise, n))
        for n in steps
        for name, f in flows.items()
    }
    times = _interleaved(fns, opts.runs)
    frames = _flow_mel(flows["fp32"], args, noise, 1).shape[2]
    audio_s = frames / MEL_FRAMES_PER_S
    print(f"flow, {opts.flow_tokens} tokens = {audio_s:.2f} s of audio, min of {opts.runs} (interleaved):")
    base = times[f"fp32 {steps[0]} steps"]
    for name, t in times.items():
        print(f"  {name:16s} {t:6.2f} s  RTF {t / audio_s:.2f}  x{base / t:.2f} vs fp32 {steps[0]} steps")
    ref = _flow_mel(flows["fp32"], args, noise, steps[0])
    print(f"  drift vs fp32 {steps[0]} steps (same tokens and noise):")
    for name, f in flows.items():
        for n in steps:
            if name == "fp32" and n == steps[0]:
                continue
            d = (_flow_mel(f, args, noise, n) - ref).abs()
            print(f"  {name} {n} steps: mel max |d| {d.max():.4f}, mean |d| {d.mean():.5f}")


def bench_hift(modules: dict[str, torch.nn.Module], opts: argparse.Namespace) -> None:
    args, noise = _flow_inputs(modules["flow"], opts.flow_tokens)
    mel = _flow_mel(
        modules["flow"], args, noise, 2
    )  # a mel of the right shape and scale; its steps do not matter
    hifts = _variants(modules["hift"], ["fp32", "bf16"])

    def vocode(h: torch.nn.Module) -> torch.Tensor:
        with torch.inference_mode():
            speech, _ = h.inference(mel, generator=torch.Generator().manual_seed(3))
        return speech

    times = _interleaved({name: (lambda h=h: vocode(h)) for name, h in hifts.items()}, opts.runs)
    audio_s = mel.shape[2] / MEL_FRAMES_PER_S
    print(f"vocoder, {mel.shape[2]} frames = {audio_s:.2f} s of audio, min of {opts.runs} (interleaved):")
    for name, t in times.items():
        print(f"  {name:6s} {t:6.3f} s  RTF {t / audio_s:.3f}  x{times['fp32'] / t:.2f} vs fp32")
    d = (vocode(hifts["bf16"]) - vocode(hifts["fp32"])).abs()
    print(f"  bf16 drift vs fp32 (same mel and draws): audio max |d| {d.max():.4f}, mean |d| {d.mean():.5f}")


# -- kernels -------------------------------------------------------------------------------------------------------


def _kernel_times(m: int, k: int, n: int, layers: int, runs: int) -> dict[str, float]:
    ws = [torch.randn(n, k) / k**0.5 for _ in range(layers)]
    x = torch.randn(m, k)
    xb = x.bfloat16()
    qs = [quantize_per_channel(w) for w in ws]
    qsb = [(q, s.bfloat16()) for q, s in qs]
    wbs = [w.bfloat16() for w in ws]
    ours = []
    for w in ws:
        lin = torch.nn.Linear(k, n, bias=False)
        lin.weight.data = w
        ours.append(Int8Linear.from_linear(lin))
    fns: dict[str, Callable[[], object]] = {
        "fp32": lambda: [torch.nn.functional.linear(x, w) for w in ws],
        "bf16": lambda: [torch.nn.functional.linear(xb, w) for w in wbs],
        "int8pack": lambda: [torch.ops.aten._weight_int8pack_mm(x.bfloat16(), q, s).float() for q, s in qsb],
        "dequant": lambda: [torch.nn.functional.linear(x, q.float()) * s for q, s in qs],
        "Int8Linear": lambda: [lin(x) for lin in ours],
    }
    if getattr(getattr(torch, "ao", None), "quantization", None) is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated in recent torch: measured, not recommended
            dyn = []
            for w in ws:
                lin = torch.nn.Linear(k, n, bias=False)
                lin.weight.data = w
                seq = torch.nn.Sequential(lin)
                dyn.append(torch.ao.quantization.quantize_dynamic(seq, {torch.nn.Linear}, torch.qint8))
        fns["ao dynamic"] = lambda: [d(x) for d in dyn]
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _interleaved(fns, runs)


def bench_kernels(opts: argparse.Namespace) -> None:
    layers = 24  # 24 x 16 MB of fp32 weights: more than the last-level cache, as a decode's 0.7 GB is
    shapes = [(1, 1024, 4096), (1, 4096, 1024), (1, 1024, 1024), (64, 1024, 4096), (200, 1024, 4096)]
    print(f"one linear layer (ms, min of {opts.runs}, cycling through {layers} distinct weights):")
    for m, k, n in shapes:
        times = _kernel_times(m, k, n, layers, opts.runs)
        cells = "  ".join(f"{name} {t * 1e3 / layers:6.3f}" for name, t in times.items())
        print(f"  {m:4d} x {k} @ {k} x {n}: {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("parts", nargs="*", default=["kernels"], help="llm, flow, hift, kernels")
    parser.add_argument("--bundle", default="/work/benchm/full-bundle", help="a float32 full-size bundle")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--runs", type=int, default=3, help="rounds; each variant's minimum is reported")
    parser.add_argument("--tokens", type=int, default=60, help="LLM tokens per timed generation")
    parser.add_argument(
        "--drift-tokens", type=int, default=300, help="teacher-forced positions for the drift"
    )
    parser.add_argument("--llm-variants", default="fp32,bf16,int8", help="of fp32, bf16, int8, int8+bf16")
    parser.add_argument(
        "--flow-tokens", type=int, default=160, help="speech tokens of the flow/vocoder input"
    )
    parser.add_argument("--steps", default="10,5", help="flow Euler step counts; the first is the reference")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    load = os.getloadavg()
    isa = torch.backends.cpu.get_cpu_capability()
    print(
        f"threads {torch.get_num_threads()}, CPU capability {isa}, load average {load[0]:.2f} {load[1]:.2f}"
    )
    modules: dict[str, torch.nn.Module] = {}
    if set(opts.parts) - {"kernels"}:
        bundle = open_bundle(opts.bundle)
        if bundle.dtype != "float32":
            parser.error(
                f"--bundle {opts.bundle}: a float32 bundle is the reference, this one is {bundle.dtype}"
            )
        modules = bundle.load(LoadOptions(verify="none")).modules
    for part in opts.parts:
        {"llm": bench_llm, "flow": bench_flow, "hift": bench_hift}.get(part, lambda m, o: bench_kernels(o))(
            modules, opts
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
