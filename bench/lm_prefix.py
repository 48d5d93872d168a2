"""What a voice's kept LM prompt prefix saves (issue 34, item 3): the LM's prefill of a one-shot prompt, whole and
from the voice's kept prefix (sos, [speaker,] prompt text: the positions before the new text), at the release's
dimensions with random weights built in this process (no files), for a short and a long voice.

    python bench/lm_prefix.py                     # CosyVoice2-0.5B's LM and CosyVoice-300M's, full size
    python bench/lm_prefix.py --dry-run           # tiny LMs, one round: the same code (CI)

A voice of S seconds has 25 speech tokens a second and a transcript of ``--text-rate`` text tokens a second (3.5:
about 2.5 English words or 4 Chinese characters a second, Qwen's or the 300M's BPE); the new text is
``--text-tokens`` tokens. Timed, interleaved round by round, each as a request runs it: the prompt's embedding (the
300M's text encoder over prompt text + text included) and its prefill, whole (1 + [1] + P + T + 1 + S positions)
or from the kept prefix (its 1 + [1] + P positions copied into the cache row, T + 1 + S run). Printed: medians,
the time saved and its share of the prefill, the prefix's bytes, and the machine's load (the figures are only as
quiet as the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any


def build(family: str, size: str) -> Any:
    """The LM of ``family`` at ``size`` with random weights (seeded)."""
    import torch

    torch.manual_seed(0)
    if family == "cosyvoice2":
        from cosyserve.families.cosyvoice2.testmodel import QWEN_VOCAB, SIZES
        from cosyserve.models.qwen2lm import Qwen2Config, Qwen2LM, Qwen2LMConfig

        s = SIZES[size]
        qwen = Qwen2Config(
            hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_attention_heads=s["heads"],
            num_hidden_layers=s["layers"], num_key_value_heads=s["kv_heads"],
            vocab_size=QWEN_VOCAB if size == "full" else 4096,
        )  # fmt: skip
        cfg = Qwen2LMConfig(
            llm_input_size=s["hidden"], llm_output_size=s["hidden"], speech_token_size=6561, qwen=qwen
        )
        return Qwen2LM(cfg).eval()
    from cosyserve.families.cosyvoice.testmodel import model_config
    from cosyserve.models.llm import TransformerLM

    return TransformerLM(model_config(size).llm).eval()


def voice_input(lm: Any, seconds: float, text_rate: float, text_tokens: int, seed: int) -> dict[str, Any]:
    """A model input: a voice of ``seconds`` (its transcript and speech tokens) and a new text, random ids."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n_text = (
        lm.stack.embed_tokens.num_embeddings if hasattr(lm.stack, "embed_tokens") else lm.cfg.text_token_size
    )
    ids = lambda n, high: torch.randint(0, high, (1, n), generator=g, dtype=torch.int32)  # noqa: E731
    out = {
        "text": ids(text_tokens, n_text),
        "prompt_text": ids(max(1, round(seconds * text_rate)), n_text),
        "llm_prompt_speech_token": ids(round(seconds * 25), int(lm.eos_token)),
    }
    if hasattr(lm, "spk_embed_affine_layer"):  # the 300M LM reads the speaker embedding
        out["llm_embedding"] = torch.randn(1, lm.cfg.spk_embed_dim, generator=g)
    return out


def timed(lm: Any, model_input: dict[str, Any], kept: Any) -> tuple[float, float]:
    """(wall, CPU) seconds of a request's prompt embedding and prefill into cache row 0, whole (``kept`` None) or
    from the kept prefix's arrays. The CPU seconds (every thread's) are the steadier figure on a busy machine."""
    t, c = time.perf_counter(), time.process_time()
    x, _ = lm.prompt(model_input)
    if kept is None:
        lm.extend(x, 0, 0)
    else:
        lm.load_prefix(kept.arrays, 0)
        lm.extend(x[:, kept.positions :], 0, kept.positions)
    return time.perf_counter() - t, time.process_time() - c


def measure(family: str, size: str, voices: list[float], rounds: int, args: argparse.Namespace) -> list[dict]:
    import torch

    from cosyserve.runtime.lm import PromptPrefix

    lm = build(family, size)
    rows = []
    with torch.inference_mode():
        for seconds in voices:
            mi = voice_input(lm, seconds, args.text_rate, args.text_tokens, seed=int(seconds * 10))
            n = lm.prefix_positions(mi)
            x, _ = lm.prompt(mi)
            lm.reserve(1, x.shape[1] + 1)
            lm.extend(x, 0, 0)  # warm: the first run pays one-time costs; it leaves the prefix in row 0
            kept = PromptPrefix(n, lm.save_prefix(0, n))
            times: dict[str, list[tuple[float, float]]] = {"whole": [], "kept": []}
            for r in range(rounds):
                order = ("whole", "kept") if r % 2 == 0 else ("kept", "whole")
                for k in order:
                    times[k].append(timed(lm, mi, None if k == "whole" else kept))
            whole, cached = (statistics.median(w for w, _ in times[k]) * 1e3 for k in ("whole", "kept"))
            cpu_whole, cpu_kept = (statistics.median(c for _, c in times[k]) * 1e3 for k in ("whole", "kept"))
            rows.append(
                {
                    "family": family, "size": size, "voice_s": seconds, "positions": int(x.shape[1]),
                    "prefix_positions": n, "whole_ms": whole, "kept_ms": cached, "saved_ms": whole - cached,
                    "saved_share": (whole - cached) / whole, "prefix_kib": kept.nbytes() / 1024,
                    "cpu_whole_ms": cpu_whole, "cpu_kept_ms": cpu_kept,
                    "cpu_saved_share": (cpu_whole - cpu_kept) / cpu_whole,
                    "samples_ms": {k: [(w * 1e3, c * 1e3) for w, c in times[k]] for k in times},
                }
            )  # fmt: skip
        lm.release()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny LMs, one round: the same code (CI)")
    ap.add_argument("--families", default="cosyvoice2,cosyvoice", help="comma-separated (default both)")
    ap.add_argument("--voices", default="2,12", help="voice lengths in seconds (default 2,12)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved pairs (default 5; dry run 1)")
    ap.add_argument("--text-rate", type=float, default=3.5, help="transcript tokens a second (default 3.5)")
    ap.add_argument("--text-tokens", type=int, default=20, help="the new text's tokens (default 20)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default torch's)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here as JSON")
    args = ap.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    size = "tiny" if args.dry_run else "full"
    rounds = args.rounds or (1 if args.dry_run else 5)
    voices = [float(v) for v in args.voices.split(",")]
    rows = []
    for family in [f.strip() for f in args.families.split(",") if f.strip()]:
        rows += measure(family, size, voices, rounds, args)
    print(
        f"{size} random-weight LMs, {torch.get_num_threads()} threads, {rounds} interleaved rounds (medians)"
    )
    print(f"{'family':<12}{'voice s':>8}{'positions':>10}{'prefix':>8}{'whole ms':>10}{'kept ms':>9}"
          f"{'saved ms':>10}{'saved':>7}{'CPU ms whole/kept':>19}{'CPU saved':>10}{'prefix KiB':>11}")  # fmt: skip
    for r in rows:
        print(
            f"{r['family']:<12}{r['voice_s']:>8g}{r['positions']:>10}{r['prefix_positions']:>8}{r['whole_ms']:>10.1f}"
            f"{r['kept_ms']:>9.1f}{r['saved_ms']:>10.1f}{r['saved_share']:>7.1%}"
            f"{r['cpu_whole_ms']:>10.0f}/{r['cpu_kept_ms']:<8.0f}{r['cpu_saved_share']:>10.1%}{r['prefix_kib']:>11.0f}"
        )
    print(
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} (the figures are only as quiet as this)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
