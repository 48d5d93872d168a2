"""The ``cosyserve`` command line's parser: one small builder per command, the flags that are settings declared
once in :mod:`cosyserve.core.settings` (their help, environment variable and default from there).

Light on purpose: ``cosyserve --help`` imports this, the settings table and the families' registry, nothing heavy.
"""

from __future__ import annotations

import argparse
import re
import textwrap
from typing import Any

from cosyserve.core.modes import MODE_TABLE, MODES
from cosyserve.core.settings import declared
from cosyserve.families import DEFAULT_FAMILY, FAMILIES

__all__ = ["build_parser", "flags_of"]
_SETTINGS = {s.name: s for s in declared()}
# the compute and memory settings `synth` and `serve` take as flags
_PRECISION = (
    "device", "llm_dtype", "flow_dtype", "hift_dtype", "llm_quantize", "llm_gemm", "flow_steps", "flow_context_seconds",
    "voice_cache_mb", "stream_state_mb", "stream_state_budget_mb",
)  # fmt: skip


def _setting(p: argparse.ArgumentParser, name: str, **kwargs: Any) -> None:
    """The flag of setting ``name``; its value stays a string (or list) for :meth:`Settings.load` to check."""
    s = _SETTINGS[name]
    assert s.flag is not None, f"setting {name} has no flag"
    env = f"env {s.env}; " if s.env else ""
    kwargs.setdefault("help", f"{s.doc} ({env}default {s.shown_default()})".replace("%", "%%"))
    kwargs.setdefault("metavar", s.flag.lstrip("-").upper().replace("-", "_"))
    kwargs.setdefault("default", None)
    p.add_argument(s.flag, dest=name, **kwargs)


def _every_command_setting(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str) -> None:
    """Setting ``name`` on every command too (``cosyserve synth ... --log-level debug``), as before the command
    (``cosyserve --log-level debug synth ...``). Not given there, it leaves alone the value given before:
    argparse copies every attribute of the command's namespace over the top-level one's."""
    for p in sub.choices.values():
        _setting(p, name, default=argparse.SUPPRESS)


def flags_of(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags, by setting name (None where a flag was not given), for :meth:`Settings.load`."""
    return {name: getattr(args, name) for name, s in _SETTINGS.items() if s.flag and hasattr(args, name)}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless there is none (None, an empty list) or the help already says it; keeps the
    line breaks of a description or epilog (RawDescriptionHelpFormatter's behaviour, for the exit-code table of
    ``serve --help``), each line still wrapped to the terminal and a line that starts with blanks hanging under
    its text."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, []) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines = []
        for line in text.splitlines():
            hang = re.match(r"\s+\S+\s+", line)  # "  3  the start failed: ..." wraps under "the"
            more = indent + " " * (hang.end() if hang else 0)
            lines.append(textwrap.fill(line, width, initial_indent=indent, subsequent_indent=more))
        return "\n".join(lines)


def _exit_codes() -> str:
    from cosyserve.server.run import EXIT_CODES  # light: no server framework, no torch

    return "exit codes:\n" + "\n".join(f"  {code}  {meaning}" for code, meaning in EXIT_CODES)


def _synth_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("synth", help="synthesize text to an audio file", formatter_class=_HelpFormatter)
    _setting(p, "models")
    p.add_argument(
        "--mode",
        choices=MODES,
        default=None,
        help="synthesis mode (default: sft, or zero_shot when --speaker is a registered voice): "
        + "; ".join(f"{m}: {spec.summary}" for m, spec in MODE_TABLE.items()),
    )
    p.add_argument(
        "--speaker",
        default=None,
        help="speaker id (see `cosyserve speakers`): pre-defined (sft, instruct) or registered (zero_shot, "
        "cross_lingual)",
    )
    p.add_argument(
        "--text",
        default=None,
        help="text to speak (all modes but vc); `-` reads it from standard input as it arrives (an LLM's output "
        "piped in is spoken while it is still being written)",
    )
    p.add_argument(
        "--prompt-wav", default=None, help="voice to clone (zero_shot, cross_lingual, vc; at most 30 s)"
    )
    p.add_argument("--prompt-text", default=None, help="transcript of --prompt-wav (zero_shot)")
    p.add_argument(
        "--instruct-text", default=None, help="style instruction (instruct, with a -Instruct model)"
    )
    p.add_argument("--source-wav", default=None, help="recording to convert to the --prompt-wav voice (vc)")
    p.add_argument("--tenant", default="default", help="speaker registry namespace")
    _setting(p, "registry_dir")
    p.add_argument(
        "--out",
        required=True,
        help="output file; its extension picks the encoding: .wav (16-bit PCM), .flac, .mp3, .opus or .ogg "
        "(Ogg Opus, at the model's rate where Opus takes it, else the next it takes: 24 kHz for 22.05 kHz), "
        ".pcm (raw 16-bit mono at the model's rate)",
    )
    p.add_argument("--stream", action="store_true", help="synthesize in streaming chunks (as a server would)")
    p.add_argument(
        "--seed", type=int, default=None, help="random seed for reproducible audio (default: random)"
    )
    p.add_argument("--speed", type=float, default=1.0, help="tempo factor in [0.25, 4.0]; not with --stream")
    _setting(p, "threads")
    _setting(p, "runtime")
    for name in _PRECISION:
        _setting(p, name)


def _convert_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "convert", help="convert an official model dir into a fast bundle", formatter_class=_HelpFormatter
    )
    p.add_argument("model_dir", help="official CosyVoice-300M model directory")
    p.add_argument("out", help="bundle directory to write (atomically)")
    p.add_argument(
        "--dtype",
        default="float32",
        help="weight storage (and compute) dtype: float32, bfloat16 or float16 for every component, or per "
        "component: llm=float32,flow=bfloat16,hift=bfloat16 (unnamed ones: float32)",
    )
    p.add_argument(
        "--quantize",
        default="none",
        help="`llm=int8`: store the LLM's transformer and speech-head linears as int8 with per-channel scales "
        "(weight-only; a quarter of the bytes a decode step reads), or `none`",
    )
    p.add_argument("--force", action="store_true", help="replace an existing bundle")
    p.add_argument(
        "--runtime",
        choices=("torch", "lite"),
        default="torch",
        help="`lite`: also export and check the ONNX graphs the lite runtime serves (every family; ONNX Runtime "
        "and numpy, no torch where it serves); `torch`: the torch runtime's bundle only",
    )


def _startup_report_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "startup-report",
        help="start fresh processes and report where start-up time goes",
        formatter_class=_HelpFormatter,
    )
    _setting(p, "models")
    p.add_argument("--runs", type=int, default=5, help="fresh process starts to time")
    p.add_argument(
        "--cold", action="store_true", help="evict the bundle from the page cache before each start"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--svg", default=None, help="write a waterfall of the phases to this SVG file")
    p.add_argument(
        "--flamegraph", default=None, help="sample the starts with py-spy into this flame graph SVG"
    )
    _setting(
        p,
        "strategy",
        help="load strategy: preload, lazy or prefetch (env COSYSERVE_PRELOAD; default preload)",
    )
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up synthesis")
    _setting(p, "threads")
    _setting(p, "runtime")


def _speakers_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "speakers",
        help="list, register, remove, import or export speakers",
        formatter_class=_HelpFormatter,
        description="list: pre-defined speakers, then the tenant's registered ones; add NAME --prompt-wav F "
        "--prompt-text T: register a cloned voice; remove NAME; import FILE.pt / export FILE.pt: the reference's "
        "spk2info.pt format",
    )
    _setting(p, "models")
    p.add_argument(
        "action",
        nargs="?",
        default="list",
        choices=["list", "add", "remove", "import", "export"],
        help="what to do",
    )
    p.add_argument(
        "target", nargs="?", default=None, help="speaker NAME (add, remove) or FILE.pt (import, export)"
    )
    p.add_argument("--prompt-wav", default=None, help="the voice to register (add; at most 30 s)")
    p.add_argument("--prompt-text", default=None, help="transcript of --prompt-wav (add)")
    p.add_argument("--tenant", default="default", help="speaker registry namespace")
    p.add_argument("--overwrite", action="store_true", help="replace registered speakers of the same name")
    p.add_argument("--include-builtin", action="store_true", help="export the pre-defined speakers too")
    _setting(p, "registry_dir")
    _setting(p, "threads")
    _setting(p, "runtime")


def _conformance_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "conformance", help="check outputs against reference fixtures", formatter_class=_HelpFormatter
    )
    p.add_argument("dir", help="fixture set folder (cases.json, tensors.safetensors, model/)")
    p.add_argument("--kinds", default=None, help="comma-separated kinds to run (default: all)")
    p.add_argument(
        "--via-bundle",
        action="store_true",
        help="convert the set's model to a bundle and load the modules from it",
    )
    p.add_argument(
        "--runtime",
        choices=("torch", "lite"),
        default="torch",
        help="`lite`: convert the set's model with --runtime lite and run every model kind on its ONNX graphs and "
        "the lite runtime's numpy code (CosyVoice2/3 sets: the LM kinds so far, the others reported as not served)",
    )


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="HTTP server: OpenAI /v1/audio/speech, the reference's /inference_*, health, metrics; Wyoming "
        "(Home Assistant) beside it with --wyoming-uri",
        formatter_class=_HelpFormatter,
        epilog=_exit_codes(),
    )
    _setting(p, "models", action="append")
    for name in (
        "pool_config",
        "host",
        "port",
        "workers",
        "worker_ready_timeout_s",
        "api_keys_file",
        "cors_origins",
        "max_text_chars",
        "max_buffered_text_chars",
        "max_prompt_text_chars",
        "max_instructions_chars",
        "max_voice_name_chars",
        "max_upload_bytes",
        "max_prompt_seconds",
        "request_timeout_s",
        "drain_delay_s",
        "shutdown_grace_s",
        "default_voice",
        "wyoming_uri",
        "wyoming_tenant",
        "wyoming_zeroconf",
        "registry_dir",
        "serve_log_level",
        "runtime",
        *_PRECISION,
    ):
        _setting(p, name)


def _quality_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "quality",
        help="how far a fast path (a bundle, load options, the chunk policy) moves the output from fp32",
        formatter_class=_HelpFormatter,
        description="Compares a variant of a model with its fp32 reference path on fixed, seeded inputs: the "
        "LLM's top-1 agreement and mean |delta log p| under teacher forcing, the flow's mel and the audio's "
        "log-mel L1 and log-spectral distance, and streamed vs one-shot audio under both chunk policies. "
        "See cosyserve.tools.quality for the definitions and the bounds.",
    )
    _setting(p, "models")
    p.add_argument(
        "--against", default=None, help="another bundle of the same model as the variant (e.g. a bf16 bundle)"
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a load option of the variant (a RuntimeOptions field, e.g. first_hop=21); repeatable",
    )
    p.add_argument("--parts", default="llm,token2wav,chunks", help="which measurements to run")
    p.add_argument("--seed", type=int, default=0, help="seed of the fixed inputs and draws")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--check", action="store_true", help="exit with status 1 when a figure exceeds its bound")
    _setting(p, "threads")
    _setting(p, "runtime")


def _make_test_model_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "make-test-model",
        help="write a random-weight model dir in the official layout",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("out", help="output directory (must not exist unless --force)")
    p.add_argument(
        "--size",
        choices=["tiny", "full"],
        default="tiny",
        help="tiny for tests; full = the release's dimensions (CosyVoice-300M, CosyVoice2-0.5B, CosyVoice3-0.5B)",
    )
    p.add_argument(
        "--family",
        choices=list(FAMILIES),
        default=DEFAULT_FAMILY,
        help="the layout: cosyvoice (CosyVoice-300M), cosyvoice2 (CosyVoice2-0.5B), cosyvoice3 (Fun-CosyVoice3-0.5B)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for the random weights")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")


# the commands, in the order --help lists them
_BUILDERS = (
    _synth_parser,
    _convert_parser,
    _startup_report_parser,
    _speakers_parser,
    _conformance_parser,
    _serve_parser,
    _quality_parser,
    _make_test_model_parser,
)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; ``args.command`` names the one given (:data:`cosyserve.cli.commands.COMMANDS`
    runs it)."""
    parser = argparse.ArgumentParser(
        prog="cosyserve", description="Serve CosyVoice text-to-speech models.", formatter_class=_HelpFormatter
    )
    _setting(parser, "log_level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for build in _BUILDERS:
        build(sub)
    _every_command_setting(sub, "log_level")
    return parser
