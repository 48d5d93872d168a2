"""Audio that is not finite numbers: refused as prompt audio at every entry point, and never answered as audio.

A float WAV may hold NaN or infinity. NaN passes every level check (each comparison with it is False), so before
this a NaN prompt made NaN features, a NaN speaker embedding and all-zero audio answered with 200, and a voice
registered from it was silent on every later use. Now: one line naming the audio and its field, nothing registered,
on the CLI, the Python API and HTTP, on both runtimes; and a chunk of model output that is not finite fails its
request in the engine (an InternalError, 500 over HTTP) instead of being encoded.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
from starlette.testclient import TestClient

from cli_util import run_main
from cosyserve.core.errors import AudioError, InternalError
from cosyserve.core.request import SynthesisRequest
from fake_runtime import FakeRuntime
from server_util import in_process

NOT_FINITE = "is not finite: it has NaN or infinite samples"


def float_wav(fill: float, seconds: float = 1.0, rate: int = 16000) -> bytes:
    """A 32-bit float WAV: a voiced tone with every tenth sample set to ``fill`` (NaN, inf)."""
    t = np.arange(int(seconds * rate)) / rate
    wave = (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32)
    wave[::10] = fill
    buf = io.BytesIO()
    soundfile.write(buf, wave, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


NAN_WAV = float_wav(np.nan)
GOOD_WAV = float_wav(0.1)


@pytest.fixture(scope="module", params=["torch", "lite"])
def model_path(request: pytest.FixtureRequest) -> tuple[str, Path]:
    fixture = "tiny_model_dir" if request.param == "torch" else "tiny_lite_bundle"
    return request.param, request.getfixturevalue(fixture)


@pytest.fixture(scope="module")
def api_model(
    model_path: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, Path]]:
    import cosyserve

    runtime, path = model_path
    registry = tmp_path_factory.mktemp("reg")
    model = cosyserve.load(path, runtime=runtime, warmup=False, registry_dir=str(registry))
    yield model, registry
    model.close()


# --- Python API ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fill", [np.nan, np.inf, -np.inf])
def test_the_python_api_refuses_a_nonfinite_prompt_naming_it(
    api_model: tuple[Any, Path], tmp_path: Path, fill: float
) -> None:
    """Prompt (zero_shot, add_speaker) and source (vc) audio with NaN or infinite samples is an AudioError of one
    line naming the file and the field, and no voice is registered from it. If this fails, a NaN prompt is cloned
    into silence again (or an infinite one is called clipped, which sends the user looking for the wrong fix)."""
    model, registry = api_model
    bad = tmp_path / "bad.wav"
    bad.write_bytes(float_wav(fill))
    for kwargs, param in (
        (dict(mode="zero_shot", text="Hi.", prompt_wav=bad, prompt_text="A prompt."), "prompt_wav"),
        (dict(mode="cross_lingual", text="Hi.", prompt_wav=bad.read_bytes()), "prompt_wav"),
        (dict(mode="vc", prompt_wav=GOOD_WAV, source_wav=bad), "source_wav"),
    ):
        with pytest.raises(AudioError, match=NOT_FINITE) as e:
            model.synthesize(**kwargs)
        assert e.value.param == param and "\n" not in str(e.value), str(e.value)
        if isinstance(kwargs.get(param), Path):
            assert str(bad) in str(e.value), f"the message should name the file: {e.value}"
    with pytest.raises(AudioError, match=NOT_FINITE):
        model.add_speaker("nan_voice", bad, "A prompt.")
    assert "nan_voice" not in model.list_speakers() and not list(registry.rglob("*.safetensors"))
    assert model.synthesize_all("Hi.", mode="cross_lingual", prompt_wav=GOOD_WAV, seed=0).size > 0


# --- CLI ----------------------------------------------------------------------------------------------------------


def test_the_cli_refuses_a_nan_prompt_in_one_line(
    model_path: tuple[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``synth`` with a NaN prompt exits 1 with one line naming the file and writes no audio; ``speakers add``
    registers nothing. If this fails, the CLI writes an all-zero WAV (with a numpy RuntimeWarning, an error under
    the suite's ``filterwarnings``) as before. In this process (tests/cli_util.py): nothing here is about the
    process itself."""
    runtime, path = model_path
    bad = tmp_path / "nan.wav"
    bad.write_bytes(NAN_WAV)
    out = tmp_path / "out.wav"
    common = ["--model", str(path), "--runtime", runtime, "--registry-dir", str(tmp_path / "reg")]
    r = run_main(capsys, "synth", *common, "--mode", "zero_shot", "--text", "Hi.", "--prompt-wav", str(bad),
            "--prompt-text", "A prompt.", "--out", str(out))  # fmt: skip
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and NOT_FINITE in lines[0] and str(bad) in lines[0], r.stderr
    assert not out.exists(), "no audio may be written for a refused prompt"
    r = run_main(capsys, "speakers", "add", "nan_voice", *common, "--prompt-wav", str(bad), "--prompt-text",
                 "A prompt.")  # fmt: skip
    assert r.returncode == 1 and NOT_FINITE in r.stderr, r.stderr
    assert not list((tmp_path / "reg").rglob("*.safetensors")), "nothing may be registered"


# --- HTTP ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http(model_path: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    from cosyserve.core.settings import Settings

    runtime, path = model_path
    registry = tmp_path_factory.mktemp("reg")
    cfg = Settings.load(flags={"models": [f"m={path}"], "runtime": runtime, "registry_dir": str(registry)})
    with in_process(cfg) as client:
        yield client


def test_http_refuses_a_nan_prompt_with_400_naming_the_field(http: TestClient) -> None:
    """/inference_zero_shot with a NaN upload is a 400 naming prompt_wav, not 200 with silence. If this fails, a
    client gets silent audio with a success status. (Registering a voice over HTTP reads its upload through the
    same check: ``add_voice``, tested above through the Python API and the CLI.)"""
    r = http.post(
        "/inference_zero_shot",
        data={"tts_text": "Hi.", "prompt_text": "A prompt."},
        files={"prompt_wav": ("nan.wav", NAN_WAV, "audio/wav")},
    )
    assert r.status_code == 400, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["param"] == "prompt_wav" and NOT_FINITE in error["message"], error
    assert "\n" not in error["message"], error


# --- output: the engine ---------------------------------------------------------------------------------------


class NaNRuntime(FakeRuntime):
    """Speaks one good chunk, then one with a NaN sample (a model gone wrong)."""

    def start(self, request: SynthesisRequest, should_stop: Callable[[], bool]) -> Iterator[np.ndarray]:
        self.resolve(request)

        def chunks() -> Iterator[np.ndarray]:
            yield np.full(50, 0.1, np.float32)
            bad = np.full(50, 0.1, np.float32)
            bad[7] = np.nan
            yield bad
            yield np.full(50, 0.1, np.float32)

        return chunks()


def test_the_engine_fails_a_request_whose_audio_is_not_finite() -> None:
    """The chunk with a NaN never reaches the consumer: the request ends with an InternalError saying why (the
    server's 500), and the engine serves the next request. If this fails, a model that makes NaN is answered with
    silence or noise and a success status."""
    from cosyserve.engine.engine import Engine

    engine = Engine("nan", NaNRuntime)
    engine.load_sync(5)
    got: list[np.ndarray] = []
    with pytest.raises(InternalError, match="NaN or infinite samples") as e:
        for chunk in engine.synthesize_sync(SynthesisRequest(text="Hi.", speaker="alice")):
            got.append(chunk)
    assert "synthesis made audio with NaN" in str(e.value) and "request" in str(e.value), str(e.value)
    assert len(got) == 1 and np.isfinite(got[0]).all(), "only the finite chunk before it may be delivered"
    assert engine.in_flight == 0
    with pytest.raises(InternalError):  # the engine is not wedged: the next request runs (and fails alike)
        list(engine.synthesize_sync(SynthesisRequest(text="Again.", speaker="alice")))
    engine.release_sync()


def test_the_python_api_fails_audio_that_is_not_finite() -> None:
    """The Python API runs the runtime in the caller's thread, without the engine: it must refuse a NaN chunk
    the same way, or `cosyserve.load(...).synthesize(...)` (and the CLI's synth) would write it as audio."""
    from cosyserve.api import CosyVoiceModel

    model = CosyVoiceModel(NaNRuntime())
    got: list[np.ndarray] = []
    with pytest.raises(InternalError, match="NaN or infinite samples"):
        for chunk in model.synthesize("Hi.", "alice"):
            got.append(chunk)
    assert len(got) == 1 and np.isfinite(got[0]).all()


def test_http_answers_500_for_audio_that_is_not_finite() -> None:
    """Over HTTP the non-streamed answer is a 500 with the engine's reason, never a 200 WAV."""
    from cosyserve.engine.pool import ModelPool, ModelSpec

    pool = ModelPool(
        [ModelSpec("nan", policy="preload")], load_model=lambda spec, reload: NaNRuntime(), memory_probe=None
    )
    with in_process(pool=pool) as client:
        body = {"model": "nan", "input": "Hi.", "voice": "alice", "stream": False}
        r = client.post("/v1/audio/speech", json=body)
    assert r.status_code == 500, (r.status_code, r.headers.get("content-type"), r.text[:300])
    assert "NaN or infinite samples" in r.json()["error"]["message"], r.text[:300]
