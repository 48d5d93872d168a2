"""Every synthesis mode end to end on the tiny random-weight model (with its tiny test ONNX models).

The input-assembly tests replace the LLM and token2wav with recorders and compare what reaches them with the
reference frontend's dicts (``cosyserve.frontend.zeroshot.Frontend``, itself checked against the reference's
recorded fixtures) and the reference's ``CosyVoiceModel.tts``, which sends ``text``, ``prompt_text``,
``llm_prompt_speech_token``, ``llm_embedding`` to the LLM and ``flow_prompt_speech_token``,
``prompt_speech_feat``, ``flow_embedding`` to token2wav (each defaulting to empty).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
import torch

import cosyserve
from cosyserve.core.errors import AudioError, ClientError, ModeUnavailableError
from cosyserve.frontend.zeroshot import Frontend
from cosyserve.runtime.pipeline import SynthesisRequest

SPK = "英文女"
PROMPT_TEXT = "Hello there, this is my voice."


def write_voice(path: Path, seconds: float, sr: int = 16000, seed: int = 0, amp: float = 0.3) -> Path:
    """A voice-like test signal (harmonics with a wobbling pitch and some noise), 16-bit PCM."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    f0 = 140 + 20 * np.sin(2 * np.pi * 3 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sr
    x = sum(np.sin(k * phase) / k for k in range(1, 6)) * (0.6 + 0.4 * np.sin(2 * np.pi * 2 * t))
    x = amp * x / np.abs(x).max() + 0.01 * rng.standard_normal(t.size)
    soundfile.write(path, x.astype(np.float32), sr, subtype="PCM_16")
    return path


def mel_samples(tokens: int) -> int:
    # one-shot token2wav: int(T / 50 * 22050 / 256) mel frames, 256 samples each (reference flow + hift)
    return int(tokens / 50 * 22050 / 256) * 256


@pytest.fixture(scope="module")
def audio(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("audio")
    return {
        "prompt": write_voice(d / "prompt.wav", 2.0, seed=1),
        "prompt_24k": write_voice(d / "prompt_24k.wav", 1.5, sr=24000, seed=2),
        "source": write_voice(d / "source.wav", 1.0, seed=3),
    }


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return cosyserve.load(tiny_model_dir, warmup=False, registry_dir=str(tmp_path_factory.mktemp("registry")))


@pytest.fixture(scope="module")
def reference_frontend(tiny_model_dir: Path) -> Frontend:
    from cosyserve.bundle.official import load_speakers

    return Frontend(tiny_model_dir, load_speakers(tiny_model_dir))


class Recorder:
    """Stands in for the decode loop (fixed tokens) and token2wav (one short chunk), recording what the LLM's prompt
    is built from (the arguments of its ``embed_inputs``) and what token2wav gets."""

    def __init__(self, embed_inputs: Any, n_tokens: int = 12) -> None:
        self.embed_inputs_of = embed_inputs
        self.n_tokens = n_tokens
        self.llm_calls: list[dict[str, torch.Tensor]] = []
        self.t2w_calls: list[dict[str, Any]] = []

    def embed_inputs(self, text, text_len, prompt_text, prompt_text_len, tokens, tokens_len, embedding):  # type: ignore[no-untyped-def]
        self.llm_calls.append(
            dict(
                text=text,
                text_len=text_len,
                prompt_text=prompt_text,
                prompt_text_len=prompt_text_len,
                prompt_speech_token=tokens,
                prompt_speech_token_len=tokens_len,
                embedding=embedding,
            )
        )
        return self.embed_inputs_of(
            text, text_len, prompt_text, prompt_text_len, tokens, tokens_len, embedding
        )

    def generate(self, spec: Any, key: int, should_stop: Any = None) -> Any:
        return iter(range(100, 100 + self.n_tokens))

    def token2wav(self, tokens, **kwargs):  # type: ignore[no-untyped-def]
        self.t2w_calls.append({"tokens": list(tokens), **kwargs})
        return iter([torch.zeros(1, 256)])


@pytest.fixture
def rec(model: Any, monkeypatch: pytest.MonkeyPatch) -> Recorder:
    pipeline = model.runtime.pipeline
    r = Recorder(pipeline.llm.embed_inputs)
    monkeypatch.setattr(pipeline.llm, "embed_inputs", r.embed_inputs)
    monkeypatch.setattr(pipeline, "decoder", r)
    monkeypatch.setattr(pipeline, "token2wav", r.token2wav)
    return r


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def normalized(text: str) -> str:
    from cosyserve.frontend.text import text_normalize

    out = text_normalize(text, split=False)
    assert isinstance(out, str)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# end to end: length and determinism


MODE_KWARGS = {
    "sft": lambda a: dict(mode="sft", speaker=SPK),
    "zero_shot": lambda a: dict(mode="zero_shot", prompt_wav=a["prompt"], prompt_text=PROMPT_TEXT),
    "cross_lingual": lambda a: dict(mode="cross_lingual", prompt_wav=a["prompt_24k"]),
    "instruct": lambda a: dict(mode="instruct", speaker=SPK, instruct_text="Speak slowly and calmly."),
}


@pytest.mark.parametrize("mode", list(MODE_KWARGS))
def test_mode_end_to_end_length_and_seed(model: Any, audio: dict[str, Path], mode: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    pipeline = model.runtime.pipeline
    real = pipeline.token2wav
    seen: list[int] = []

    def counting(tokens, **kwargs):  # type: ignore[no-untyped-def]
        tokens = list(tokens)
        seen.append(len(tokens))
        return real(tokens, **kwargs)

    monkeypatch.setattr(pipeline, "token2wav", counting)
    kwargs = MODE_KWARGS[mode](audio)
    a = model.synthesize_all("Hi.", seed=11, **kwargs)
    b = model.synthesize_all("Hi.", seed=11, **kwargs)
    assert a.dtype == np.float32 and a.ndim == 1
    # the audio is exactly what the reference's one-shot token2wav makes of the LLM's tokens
    assert len(seen) == 2 and seen[0] == seen[1] and seen[0] > 0
    assert a.size == mel_samples(seen[0]), f"{mode}: audio length does not follow the token count"
    assert np.array_equal(a, b), f"{mode}: the same seed gave different audio"


def test_vc_length_follows_source_tokens_and_seed(model: Any, audio: dict[str, Path]) -> None:
    a = model.synthesize_all(mode="vc", source_wav=audio["source"], prompt_wav=audio["prompt"], seed=3)
    b = model.synthesize_all(mode="vc", source_wav=audio["source"], prompt_wav=audio["prompt"], seed=3)
    # 1 s at 16 kHz -> 100 whisper frames -> 50 speech tokens (50 Hz) straight to token2wav
    assert a.size == mel_samples(50)
    assert np.array_equal(a, b)
    c = model.synthesize_all(mode="vc", source_wav=audio["source"], prompt_wav=audio["prompt"], seed=4)
    assert not np.array_equal(a, c), "the seed does not reach the flow / vocoder draws in vc mode"


def test_zero_shot_tier_loads_on_first_prompt_request_only(
    tiny_model_dir: Path, audio: dict[str, Path]
) -> None:
    m = cosyserve.load(tiny_model_dir, warmup=False)
    p = m.runtime.pipeline
    list(m.synthesize("Hi.", SPK, seed=0))
    list(m.synthesize("Hi.", SPK, mode="instruct", instruct_text="Be happy.", seed=0))
    assert not p.frontend_loaded, "SFT / instruct created the zero-shot tier"
    list(m.synthesize("Hi.", mode="cross_lingual", prompt_wav=audio["prompt"], seed=0))
    assert p.frontend_loaded and p.frontend().campplus.loaded and p.frontend().speech_tokenizer.loaded


# ---------------------------------------------------------------------------------------------------------------------
# input assembly, mode by mode


def test_sft_assembly(model: Any, rec: Recorder) -> None:
    list(model.synthesize("Hello world.", SPK, seed=0))
    (llm,) = rec.llm_calls
    emb = model.runtime.pipeline.speakers[SPK]["embedding"]
    assert same(
        llm["text"],
        torch.tensor([model.runtime.pipeline.tokenizer.encode("Hello world.")], dtype=torch.int32),
    )
    assert llm["prompt_text"].shape == (1, 0) and llm["prompt_speech_token"].shape == (1, 0)
    assert same(llm["embedding"], emb)
    (t2w,) = rec.t2w_calls
    assert (
        same(t2w["embedding"], emb)
        and t2w["prompt_token"].shape == (1, 0)
        and t2w["prompt_feat"].shape == (1, 0, 80)
    )


def test_zero_shot_assembly_matches_reference_frontend(
    model: Any, rec: Recorder, audio: dict[str, Path], reference_frontend: Frontend
) -> None:
    list(
        model.synthesize(
            "Hello world.", mode="zero_shot", prompt_wav=audio["prompt"], prompt_text=PROMPT_TEXT
        )
    )
    ref = reference_frontend.frontend_zero_shot("Hello world.", normalized(PROMPT_TEXT), audio["prompt"], "")
    (llm,) = rec.llm_calls
    assert same(llm["text"], ref["text"]) and same(llm["text_len"], ref["text_len"])
    assert same(llm["prompt_text"], ref["prompt_text"]) and same(
        llm["prompt_text_len"], ref["prompt_text_len"]
    )
    assert same(llm["prompt_speech_token"], ref["llm_prompt_speech_token"])
    assert same(llm["prompt_speech_token_len"], ref["llm_prompt_speech_token_len"])
    assert same(llm["embedding"], ref["llm_embedding"])
    (t2w,) = rec.t2w_calls
    assert t2w["tokens"] == list(range(100, 112))
    assert same(t2w["prompt_token"], ref["flow_prompt_speech_token"])
    assert same(t2w["prompt_feat"], ref["prompt_speech_feat"])
    assert same(t2w["embedding"], ref["flow_embedding"])


def test_zero_shot_long_text_one_llm_call_per_piece_same_prompt(
    model: Any, rec: Recorder, audio: dict[str, Path]
) -> None:
    text = " ".join(["This sentence is here to make the text long enough to be split into pieces."] * 8)
    pieces = model.runtime.pipeline.split_text(text)
    assert len(pieces) >= 2
    list(model.synthesize(text, mode="zero_shot", prompt_wav=audio["prompt"], prompt_text=PROMPT_TEXT))
    assert len(rec.llm_calls) == len(pieces) == len(rec.t2w_calls)
    enc = model.runtime.pipeline.tokenizer.encode
    for call, piece in zip(rec.llm_calls, pieces, strict=True):
        assert call["text"].tolist() == [enc(piece)]
        assert same(call["prompt_speech_token"], rec.llm_calls[0]["prompt_speech_token"])
        assert same(call["prompt_text"], rec.llm_calls[0]["prompt_text"])


def test_cross_lingual_assembly_drops_llm_prompt(
    model: Any, rec: Recorder, audio: dict[str, Path], reference_frontend: Frontend
) -> None:
    list(model.synthesize("Hello world.", mode="cross_lingual", prompt_wav=audio["prompt_24k"]))
    ref = reference_frontend.frontend_cross_lingual("Hello world.", audio["prompt_24k"], "")
    assert "prompt_text" not in ref and "llm_prompt_speech_token" not in ref
    (llm,) = rec.llm_calls
    assert same(llm["text"], ref["text"])
    assert llm["prompt_text"].shape == (1, 0) and llm["prompt_speech_token"].shape == (1, 0)
    assert same(llm["embedding"], ref["llm_embedding"])
    (t2w,) = rec.t2w_calls
    assert same(t2w["prompt_token"], ref["flow_prompt_speech_token"])
    assert same(t2w["prompt_feat"], ref["prompt_speech_feat"])
    assert same(t2w["embedding"], ref["flow_embedding"])


def test_instruct_assembly_has_no_llm_embedding(
    model: Any, rec: Recorder, reference_frontend: Frontend
) -> None:
    instruct = "Speak slowly and calmly."
    list(model.synthesize("Hello world.", SPK, mode="instruct", instruct_text=instruct))
    ref = reference_frontend.frontend_instruct("Hello world.", SPK, normalized(instruct))
    (llm,) = rec.llm_calls
    assert same(llm["text"], ref["text"])
    assert same(llm["prompt_text"], ref["prompt_text"]) and same(
        llm["prompt_text_len"], ref["prompt_text_len"]
    )
    assert llm["prompt_speech_token"].shape == (1, 0)
    assert llm["embedding"].shape == (0, 192), "instruct mode must not give the LLM a speaker embedding"
    (t2w,) = rec.t2w_calls
    assert same(t2w["embedding"], ref["flow_embedding"])
    assert t2w["prompt_token"].shape == (1, 0) and t2w["prompt_feat"].shape == (1, 0, 80)


def test_vc_assembly_bypasses_llm(
    model: Any, rec: Recorder, audio: dict[str, Path], reference_frontend: Frontend
) -> None:
    list(model.synthesize(mode="vc", source_wav=audio["source"], prompt_wav=audio["prompt"], stream=True))
    ref = reference_frontend.frontend_vc(audio["source"], audio["prompt"])
    assert rec.llm_calls == []
    (t2w,) = rec.t2w_calls
    assert t2w["tokens"] == ref["source_speech_token"].flatten().tolist()
    assert same(t2w["prompt_token"], ref["flow_prompt_speech_token"])
    assert same(t2w["prompt_feat"], ref["prompt_speech_feat"])
    assert same(t2w["embedding"], ref["flow_embedding"])
    assert t2w["stream"] is True


def test_registered_voice_is_the_reference_zero_shot_spk_entry(
    model: Any, rec: Recorder, audio: dict[str, Path], reference_frontend: Frontend
) -> None:
    spk = model.add_speaker("assembly-voice", audio["prompt"], PROMPT_TEXT, overwrite=True)
    ref = reference_frontend.frontend_zero_shot("", normalized(PROMPT_TEXT), audio["prompt"], "")
    del ref["text"], ref["text_len"]
    assert set(spk.features) == set(ref) and all(same(spk.features[k], ref[k]) for k in ref)
    list(model.synthesize("Hello world.", "assembly-voice"))  # a registered voice: zero_shot by default
    list(model.synthesize("Hello world.", "assembly-voice", mode="cross_lingual"))
    zs, cl = rec.llm_calls
    assert same(zs["prompt_speech_token"], ref["llm_prompt_speech_token"]) and same(
        zs["prompt_text"], ref["prompt_text"]
    )
    assert cl["prompt_speech_token"].shape == (1, 0) and cl["prompt_text"].shape == (1, 0)
    assert same(cl["embedding"], ref["llm_embedding"])
    assert all(same(c["prompt_feat"], ref["prompt_speech_feat"]) for c in rec.t2w_calls)


def test_registered_voice_gives_the_same_audio_as_its_prompt(
    model: Any, audio: dict[str, Path], tmp_path: Path
) -> None:
    model.add_speaker("same-voice", audio["prompt"], PROMPT_TEXT, overwrite=True)
    stats = model.runtime.pipeline.decoder.stats
    kept = stats.prefix_positions
    inline = model.synthesize_all(
        "Hello world.", mode="zero_shot", prompt_wav=audio["prompt"], prompt_text=PROMPT_TEXT, seed=5
    )
    registered = model.synthesize_all("Hello world.", "same-voice", seed=5)
    assert np.array_equal(inline, registered)
    # the LM's prompt prefix (sos, speaker, prompt text) the inline request left served the registered one
    assert stats.prefix_positions > kept, "a voice's second request prefilled its prompt text again"
    # persisted: a fresh registry over the same folder (a restart) serves the voice
    from cosyserve.voices.registry import SpeakerRegistry

    again = SpeakerRegistry(model.runtime.registry_root).get("same-voice")
    assert again is not None and again.prompt_text == PROMPT_TEXT
    assert "same-voice" in model.speakers and model.speakers.index(SPK) < model.speakers.index("same-voice")


# ---------------------------------------------------------------------------------------------------------------------
# errors


def test_model_without_onnx_serves_sft_and_names_missing_file(
    tmp_path: Path, audio: dict[str, Path], model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cosyserve.families.testmodel import make_test_model

    monkeypatch.setenv("COSYSERVE_CACHE_DIR", str(tmp_path / "cache"))
    make_test_model(tmp_path / "bare-Instruct", size="tiny", seed=0, onnx=False)
    m = cosyserve.load(tmp_path / "bare-Instruct", warmup=False, registry_dir=str(tmp_path / "registry"))
    assert m.available_modes == ["sft", "instruct"]
    assert "campplus.onnx" in m.unavailable_modes()["zero_shot"]
    assert m.synthesize_all("Hi.", SPK, seed=0).size > 0
    for kwargs in (
        dict(mode="zero_shot", prompt_wav=audio["prompt"], prompt_text=PROMPT_TEXT),
        dict(mode="cross_lingual", prompt_wav=audio["prompt"]),
    ):
        with pytest.raises(
            ModeUnavailableError, match=r"unavailable: .*campplus\.onnx or speech_tokenizer_v1\.onnx"
        ):
            m.synthesize("Hi.", **kwargs)
    with pytest.raises(ModeUnavailableError, match="vc synthesis is unavailable"):
        m.synthesize(mode="vc", source_wav=audio["source"], prompt_wav=audio["prompt"])
    with pytest.raises(ModeUnavailableError, match="campplus.onnx"):
        m.add_speaker("x", audio["prompt"], PROMPT_TEXT)
    assert not m.runtime.pipeline.frontend_loaded
    # features registered elsewhere need no extraction: an imported voice works without the ONNX models
    model.add_speaker("portable", audio["prompt"], PROMPT_TEXT, overwrite=True)
    model.export_speakers(tmp_path / "spk2info.pt")
    m.import_speakers(tmp_path / "spk2info.pt")
    assert m.synthesize_all("Hi.", "portable", seed=0).size > 0


@pytest.fixture(scope="module")
def bad_audio(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, str]]:
    d = tmp_path_factory.mktemp("bad")
    (d / "empty.wav").write_bytes(b"")
    (d / "junk.wav").write_bytes(b"this is not audio at all\n" * 50)
    soundfile.write(d / "silent.wav", np.zeros(32000, dtype=np.float32), 16000, subtype="PCM_16")
    square = np.sign(np.sin(2 * np.pi * 200 * np.arange(32000) / 16000)).astype(np.float32)
    soundfile.write(d / "clipped.wav", square, 16000, subtype="PCM_16")
    write_voice(d / "long.wav", 31.0)
    soundfile.write(d / "8k.wav", np.full(16000, 0.1, dtype=np.float32), 8000, subtype="PCM_16")
    return {
        "empty file": (d / "empty.wav", r"cannot decode|empty|no samples"),
        "empty bytes": (b"", "empty"),
        "missing file": (d / "nope.wav", "does not exist"),
        "undecodable": (d / "junk.wav", "cannot decode"),
        "undecodable bytes": (b"\x00\x01junk" * 40, "cannot decode"),
        "silent": (d / "silent.wav", "silent"),
        "clipped": (d / "clipped.wav", "clipped"),
        "over 30 s": (d / "long.wav", r"at most 30 s"),
        "8 kHz": (d / "8k.wav", "sample rate 8000"),
    }


BAD_CASES = [
    "empty file",
    "empty bytes",
    "missing file",
    "undecodable",
    "undecodable bytes",
    "silent",
    "clipped",
    "over 30 s",
    "8 kHz",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_prompt_audio_is_a_clear_error(
    model: Any, bad_audio: dict[str, tuple[Any, str]], audio: dict[str, Path], case: str
) -> None:
    wav, needle = bad_audio[case]
    with pytest.raises(AudioError, match=needle) as e:
        model.synthesize("Hi.", mode="zero_shot", prompt_wav=wav, prompt_text=PROMPT_TEXT)
    assert "prompt audio" in str(e.value) or case == "empty bytes"
    with pytest.raises(AudioError, match=needle) as e:
        model.synthesize(mode="vc", source_wav=wav, prompt_wav=audio["prompt"])
    assert "source audio" in str(e.value) or case == "empty bytes"
    with pytest.raises(AudioError, match=needle):
        model.add_speaker("bad", wav, PROMPT_TEXT)
    assert model.runtime.pipeline.registry.get("bad") is None


def test_unreadable_audio_names_its_field_without_object_reprs(model: Any, audio: dict[str, Path]) -> None:
    """A WAV with a broken header must be refused with libsndfile's reason, not the repr of the in-memory file
    object (``<_io.BytesIO object at 0x...>``), and the error must say which field gave the audio, so that a
    server can name it (``param``) in its 400."""
    bad = b"RIFF" + (100).to_bytes(4, "little") + b"WAVEfmt " + bytes(40)  # a 'fmt ' chunk cut short
    with pytest.raises(AudioError) as e:
        model.synthesize("Hi.", mode="zero_shot", prompt_wav=bad, prompt_text=PROMPT_TEXT)
    assert e.value.param == "prompt_wav", "the error does not name the field that gave the audio"
    assert "object at 0x" not in str(e.value) and "not a readable audio file" in str(e.value), str(e.value)
    assert "fmt" in str(e.value), f"libsndfile's reason is missing: {e.value}"
    with pytest.raises(AudioError) as e:
        model.synthesize(mode="vc", source_wav=bad, prompt_wav=audio["prompt"])
    assert e.value.param == "source_wav" and "object at 0x" not in str(e.value)
    with pytest.raises(AudioError) as e:
        model.synthesize(mode="vc", source_wav=audio["source"], prompt_wav=bad)
    assert e.value.param == "prompt_wav"


@pytest.mark.parametrize("text", ["!!!", "\u200b\u200b", "\u200d\u2060 \ufeff", "\u3000\u200b.", "…"])
@pytest.mark.parametrize("normalize", [True, False])
def test_text_with_nothing_to_speak_is_refused_alike(model: Any, text: str, normalize: bool) -> None:
    """Zero-width characters have as little to speak as punctuation: both must be refused, naming ``text``,
    instead of sending invisible characters to the LLM (which makes audio of noise)."""
    with pytest.raises(ClientError, match="nothing to speak") as e:
        model.synthesize_request(SynthesisRequest(text=text, speaker=SPK, normalize=normalize))
    assert e.value.param == "text"


@pytest.mark.parametrize("speed", [0.25, 4.0])
def test_openai_speed_range_stretches_the_audio(model: Any, speed: float) -> None:
    """OpenAI's speed range (0.25-4.0) must be served, and the audio must be 1/speed as long (the mel is
    stretched in time, within one mel frame of 256 samples): if this fails, a speed is refused or ignored."""
    req = SynthesisRequest(mode="sft", text="Hello there, how are you?", speaker=SPK, seed=5)
    base = np.concatenate(list(model.synthesize_request(req)))
    out = np.concatenate(list(model.synthesize_request(dataclasses.replace(req, speed=speed))))
    assert abs(out.size - base.size / speed) <= 256, (out.size, base.size, speed)
    assert np.isfinite(out).all() and 0 < np.abs(out).max() <= 1.0
    for bad in (0.2, 4.5, float("nan")):
        with pytest.raises(ClientError, match=r"between 0\.25 and 4\.0|number") as e:
            model.synthesize_request(dataclasses.replace(req, speed=bad))
        assert e.value.param == "speed"


def test_instruct_needs_an_instruct_model(plain_model_dir: Path, tiny_model_dir: Path) -> None:
    """As in the reference, instruct mode runs only on an -Instruct model: the same weights converted from a
    directory not named like one must refuse it (naming instruct_text), and still serve sft."""
    from cosyserve.api import resolve_bundle
    from cosyserve.bundle.loader import open_bundle

    plain = cosyserve.load(plain_model_dir, warmup=False)
    assert "instruct" not in plain.available_modes and "instruct" in plain.unavailable_modes()
    with pytest.raises(ModeUnavailableError, match="not an instruct model") as e:
        plain.synthesize("Hi.", SPK, mode="instruct", instruct_text="Speak calmly.")
    assert e.value.param == "instruct_text"
    assert plain.synthesize_all("Hi.", SPK, seed=0).size > 0
    assert plain.runtime.bundle.manifest["instruct"] is False
    instruct = open_bundle(resolve_bundle(tiny_model_dir, progress=False))
    assert instruct.manifest["instruct"] is True and instruct.instruct


def test_prompt_audio_error_is_raised_before_any_audio(
    model: Any, bad_audio: dict[str, tuple[Any, str]]
) -> None:
    # errors come from synthesize() itself, so a server can answer 4xx before streaming starts
    with pytest.raises(AudioError):
        model.synthesize("Hi.", mode="cross_lingual", prompt_wav=bad_audio["silent"][0])


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(mode="zero_shot", prompt_wav="P"), "needs prompt_text"),
        (dict(mode="zero_shot", prompt_text=PROMPT_TEXT), "needs prompt_wav"),
        (
            dict(mode="cross_lingual", prompt_wav="P", prompt_text="x"),
            "prompt_text is not used in cross_lingual",
        ),
        (dict(mode="sft", speaker=SPK, prompt_wav="P"), "prompt_wav is not used in sft"),
        (dict(mode="instruct", speaker=SPK), "needs instruct_text"),
        (dict(mode="vc", prompt_wav="P"), "vc mode needs source_wav"),
        (dict(mode="zero_shot", speaker="v", prompt_wav="P"), "not both"),
        (dict(mode="karaoke", speaker=SPK), "unknown mode 'karaoke'"),
        (dict(mode="zero_shot", speaker=SPK), "pre-defined speaker"),
        (dict(mode="zero_shot", speaker="nobody"), "unknown speaker 'nobody'"),
    ],
)
def test_bad_field_combinations(model: Any, kwargs: dict[str, Any], needle: str) -> None:
    text = "" if kwargs.get("mode") == "vc" else "Hi."
    with pytest.raises(ClientError, match=needle):
        model.synthesize(text, **kwargs)


def test_vc_refuses_text_and_registered_voice_refuses_sft(model: Any, audio: dict[str, Path]) -> None:
    with pytest.raises(ClientError, match="text is not used in vc"):
        model.synthesize("Hi.", mode="vc", source_wav=audio["source"], prompt_wav=audio["prompt"])
    model.add_speaker("zs-only", audio["prompt"], PROMPT_TEXT, overwrite=True)
    with pytest.raises(ClientError, match="registered zero-shot voice"):
        model.synthesize("Hi.", "zs-only", mode="sft")
    with pytest.raises(ClientError, match="pre-defined speaker"):
        model.add_speaker(SPK, audio["prompt"], PROMPT_TEXT)


def test_request_object_and_replace(model: Any, audio: dict[str, Path]) -> None:
    req = SynthesisRequest(mode="sft", text="Hi.", speaker=SPK, seed=2)
    a = np.concatenate(list(model.synthesize_request(req)))
    b = np.concatenate(list(model.synthesize_request(dataclasses.replace(req, speed=2.0))))
    assert math.isclose(b.size, a.size / 2, abs_tol=256)
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.mode = "vc"  # type: ignore[misc]


def test_no_speaker_means_the_default_voice(model: Any) -> None:
    """A request that names no speaker (an OpenAI voice alias over HTTP) speaks in the model's default voice:
    the first pre-defined speaker, byte for byte, unless a default voice is configured."""
    first = model.runtime.speakers()[0]
    a = model.synthesize_all("Hi.", None, seed=5)
    b = model.synthesize_all("Hi.", first, seed=5)
    np.testing.assert_array_equal(a, b)


def test_a_huge_unknown_speaker_name_is_cut_in_messages(model: Any, reference_frontend: Frontend) -> None:
    """A 100,000-character speaker name is shown cut (its first characters and its length) by the Python API, the
    runtime and the frontend, as the server shows it: if this fails, the CLI prints, and a caller logs, the whole
    name."""
    from cosyserve.core.errors import UnknownVoiceError

    name = "v" * 100_000
    for mode in (None, "zero_shot"):  # the Python API refuses it by the voice name's limit, unrepeated
        with pytest.raises(ClientError, match="speaker is 100000 characters; the limit is 256") as e:
            model.synthesize("Hi.", name, mode=mode)
        assert e.value.param == "speaker" and len(str(e.value)) < 1000
    calls = (
        lambda: model.runtime.resolve(SynthesisRequest(text="Hi.", speaker=name)),
        lambda: model.runtime.resolve(SynthesisRequest(text="Hi.", speaker=name, mode="zero_shot")),
        lambda: reference_frontend.frontend_sft("Hi.", name),
        lambda: reference_frontend.frontend_zero_shot("Hi.", "", b"", zero_shot_spk_id=name),
        lambda: reference_frontend.frontend_cross_lingual("Hi.", b"", zero_shot_spk_id=name),
    )
    for call in calls:
        with pytest.raises(UnknownVoiceError) as e:
            call()
        assert len(str(e.value)) < 1000 and "(100000 characters)" in str(e.value), str(e.value)[:200]


@pytest.mark.parametrize("runtime", ["torch", "lite"])
def test_a_resolved_request_is_prepared_as_it_is(
    model: Any, tiny_lite_bundle: Path, monkeypatch: pytest.MonkeyPatch, runtime: str
) -> None:
    """A request resolved once on its way (by the engine, or a WebSocket session for all its utterances) is
    prepared as it is: the runtime resolved every request again (a WebSocket utterance was resolved three times).
    One that is not resolved (a caller of ``Runtime.start`` itself) is resolved there, once."""
    from cosyserve.core.request import ResolvedRequest
    from cosyserve.runtime import RuntimeOptions, load_runtime

    rt = (
        model.runtime
        if runtime == "torch"
        else load_runtime(tiny_lite_bundle, RuntimeOptions(warmup=False), runtime="lite")
    )
    try:
        resolved = rt.resolve(SynthesisRequest(text="Hi.", seed=1))
        assert isinstance(resolved, ResolvedRequest) and resolved.mode == "sft" and resolved.speaker, resolved
        calls: list[Any] = []
        real = rt.pipeline.resolve
        monkeypatch.setattr(rt.pipeline, "resolve", lambda r: calls.append(r) or real(r))
        rt.start(resolved, lambda: True).close()
        assert calls == [], "the runtime resolved a resolved request again"
        rt.start(SynthesisRequest(text="Hi.", seed=1), lambda: True).close()
        assert len(calls) == 1
    finally:
        if runtime == "lite":
            rt.close()
