"""Prompt recordings of any length the limits allow (0.1 s to 30 s) and any usual rate (16, 22.05, 24, 44.1 kHz) work
in every prompt mode of every family.

CosyVoice2 and 3 speak 25 speech tokens (P) and 50 mel frames (F) per second of prompt, and the two are computed
from differently resampled copies of it, so F is 2P only for some lengths. The reference's zero-shot frontends
(and so cross-lingual and instruct2) trim both to F = 2P; its vc frontend trims nothing, and its causal flow takes
the mismatch: the output is the last 2(P + S) - F frames, so the d = 2P - F frames of the last prompt tokens come
first (KINDS-cosyvoice3.md, ``vc_frontend`` and "Downstream"). Here:

- every length at every rate through the CosyVoice2 and CosyVoice3 frontends (trimmed for zero-shot, untrimmed
  for vc) and their flows (output length 2(P + S) - F);
- every length end to end in the prompt modes of the tiny CosyVoice2 model (torch) and CosyVoice-300M model (torch
  and lite), the modes and rates taking turns (every mode at the shortest and longest), with CosyVoice2 vc's exact
  output length one-shot and streamed (d = 0, 1, 2);
- a prompt under the 0.1 s minimum refused with one line naming it, on each runtime.

CosyVoice3 is checked at the frontend and flow level only: the runtimes do not serve it yet.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile

from cosyserve.core.errors import AudioError
from cosyserve.frontend.prompt import load_prompt

LENGTHS = (0.1, 0.5, 1.0, 2.0, 3.0, 3.19, 4.37, 5.0, 10.0, 29.9)
RATES = (16000, 22050, 24000, 44100)
# end to end, length i is recorded at RATES[i % 4]
TURNS = [(seconds, RATES[i % len(RATES)]) for i, seconds in enumerate(LENGTHS)]
CV2_MODES = ("zero_shot", "cross_lingual", "instruct2", "vc")
CV300M_MODES = ("zero_shot", "cross_lingual", "vc")


def _turns(modes: tuple[str, ...]) -> list[tuple[str, float, int]]:
    """(mode, seconds, rate): every mode after the shortest and the longest prompt, the lengths between taken by the
    modes in turn (the frontend test above runs every length at every rate; end to end, what a length changes is
    the prompt's shapes, the same in every mode of a family)."""
    last = len(TURNS) - 1
    return [
        (mode, seconds, rate)
        for i, (seconds, rate) in enumerate(TURNS)
        for j, mode in enumerate(modes)
        if i in (0, last) or j == i % len(modes)
    ]


SAMPLES_PER_FRAME = 480  # CosyVoice2's vocoder: 24 kHz, 50 mel frames per second


@functools.cache
def voice(seconds: float, rate: int) -> bytes:
    """A voiced tone (not silent, not clipped) as 16-bit WAV bytes, ``round(seconds * rate)`` samples long."""
    t = np.arange(round(seconds * rate)) / rate
    wave = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.3 * np.sin(2 * np.pi * 3 * t))
    buf = io.BytesIO()
    soundfile.write(buf, wave.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


class _NoText:
    # the frontend level speaks no text (the transcript is empty): no tokenizer to load
    def encode(self, text: str) -> list[int]:
        return []


# ---------------------------------------------------------------------------------------------------------------------
# frontend and flow, every length at every rate


def _frontend_and_flow(family: str, model_dir: Path) -> tuple[Any, Any]:
    from cosyserve.tools.conformance.context import CaseContext

    ctx = CaseContext(model_dir, model_dir)
    if family == "cosyvoice3":
        from cosyserve.families.cosyvoice3.frontend import build_frontend

        frontend = build_frontend(model_dir, ctx.config)
    else:
        from cosyserve.frontend.features import mel_spectrogram_24k
        from cosyserve.frontend.zeroshot import Frontend, OnnxModel

        frontend = Frontend(
            model_dir, tokenizer=_NoText(), feat_extractor=mel_spectrogram_24k, mel_per_token=2
        )
        frontend.speech_tokenizer = OnnxModel(model_dir / "speech_tokenizer_v2.onnx")
    return frontend, ctx.flow()


@pytest.fixture(scope="module", params=["cosyvoice2", "cosyvoice3"])
def family_parts(request: pytest.FixtureRequest) -> tuple[str, Any, Any]:
    model_dir = request.getfixturevalue("cv2_model_dir" if request.param == "cosyvoice2" else "cv3_model_dir")
    return (request.param, *_frontend_and_flow(request.param, model_dir))


def test_every_length_and_rate_through_the_frontends_and_flow(family_parts: tuple[str, Any, Any]) -> None:
    """zero-shot trims the prompt to F = 2P (the reference's ``token_len = min(F // 2, P)``); vc keeps both whole,
    so F differs from 2P for some lengths (3.19 s at 16 kHz: P 80, F 159; 4.37 s at 44.1 kHz: P 110, F 218, as the
    reference's ``vc_frontend`` cases record), and the flow turns either into 2(P + S) - F frames. If this fails, a
    frontend trims where the reference does not (wrong vc audio) or not where it does, or the flow refuses the
    reference's vc input (the "prompt_feat has 159 frames for 80 prompt tokens" failure)."""
    family, frontend, flow = family_parts
    source = voice(0.5, 16000)
    d_seen: dict[int, list[tuple[float, int]]] = {}
    flowed: set[tuple[int, int]] = set()
    for seconds in LENGTHS:
        for rate in RATES:
            prompt = load_prompt(voice(seconds, rate))
            raw_feat = frontend.extract_speech_feat(prompt.speech_24k)[0].shape[1]
            raw_tokens = frontend.extract_speech_token(prompt.speech_16k)[0].shape[1]
            where = f"{family}, {seconds} s at {rate} Hz"

            zs = frontend.prompt_features("", prompt)
            n = min(raw_feat // 2, raw_tokens)
            assert (
                zs["flow_prompt_speech_token"].shape[1] == n and zs["prompt_speech_feat"].shape[1] == 2 * n
            ), where
            assert (
                int(zs["prompt_speech_feat_len"][0]) == 2 * n
                and int(zs["flow_prompt_speech_token_len"][0]) == n
            )

            vc = frontend.frontend_vc(source, prompt)
            p, f = vc["flow_prompt_speech_token"].shape[1], vc["prompt_speech_feat"].shape[1]
            assert (p, f) == (raw_tokens, raw_feat), (
                f"{where}: vc trimmed the prompt to {p} tokens, {f} frames"
            )
            assert (
                int(vc["flow_prompt_speech_token_len"][0]) == p and int(vc["prompt_speech_feat_len"][0]) == f
            )
            d_seen.setdefault(2 * p - f, []).append((seconds, rate))

            s = vc["source_speech_token"].shape[1]
            for tokens, feat in ((zs["flow_prompt_speech_token"], zs["prompt_speech_feat"]),
                                 (vc["flow_prompt_speech_token"], vc["prompt_speech_feat"])):  # fmt: skip
                key = (tokens.shape[1], feat.shape[1])
                if key in flowed:  # the flow sees only the shapes' lengths: one run per pair
                    continue
                flowed.add(key)
                mel = flow.inference(
                    vc["source_speech_token"], tokens, feat, vc["flow_embedding"],
                    streaming=False, finalize=True, n_timesteps=1,
                )  # fmt: skip
                assert mel.shape[2] == 2 * (key[0] + s) - key[1], f"{where}: P, F = {key}"
                assert bool(mel.isfinite().all()), where
    assert set(d_seen) <= {0, 1, 2}, f"F = 2P - d with d outside 0-2: {d_seen}"
    assert (3.19, 16000) in d_seen.get(1, []) and (4.37, 44100) in d_seen.get(2, []), d_seen


# ---------------------------------------------------------------------------------------------------------------------
# end to end, every mode


@pytest.fixture(scope="module")
def cv2(cv2_model_dir: Path) -> Any:
    import cosyserve

    # one Euler step: the lengths and shapes are what is checked, and they do not depend on the steps
    return cosyserve.load(cv2_model_dir, flow_steps=1, warmup=False)


@pytest.fixture(scope="module")
def cv2_frontend(cv2_model_dir: Path) -> Any:
    return _frontend_and_flow("cosyvoice2", cv2_model_dir)[0]


@pytest.fixture(scope="module", params=["torch", "lite"])
def cv300m(request: pytest.FixtureRequest) -> Iterator[Any]:
    import cosyserve

    path = request.getfixturevalue("tiny_model_dir" if request.param == "torch" else "tiny_lite_bundle")
    model = cosyserve.load(path, runtime=request.param, flow_steps=1, warmup=False)
    yield model
    model.close()


def _kwargs(mode: str, prompt: bytes, source: bytes) -> dict[str, Any]:
    return {
        "zero_shot": dict(prompt_wav=prompt, prompt_text="Hello there."),
        "cross_lingual": dict(prompt_wav=prompt),
        "instruct2": dict(prompt_wav=prompt, instruct_text="Speak slowly.<|endofprompt|>"),
        "vc": dict(prompt_wav=prompt, source_wav=source),
    }[mode]


def _speak(model: Any, mode: str, seconds: float, rate: int, **kwargs: Any) -> list[np.ndarray]:
    source = kwargs.pop("source", voice(0.5, 16000))
    text = "" if mode == "vc" else "Hi."
    chunks = [
        c.copy()
        for c in model.synthesize(
            text, mode=mode, seed=1, **_kwargs(mode, voice(seconds, rate), source), **kwargs
        )
    ]
    audio = np.concatenate(chunks)
    assert audio.size > 0 and np.isfinite(audio).all(), f"{mode}, {seconds} s at {rate} Hz"
    return chunks


@pytest.mark.parametrize(("mode", "seconds", "rate"), _turns(CV2_MODES))
def test_cosyvoice2_speaks_after_any_prompt_length(
    cv2: Any, cv2_frontend: Any, mode: str, seconds: float, rate: int
) -> None:
    """Every CosyVoice2 prompt mode gives finite audio after a prompt of this length; vc's is 480(2S + d) samples
    (S source tokens, d = 2P - F), the reference's length. If this fails, a prompt length a user records by chance
    fails (vc refused most lengths before), or vc drops or adds frames the reference keeps."""
    chunks = _speak(cv2, mode, seconds, rate)
    if mode == "vc":
        vc = cv2_frontend.frontend_vc(voice(0.5, 16000), voice(seconds, rate))
        s = vc["source_speech_token"].shape[1]
        d = 2 * vc["flow_prompt_speech_token"].shape[1] - vc["prompt_speech_feat"].shape[1]
        assert sum(c.size for c in chunks) == SAMPLES_PER_FRAME * (2 * s + d), (s, d)


# d = 0, 1 and 2 (the frontend test above finds 3.19 s at 16 kHz gives d 1, 4.37 s at 44.1 kHz d 2)
@pytest.mark.parametrize(("seconds", "rate"), [(2.0, 24000), (3.19, 16000), (4.37, 44100)])
def test_cosyvoice2_streamed_vc_repeats_d_frames_per_chunk(
    cv2: Any, cv2_frontend: Any, seconds: float, rate: int
) -> None:
    """Streamed vc drops 2 frames per token already spoken from each chunk's flow output, which starts d frames
    early: each chunk repeats d frames, 480(2S + d * chunks) samples in all (the reference's token2wav). If this
    fails, the streaming offsets no longer follow the reference's token arithmetic when F != 2P."""
    source = voice(
        2.4, 16000
    )  # 60 tokens: two chunks or more after any prompt (its pad tops P up to 25 tokens)
    chunks = _speak(cv2, "vc", seconds, rate, source=source, stream=True)
    vc = cv2_frontend.frontend_vc(source, voice(seconds, rate))
    s = vc["source_speech_token"].shape[1]
    d = 2 * vc["flow_prompt_speech_token"].shape[1] - vc["prompt_speech_feat"].shape[1]
    assert len(chunks) >= 2, "expected a streamed answer in several chunks"
    assert sum(c.size for c in chunks) == SAMPLES_PER_FRAME * (2 * s + d * len(chunks)), (s, d, len(chunks))


@pytest.mark.parametrize(("mode", "seconds", "rate"), _turns(CV300M_MODES))
def test_cosyvoice_300m_speaks_after_any_prompt_length(
    cv300m: Any, mode: str, seconds: float, rate: int
) -> None:
    """CosyVoice-300M's prompt modes on both runtimes (its flow's length regulator takes any prompt mel). If this
    fails, a prompt length or rate that the limits accept breaks a runtime."""
    _speak(cv300m, mode, seconds, rate)


def test_a_prompt_under_the_minimum_is_one_line_naming_it(cv2: Any, cv300m: Any) -> None:
    """0.1 s is the shortest prompt (PromptLimits.min_seconds). The reference checks no minimum: under one 25 ms
    fbank window its features are empty and its feature code or ONNX runs raise. Shorter than 0.1 s is a client
    error naming the minimum and the field, not a crash in a model."""
    for model in (cv2, cv300m):
        for mode in ("zero_shot", "vc"):
            with pytest.raises(AudioError, match=r"give at least 0\.1 s") as e:
                text = "" if mode == "vc" else "Hi."
                model.synthesize(text, mode=mode, **_kwargs(mode, voice(0.09, 44100), voice(0.5, 16000)))
            assert "\n" not in str(e.value) and e.value.param == "prompt_wav", str(e.value)
