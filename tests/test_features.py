"""Audio input path and feature extractors against the recorded reference (mel, fbank, whisper_logmel, resample)."""

from __future__ import annotations

import io
import json
import math
import types
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from safetensors.torch import load_file

from cosyserve.core.errors import AudioError
from cosyserve.frontend.audio import load_wav, resample
from cosyserve.frontend.features import (
    kaldi_fbank,
    mel_spectrogram,
    speaker_fbank,
    whisper_log_mel,
)
from cosyserve.tools.conformance.kinds_features import KINDS


@pytest.fixture(scope="module")
def fixture_cases(fixture_set_dir: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    cases = json.loads((fixture_set_dir / "cases.json").read_text())["cases"]
    return cases, load_file(str(fixture_set_dir / "tensors.safetensors"))


def _resolve(value: object, tensors: dict[str, torch.Tensor]) -> object:
    return tensors[value["tensor"]] if isinstance(value, dict) and "tensor" in value else value


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_fixture_cases_match_reference(kind: str, fixture_set_dir: Path, fixture_cases: tuple) -> None:
    """If this fails, our feature/resample math drifted from the reference (filterbank, window, padding or
    float32 rounding) and the flow prompt, speaker embedding or speech tokens will differ from CosyVoice's."""
    cases, tensors = fixture_cases
    selected = [c for c in cases if c["kind"] == kind]
    if not selected:
        pytest.skip(f"no `{kind}` case in this fixture set")
    ctx = types.SimpleNamespace(set_dir=fixture_set_dir)
    failures = []
    for case in selected:
        inputs = {k: _resolve(v, tensors) for k, v in case["inputs"].items()}
        got = KINDS[kind](ctx, inputs)
        for name, ref in case["outputs"].items():
            expected = _resolve(ref, tensors)
            out = got[name]
            assert out.shape == expected.shape, (
                f"{case['name']}.{name}: shape {out.shape} != {expected.shape}"
            )
            diff = (out - expected).abs()
            if not bool((diff <= case["atol"] + case["rtol"] * expected.abs()).all()):
                failures.append(f"{case['name']}.{name}: max abs err {diff.max():.3e} > atol {case['atol']}")
    assert not failures, "; ".join(failures)


def test_decode_equals_recorded_speech(fixture_set_dir: Path, fixture_cases: tuple) -> None:
    """If this fails, our decode of 16-bit PCM is not int16/32768 exactly, so every feature starts from
    different samples than the reference's load_wav."""
    cases, tensors = fixture_cases
    checked = 0
    for case in cases:
        speech = case["inputs"].get("speech")
        if not isinstance(speech, dict) or "wav" not in case["inputs"]:
            continue
        path = fixture_set_dir / case["inputs"]["wav"]
        native = load_wav(path, soundfile.info(str(path)).samplerate)
        assert torch.equal(native, tensors[speech["tensor"]]), case["name"]
        # bytes in, same samples out
        assert torch.equal(load_wav(path.read_bytes(), soundfile.info(str(path)).samplerate), native)
        checked += 1
    if not checked:
        pytest.skip("no case with a decoded `speech` input in this fixture set")


def _wav_bytes(samples: np.ndarray, sr: int, subtype: str = "PCM_16") -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, sr, format="WAV", subtype=subtype)
    return buf.getvalue()


@pytest.mark.parametrize("orig,new", [(16000, 22050), (24000, 16000), (22050, 16000), (16000, 24000)])
def test_resample_keeps_frequency(orig: int, new: int) -> None:
    """If this fails, the sinc kernel or the output interleaving is wrong: a pure tone must come out as the same
    tone at the new rate (the pitch of every resampled prompt would shift otherwise)."""
    freq, n = 440.0, 4000
    wave = torch.sin(2 * math.pi * freq * torch.arange(n, dtype=torch.float64) / orig).float()[None]
    out = resample(wave, orig, new)
    expected = torch.sin(2 * math.pi * freq * torch.arange(out.shape[-1], dtype=torch.float64) / new).float()
    edge = 64  # zero padding at the ends distorts the first/last few filter widths
    torch.testing.assert_close(out[0, edge:-edge], expected[edge:-edge], atol=2e-3, rtol=0)


@pytest.mark.parametrize(
    "orig,new,n",
    [(16000, 22050, 1001), (22050, 16000, 12345), (44100, 16000, 777), (48000, 24000, 5), (8000, 22050, 3)],
)
def test_resample_length(orig: int, new: int, n: int) -> None:
    """If this fails, N' differs from torchaudio's ceil(N * new / orig) and prompt lengths go out of step."""
    out = resample(torch.randn(2, n), orig, new)
    assert out.shape == (2, math.ceil(n * new / orig))


def test_resample_identity_and_errors() -> None:
    """If this fails, equal rates are not a no-op, or bad rates pass silently."""
    wave = torch.randn(1, 100)
    assert resample(wave, 16000, 16000) is wave
    with pytest.raises(AudioError, match="new_sr"):
        resample(wave, 16000, 0)
    with pytest.raises(AudioError, match="orig_sr"):
        resample(wave, -1, 16000)


def test_load_wav_mixes_channels_and_resamples() -> None:
    """If this fails, multichannel input is not averaged like the reference's mean over channels, or
    load_wav skips resampling."""
    left = np.sin(np.arange(3200) / 10.0) * 0.5
    stereo = np.stack([left, -0.25 * left], axis=1)
    data = _wav_bytes(stereo, 16000)
    decoded = torch.from_numpy(soundfile.read(io.BytesIO(data), dtype="float32")[0].T.copy())
    mono = load_wav(data, 16000)
    assert mono.shape == (1, 3200) and mono.dtype == torch.float32
    torch.testing.assert_close(mono, decoded.mean(dim=0, keepdim=True), atol=0, rtol=0)
    up = load_wav(data, 22050)
    torch.testing.assert_close(up, resample(mono, 16000, 22050), atol=0, rtol=0)


def test_load_wav_errors_name_the_problem(tmp_path: Path) -> None:
    """If this fails, a bad upload would crash deep inside the model or fail with an unhelpful message."""
    with pytest.raises(AudioError, match="empty"):
        load_wav(b"", 16000)
    with pytest.raises(AudioError, match="cannot decode"):
        load_wav(b"definitely not audio" * 10, 16000)
    garbage = tmp_path / "garbage.wav"
    garbage.write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunkjunk")
    with pytest.raises(AudioError, match="garbage.wav"):
        load_wav(garbage, 16000)
    with pytest.raises(AudioError, match="missing.wav"):
        load_wav(tmp_path / "missing.wav", 16000)
    with pytest.raises(AudioError, match="no samples"):
        load_wav(_wav_bytes(np.zeros((0, 1)), 16000), 16000)
    with pytest.raises(AudioError, match="8000 Hz"):
        load_wav(_wav_bytes(np.zeros(800), 8000), 16000)
    with pytest.raises(AudioError, match="target sample rate"):
        load_wav(_wav_bytes(np.zeros(800), 16000), 0)
    assert issubclass(AudioError, ValueError)


def test_features_shapes_and_short_input() -> None:
    """If this fails, the frame counts differ from the reference's conventions or too-short audio is not refused
    with a clear message."""
    speech = 0.1 * torch.randn(1, 16000)
    assert mel_spectrogram(speech).shape == (1, 80, 62)  # (16000 + 768 - 1024) // 256 + 1
    assert kaldi_fbank(speech).shape == (98, 80)  # 1 + (16000 - 400) // 160
    feat = speaker_fbank(speech)
    assert feat.shape == (98, 80)
    torch.testing.assert_close(feat.mean(dim=0), torch.zeros(80), atol=1e-5, rtol=0)
    assert whisper_log_mel(speech).shape == (1, 128, 100)
    with pytest.raises(ValueError, match="too short"):
        kaldi_fbank(torch.zeros(1, 399))
    with pytest.raises(ValueError, match=r"\[1, N\]"):
        mel_spectrogram(torch.zeros(16000))
