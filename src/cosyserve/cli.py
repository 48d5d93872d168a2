"""The ``cosyserve`` command line. Parsing only: each command calls a typed function of the Python API.

Heavy modules (torch and everything under it) are imported inside the commands, so ``cosyserve --help`` is fast.
Every flag can also come from the environment as ``COSYSERVE_<FLAG>`` (for example ``COSYSERVE_MODEL``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]

ENV_PREFIX = "COSYSERVE_"


class CLIError(Exception):
    """A user-facing failure: printed as one line, exit status 1."""


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(ENV_PREFIX + name.upper().replace("-", "_"), default)


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=_env("model"),
        required=_env("model") is None,
        help="official CosyVoice-300M model directory (env COSYSERVE_MODEL)",
    )


def _cmd_synth(args: argparse.Namespace) -> None:
    from cosyserve.wavfile import write_wav_atomic

    out = Path(args.out)
    if not out.parent.is_dir():
        raise CLIError(f"cannot write {out}: directory {out.parent} does not exist")
    if not os.access(out.parent, os.W_OK):
        raise CLIError(f"cannot write {out}: directory {out.parent} is not writable")
    model = _load(args.model, args.threads)
    chunks = model.synthesize(args.text, args.speaker, stream=args.stream, speed=args.speed, seed=args.seed)
    seconds = write_wav_atomic(out, chunks, model.sample_rate)
    print(f"wrote {out} ({seconds:.2f} s of audio at {model.sample_rate} Hz)")


def _cmd_speakers(args: argparse.Namespace) -> None:
    model = _load(args.model, args.threads)
    for spk in model.speakers:
        print(spk)


def _cmd_conformance(args: argparse.Namespace) -> None:
    from cosyserve.conformance import run_conformance

    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()] if args.kinds else None
    try:
        results = run_conformance(args.dir, kinds=kinds)
    except ValueError as e:
        raise CLIError(str(e)) from e
    if not results:
        raise CLIError(f"no cases ran from {args.dir}" + (f" for kinds {args.kinds}" if kinds else ""))
    if not all(r.passed for r in results):
        sys.exit(1)


def _cmd_make_test_model(args: argparse.Namespace) -> None:
    from cosyserve.testmodel import make_test_model

    out = Path(args.out)
    info = make_test_model(out, size=args.size, seed=args.seed, force=args.force)
    for name, (params, nbytes) in info.items():
        print(f"{name:<6} {params / 1e6:8.2f}M parameters  {nbytes / 1e9:6.3f} GB")
    print(f"wrote random-weight {args.size} model to {out} (it makes noise, not speech)")


def _load(model: str, threads: int | None) -> object:
    import cosyserve

    return cosyserve.load(model, threads=threads)


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="cosyserve", description="Serve CosyVoice text-to-speech models.", formatter_class=fmt)
    parser.add_argument("--log-level", default=_env("log_level", "warning"), help="logging level (env COSYSERVE_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("synth", help="synthesize text to a WAV file", formatter_class=fmt)
    _add_model(p)
    p.add_argument("--speaker", required=True, help="pre-defined speaker id (see `cosyserve speakers`)")
    p.add_argument("--text", required=True, help="text to speak")
    p.add_argument("--out", required=True, help="output WAV path (16-bit PCM)")
    p.add_argument("--stream", action="store_true", help="synthesize in streaming chunks (as a server would)")
    p.add_argument("--seed", type=int, default=None, help="random seed for reproducible audio (default: random)")
    p.add_argument("--speed", type=float, default=1.0, help="tempo factor in [0.5, 2.0]; not with --stream")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.set_defaults(func=_cmd_synth)

    p = sub.add_parser("speakers", help="list the model's pre-defined speakers", formatter_class=fmt)
    _add_model(p)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.set_defaults(func=_cmd_speakers)

    p = sub.add_parser("conformance", help="check outputs against reference fixtures", formatter_class=fmt)
    p.add_argument("dir", help="fixture set folder (cases.json, tensors.safetensors, model/)")
    p.add_argument("--kinds", default=None, help="comma-separated kinds to run (default: all)")
    p.set_defaults(func=_cmd_conformance)

    p = sub.add_parser("make-test-model", help="write a random-weight model dir in the official layout", formatter_class=fmt)
    p.add_argument("out", help="output directory (must not exist unless --force)")
    p.add_argument("--size", choices=["tiny", "full"], default="tiny", help="tiny for tests; full = CosyVoice-300M dimensions")
    p.add_argument("--seed", type=int, default=0, help="seed for the random weights")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.set_defaults(func=_cmd_make_test_model)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "synth" and args.stream and args.speed != 1.0:
        parser.error("--speed needs one-shot synthesis: drop --stream or --speed")
    level = getattr(logging, str(args.log_level).upper(), None)
    if not isinstance(level, int):
        parser.error(f"--log-level: unknown level {args.log_level!r}")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except CLIError as e:
        print(f"cosyserve {args.command}: error: {e}", file=sys.stderr)
        sys.exit(1)
    except (ValueError, OSError) as e:
        # ConfigError, ModelDirError, SynthesisError and I/O failures are ValueError/OSError subclasses
        print(f"cosyserve {args.command}: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
