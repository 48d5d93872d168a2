"""The ``cosyserve`` command line: :func:`main` and the commands, each calling a typed function of the Python API
(the flags: :mod:`cosyserve.cli.parser`).

Heavy modules (torch and everything under it) are imported inside the commands, so ``cosyserve --help`` is fast.
The flags that are settings (``--model``, ``--port``, ``--threads``, ...) are declared in :mod:`cosyserve.core.settings`
with their environment variables; :func:`main` reads the :class:`~cosyserve.core.settings.Settings` once from the
parsed flags and the environment and passes it to the command.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cosyserve.cli.parser import build_parser, flags_of
from cosyserve.core.settings import Settings

__all__ = ["main"]


class CLIError(Exception):
    """A user-facing failure: printed as one line, exit status 1."""


# optional packages -> the extra that installs them (a missing one is a one-line error naming the extra)
_EXTRAS = {"huggingface_hub": "hub", "modelscope": "hub", "wyoming": "wyoming", "zeroconf": "wyoming"}

# synth --out: the extension picks the encoding (the server's encoders, cosyserve.server.audiofile)
OUT_FORMATS = {".wav": "wav", ".flac": "flac", ".mp3": "mp3", ".opus": "opus", ".ogg": "opus", ".pcm": "pcm"}


# commands that load a model: they need --model (or COSYSERVE_MODEL)
_NEEDS_MODEL = ("synth", "speakers", "startup-report", "quality")


def _cmd_synth(args: argparse.Namespace, settings: Settings) -> None:
    from cosyserve.server.audiofile import write_audio_atomic
    from cosyserve.system.gchold import release_gc

    out = Path(args.out)
    fmt = OUT_FORMATS.get(out.suffix.lower())
    if fmt is None:
        raise CLIError(
            f"--out {out}: unknown audio format {repr(out.suffix) if out.suffix else '(no extension)'}; the "
            f"extension picks the encoding: {', '.join(OUT_FORMATS)}"
        )
    if out.is_dir():
        raise CLIError(f"cannot write {out}: it is a directory")
    if not out.parent.is_dir():
        raise CLIError(f"cannot write {out}: directory {out.parent} does not exist")
    if not os.access(out.parent, os.W_OK):
        raise CLIError(f"cannot write {out}: directory {out.parent} is not writable")
    for flag, value in (("--prompt-wav", args.prompt_wav), ("--source-wav", args.source_wav)):
        if value is not None and not Path(value).is_file():
            raise CLIError(f"{flag} {value}: no such file")
    from cosyserve.core.errors import ClientError, ModeUnavailableError
    from cosyserve.core.limits import Limits

    limits = Limits.from_settings(settings)
    try:  # within the limits every request is (the one constructor), before the model loads
        request = limits.request(
            names=_SYNTH_FIELDS | {"speed": "--speed"},
            text=_stdin_pieces(limits.text_chars) if args.text == "-" else args.text or "",
            speaker=args.speaker,
            stream=args.stream,
            speed=args.speed,
            seed=args.seed,
            mode=args.mode,
            prompt_text=args.prompt_text or "",
            prompt_wav=args.prompt_wav,
            source_wav=args.source_wav,
            instruct_text=args.instruct_text or "",
            tenant=args.tenant,
        )
    except ClientError as e:
        raise CLIError(str(e)) from e  # naming the flag (names=_SYNTH_FIELDS)
    model = _load(settings)
    release_gc()
    try:
        chunks = model.synthesize_request(request)
    except ModeUnavailableError as e:  # the model cannot run the mode the flag asks for
        raise CLIError(f"--mode {args.mode}: {e}") from e
    seconds = write_audio_atomic(out, chunks, model.sample_rate, fmt)
    print(f"wrote {out} ({seconds:.2f} s of audio at {model.sample_rate} Hz)")


def _stdin_pieces(most: int) -> Any:
    # `--text -`: standard input as it arrives (an LLM's output piped in), synthesized while it is still written,
    # in pieces within `most` characters, the limit of a streamed piece (a read's characters are at most its bytes
    # and the 3 a cut character may have left undecoded)
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    fd = sys.stdin.fileno()
    while data := os.read(fd, max(1, min(4096, most - 3))):
        if text := decoder.decode(data):
            yield text
    if tail := decoder.decode(b"", final=True):
        yield tail


def _cmd_convert(args: argparse.Namespace, settings: Settings) -> None:
    import time

    from cosyserve.bundle.convert import convert, parse_component_dtypes, parse_quantize

    try:
        dtypes = parse_component_dtypes(args.dtype, "--dtype")
        quantize = parse_quantize(args.quantize, "--quantize")
    except ValueError as e:
        raise CLIError(str(e)) from None
    t0 = time.perf_counter()
    out = convert(
        args.model_dir, args.out, dtype=dtypes, quantize=quantize, force=args.force, runtime=args.runtime
    )
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    what = ",".join(f"{c}={d}" for c, d in dtypes.items()) if len(set(dtypes.values())) > 1 else dtypes["llm"]
    what += "".join(f", {c} {q}" for c, q in quantize.items())
    print(f"wrote bundle {out} ({size / 1e9:.3f} GB, {what}) in {time.perf_counter() - t0:.1f} s")


def _cmd_startup_report(args: argparse.Namespace, settings: Settings) -> None:
    from cosyserve.api import choose_runtime
    from cosyserve.tools.report import startup_report

    choose_runtime(settings.models[0], settings)  # the runtime its fresh processes will load on
    startup_report(
        settings.models[0],
        runs=args.runs,
        cold=args.cold,
        as_json=args.json,
        svg=args.svg,
        flamegraph=args.flamegraph,
        warmup=not args.no_warmup,
        settings=settings,
    )


def _cmd_speakers(args: argparse.Namespace, settings: Settings) -> None:
    if args.action == "add" and not Path(args.prompt_wav).is_file():
        raise CLIError(f"--prompt-wav {args.prompt_wav}: no such file")
    if args.action == "import" and not Path(args.target).is_file():
        raise CLIError(f"{args.target}: no such file")
    model = _load(settings, warmup=False)
    tenant = args.tenant
    if args.action == "list":
        for voice in model.runtime.voices(tenant):
            print(voice.name if voice.kind == "pre-defined" else f"{voice.name}  (registered)")
    elif args.action == "add":
        spk = model.add_speaker(
            args.target, args.prompt_wav, args.prompt_text, tenant=tenant, overwrite=args.overwrite
        )
        print(f"registered {spk.name!r} for tenant {tenant!r} ({spk.seconds:.2f} s prompt)")
    elif args.action == "remove":
        model.remove_speaker(args.target, tenant=tenant)
        print(f"removed {args.target!r} from tenant {tenant!r}")
    elif args.action == "import":
        result = model.import_speakers(args.target, tenant=tenant, overwrite=args.overwrite)
        print(
            f"imported {len(result.imported)} speaker(s) into tenant {tenant!r}: {', '.join(result.imported)}"
        )
        if result.skipped:
            print(f"skipped the model's pre-defined speaker(s): {', '.join(result.skipped)}")
    else:
        out = Path(args.target)
        names = model.export_speakers(out, tenant=tenant, include_builtin=args.include_builtin)
        print(f"wrote {len(names)} speaker(s) to {out}")


_SYNTH_FIELDS = {
    "text": "--text",
    "speaker": "--speaker",
    "prompt_wav": "--prompt-wav",
    "prompt_text": "--prompt-text",
    "instruct_text": "--instruct-text",
    "source_wav": "--source-wav",
}


def _check_synth_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from cosyserve.core.request import field_errors

    given = {f for f in _SYNTH_FIELDS if getattr(args, f) is not None}
    # without --mode: sft, or zero_shot for a registered voice (decided after loading); both take these flags
    errors = [msg for _, msg in field_errors(args.mode, given, _SYNTH_FIELDS)]
    if errors:
        hint = "" if args.mode else " (choose a mode with --mode)"
        parser.error("; ".join(errors) + hint)


def _check_speakers_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    needs_target = {"add": "NAME", "remove": "NAME", "import": "FILE.pt", "export": "FILE.pt"}
    if args.action in needs_target and not args.target:
        parser.error(f"speakers {args.action} needs {needs_target[args.action]}")
    if args.action == "list" and args.target:
        parser.error(f"unexpected argument {args.target!r}: did you mean `speakers add {args.target}`?")
    if args.action == "add":
        if not args.prompt_wav or not args.prompt_text:
            parser.error("speakers add needs --prompt-wav (the voice) and --prompt-text (its transcript)")
    elif args.prompt_wav or args.prompt_text:
        parser.error("--prompt-wav and --prompt-text are for `speakers add`")
    if args.overwrite and args.action not in ("add", "import"):
        parser.error("--overwrite is for `speakers add` and `speakers import`")
    if args.include_builtin and args.action != "export":
        parser.error("--include-builtin is for `speakers export`")


def _cmd_conformance(args: argparse.Namespace, settings: Settings) -> None:
    from cosyserve.tools.conformance import run_conformance

    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()] if args.kinds else None
    try:
        results = run_conformance(
            args.dir,
            kinds=kinds,
            via_bundle=args.via_bundle,
            runtime=args.runtime,
            llm_gemm=settings.llm_gemm,
        )
    except ValueError as e:
        raise CLIError(str(e)) from e
    if not results:
        raise CLIError(f"no cases ran from {args.dir}" + (f" for kinds {args.kinds}" if kinds else ""))
    if not all(r.passed or not r.served for r in results):
        sys.exit(1)


def _cmd_quality(args: argparse.Namespace, settings: Settings) -> None:
    from cosyserve.tools.quality import PARTS, parse_options, run_quality

    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise CLIError(f"--parts {args.parts}: expected a comma-separated subset of {', '.join(PARTS)}")
    try:
        options = parse_options(args.option)
    except ValueError as e:
        raise CLIError(str(e)) from e
    report = run_quality(
        settings.models[0],
        against=args.against,
        options=options,
        threads=settings.threads,
        seed=args.seed,
        parts=parts,
    )
    print(report.to_json() if args.json else report.table())
    failures = report.failures()
    if args.check and failures:
        for line in failures:
            print(f"cosyserve quality: bound exceeded: {line}", file=sys.stderr)
        sys.exit(1)


def _cmd_make_test_model(args: argparse.Namespace, settings: Settings) -> None:
    from cosyserve.families.testmodel import make_test_model

    out = Path(args.out)
    info = make_test_model(out, size=args.size, seed=args.seed, force=args.force, family=args.family)
    for name, (params, nbytes) in info.items():
        print(f"{name:<6} {params / 1e6:8.2f}M parameters  {nbytes / 1e9:6.3f} GB")
    print(f"wrote random-weight {args.size} model to {out} (it makes noise, not speech)")


def _cmd_serve(args: argparse.Namespace, settings: Settings) -> None:
    settings.model_args()  # checks the --model names before anything starts
    from cosyserve.server import serve
    from cosyserve.server.run import setup_logging

    setup_logging(settings)  # as serve() does: the runtime notes below are the server's first lines
    _preload_runtimes(settings)
    sys.exit(serve(settings))


def _preload_runtimes(settings: Settings) -> None:
    """Choose each preload model's runtime as its load will (``cosyserve.api.choose_runtime``): the lite runtime is
    said at INFO where torch is not installed, and a model that needs torch there stops the start in one line."""
    from cosyserve.api import choose_runtime
    from cosyserve.core.settings import DEMO_MODEL, ModelArg
    from cosyserve.engine.poolfile import load_pool_config

    args = (ModelArg(DEMO_MODEL, DEMO_MODEL),) if settings.demo else settings.model_args()
    defaulted = settings.origin("runtime") == "default"
    for spec in load_pool_config(settings, preload=args).models.values():
        if spec.policy == "preload":
            # a model without a runtime of its own in the pool config has the setting's
            own = None if defaulted and spec.runtime == settings.runtime else spec.runtime
            choose_runtime(spec.path, settings, own)


def _load(settings: Settings, **overrides: Any) -> Any:
    import cosyserve

    return cosyserve.load(settings.models[0], settings=settings, **overrides)


# each command's function, by the name build_parser gives it
COMMANDS = {
    "synth": _cmd_synth,
    "convert": _cmd_convert,
    "startup-report": _cmd_startup_report,
    "speakers": _cmd_speakers,
    "conformance": _cmd_conformance,
    "serve": _cmd_serve,
    "quality": _cmd_quality,
    "make-test-model": _cmd_make_test_model,
}


def main(argv: Sequence[str] | None = None) -> None:
    from cosyserve.api import quiet_onnxruntime

    quiet_onnxruntime()  # before any command imports onnxruntime; inherited by the server's workers and probes
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["serve"], ["synth"]):
        # no garbage collection from here to READY: `import torch` and the model build long-lived objects that
        # a collection would only scan (the server and _cmd_synth release the hold once their model is loaded)
        from cosyserve.system.gchold import hold_gc

        hold_gc()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = Settings.load(flags=flags_of(args))
    except ValueError as e:  # SettingsError: names the flag, variable or file and key
        print(f"cosyserve {args.command}: error: {e}", file=sys.stderr)
        sys.exit(1)
    from cosyserve.api import apply_omp_wait_policy

    apply_omp_wait_policy(settings.omp_wait_policy)  # before any command imports torch; inherited by workers
    if args.command in _NEEDS_MODEL and not settings.models:
        parser.error(f"{args.command} needs --model (or the COSYSERVE_MODEL variable)")
    if args.command in ("serve", "synth"):
        from cosyserve.system.pagecache import prefetch_bundles

        # a cold page cache is read while torch imports (the loader then finds the pages there)
        prefetch_bundles(
            (m.partition("=")[2] or m for m in settings.models), settings.strategy, settings.runtime
        )
    if args.command == "synth" and args.stream and args.speed != 1.0:
        parser.error("--speed needs one-shot synthesis: drop --stream or --speed")
    if args.command == "synth":
        _check_synth_flags(parser, args)
    if args.command == "speakers":
        _check_speakers_flags(parser, args)
    if args.command == "startup-report" and args.runs < 1:
        parser.error("--runs must be at least 1")
    level = logging.getLevelNamesMapping()[settings.log_level.upper()]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command != "serve" and level > logging.INFO:
        _show_progress()
    from cosyserve.core.errors import CosyserveError

    try:
        COMMANDS[args.command](args, settings)
    except CLIError as e:
        print(f"cosyserve {args.command}: error: {e}", file=sys.stderr)
        sys.exit(1)
    except (CosyserveError, ValueError, OSError) as e:
        # every error of cosyserve.core.errors (a bad request, model, setting or file) and I/O failures
        print(f"cosyserve {args.command}: error: {e}", file=sys.stderr)
        sys.exit(1)
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] in ("", "cosyserve"):
            raise  # our own code: a bug, not an install to fix
        print(f"cosyserve {args.command}: error: {_missing_package(e, args.command)}", file=sys.stderr)
        sys.exit(1)


class _ProgressHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        print(f"cosyserve: {record.getMessage()}", file=sys.stderr, flush=True)  # today's sys.stderr


def _show_progress() -> None:
    """Expected slow steps (a model dir's first conversion) are INFO records of ``cosyserve.progress``: below the
    default log level, so the CLI prints them itself, one short line each on stderr."""
    log = logging.getLogger("cosyserve.progress")
    if not any(isinstance(h, _ProgressHandler) for h in log.handlers):
        log.addHandler(_ProgressHandler())
    log.setLevel(logging.INFO)
    log.propagate = False


# why a command needs torch whatever its --runtime (the others need it for the torch runtime only)
_TORCH_FOR = {
    "convert": "convert reads the official checkpoints with torch, with --runtime lite too",
    "make-test-model": "make-test-model builds the model with torch",
    "conformance": "conformance reads the fixture tensors and converts the set's model with torch, with --runtime lite "
    "too",
    "quality": "quality measures the torch runtime",
}


def _missing_package(e: ModuleNotFoundError, command: str = "") -> str:
    top = (e.name or "").partition(".")[0]
    if top == "torch":
        from cosyserve.api import TORCH_INSTALL

        why = _TORCH_FOR.get(command, "the torch runtime needs it")
        return (
            f"this needs torch, which is not installed ({why}): {TORCH_INSTALL}; without torch, cosyserve serves "
            "bundles converted with --runtime lite (where torch is)"
        )
    extra = _EXTRAS.get(top)
    if extra:
        return f"this needs the {top!r} package: pip install 'cosyserve[{extra}]'"
    return f"the {top!r} package is missing (a dependency of cosyserve): reinstall cosyserve ({e})"
