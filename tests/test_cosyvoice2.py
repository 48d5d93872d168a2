"""CosyVoice2 end to end on a tiny random-weight model in the official layout (make-test-model --family
cosyvoice2): conversion round trip, every mode through the Python API, determinism with a seed, streaming, the
reference's hop-doubling bug not copied, and the HTTP routes. Equality with the reference is the conformance
fixtures' job (tests/test_conformance.py runs the CosyVoice2 set)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import torch

from server_util import in_process

SPK = "英文女"


def wav_bytes(seconds: float = 2.0, sr: int = 16000, f0: float = 180.0) -> bytes:
    t = np.arange(int(seconds * sr)) / sr
    wave = 0.3 * np.sin(2 * np.pi * f0 * t) * (1 + 0.3 * np.sin(2 * np.pi * 3 * t))
    buf = io.BytesIO()
    sf.write(buf, wave.astype(np.float32), sr, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture(scope="module")
def model(cv2_model_dir: Path) -> Any:
    import cosyserve

    return cosyserve.load(cv2_model_dir)


def test_official_layout_round_trips_through_a_bundle(cv2_model_dir: Path, tmp_path: Path) -> None:
    """Conversion strict-loads llm.pt / flow.pt / hift.pt into our modules and stores them; the bundle's tensors
    equal the official ones (the vocoder's weight norm folded; the LM's tied text head, which speech never uses,
    not stored), the manifest names the family and the Qwen tokenizer files travel with the bundle. If this
    failed, a CosyVoice2 bundle would serve other weights than the directory it came from."""
    from cosyserve.bundle.convert import convert
    from cosyserve.bundle.loader import LoadOptions, open_bundle
    from cosyserve.bundle.official import load_component, read_state_dict
    from cosyserve.families.cosyvoice2 import QWEN_FILES
    from cosyserve.families.modelconfig import load_model_config

    bundle = convert(cv2_model_dir, tmp_path / "b", progress=False)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["family"] == "cosyvoice2" and manifest["instruct"] is False
    assert set(QWEN_FILES) | {"campplus.onnx", "speech_tokenizer_v2.onnx"} == set(manifest["extras"])
    parts = open_bundle(bundle).load(LoadOptions(verify="full"))
    cfg = load_model_config(cv2_model_dir)
    for name in ("llm", "flow", "hift"):
        official = load_component(cv2_model_dir, name, getattr(cfg, name), "cosyvoice2").state_dict()
        stored = parts.modules[name].state_dict()
        assert sorted(stored) == sorted(official), name
        for key, value in official.items():
            assert torch.equal(stored[key], value), f"{name}: {key}"
    raw = read_state_dict(cv2_model_dir / "llm.pt")
    assert set(raw) - set(parts.modules["llm"].state_dict()) == {"llm.model.lm_head.weight"}


def test_every_mode_speaks_and_a_seed_repeats_it(model: Any, tmp_path: Path) -> None:
    """sft, zero_shot, cross_lingual, instruct2 and vc each give finite 24 kHz audio, and the same seed gives the
    same samples. A mode wired to the wrong inputs (the 300M frontend's speech tokenizer, a missing prompt) fails
    here before any user hears it."""
    prompt = tmp_path / "prompt.wav"
    prompt.write_bytes(wav_bytes())
    cases = {
        "sft": dict(speaker=SPK),
        "zero_shot": dict(prompt_wav=prompt, prompt_text="Hello there."),
        "cross_lingual": dict(prompt_wav=prompt),
        "instruct2": dict(prompt_wav=prompt, instruct_text="Speak slowly.<|endofprompt|>"),
        "vc": dict(prompt_wav=prompt, source_wav=prompt),
    }
    assert model.sample_rate == 24000
    for mode, kwargs in cases.items():
        text = "" if mode == "vc" else "Hello world."
        a = model.synthesize_all(text, mode=mode, seed=3, **kwargs)
        b = model.synthesize_all(text, mode=mode, seed=3, **kwargs)
        assert a.dtype == np.float32 and a.size > 0 and np.isfinite(a).all(), mode
        assert np.array_equal(a, b), f"{mode}: the same seed gave different audio"


def test_a_second_streaming_request_gives_the_first_ones_audio(model: Any) -> None:
    """The reference doubles its streaming hop on the model object and keeps it, so its second streamed request
    is chunked (and sounds) differently; here each request starts at the first hop: same seed, same chunks."""
    runs = [
        [c.copy() for c in model.synthesize("Hello there, this is a longer test.", SPK, stream=True, seed=5)]
        for _ in range(2)
    ]
    assert len(runs[0]) >= 2, "expected a streamed answer in several chunks"
    assert [len(c) for c in runs[0]] == [len(c) for c in runs[1]]
    assert all(np.array_equal(x, y) for x, y in zip(*runs, strict=True))


def test_stream_and_one_shot_have_the_same_length(model: Any) -> None:
    """Streaming re-runs the flow with chunked attention (the reference's rule), so samples differ from one-shot,
    but the utterance is as long: every token's frames are spoken exactly once."""
    text = "Hello there, this is a longer test."
    one = model.synthesize_all(text, SPK, seed=7)
    streamed = model.synthesize_all(text, SPK, seed=7, stream=True)
    assert abs(len(one) - len(streamed)) == 0


def test_instruct_means_instruct2_on_cosyvoice2(model: Any, tmp_path: Path) -> None:
    """CosyVoice2 has no speaker-instruct mode: a pre-defined speaker with an instruction is refused with the way
    out; a registered (cloned) voice with an instruction runs as instruct2 (the OpenAI ``instructions`` path)."""
    from cosyserve.core.errors import ClientError

    with pytest.raises(ClientError, match="instruct2"):
        model.synthesize_all("Hello.", SPK, mode="instruct", instruct_text="Speak slowly.")
    prompt = tmp_path / "p.wav"
    prompt.write_bytes(wav_bytes(f0=220.0))
    model.add_speaker("cloned", prompt, "Hello there.", overwrite=True)
    audio = model.synthesize_all("Hello.", "cloned", mode="instruct", instruct_text="Speak slowly.", seed=1)
    assert audio.size > 0


@pytest.fixture(scope="module")
def client(cv2_model_dir: Path) -> Iterator[Any]:
    from cosyserve.core.settings import Settings

    with in_process(Settings.load(flags={"models": [f"cv2={cv2_model_dir}"]})) as c:
        yield c


def test_http_routes_serve_a_cosyvoice2_model(client: Any) -> None:
    """The OpenAI route (one-shot and streamed) and the reference's routes, /inference_instruct2 included,
    answer with 24 kHz audio from a CosyVoice2 model."""
    body = {"input": "Hello there.", "voice": SPK, "response_format": "wav", "seed": 1}
    r = client.post("/v1/audio/speech", json=body)
    assert r.status_code == 200, r.text
    audio, sr = sf.read(io.BytesIO(r.content))
    assert sr == 24000 and len(audio) > 0
    r = client.post("/v1/audio/speech", json={**body, "response_format": "pcm", "stream": True})
    assert r.status_code == 200 and len(r.content) > 0
    files = {"prompt_wav": ("p.wav", wav_bytes(), "audio/wav")}
    r = client.post(
        "/inference_instruct2",
        data={"tts_text": "Hello.", "instruct_text": "Speak slowly.<|endofprompt|>"},
        files=files,
    )
    assert r.status_code == 200 and len(r.content) > 0, r.text
    r = client.post(
        "/inference_zero_shot", data={"tts_text": "Hello.", "prompt_text": "Hi there."}, files=files
    )
    assert r.status_code == 200 and len(r.content) > 0, r.text
    r = client.post(
        "/inference_instruct", data={"tts_text": "Hi.", "spk_id": SPK, "instruct_text": "Calmly."}
    )
    assert r.status_code == 400 and "instruct2" in r.json()["error"]["message"]


def test_a_broken_tokenizer_file_is_refused_at_conversion(cv2_model_dir: Path, tmp_path: Path) -> None:
    """A truncated vocab.json or a missing tokenizer config stops the conversion with the file named and no
    bundle written; if this failed, the error would come from the first request's text instead (and, from
    the background text tier, as a traceback in the server's log)."""
    import shutil

    from cosyserve.bundle.convert import convert
    from cosyserve.core.errors import ModelDirError

    broken = tmp_path / "broken"
    shutil.copytree(cv2_model_dir, broken)
    vocab = broken / "CosyVoice-BlankEN" / "vocab.json"
    vocab.write_text(vocab.read_text(encoding="utf-8")[:1000], encoding="utf-8")
    with pytest.raises(ModelDirError, match="vocab.json"):
        convert(broken, tmp_path / "b1", progress=False)
    assert not (tmp_path / "b1").exists()
    shutil.copy(cv2_model_dir / "CosyVoice-BlankEN" / "vocab.json", vocab)
    (broken / "CosyVoice-BlankEN" / "tokenizer_config.json").unlink()
    with pytest.raises(ModelDirError, match="tokenizer_config.json"):
        convert(broken, tmp_path / "b2", progress=False)


def test_the_qwen_vocabulary_maps_each_character_to_its_byte_and_refuses_what_is_not_byte_level(
    tmp_path: Path,
) -> None:
    """The vocabulary's tokens become bytes through GPT-2's byte stand-ins (all tokens at once): if this fails, a
    token's bytes are wrong (its text encodes to other ids than the reference's), or a vocabulary that is not
    byte-level BPE (a space, a CJK character, a lone surrogate in a token; a negative or boolean id) is served
    instead of refused with the file and the token named."""
    from cosyserve.core.errors import ModelDirError
    from cosyserve.frontend.qwen_tokenizer import _byte_ranks, _unicode_to_byte

    stand_in = {b: ch for ch, b in _unicode_to_byte().items()}
    words = [b"hello", b" world", b"\n", b"\x00\xff", "中".encode(), b"!~\xa1\xad"]
    vocab = {"".join(stand_in[b] for b in w): i for i, w in enumerate(words)}
    assert _byte_ranks(vocab, tmp_path) == {w: i for i, w in enumerate(words)}
    for bad, what in [
        ({**vocab, "a b": 6}, "'a b' is not byte-level"),
        ({**vocab, "中": 6}, "'中' is not byte-level"),
        ({**vocab, "\ud800": 6}, "is not byte-level"),
        ({**vocab, "ab": -1}, "has id -1"),
        ({**vocab, "ab": True}, "has id True"),
    ]:
        with pytest.raises(ModelDirError, match=what) as e:
            _byte_ranks(bad, tmp_path / "vocab.json")
        assert "vocab.json" in str(e.value)
