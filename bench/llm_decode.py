"""Decode speed of the full-size CosyVoice-300M speech-token LM (random weights) on CPU.

Prints time to first token (text encoder + prefill + first sample), steady-state ms per generated token, and for
bf16 how far its log-probabilities drift from fp32 along the same token sequence.

    PYTHONPATH=src python bench/llm_decode.py --threads 2 --tokens 160 --text-len 8
"""

from __future__ import annotations

import argparse
import time

import torch

from cosyserve.families.cosyvoice.testmodel import model_config
from cosyserve.models.llm import LLMConfig, TransformerLM


def full_config() -> LLMConfig:
    # the CosyVoice-300M release dimensions, as make-test-model --size full writes them
    return model_config("full").llm


def _input(args: tuple) -> dict:
    text, _, prompt_text, _, speech, _, embedding = args
    return {
        "text": text,
        "prompt_text": prompt_text,
        "llm_prompt_speech_token": speech,
        "llm_embedding": embedding,
    }


def _teacher_forced(model: TransformerLM, args: tuple, teacher: list[int]) -> torch.Tensor:
    from cosyserve.runtime.lm import one_shot
    from cosyserve.runtime.oneoff import teacher_forced

    with torch.inference_mode():
        return teacher_forced(model, one_shot(model, _input(args)), teacher).logprobs


def timed_generation(model: TransformerLM, args: tuple, n_tokens: int, text_len: int, seed: int):
    from cosyserve.core.sampling import row_key
    from cosyserve.runtime.lm import one_shot
    from cosyserve.runtime.oneoff import generate

    ratio = n_tokens / text_len  # min == max: EOS is masked for every step, exactly n_tokens come out
    t0 = time.perf_counter()
    with torch.inference_mode():
        row = one_shot(model, _input(args), min_ratio=ratio, max_ratio=ratio)
    gen = generate(model, row, row_key(seed))
    stamps, tokens = [], []
    for tok in gen:
        stamps.append(time.perf_counter())
        tokens.append(tok)
    first = stamps[0] - t0
    steady = (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)
    return tokens, first, steady


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--tokens", type=int, default=160, help="speech tokens to generate")
    parser.add_argument("--text-len", type=int, default=8, help="text tokens (no prompt)")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 run")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)

    t = time.perf_counter()
    model = TransformerLM(full_config()).eval()
    print(f"construct (random init): {time.perf_counter() - t:.1f} s, threads {torch.get_num_threads()}")
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, 51866, (1, opts.text_len), generator=g, dtype=torch.int32)
    empty_text = torch.zeros(1, 0, dtype=torch.int32)
    empty_speech = torch.zeros(1, 0, dtype=torch.int32)
    length = torch.tensor([opts.text_len], dtype=torch.int32)
    zero = torch.tensor([0], dtype=torch.int32)
    args = (text, length, empty_text, zero, empty_speech, zero, torch.randn(1, 192, generator=g))

    timed_generation(model, args, 8, opts.text_len, seed=1)  # warmup: allocator, caches, position table
    tokens, first, steady = timed_generation(model, args, opts.tokens, opts.text_len, seed=1)
    print(f"fp32: first token {first * 1e3:.0f} ms, {steady * 1e3:.1f} ms/token over {len(tokens)} tokens")

    if opts.no_bf16:
        return
    ref = _teacher_forced(model, args, tokens)
    model = model.to(torch.bfloat16)
    timed_generation(model, args, 8, opts.text_len, seed=1)
    tokens_bf16, first, steady = timed_generation(model, args, opts.tokens, opts.text_len, seed=1)
    print(
        f"bf16: first token {first * 1e3:.0f} ms, {steady * 1e3:.1f} ms/token over {len(tokens_bf16)} tokens"
    )
    got = _teacher_forced(model, args, tokens)
    diff = (got - ref).abs()
    top = ref.topk(25, dim=-1).indices
    kl = (ref.exp() * (ref - got)).sum(-1)
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean()
    print(
        f"bf16 vs fp32 log-probs (teacher-forced on the fp32 tokens): max |d| {diff.max():.3f}, "
        f"mean |d| {diff.mean():.4f}, max |d| over fp32 top-25 {diff.gather(-1, top).max():.3f}, "
        f"mean KL {kl.mean():.2e}, argmax agreement {agree:.1%}"
    )


if __name__ == "__main__":
    main()
