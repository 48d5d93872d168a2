import argparse
import os
import subprocess
import sys
import wave
from pathlib import Path

import pytest

from cli_util import run_main

SRC = str(Path(__file__).resolve().parents[1] / "src")


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI subprocess, read when it starts: the session's private cache dir (set by conftest
    after this module is imported) is in it, so no test converts into the user's cache."""
    return {**os.environ, "PYTHONPATH": SRC, **extra}


def test_import_and_help_do_not_import_torch() -> None:
    # cold start: the package and the CLI's --help must stay light
    code = (
        "import sys, cosyserve, cosyserve.cli\n"
        "try:\n    cosyserve.cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'numpy', 'safetensors', 'tiktoken') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert "synth" in r.stdout and "make-test-model" in r.stdout


def test_synth_writes_wav(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "a.wav"
    r = run_main(
        capsys,
        "synth",
        "--model",
        str(tiny_model_dir),
        "--speaker",
        "英文女",
        "--text",
        "Hello there.",
        "--seed",
        "3",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    with wave.open(str(out)) as w:
        assert w.getframerate() == 22050 and w.getnchannels() == 1 and w.getsampwidth() == 2
        assert w.getnframes() > 0
    # the same seed gives the same file
    out2 = tmp_path / "b.wav"
    r = run_main(
        capsys,
        "synth",
        "--model",
        str(tiny_model_dir),
        "--speaker",
        "英文女",
        "--text",
        "Hello there.",
        "--seed",
        "3",
        "--out",
        str(out2),
    )
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == out2.read_bytes()


def test_speakers_lists_spk2info(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = run_main(capsys, "speakers", "--model", str(tiny_model_dir))
    assert r.returncode == 0, r.stderr
    assert "英文女" in r.stdout.split() and "中文男" in r.stdout.split()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--speaker", "nobody", "--text", "Hi."], "unknown speaker 'nobody'"),
        (["--speaker", "英文女", "--text", "   "], "text is empty"),
    ],
)
def test_synth_bad_request_is_one_line_error_without_output(
    tiny_model_dir: Path, tmp_path: Path, args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "x.wav"
    run_main(
        capsys, "speakers", "--model", str(tiny_model_dir)
    )  # its first conversion's line is not the error's
    r = run_main(capsys, "synth", "--model", str(tiny_model_dir), *args, "--out", str(out))
    assert r.returncode != 0
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists() and not list(tmp_path.iterdir()), "a partial WAV or temp file was left behind"


def test_synth_instruct_mode_on_a_model_that_is_not_instruct(
    plain_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--mode instruct`` on a model that is not an -Instruct model is refused (as the reference does) in one
    line naming the flag, and writes nothing."""
    out = tmp_path / "x.wav"
    args = ["--mode", "instruct", "--speaker", "英文女", "--text", "Hi.", "--instruct-text", "Speak calmly."]
    r = run_main(capsys, "synth", "--model", str(plain_model_dir), *args, "--out", str(out))
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]  # (before it: the conversion's log line)
    assert last.startswith("cosyserve synth: error: --mode instruct:") and "not an instruct model" in last, (
        r.stderr
    )
    assert "Traceback" not in r.stderr and not out.exists()


def test_synth_bad_model_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = run_main(
        capsys,
        "synth",
        "--model",
        str(tmp_path / "missing"),
        "--speaker",
        "a",
        "--text",
        "Hi.",
        "--out",
        str(tmp_path / "x.wav"),
    )
    assert r.returncode != 0
    assert "model directory not found" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "cosyvoice.yaml").write_text("llm: [unclosed\n")
    r = run_main(
        capsys,
        "synth",
        "--model",
        str(tmp_path / "m"),
        "--speaker",
        "a",
        "--text",
        "Hi.",
        "--out",
        str(tmp_path / "x.wav"),
    )
    assert r.returncode != 0 and "not valid YAML" in r.stderr
    assert not (tmp_path / "x.wav").exists()


def test_synth_corrupt_weights_named(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny_model_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "flow.pt").write_bytes(b"not a checkpoint")
    r = run_main(
        capsys,
        "synth",
        "--model",
        str(bad),
        "--speaker",
        "英文女",
        "--text",
        "Hi.",
        "--out",
        str(tmp_path / "x.wav"),
    )
    assert r.returncode != 0 and "flow.pt" in r.stderr, r.stderr


def test_synth_unwritable_output(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r = run_main(
        capsys,
        "synth",
        "--model",
        str(tiny_model_dir),
        "--speaker",
        "英文女",
        "--text",
        "Hi.",
        "--out",
        str(tmp_path / "no" / "x.wav"),
    )
    assert r.returncode != 0 and "does not exist" in r.stderr


def test_stream_with_speed_is_a_usage_error(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r = run_main(
        capsys,
        "synth",
        "--model",
        str(tiny_model_dir),
        "--speaker",
        "英文女",
        "--text",
        "Hi.",
        "--stream",
        "--speed",
        "1.5",
        "--out",
        str(tmp_path / "x.wav"),
    )
    assert r.returncode == 2 and "--speed" in r.stderr


def test_model_from_env(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COSYSERVE_MODEL", str(tiny_model_dir))
    r = run_main(capsys, "speakers")
    assert r.returncode == 0 and "英文男" in r.stdout


def test_make_test_model_refuses_existing_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = run_main(capsys, "make-test-model", str(tmp_path))
    assert r.returncode != 0 and "already exists" in r.stderr


def test_make_test_model_force_replaces_only_its_own_models(tmp_path: Path) -> None:
    """--force must never delete what make-test-model did not write: a real model dir or any other folder the user
    names survives untouched; a test model it wrote before (or an empty folder) is replaced."""
    from cosyserve.families.testmodel import make_test_model

    real = tmp_path / "CosyVoice-300M-SFT"
    real.mkdir()
    (real / "cosyvoice.yaml").write_text("# the official yaml\nsample_rate: 22050\n", encoding="utf-8")
    (real / "llm.pt").write_bytes(b"weights")
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me", encoding="utf-8")
    for path in (real, other):
        with pytest.raises(FileExistsError, match="not a model that make-test-model wrote"):
            make_test_model(path, force=True, onnx=False)
    assert (real / "llm.pt").read_bytes() == b"weights" and (other / "todo.txt").read_text() == "keep me"
    ours = tmp_path / "ours"
    make_test_model(ours, onnx=False)
    (ours / "extra").write_text("left by an older run", encoding="utf-8")
    make_test_model(ours, force=True, onnx=False)
    assert not (ours / "extra").exists() and (ours / "llm.pt").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    make_test_model(empty, force=True, onnx=False)
    assert (empty / "cosyvoice.yaml").is_file()


def test_make_test_model_and_demo_load_without_onnx_package(tmp_path: Path) -> None:
    """If this fails, a plain `pip install cosyserve` (no extras: the `onnx` package is a dev dependency) cannot
    run `make-test-model` or the demo model of `cosyserve serve` without --model, or the demo loses its zero-shot
    tier: the stand-in ONNX files must be written without `onnx` and load in onnxruntime."""
    import numpy as np
    import soundfile

    wav = tmp_path / "prompt.wav"
    t = np.arange(22050 * 2) / 22050
    soundfile.write(wav, (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), 22050, subtype="PCM_16")
    code = (
        "import sys\n"
        "sys.modules['onnx'] = None  # import onnx -> ImportError, as on a plain install\n"
        "import cosyserve\n"
        "from cosyserve.cli import main\n"
        "from cosyserve.bundle.sources import demo_model_dir\n"
        f"main(['make-test-model', {str(tmp_path / 'made')!r}])\n"
        "demo = demo_model_dir()\n"
        f"m = cosyserve.load(demo, warmup=False, registry_dir={str(tmp_path / 'registry')!r})\n"
        "assert 'zero_shot' in m.available_modes, m.unavailable_modes()\n"
        f"spk = m.add_speaker('me', {str(wav)!r}, 'Hello there.')\n"
        "assert 'onnx' not in [k for k, v in sys.modules.items() if v is not None]\n"
        "print('registered', spk.name)\n"
    )
    env = cli_env(COSYSERVE_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "registered me" in r.stdout
    for made in (tmp_path / "made", tmp_path / "cache" / "demo-model"):
        assert (made / "campplus.onnx").is_file() and (made / "speech_tokenizer_v1.onnx").is_file(), made


def _synth_main(model: Path, out: Path, *extra: str) -> None:
    from cosyserve.cli import main

    main(
        [
            "synth",
            "--model",
            str(model),
            "--speaker",
            "英文女",
            "--text",
            "Hi.",
            "--seed",
            "1",
            "--out",
            str(out),
            *extra,
        ]
    )


@pytest.mark.parametrize(("suffix", "container"), [(".mp3", "MP3"), (".flac", "FLAC"), (".opus", "OGG")])
def test_synth_out_extension_picks_the_encoding(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str, container: str
) -> None:
    """If this fails, `synth --out x.mp3` (or .flac, .opus) writes a file whose bytes are not in the format its
    name says (it used to be WAV whatever the extension)."""
    import soundfile

    monkeypatch.setenv("PREWARM_MODELS", "0")
    out = tmp_path / f"x{suffix}"
    _synth_main(tiny_model_dir, out)
    info = soundfile.info(out)
    assert info.format == container and info.frames > 0, info
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary file left behind"


def test_synth_out_unknown_extension_refused_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """If this fails, an --out extension no encoder handles (.aiff, none) is written as something else, or is
    noticed only after the model loaded and synthesized (the model path here does not even exist)."""
    for name in ("x.aiff", "x"):
        with pytest.raises(SystemExit) as exc:
            _synth_main(tmp_path / "no-such-model", tmp_path / name)
        err = capsys.readouterr().err
        assert exc.value.code == 1 and "unknown audio format" in err and ".mp3" in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert not list(tmp_path.iterdir())


def test_synth_unwritable_out_names_the_given_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """If this fails, a failure to write --out names the hidden temporary file (.x.wav.abc123.part) instead of the
    path the user gave."""
    import numpy as np

    from cosyserve.server.audiofile import write_wav_atomic

    target = tmp_path / "taken.wav"
    target.mkdir()  # a directory cannot be replaced by the finished file
    with pytest.raises(IsADirectoryError) as exc:
        write_wav_atomic(target, [np.zeros(100, np.float32)], 22050)
    assert str(target) in str(exc.value) and ".part" not in str(exc.value), exc.value
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.wav"], "temporary file left behind"
    with pytest.raises(SystemExit):
        _synth_main(tmp_path / "no-such-model", target)
    err = capsys.readouterr().err
    assert f"cannot write {target}" in err and ".part" not in err, err


def test_help_shows_real_defaults_only() -> None:
    """If this fails, --help prints "(default: None)" (also after a help text that states the default itself),
    or no longer shows a real default such as --speed 1.0 or --runs 5."""
    from cosyserve.cli.parser import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {name: p.format_help() for name, p in sub.choices.items()}
    for name, text in helps.items():
        assert "(default: None)" not in text and "(default: [])" not in text, name
    flat = {name: " ".join(text.split()) for name, text in helps.items()}
    assert "(default: 1.0)" in flat["synth"] and "(default: 5)" in flat["startup-report"]
    assert "(default: random)" in flat["synth"] and "(default: random) (default" not in flat["synth"]


def test_flamegraph_without_py_spy_fails_before_any_start(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """If this fails, `startup-report --flamegraph F` without py-spy runs every timed start first and then exits 0
    saying "skipped", instead of failing at once with a one-line error naming the `profile` extra."""
    import shutil

    from cosyserve.cli import main
    from cosyserve.tools import report

    def no_start(*args: object, **kwargs: object) -> None:
        raise AssertionError("a timed start ran although the flame graph cannot be made")

    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))  # no py-spy beside it
    monkeypatch.setattr(report, "spawn_timed", no_start)
    with pytest.raises(SystemExit) as exc:
        main(["startup-report", "--model", str(tiny_model_dir), "--flamegraph", str(tmp_path / "f.svg")])
    err = capsys.readouterr().err
    assert exc.value.code == 1 and "py-spy" in err and "cosyserve[profile]" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_model_takes_hub_ids_in_every_command(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """If this fails, `synth` / `speakers` / `startup-report` say "model directory not found" for a hub id that
    `serve` takes: every --model must go through the hub resolver (the download is stubbed: no network here)."""
    import cosyserve.bundle.hub
    from cosyserve.cli import main

    monkeypatch.chdir(tmp_path)  # no local folder named like the id
    monkeypatch.setenv("PREWARM_MODELS", "0")
    fetched: list[str] = []

    def download(model_id: str) -> Path:
        fetched.append(model_id)
        return tiny_model_dir

    monkeypatch.setattr(cosyserve.bundle.hub, "download", download)
    main(["speakers", "--model", "FunAudioLLM/CosyVoice-300M-SFT"])
    assert "英文女" in capsys.readouterr().out.split()
    main(
        [
            "synth",
            "--model",
            "iic/CosyVoice-300M-SFT",
            "--speaker",
            "英文女",
            "--text",
            "Hi.",
            "--out",
            "a.wav",
        ]
    )
    assert (tmp_path / "a.wav").stat().st_size > 44
    assert fetched == ["FunAudioLLM/CosyVoice-300M-SFT", "iic/CosyVoice-300M-SFT"]


def test_hub_id_without_hub_extra_is_one_line_naming_the_extra(tmp_path: Path) -> None:
    """If this fails, `synth --model iic/...` without the hub extra says "model directory not found" or prints a
    traceback, instead of one line naming `pip install 'cosyserve[hub]'`."""
    code = (
        "import sys\n"
        "sys.modules['modelscope'] = None\n"
        "from cosyserve.cli import main\n"
        "main(['synth', '--model', 'iic/CosyVoice-300M-SFT', '--speaker', 'a', '--text', 'Hi.', '--out', 'x.wav'])\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), cwd=tmp_path, timeout=120
    )
    assert r.returncode == 1 and "cosyserve[hub]" in r.stderr, r.stderr
    assert "not found" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_missing_dependency_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """If this fails, a command whose dependency cannot be imported prints a Python traceback instead of one line
    naming the package."""
    code = "import sys\nsys.modules['uvicorn'] = None\nfrom cosyserve.cli import main\nmain(['serve', '--port', '0'])\n"
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), cwd=tmp_path, timeout=120
    )
    assert r.returncode == 1 and "'uvicorn'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_first_conversion_is_one_progress_line_not_a_warning(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """If this fails, the expected first conversion of a model dir is logged as a WARNING (it is normal, not a
    problem), or the CLI user no longer sees one short line saying what the pause is."""
    monkeypatch.setenv("COSYSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PREWARM_MODELS", "0")
    args = ("synth", "--model", str(tiny_model_dir), "--speaker", "英文女", "--text", "Hi.", "--out")
    r = run_main(capsys, *args, str(tmp_path / "a.wav"))
    assert r.returncode == 0, r.stderr
    lines = r.stderr.strip().splitlines()
    assert "WARNING" not in r.stderr and len(lines) == 1, r.stderr
    assert lines[0].startswith("cosyserve: converting ") and "once" in lines[0], lines
    r = run_main(capsys, *args, str(tmp_path / "b.wav"))
    assert r.returncode == 0 and r.stderr == "", "a cached conversion must start silently: " + r.stderr


def test_pyproject_license_is_an_spdx_string() -> None:
    """If this fails, installing cosyserve prints setuptools' deprecation warning for `project.license` as a table:
    the license must be an SPDX string, with a build requirement on a setuptools that reads it (>= 77)."""
    import re
    import tomllib

    meta = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    assert meta["project"]["license"] == "Apache-2.0"
    (setuptools,) = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    m = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", setuptools)
    assert m and int(m.group(1)) >= 77, setuptools


def test_synth_damaged_onnx_is_one_line_error(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import numpy as np
    import soundfile as sf

    from cosyserve.bundle.convert import convert

    bundle = convert(tiny_model_dir, tmp_path / "b", progress=False)
    onnx = bundle / "campplus.onnx"
    onnx.write_bytes(onnx.read_bytes()[:1000])
    prompt = tmp_path / "p.wav"
    sf.write(prompt, (0.3 * np.sin(np.arange(32000) / 16000 * 2 * np.pi * 220)).astype(np.float32), 16000)
    out = tmp_path / "x.wav"
    r = run_main(
        capsys,
        "synth",
        "--model",
        str(bundle),
        "--mode",
        "zero_shot",
        "--prompt-wav",
        str(prompt),
        "--prompt-text",
        "A short prompt.",
        "--text",
        "Hi.",
        "--out",
        str(out),
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(onnx) in lines[0] and "convert" in lines[0], r.stderr
    assert not out.exists()


@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o077, 0o600)])
def test_synth_wav_follows_the_umask(tmp_path: Path, mask: int, mode: int) -> None:
    import numpy as np

    from cosyserve.server.audiofile import write_wav_atomic

    saved = os.umask(mask)
    try:
        write_wav_atomic(tmp_path / "a.wav", [np.zeros(100, dtype=np.float32)], 22050)
    finally:
        os.umask(saved)
    got = (tmp_path / "a.wav").stat().st_mode & 0o777
    assert got == mode, f"{oct(got)}: a WAV must get the umask's mode, as open() gives it"


def test_hub_downloads_skip_the_release_files_cosyserve_never_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CosyVoice2 release holds CosyVoice-BlankEN/model.safetensors (~1 GB, every LM weight is in llm.pt) and
    the reference's GPU exports (*.zip, *.plan, the estimator ONNX). If this fails, `--model FunAudioLLM/...`
    downloads gigabytes nothing reads. Both hubs are stubbed (no network here); the patterns must match the
    release's file names, each hub in its own syntax (globs for Hugging Face, regular expressions for
    ModelScope)."""
    import fnmatch
    import re
    import sys
    import types

    import cosyserve.bundle.hub

    seen: dict[str, list[str]] = {}
    hf = types.ModuleType("huggingface_hub")
    hf.snapshot_download = lambda model_id, ignore_patterns: seen.setdefault("hf", ignore_patterns) and "/x"  # type: ignore[attr-defined]
    ms = types.ModuleType("modelscope")
    ms.snapshot_download = lambda model_id, ignore_file_pattern: (
        seen.setdefault("ms", ignore_file_pattern) and "/y"
    )  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "huggingface_hub", hf)
    monkeypatch.setitem(sys.modules, "modelscope", ms)
    cosyserve.bundle.hub.download("FunAudioLLM/CosyVoice2-0.5B")
    cosyserve.bundle.hub.download("iic/CosyVoice2-0.5B")
    skipped = [
        "CosyVoice-BlankEN/model.safetensors",
        "flow.encoder.fp32.zip",
        "flow.decoder.estimator.fp32.onnx",
    ]
    kept = ["llm.pt", "flow.pt", "campplus.onnx", "speech_tokenizer_v2.onnx", "CosyVoice-BlankEN/vocab.json"]
    for name in skipped + kept:
        by_hf = any(fnmatch.fnmatch(name, p) for p in seen["hf"])
        by_ms = any(re.match(p, name) for p in seen["ms"])
        assert by_hf == by_ms == (name in skipped), name


def test_log_level_is_taken_after_the_command_too(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """If this fails, `--log-level` works only before the command (`cosyserve --log-level debug synth ...`), though
    every command takes it, or given after the command it undoes the one given before."""
    from cosyserve.cli.parser import build_parser, flags_of
    from cosyserve.core.settings import Settings

    parser = build_parser()
    for argv, level in (
        (["synth", "--out", "x.wav", "--log-level", "debug"], "debug"),
        (["--log-level", "info", "speakers"], "info"),  # not overwritten by the command's own (absent) flag
        (["--log-level", "info", "serve", "--log-level", "error"], "error"),
        (["convert", "a", "b"], "warning"),
    ):
        args = parser.parse_args(argv)
        assert Settings.load(flags=flags_of(args), env={}).log_level == level, argv
    r = run_main(capsys, "speakers", "--model", str(tiny_model_dir), "--log-level", "info")
    assert r.returncode == 0 and " INFO cosyserve." in r.stderr, r.stderr[-3000:]
    r = run_main(capsys, "synth", "--out", str(tmp_path / "x.wav"), "--log-level", "loud")
    assert r.returncode == 1 and "--log-level loud" in r.stderr, r.stderr[-3000:]


def test_speakers_import_of_a_pickle_with_code_is_one_line_without_unsafe_advice(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """If this fails, importing a spk2info.pt whose pickle names a function (os.system here) shows torch's
    several lines that advise loading it with weights_only=False (running it), or runs it."""
    marker = tmp_path / "ran"
    code = (
        "import os, sys, torch\n"
        "class Evil:\n"
        "    def __reduce__(self):\n"
        "        return (os.system, ('touch ' + sys.argv[2],))\n"
        "torch.save({'evil': {'embedding': Evil()}}, sys.argv[1])\n"
    )
    evil = tmp_path / "spk2info.pt"
    made = subprocess.run(
        [sys.executable, "-c", code, str(evil), str(marker)], capture_output=True, timeout=120
    )
    assert made.returncode == 0 and evil.is_file(), made.stderr
    monkeypatch.setenv("COSYSERVE_REGISTRY_DIR", str(tmp_path / "voices"))
    r = run_main(capsys, "speakers", "import", str(evil), "--model", str(tiny_model_dir))
    assert r.returncode == 1 and not marker.exists(), r.stderr[-3000:]
    # (a first conversion of the model adds its one progress line, "cosyserve: converting ...")
    lines = [line for line in r.stderr.strip().splitlines() if not line.startswith("cosyserve: ")]
    assert len(lines) == 1, r.stderr[-3000:]
    assert str(evil) in lines[0] and "other than tensors" in lines[0] and "system" in lines[0], lines[0]
    assert "weights_only" not in lines[0] and "trust" not in lines[0], lines[0]


def test_serve_help_lists_the_exit_codes_and_stays_light() -> None:
    """`serve --help` ends with every exit code of cosyserve.server.run.EXIT_CODES (one table for the help and
    docs/http-api.md), one per line; building it imports neither torch nor the server framework. If this fails, an operator
    cannot tell a port in use (3) from a bad flag (2) without the source, or `--help` got slow."""
    from cosyserve.server.run import EXIT_CODES

    code = (
        "import sys, cosyserve.cli\n"
        "try:\n    cosyserve.cli.main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'numpy', 'starlette', 'uvicorn') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(COLUMNS="100"), timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert "exit codes:\n" in r.stdout, r.stdout[-500:]
    table = r.stdout.split("exit codes:\n", 1)[1]
    starts = [line.split()[0] for line in table.splitlines() if line.startswith("  ") and line[2] != " "]
    assert starts == [str(c) for c, _ in EXIT_CODES], table
    flat = " ".join(table.split())
    for c, meaning in EXIT_CODES:
        assert f"{c} {' '.join(meaning.split())}" in flat, f"exit code {c} is not explained: {table}"


def test_stdin_text_is_read_as_it_arrives(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--text -` hands the runtime each piece of standard input as it is written (the runtime speaks text given
    as pieces as it arrives: tests/test_text_stream.py): if it read to the end first, an LLM's output piped in
    would be spoken only once the LLM finished. A multi-byte character split across writes comes out whole, and
    no piece passes the limit of a streamed piece (max_text_chars: the synth would refuse it)."""
    from cosyserve.cli.commands import _stdin_pieces

    r, w = os.pipe()
    stdin = os.fdopen(r, "rb", buffering=0)
    monkeypatch.setattr(sys, "stdin", stdin)
    pieces = _stdin_pieces(4096)
    os.write(w, b"Hello there. ")
    assert next(pieces) == "Hello there. "  # while the writer is still open: read as it came
    data = "你好".encode()
    os.write(w, data[:2])
    os.write(w, data[2:])
    os.close(w)
    assert "".join(pieces) == "你好"
    stdin.close()
    r, w = os.pipe()
    stdin = os.fdopen(r, "rb", buffering=0)
    monkeypatch.setattr(sys, "stdin", stdin)
    os.write(w, "ab你好cd".encode() * 8)
    os.close(w)
    got = list(_stdin_pieces(8))
    assert "".join(got) == "ab你好cd" * 8 and max(map(len, got)) <= 8, got
    stdin.close()


def test_synth_speaks_text_piped_in(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "piped.wav"
    r = subprocess.run(
        [sys.executable, "-m", "cosyserve", "synth", "--model", str(tiny_model_dir), "--text", "-",
         "--out", str(out), "--seed", "1", "--flow-steps", "1"],
        input="Hello there, this is piped in. And a second sentence.", capture_output=True, text=True,
        env=cli_env(), timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    with wave.open(str(out)) as f:
        assert f.getnframes() > 0


OMP_PROBE = (
    "import os, sys\n"
    "import cosyserve.api as api\n"
    "real = api.apply_omp_wait_policy\n"
    "def spy(policy):\n"
    "    real(policy)\n"
    "    print('torch-before', 'torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY'), flush=True)\n"
    "    os._exit(0)  # what is checked is known now: the command's synthesis would add nothing\n"
    "api.apply_omp_wait_policy = spy\n"
    "from cosyserve.cli import main\n"
    "main(sys.argv[1:])\n"
)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "PASSIVE"),
        ({"COSYSERVE_OMP_WAIT_POLICY": "active"}, "ACTIVE"),
        ({"COSYSERVE_OMP_WAIT_POLICY": "unset"}, None),
        ({"OMP_WAIT_POLICY": "active"}, "active"),
        ({"OMP_WAIT_POLICY": " "}, "PASSIVE"),  # blank is unset to libgomp: ours applies
    ],
)
def test_omp_wait_policy_is_set_before_torch_loads(
    tiny_model_dir: Path, tmp_path: Path, env: dict[str, str], expected: str | None
) -> None:
    """libgomp reads OMP_WAIT_POLICY once, when torch loads: set after it, the default would do nothing (the CLI
    spinning beside a busy neighbour, bench/omp_wait.py); and a policy the user set must win."""
    base = {k: v for k, v in cli_env().items() if k not in ("OMP_WAIT_POLICY", "COSYSERVE_OMP_WAIT_POLICY")}
    r = subprocess.run(
        [sys.executable, "-c", OMP_PROBE, "synth", "--model", str(tiny_model_dir), "--text", "Hi.",
         "--out", str(tmp_path / "o.wav")],
        capture_output=True, text=True, env={**base, **env}, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"torch-before False {expected}" in r.stdout.splitlines(), r.stdout


def test_a_bad_omp_wait_policy_stops_the_command_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COSYSERVE_OMP_WAIT_POLICY", "lazy")
    r = run_main(capsys, "speakers", "--model", "x")
    assert r.returncode == 1 and "COSYSERVE_OMP_WAIT_POLICY" in r.stderr and "passive" in r.stderr, r.stderr
