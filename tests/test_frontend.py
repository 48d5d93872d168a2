"""Text normalisation and the prompt frontends (zero-shot, cross-lingual, instruct, vc) against the reference."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from safetensors.torch import load_file

from cosyserve.core.errors import AudioError, ModeUnavailableError, UnknownVoiceError
from cosyserve.core.modes import PROMPT_MODES
from cosyserve.families.cosyvoice.conformance import KINDS
from cosyserve.frontend.onnx_testmodels import SPEECH_TOKEN_VOCAB, write_test_onnx_models
from cosyserve.frontend.text import normalize_and_split, split_paragraph, text_normalize
from cosyserve.frontend.zeroshot import (
    CAMPPLUS_FILE,
    SPEECH_TOKENIZER_FILE,
    Frontend,
    OnnxModel,
    load_prompt,
)
from cosyserve.tools.conformance import run_case
from cosyserve.tools.conformance.context import CaseContext

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------------------------
# fixture cases


@pytest.fixture(scope="module")
def fixture_cases(fixture_set_dir: Path) -> tuple[list[dict], dict[str, torch.Tensor], CaseContext]:
    cases = json.loads((fixture_set_dir / "cases.json").read_text())["cases"]
    ctx = CaseContext(fixture_set_dir, fixture_set_dir / "model")
    return cases, load_file(str(fixture_set_dir / "tensors.safetensors")), ctx


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_fixture_cases_match_reference(kind: str, fixture_cases: tuple) -> None:
    """If this fails, our text normalisation (wetext pipeline, splitting) or the prompt frontend (ONNX inputs,
    resample rates, feature layout, dict keys) differs from CosyVoice's, so the models get other inputs."""
    cases, tensors, ctx = fixture_cases
    selected = [c for c in cases if c["kind"] == kind]
    if not selected:
        pytest.skip(f"no `{kind}` case in this fixture set")
    results = [run_case(case, tensors, ctx) for case in selected]
    failed = [r.line() for r in results if not r.passed]
    assert not failed, "\n".join(failed)


# ---------------------------------------------------------------------------------------------------------------------
# text


def _tok(text: str) -> list[int]:
    from cosyserve.frontend.tokenizer import get_tokenizer

    return get_tokenizer().encode(text)


def test_text_normalize_edge_cases() -> None:
    """If this fails, markup, blank or punctuation-only text reaches the LLM in a form the reference never gives."""
    assert text_normalize("<|en|>Hi 5") == ["<|en|>Hi 5"]  # markup: untouched, numbers too
    assert text_normalize("   ") == []
    assert text_normalize("") == []
    assert text_normalize("...!!!") == []
    assert text_normalize("I have 2 cats", split=False) == "I have two cats"
    assert normalize_and_split("他有3只猫", _tok) == ["他有三只猫。"]


def test_pieces_with_nothing_to_speak_are_dropped() -> None:
    """If this fails, a piece of invisible characters (zero-width spaces, joiners, BOM, ideographic space) goes
    to the LLM, which makes noise of it, while a piece of punctuation is dropped: they must be treated alike."""
    for text in ("\u200b\u200b", "\u200d\u2060", "\ufeff", "\u3000\u200b", "\u200b!"):
        assert text_normalize(text) == [], repr(text)
    assert text_normalize("Hello.\u200b") != [], "a speakable text with a zero-width space is kept"


def test_split_paragraph_limits() -> None:
    """If this fails, long text is cut into pieces of the wrong size (the LLM's per-piece limits) or a short
    tail is left alone instead of being merged."""
    text = "".join(f"第{i}句话说得很长很长很长很长很长。" for i in range(20))
    pieces = split_paragraph(text, _tok, "zh")
    assert "".join(pieces) == text
    assert all(len(p) <= 80 + 16 for p in pieces) and all(len(p) > 60 for p in pieces[:-1])
    assert split_paragraph("A long first sentence here. Tail.", _tok, "en", 5, 3, 20) == [
        "A long first sentence here. Tail."
    ]
    assert split_paragraph('He said "hi." Then left', _tok, "en", 2, 1, 0) == ['He said "hi."', " Then left."]


# ---------------------------------------------------------------------------------------------------------------------
# laziness


def test_importing_and_sft_do_not_load_onnxruntime_or_wetext(tmp_path: Path) -> None:
    """If this fails, importing the frontend or serving a pre-defined speaker loads onnxruntime or wetext's
    40 MB of FSTs, slowing every server start for modes nobody asked for."""
    write_test_onnx_models(tmp_path)
    code = f"""
import sys, torch
from cosyserve.frontend import text, zeroshot
from cosyserve.families.cosyvoice import conformance
fe = zeroshot.Frontend({str(tmp_path)!r}, {{"a": {{"embedding": torch.zeros(1, 192)}}}})
fe.frontend_sft("hello", "a")
fe.frontend_instruct("hello", "a", "calm")
assert not fe.campplus.loaded and not fe.speech_tokenizer.loaded
bad = sorted(m for m in ("onnxruntime", "wetext", "inflect", "kaldifst", "onnx") if m in sys.modules)
assert not bad, bad
assert not text.normalizers_loaded()
"""
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_onnx_session_is_created_once_for_concurrent_first_callers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If this fails, simultaneous first requests each build their own ONNX session (wasted seconds and memory)."""
    write_test_onnx_models(tmp_path)
    model = OnnxModel(tmp_path / CAMPPLUS_FILE)
    calls = []
    original = OnnxModel._create

    def counting_create(self: OnnxModel) -> object:
        calls.append(1)
        return original(self)

    monkeypatch.setattr(OnnxModel, "_create", counting_create)
    barrier = threading.Barrier(6)
    sessions = []

    def first_use() -> None:
        barrier.wait()
        sessions.append(model.session())

    threads = [threading.Thread(target=first_use) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len({id(s) for s in sessions}) == 1 and model.loaded


# ---------------------------------------------------------------------------------------------------------------------
# test ONNX models and the frontend end to end


def _voice(seconds: float, sr: int, amp: float = 0.3, seed: int = 0) -> np.ndarray:
    t = np.arange(int(seconds * sr)) / sr
    rng = np.random.default_rng(seed)
    return (
        amp * np.sin(2 * np.pi * 180 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))
        + 0.01 * rng.standard_normal(t.shape)
    ).astype(np.float32)


@pytest.fixture(scope="module")
def test_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("onnx")
    write_test_onnx_models(out, seed=0)
    return out


def test_test_onnx_models_have_official_signature(test_model_dir: Path, fixture_set_dir: Path) -> None:
    """If this fails, the tiny test models differ from the official ones in input/output names, dtypes or fixed
    dims, so tests here would not exercise the code path real models take."""
    import onnx

    for name in (CAMPPLUS_FILE, SPEECH_TOKENIZER_FILE):
        ours, official = onnx.load(test_model_dir / name), onnx.load(fixture_set_dir / "model" / name)
        assert (test_model_dir / name).stat().st_size < 200_000

        def sig(m: onnx.ModelProto) -> list:
            return [
                (
                    v.name,
                    v.type.tensor_type.elem_type,
                    [d.dim_value or "?" for d in v.type.tensor_type.shape.dim],
                )
                for v in [*m.graph.input, *m.graph.output]
            ]

        assert sig(ours) == sig(official), name


def test_test_onnx_models_are_valid_onnx_in_canonical_bytes(test_model_dir: Path) -> None:
    """If this fails, the hand-written protobuf of the stand-in ONNX files (written without the ``onnx`` package,
    so a plain install can make the demo model) is not a valid model by onnx's full checker, or differs from what
    onnx's own serializer writes for the same graph (a field out of order, a packed or missing field)."""
    import onnx

    for name in (CAMPPLUS_FILE, SPEECH_TOKENIZER_FILE):
        ours = (test_model_dir / name).read_bytes()
        model = onnx.load_from_string(ours)
        onnx.checker.check_model(model, full_check=True)
        assert model.ir_version == 8 and [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
        assert model.SerializeToString() == ours, f"{name}: not protobuf's canonical serialization"
        assert len(model.graph.node) >= 6 and len(model.graph.initializer) >= 4, name


def test_test_onnx_models_run_in_onnxruntime(test_model_dir: Path) -> None:
    """If this fails, make-test-model writes ONNX files onnxruntime cannot run, or with outputs of the wrong
    shape/dtype (50 Hz int64 ids below 4096, a [1, 192] float embedding)."""
    import onnxruntime

    tok = onnxruntime.InferenceSession(
        str(test_model_dir / SPEECH_TOKENIZER_FILE), providers=["CPUExecutionProvider"]
    )
    rng = np.random.default_rng(0)
    for frames in (1, 2, 101, 400):
        feats = rng.standard_normal((1, 128, frames)).astype(np.float32)
        (ids,) = tok.run(None, {"feats": feats, "feats_length": np.array([frames], dtype=np.int32)})
        assert ids.dtype == np.int64 and ids.shape == (1, (frames + 1) // 2)
        assert 0 <= ids.min() and ids.max() < SPEECH_TOKEN_VOCAB
    cam = onnxruntime.InferenceSession(
        str(test_model_dir / CAMPPLUS_FILE), providers=["CPUExecutionProvider"]
    )
    (emb,) = cam.run(None, {"input": rng.standard_normal((1, 37, 80)).astype(np.float32)})
    assert emb.dtype == np.float32 and emb.shape == (1, 192) and np.isfinite(emb).all()
    again = test_model_dir.parent / "again"
    again.mkdir()
    write_test_onnx_models(again, seed=0)
    assert (again / CAMPPLUS_FILE).read_bytes() == (test_model_dir / CAMPPLUS_FILE).read_bytes()


def test_frontend_end_to_end_on_test_models(test_model_dir: Path, tmp_path: Path) -> None:
    """If this fails, a zero-shot / cross-lingual / vc request on a model with the ONNX files gives inputs of the
    wrong keys, shapes or dtypes for the LLM and flow."""
    wav = tmp_path / "prompt.wav"
    soundfile.write(wav, _voice(2.0, 22050), 22050, subtype="PCM_16")
    fe = Frontend(test_model_dir, {"spk": {"embedding": torch.ones(1, 192)}})
    assert fe.unavailable_modes() == {}
    zs = fe.frontend_zero_shot("你好世界。", "希望你以后能够做的比我还好呦。", wav)
    assert set(zs) == {
        "text", "text_len", "prompt_text", "prompt_text_len", "llm_prompt_speech_token",
        "llm_prompt_speech_token_len", "flow_prompt_speech_token", "flow_prompt_speech_token_len",
        "prompt_speech_feat", "prompt_speech_feat_len", "llm_embedding", "flow_embedding",
    }  # fmt: skip
    frames = 32000 // 160
    assert zs["flow_prompt_speech_token"].shape == (1, (frames + 1) // 2)
    assert zs["flow_prompt_speech_token"].dtype == torch.int32
    assert zs["prompt_speech_feat"].shape == (1, 48000 // 256, 80)  # 24 kHz resample, mel hop 256
    assert zs["prompt_speech_feat_len"].tolist() == [48000 // 256]
    assert zs["llm_embedding"].shape == (1, 192) and zs["llm_embedding"].dtype == torch.float32
    assert zs["text_len"].tolist() == [zs["text"].shape[1]]
    xl = fe.frontend_cross_lingual("<|en|>Hello.", wav.read_bytes())
    assert "prompt_text" not in xl and "llm_prompt_speech_token" not in xl
    assert torch.equal(xl["flow_prompt_speech_token"], zs["flow_prompt_speech_token"])  # bytes == path
    vc = fe.frontend_vc(wav, wav)
    assert torch.equal(vc["source_speech_token"], vc["flow_prompt_speech_token"])
    fe.mel_per_token = 2  # a CosyVoice2/3 family's frontend (Family.prompt_mel_per_token)
    trimmed = fe.frontend_zero_shot("hi", "hey", wav)
    assert trimmed["prompt_speech_feat"].shape[1] == 2 * trimmed["flow_prompt_speech_token"].shape[1]


def test_model_dir_without_onnx_still_serves_sft(tmp_path: Path) -> None:
    """If this fails, a model dir without the zero-shot ONNX files breaks SFT, or a zero-shot request on it
    fails with an unclear error instead of naming the missing file."""
    fe = Frontend(tmp_path, {"spk": {"embedding": torch.ones(1, 192)}})
    assert set(fe.unavailable_modes()) == set(PROMPT_MODES)
    assert fe.frontend_sft("hello", "spk")["flow_embedding"].shape == (1, 192)
    with pytest.raises(ModeUnavailableError, match=CAMPPLUS_FILE):
        fe.frontend_zero_shot("hello", "hi", tmp_path / "whatever.wav")
    with pytest.raises(ModeUnavailableError, match="cross_lingual"):
        fe.frontend_cross_lingual("hello", b"")
    with pytest.raises(UnknownVoiceError, match="unknown speaker 'nobody'.*spk"):
        fe.frontend_sft("hello", "nobody")


# ---------------------------------------------------------------------------------------------------------------------
# bad prompt audio


def _wav_bytes(data: np.ndarray, sr: int, subtype: str = "PCM_16") -> bytes:
    import io

    buf = io.BytesIO()
    soundfile.write(buf, data, sr, format="WAV", subtype=subtype)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: b"", "empty"),
        (lambda: b"RIFF\x00\x00\x00\x00WAVEjunkjunkjunk" * 4, "cannot decode"),
        (lambda: _wav_bytes(np.zeros(0, np.float32), 16000), "no samples"),
        (lambda: _wav_bytes(np.zeros(16000, np.float32), 16000), "silent"),
        (lambda: _wav_bytes(np.tile(_voice(1.0, 16000)[:, None], (1, 3)), 16000), "3 channels"),
        (lambda: _wav_bytes(_voice(1.0, 8000), 8000), "8000 Hz"),
        (lambda: _wav_bytes(_voice(30.5, 16000), 16000), "30.50 s long"),
        (lambda: _wav_bytes(_voice(0.02, 16000), 16000), "ms long"),
        (lambda: _wav_bytes(np.sign(_voice(1.0, 16000)), 16000), "clipped"),
    ],
    ids=[
        "zero-bytes",
        "undecodable",
        "no-frames",
        "silent",
        "3-channels",
        "8khz",
        "over-30s",
        "too-short",
        "clipped",
    ],
)
def test_bad_prompt_audio_is_refused_clearly(make, message: str) -> None:  # noqa: ANN001
    """If this fails, unusable prompt audio gets through to the models (garbage voice, or a crash deep in the
    feature code) instead of a ValueError that tells the client what is wrong with the file."""
    with pytest.raises(AudioError, match=message) as info:
        load_prompt(make())
    assert isinstance(info.value, AudioError) and isinstance(info.value, ValueError)


def test_good_stereo_prompt_and_token_length_guard(test_model_dir: Path, tmp_path: Path) -> None:
    """If this fails, a normal stereo 48 kHz prompt is refused, or speech tokens are extracted from more than
    the reference's 30 s."""
    stereo = np.stack([_voice(1.5, 48000), _voice(1.5, 48000, seed=1)], axis=1)
    prompt = load_prompt(_wav_bytes(stereo, 48000))
    assert (
        prompt.channels == 2
        and prompt.speech_16k.shape == (1, 24000)
        and prompt.speech_24k.shape == (1, 36000)
    )
    fe = Frontend(test_model_dir)
    with pytest.raises(AudioError, match="at most 30 s"):
        fe.extract_speech_token(torch.zeros(1, 16000 * 30 + 1))
    missing = tmp_path / "nope.wav"
    with pytest.raises(AudioError, match="does not exist"):
        fe.frontend_zero_shot("hi", "hey", missing)
