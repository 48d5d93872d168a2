import os
import subprocess
import sys
import wave
from pathlib import Path

import pytest

ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cosyserve", *args],
        capture_output=True,
        text=True,
        env=env or ENV,
        timeout=300,
    )


def test_import_and_help_do_not_import_torch() -> None:
    # cold start: the package and the CLI's --help must stay light
    code = (
        "import sys, cosyserve, cosyserve.cli\n"
        "try:\n    cosyserve.cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'numpy', 'safetensors', 'tiktoken') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "synth" in r.stdout and "make-test-model" in r.stdout


def test_synth_writes_wav(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "a.wav"
    r = cli(
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
    r = cli(
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


def test_speakers_lists_spk2info(tiny_model_dir: Path) -> None:
    r = cli("speakers", "--model", str(tiny_model_dir))
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
    tiny_model_dir: Path, tmp_path: Path, args: list[str], needle: str
) -> None:
    out = tmp_path / "x.wav"
    r = cli("synth", "--model", str(tiny_model_dir), *args, "--out", str(out))
    assert r.returncode != 0
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists() and not list(tmp_path.iterdir()), "a partial WAV or temp file was left behind"


def test_synth_bad_model_dir(tmp_path: Path) -> None:
    r = cli(
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
    r = cli(
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


def test_synth_corrupt_weights_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny_model_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "flow.pt").write_bytes(b"not a checkpoint")
    r = cli(
        "synth", "--model", str(bad), "--speaker", "英文女", "--text", "Hi.", "--out", str(tmp_path / "x.wav")
    )
    assert r.returncode != 0 and "flow.pt" in r.stderr, r.stderr


def test_synth_unwritable_output(tiny_model_dir: Path, tmp_path: Path) -> None:
    r = cli(
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


def test_stream_with_speed_is_a_usage_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    r = cli(
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


def test_model_from_env(tiny_model_dir: Path) -> None:
    r = cli("speakers", env={**ENV, "COSYSERVE_MODEL": str(tiny_model_dir)})
    assert r.returncode == 0 and "英文男" in r.stdout


def test_make_test_model_refuses_existing_dir(tmp_path: Path) -> None:
    r = cli("make-test-model", str(tmp_path))
    assert r.returncode != 0 and "already exists" in r.stderr


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
        "from cosyserve.server.app import _load_source\n"
        "from cosyserve.server.config import DEMO_MODEL\n"
        f"main(['make-test-model', {str(tmp_path / 'made')!r}])\n"
        "demo = _load_source(DEMO_MODEL, DEMO_MODEL)\n"
        "m = cosyserve.load(demo, warmup=False)\n"
        "assert 'zero_shot' in m.available_modes, m.unavailable_modes()\n"
        f"m.use_registry({str(tmp_path / 'registry')!r})\n"
        f"spk = m.add_speaker('me', {str(wav)!r}, 'Hello there.')\n"
        "assert 'onnx' not in [k for k, v in sys.modules.items() if v is not None]\n"
        "print('registered', spk.name)\n"
    )
    env = {**ENV, "COSYSERVE_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "registered me" in r.stdout
    for made in (tmp_path / "made", tmp_path / "cache" / "demo-model"):
        assert (made / "campplus.onnx").is_file() and (made / "speech_tokenizer_v1.onnx").is_file(), made
