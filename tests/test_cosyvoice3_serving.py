"""CosyVoice3 served as the other families are, on a tiny random-weight model in the official layout
(make-test-model --family cosyvoice3): every mode through the Python API, streamed and not, with seeds; the
documented completion of a request without ``<|endofprompt|>``; registered voices (Python API and CLI); the chunk
policies; the batching LM; int8 and bfloat16; the HTTP routes; the startup report; prefork workers; and the
one-line errors of a broken model dir. Equality with the reference is the conformance fixtures' job
(tests/test_conformance.py runs the CosyVoice3 set); the modules' own properties are tests/test_cosyvoice3.py's.

Most tests use one flow Euler step (``flow_steps=1``): what is tested here is the wiring around the modules, which
the step count does not change."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import torch
from tests.test_cosyvoice2 import wav_bytes  # a voiced 2 s tone

from cli_util import run_main
from server_util import LOAD_S, in_process, running_server, wait_until

SPK = "英文女"
PREFIX = "You are a helpful assistant.<|endofprompt|>"  # the documented default (families/cosyvoice3)
LONG = "Hello there, this is a longer test of streaming."


@pytest.fixture(scope="module")
def prompt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cv3-prompt") / "prompt.wav"
    path.write_bytes(wav_bytes())
    return path


@pytest.fixture(scope="module")
def model(cv3_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    import cosyserve

    m = cosyserve.load(cv3_model_dir, flow_steps=1, registry_dir=str(tmp_path_factory.mktemp("cv3-registry")))
    yield m
    m.close()


def _modes(prompt: Path) -> dict[str, dict[str, Any]]:
    return {
        "sft": dict(speaker=SPK),
        "zero_shot": dict(prompt_wav=prompt, prompt_text="Hello there."),
        "cross_lingual": dict(prompt_wav=prompt),
        "instruct2": dict(prompt_wav=prompt, instruct_text="Speak slowly."),
        "vc": dict(prompt_wav=prompt, source_wav=prompt),
    }


def _chunks(model: Any, text: str, **kwargs: Any) -> list[np.ndarray]:
    return [c.copy() for c in model.synthesize(text, stream=True, **kwargs)]


# -- every mode through the Python API -------------------------------------------------------------------------------


def test_every_mode_streamed_and_not_repeats_with_a_seed(model: Any, prompt: Path) -> None:
    """sft, zero_shot, cross_lingual, instruct2 and vc each give finite 24 kHz audio, one-shot and streamed; the
    same seed gives the same samples, and a second stream the same chunks as the first (the reference keeps its
    doubled hop on the model, so its second stream is chunked otherwise: not copied). Streamed and one-shot
    utterances are equally long: every token's frames are spoken once (vc's prompt here is 2.0 s, 2 mel frames per
    token, so its chunks repeat no frame either). If this failed, a mode would be wired to the wrong inputs or keep
    state between requests."""
    assert model.sample_rate == 24000
    assert set(model.available_modes) == {"sft", "zero_shot", "cross_lingual", "instruct2", "vc"}
    for mode, kwargs in _modes(prompt).items():
        text = "" if mode == "vc" else LONG
        one = model.synthesize_all(text, mode=mode, seed=7, **kwargs)
        again = model.synthesize_all(text, mode=mode, seed=7, **kwargs)
        assert one.dtype == np.float32 and one.size > 0 and np.isfinite(one).all(), mode
        assert np.array_equal(one, again), f"{mode}: the same seed gave different audio"
        first, second = (
            _chunks(model, text, mode=mode, seed=7, **kwargs),
            _chunks(model, text, mode=mode, seed=7, **kwargs),
        )
        assert [len(c) for c in first] == [len(c) for c in second], mode
        assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True)), f"{mode}: second stream"
        assert sum(len(c) for c in first) == len(one), f"{mode}: streamed and one-shot lengths differ"


def test_a_stream_shorter_than_the_first_hop_is_the_one_shot_audio(model: Any) -> None:
    """An utterance whose tokens end before the first chunk is due is one finalizing token2wav call, streamed or
    not, as in the reference (CosyVoice3Model.tts): the same samples. If this failed, streaming would run the flow
    or the vocoder differently from one-shot synthesis for the same tokens."""
    one = model.synthesize_all("Hello world.", SPK, seed=4)
    streamed = _chunks(model, "Hello world.", speaker=SPK, seed=4)
    # 960 samples per 25 Hz token: fewer tokens than the low-latency policy's first hop (10) and lookahead (3)
    assert 0 < len(one) // 960 < 13, "pick a seed whose utterance is shorter than the first hop"
    assert len(streamed) == 1 and np.array_equal(streamed[0], one)


def test_the_vocoder_noise_is_replayed_after_ready_not_by_the_first_request(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The torch runtime replays CosyVoice3's fixed vocoder noise in its after-READY thread (the pipeline's
    ``after_ready``, as the lite runtime does): once that thread is done, a request makes no replay. If this
    failed, the first request after READY would pay the replay (~110 ms at full size) before its first audio."""
    runtime = model.runtime
    runtime.join_background()
    assert "vocoder_noise" in runtime.clock.durations, runtime.clock.durations
    noise = runtime.pipeline.token2wav.noise

    def replay(have: Any, samples: int) -> Any:
        raise AssertionError(f"a request replayed the vocoder noise ({samples} samples)")

    monkeypatch.setattr(noise, "_extend", replay)
    assert len(model.synthesize_all("Hello world.", SPK, seed=4)) > 0


def test_text_without_endofprompt_gets_the_documented_default(model: Any, prompt: Path) -> None:
    """CosyVoice3's LM needs <|endofprompt|> in its prompt text or text. A request without one is completed with
    'You are a helpful assistant.<|endofprompt|>' (in the prompt text when the mode has one, else before the text;
    an instruction becomes 'You are a helpful assistant. <instruction><|endofprompt|>'), so it speaks exactly as the
    request that wrote the default itself. If this failed, a client that knows nothing of the marker (any OpenAI
    client) would get an error, or audio from another prompt than the documented one."""
    same = [
        (dict(text="Hello world.", speaker=SPK), dict(text=PREFIX + "Hello world.", speaker=SPK)),
        (
            dict(text="Hello world.", mode="zero_shot", prompt_wav=prompt, prompt_text="Hello there."),
            dict(
                text="Hello world.", mode="zero_shot", prompt_wav=prompt, prompt_text=PREFIX + "Hello there."
            ),
        ),
        (
            dict(text="Hello world.", mode="cross_lingual", prompt_wav=prompt),
            dict(text=PREFIX + "Hello world.", mode="cross_lingual", prompt_wav=prompt),
        ),
        (
            dict(text="Hello world.", mode="instruct2", prompt_wav=prompt, instruct_text="Speak slowly."),
            dict(
                text="Hello world.",
                mode="instruct2",
                prompt_wav=prompt,
                instruct_text="You are a helpful assistant. Speak slowly.<|endofprompt|>",
            ),
        ),
    ]
    for bare, written in same:
        a, b = model.synthesize_all(seed=4, **bare), model.synthesize_all(seed=4, **written)
        assert a.size > 0 and np.array_equal(a, b), bare


def test_an_unknown_tag_is_read_as_text(model: Any, cv3_model_dir: Path) -> None:
    """The tokenizer's tags ([breath], [laughter], the phone and pinyin tags, ...) are one id each; an unknown
    bracketed word such as [foo] is plain text, tokenized as its characters, as the reference's tokenizer does (it
    has no list of tags to refuse): the request is served. If this failed, a typo in a tag would fail a request the
    reference serves, or a known tag would be read as its letters."""
    from cosyserve.families import family_named

    factory = family_named("cosyvoice3").tokenizer(cv3_model_dir)
    assert factory is not None
    tokenizer = factory()
    assert len(tokenizer.encode("[breath]")) == 1 and len(tokenizer.encode("[AA1]")) == 1
    assert tokenizer.encode("Hi [foo] there.") == tokenizer.encode("Hi [") + tokenizer.encode("foo] there.")
    audio = model.synthesize_all("Hello [foo] world [breath].", SPK, seed=2)
    assert audio.size > 0 and np.isfinite(audio).all()


# -- registered voices -----------------------------------------------------------------------------------------------


def test_a_registered_voice_speaks_as_its_recording(model: Any, prompt: Path) -> None:
    """A voice registered once (its prompt features kept in the registry's cosyvoice3 folder) gives the same audio
    in zero_shot, cross_lingual and instruct2 as its recording passed with the request; ``instruct`` with a
    registered voice runs as instruct2 (the OpenAI ``instructions`` path). If this failed, a registered voice would
    speak otherwise than the recording it was made from, or land where another family's model would read it."""
    spk = model.add_speaker("clara", prompt, "Hello there.", overwrite=True)
    assert spk.name == "clara" and "clara" in model.speakers
    registry = Path(model.runtime.options.registry_dir)
    assert list((registry / "cosyvoice3" / "default").glob("*.safetensors")), sorted(registry.rglob("*"))
    pairs = [
        (dict(speaker="clara"), dict(mode="zero_shot", prompt_wav=prompt, prompt_text="Hello there.")),
        (dict(speaker="clara", mode="cross_lingual"), dict(mode="cross_lingual", prompt_wav=prompt)),
        (
            dict(speaker="clara", mode="instruct2", instruct_text="Speak slowly."),
            dict(mode="instruct2", prompt_wav=prompt, instruct_text="Speak slowly."),
        ),
        (
            dict(speaker="clara", mode="instruct", instruct_text="Speak slowly."),
            dict(mode="instruct2", prompt_wav=prompt, instruct_text="Speak slowly."),
        ),
    ]
    for registered, given in pairs:
        a = model.synthesize_all("Hello world.", seed=5, **registered)
        b = model.synthesize_all("Hello world.", seed=5, **given)
        assert a.size > 0 and np.array_equal(a, b), registered


def test_cli_speakers_add_then_synth(
    cv3_model_dir: Path, prompt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """`cosyserve speakers add` registers a voice of a CosyVoice3 model and `synth --speaker` speaks in it at
    24 kHz. If this failed, the CLI would not serve CosyVoice3 voices as it does the other families'."""
    from cosyserve.cli import main

    monkeypatch.setenv("COSYSERVE_REGISTRY_DIR", str(tmp_path / "reg"))
    model = ["--model", str(cv3_model_dir), "--flow-steps", "1"]
    main(["speakers", "add", "bea", "--prompt-wav", str(prompt), "--prompt-text", "Hello there.", *model[:2]])
    main(["speakers", *model[:2]])
    assert "bea  (registered)" in capsys.readouterr().out.splitlines()
    main(
        [
            "synth",
            "--speaker",
            "bea",
            "--text",
            "Hi.",
            "--seed",
            "1",
            "--out",
            str(tmp_path / "a.wav"),
            *model,
        ]
    )
    audio, sr = sf.read(tmp_path / "a.wav")
    assert sr == 24000 and len(audio) > 0
    assert list((tmp_path / "reg" / "cosyvoice3" / "default").glob("*.safetensors"))


# -- the chunk policies, batching, int8 and bfloat16 -----------------------------------------------------------------


def test_low_latency_starts_sooner_than_the_reference_policy(
    model: Any, cv3_model_dir: Path, prompt: Path
) -> None:
    """The low-latency policy's first chunk comes after fewer tokens than the reference's 25 (+3 lookahead), the
    rest doubling up to the same longest hop; both speak every frame once, and one-shot synthesis does not depend
    on the policy. If this failed, --chunk-policy would not reach CosyVoice3's token2wav, or would change the
    audio of one-shot requests."""
    import cosyserve

    reference = cosyserve.load(cv3_model_dir, flow_steps=1, chunk_policy="reference")
    try:
        kwargs: dict[str, Any] = dict(mode="zero_shot", prompt_wav=prompt, prompt_text="Hello there.", seed=1)
        one = model.synthesize_all(LONG, **kwargs)
        assert np.array_equal(one, reference.synthesize_all(LONG, **kwargs))
        low, ref = _chunks(model, LONG, **kwargs), _chunks(reference, LONG, **kwargs)
        assert len(low) >= 2 and len(ref) >= 2, "pick a seed with a longer utterance"
        assert len(low[0]) < len(ref[0])
        assert sum(map(len, low)) == sum(map(len, ref)) == len(one)
    finally:
        reference.close()


def test_batching_lm_serves_two_requests_at_once_with_unbatched_audio(
    model: Any, cv3_model_dir: Path, prompt: Path
) -> None:
    """--batch-size 2: two concurrent requests (one streamed) decode in one loop of two rows, whose stop rule must
    be CosyVoice3's (any id from 6561 on ends an utterance), and each gets the audio of the one-row loop for its
    seed. If this failed, batching would end CosyVoice3 utterances early or late, or mix the two requests."""
    import cosyserve

    requests = [
        dict(text=LONG, mode="zero_shot", prompt_wav=prompt, prompt_text="Hello there.", seed=7, stream=True),
        dict(text=LONG, speaker=SPK, seed=3),
    ]
    expected = [model.synthesize_all(**r) for r in requests]
    batched = cosyserve.load(cv3_model_dir, flow_steps=1, batch_size=2)
    try:
        lm = batched.runtime.pipeline.decoder
        assert lm.max_rows == 2
        got: list[Any] = [None, None]

        def run(i: int) -> None:
            try:
                got[i] = batched.synthesize_all(**requests[i])
            except Exception as e:  # noqa: BLE001 - handed to the test's thread
                got[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for g, e in zip(got, expected, strict=True):
            assert isinstance(g, np.ndarray), g
            np.testing.assert_array_equal(g, e)
        assert lm.stats.prefills == 2 and lm.active == 0
    finally:
        batched.close()


def test_int8_llm_quantized_at_load_or_at_conversion_speaks_the_same(
    cv3_model_dir: Path, tmp_path: Path
) -> None:
    """--llm-quantize int8 makes the Qwen2 layers' and the speech head's linears weight-only int8 (the text
    embedding and the DiT and vocoder stay float); quantizing at load and at conversion give the same audio. If
    this failed, int8 would not reach CosyVoice3's LM, or a quantized bundle would serve other weights."""
    import cosyserve
    from cosyserve.bundle.convert import convert
    from cosyserve.models.precision import Int8Linear

    loaded = cosyserve.load(cv3_model_dir, flow_steps=1, llm_quantize="int8")
    bundle = convert(cv3_model_dir, tmp_path / "int8", quantize="llm=int8", progress=False)
    stored = cosyserve.load(bundle, flow_steps=1)
    try:
        for m in (loaded, stored):
            lm = m.runtime.pipeline.llm
            assert isinstance(lm.llm_decoder, Int8Linear)
            assert isinstance(lm.llm.model.model.layers[0].self_attn.q_proj, Int8Linear)
            assert lm.llm.model.model.embed_tokens.weight.dtype == torch.float32
        a = loaded.synthesize_all(LONG, SPK, seed=3)
        assert a.size > 0 and np.isfinite(a).all()
        np.testing.assert_array_equal(a, stored.synthesize_all(LONG, SPK, seed=3))
    finally:
        loaded.close()
        stored.close()


def test_a_bfloat16_flow_keeps_its_rotary_table_float32(cv3_model_dir: Path, tmp_path: Path) -> None:
    """In a bfloat16 DiT (--flow-dtype bfloat16, or a bundle converted so) the rotary frequencies stay float32 and
    the cos/sin table is the float32 one rounded once. Computed in bfloat16 it would be noise past a few hundred
    frames (positions off by 2-4, angles by whole radians: a cos error up to 2 at 1000 frames); the vocoder's f0
    predictor stays float64. If this failed, bfloat16 CosyVoice3 would lose its positions in long utterances."""
    from cosyserve.bundle.convert import convert
    from cosyserve.bundle.loader import LoadOptions, open_bundle

    bundle = convert(cv3_model_dir, tmp_path / "bf16", dtype="flow=bfloat16,hift=bfloat16", progress=False)
    parts = open_bundle(bundle).load(LoadOptions(verify="full")).modules
    dit = parts["flow"].decoder.estimator
    assert dit.proj_out.weight.dtype == torch.bfloat16
    assert dit.rotary_embed.inv_freq.dtype == torch.float32
    assert next(parts["hift"].f0_predictor.parameters()).dtype == torch.float64
    n = 1200
    cos, sin = dit.rotary_embed(n, torch.bfloat16)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * dit.rotary_embed.inv_freq.double()
    want = angles.repeat_interleave(2, dim=-1)[None]
    assert cos.dtype == torch.bfloat16
    assert (cos.double() - want.cos()).abs().max() < 1e-2 and (sin.double() - want.sin()).abs().max() < 1e-2


# -- the server ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(cv3_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from cosyserve.core.settings import Settings

    flags = {
        "models": [f"cv3={cv3_model_dir}"],
        "flow_steps": 1,
        "registry_dir": str(tmp_path_factory.mktemp("cv3-server-registry")),
    }
    with in_process(Settings.load(flags=flags)) as c:
        yield c


def _audio(content: bytes) -> tuple[np.ndarray, int]:
    audio, sr = sf.read(io.BytesIO(content))
    return audio, sr


def test_openai_speech_route_serves_a_cosyvoice3_model(client: Any) -> None:
    """POST /v1/audio/speech answers 24 kHz audio from a CosyVoice3 model, one-shot and streamed (the same seed:
    the same samples), and refuses an unknown voice by name. If this failed, OpenAI clients could not use
    CosyVoice3."""
    body = {"model": "cv3", "input": LONG, "voice": SPK, "response_format": "wav", "seed": 1}
    r = client.post("/v1/audio/speech", json=body)
    assert r.status_code == 200, r.text
    audio, sr = _audio(r.content)
    assert sr == 24000 and len(audio) > 0
    r = client.post("/v1/audio/speech", json={**body, "response_format": "pcm", "stream": True})
    assert r.status_code == 200 and len(r.content) == 2 * len(audio)
    r = client.post("/v1/audio/speech", json={**body, "voice": "nobody"})
    assert r.status_code in (400, 404) and "nobody" in r.json()["error"]["message"], r.text


def test_reference_routes_serve_a_cosyvoice3_model(client: Any) -> None:
    """The reference's /inference_sft, /inference_zero_shot (a transcript without <|endofprompt|> completed),
    /inference_cross_lingual and /inference_instruct2 answer raw 24 kHz PCM; /inference_instruct (CosyVoice-300M's
    speaker-instruct mode) is refused with a one-line message naming instruct2. If this failed, clients of the
    reference's FastAPI server could not switch to a CosyVoice3 model."""
    files = {"prompt_wav": ("p.wav", wav_bytes(), "audio/wav")}
    requests = {
        "sft": ("/inference_sft", {"tts_text": "Hello.", "spk_id": SPK}, None),
        "zero_shot": ("/inference_zero_shot", {"tts_text": "Hello.", "prompt_text": "Hi there."}, files),
        "cross_lingual": ("/inference_cross_lingual", {"tts_text": "Hello."}, files),
        "instruct2": (
            "/inference_instruct2",
            {"tts_text": "Hello.", "instruct_text": "Speak slowly."},
            files,
        ),
    }
    for route, (path, data, upload) in requests.items():
        # the reference's routes take no seed, and CosyVoice3's minimum-length rule masks id 6561 (sos), not the
        # real end of speech (models/cosyvoice3_lm.py): a random-weight LM ends at its first step in about 3% of
        # draws, an empty 200 as the reference gives. Five draws all empty (~1e-8) is a wiring fault.
        bodies = []
        for _ in range(5):
            r = client.post(path, data=data, files=upload)
            assert r.status_code == 200 and len(r.content) % 2 == 0, (route, r.text)
            bodies.append(r.content)
            if r.content:
                break
        assert any(bodies), (route, "five empty answers")
    r = client.post(
        "/inference_instruct", data={"tts_text": "Hi.", "spk_id": SPK, "instruct_text": "Calmly."}
    )
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "instruct2" in message and "\n" not in message


def test_a_voice_registered_over_http_is_usable_by_name(client: Any) -> None:
    """POST /v1/audio/voices registers a CosyVoice3 voice; it is listed, speaks by name on /v1/audio/speech (with
    OpenAI's ``instructions``: instruct2), and is deleted. If this failed, the voices API would not serve
    CosyVoice3 models."""
    r = client.post(
        "/v1/audio/voices",
        data={"name": "dora", "consent": "test-consent", "ref_text": "Hello there.", "model": "cv3"},
        files={"audio_sample": ("d.wav", wav_bytes(f0=220.0), "audio/wav")},
    )
    assert r.status_code == 200, r.text
    names = [v["name"] for v in client.get("/v1/audio/voices", params={"model": "cv3"}).json()["voices"]]
    assert "dora" in names and SPK in names, names
    body = {"model": "cv3", "input": "Hello.", "voice": "dora", "response_format": "wav", "seed": 2}
    for extra in ({}, {"instructions": "Speak slowly."}):
        r = client.post("/v1/audio/speech", json={**body, **extra})
        assert r.status_code == 200 and len(_audio(r.content)[0]) > 0, (extra, r.text)
    assert client.delete("/v1/audio/voices/dora", params={"model": "cv3"}).status_code == 200


# -- start-up and prefork --------------------------------------------------------------------------------------------


def test_startup_report_times_a_cosyvoice3_start(
    cv3_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`cosyserve startup-report` starts a fresh process on a CosyVoice3 model and reports READY and its first
    audio. If this failed, the start-up figures of issue 26 could not be measured."""
    # the command in this process (cli_util.run_main): the start it measures is a process of its own
    r = run_main(capsys, "startup-report", "--model", str(cv3_model_dir), "--runs", "1", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout[: r.stdout.rindex("}") + 1])
    assert rep["first_audio_ms"]["median"] > rep["ready_ms"]["median"] > 0
    assert {"construct", "map_assign", "warmup"} <= set(rep["phases_ms"])


def test_prefork_workers_serve_a_cosyvoice3_model(cv3_model_dir: Path, tmp_path: Path) -> None:
    """serve --workers 2: both forked workers answer with the template's CosyVoice3 model, the same seed giving
    the same bytes whichever worker answers. If this failed, prefork would not serve CosyVoice3."""
    args = ["--workers", "2", "--flow-steps", "1"]
    with running_server(cv3_model_dir, tmp_path, args=args, ready_timeout_s=180) as server:
        with server.client(timeout=120.0) as c:
            wait_until(  # /health/ready is per worker: wait for both
                lambda: c.get("/health/ready").json().get("workers", {}).get("ready", 0) >= 2,
                lambda: f"both workers ready:\n{server.log()[-3000:]}",
                LOAD_S,
            )
            body = {"input": "Hello there.", "voice": SPK, "response_format": "wav", "seed": 1}
            answers = {c.post("/v1/audio/speech", json=body).content for _ in range(4)}
            assert len(answers) == 1 and len(next(iter(answers))) > 44
            files = {"prompt_wav": ("p.wav", wav_bytes(), "audio/wav")}
            r = c.post(
                "/inference_instruct2", data={"tts_text": "Hi.", "instruct_text": "Calmly."}, files=files
            )
            assert r.status_code == 200 and len(r.content) > 0, r.text
        assert "Traceback" not in server.log(), server.log()[-3000:]


# -- a broken CosyVoice3 dir -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (lambda d: (d / "flow.pt").unlink(), "flow.pt"),
        (lambda d: _truncate(d / "llm.pt", 100_000), "llm.pt"),
        (lambda d: _truncate(d / "hift.pt", 5_000), "hift.pt"),
        (lambda d: _truncate(d / "cosyvoice3.yaml", 300), "cosyvoice3.yaml"),
        (lambda d: (d / "CosyVoice-BlankEN" / "vocab.json").unlink(), "vocab.json"),
        (lambda d: _truncate(d / "CosyVoice-BlankEN" / "vocab.json", 1_000), "vocab.json"),
        (lambda d: _truncate(d / "speech_tokenizer_v3.onnx", 100), "speech_tokenizer_v3.onnx"),
    ],
    ids=[
        "missing-flow",
        "truncated-llm",
        "truncated-hift",
        "truncated-yaml",
        "missing-vocab",
        "truncated-vocab",
        "truncated-speech-tokenizer",
    ],
)
def test_a_broken_model_dir_is_refused_in_one_line_naming_the_file(
    cv3_model_dir: Path, tmp_path: Path, damage: Any, named: str
) -> None:
    """A CosyVoice3 dir with a missing or truncated file is refused at conversion (before any request) with one
    line that names the file, and no bundle is left behind. If this failed, the user would get a traceback, or an
    error on the first request instead of at start."""
    from cosyserve.bundle.convert import convert
    from cosyserve.core.errors import InputError

    broken = tmp_path / "broken"
    shutil.copytree(cv3_model_dir, broken)
    damage(broken)
    with pytest.raises(InputError) as e:
        convert(broken, tmp_path / "b", progress=False)
    assert named in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "b").exists()


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def test_without_its_speech_tokenizer_the_prompt_modes_name_it(
    cv3_model_dir: Path, tmp_path: Path, prompt: Path
) -> None:
    """Without speech_tokenizer_v3.onnx the prompt modes are unavailable with a message naming the file, and sft
    still speaks (a truncated one is refused at conversion: the parametrized test above). If this failed, a
    zero-shot request would fail with an ONNX Runtime traceback, or the model would not serve at all."""
    import cosyserve
    from cosyserve.core.errors import ClientError

    missing = tmp_path / "missing"
    shutil.copytree(cv3_model_dir, missing)
    (missing / "speech_tokenizer_v3.onnx").unlink()
    m = cosyserve.load(missing, flow_steps=1)
    try:
        for mode in ("zero_shot", "cross_lingual", "instruct2", "vc"):
            assert "speech_tokenizer_v3.onnx" in m.unavailable_modes()[mode], mode
        with pytest.raises(ClientError, match="speech_tokenizer_v3.onnx") as e:
            m.synthesize_all("Hi.", mode="zero_shot", prompt_wav=prompt, prompt_text="Hello there.")
        assert "\n" not in str(e.value)
        assert m.synthesize_all("Hi.", SPK, seed=1).size > 0
    finally:
        m.close()


def test_loading_a_model_imports_neither_dynamo_nor_sympy(
    tiny_model_dir: Path, cv2_model_dir: Path, cv3_model_dir: Path
) -> None:
    """Arithmetic on the meta device (where modules are built) goes through torch's reference ops, whose first use
    imports torch._dynamo and sympy: 0.65 s of a full-size CosyVoice3 start (READY 1.80x the import-torch floor
    instead of 1.19x). If this fails, a module's constructor computes on the meta device.

    One fresh process loads a model of each family in turn and lists the two modules after each load: a module
    once imported stays in ``sys.modules``, so the first family whose load imports one is the one named."""
    models = {"cosyvoice": tiny_model_dir, "cosyvoice2": cv2_model_dir, "cosyvoice3": cv3_model_dir}
    code = (
        "import json, sys, cosyserve\n"
        "for model in sys.argv[1:]:\n"
        "    cosyserve.load(model, warmup=False).close()\n"
        "    print(json.dumps(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules)))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    r = subprocess.run(
        [sys.executable, "-c", code, *map(str, models.values())],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()[-len(models) :]
    assert dict(zip(models, map(json.loads, lines), strict=True)) == dict.fromkeys(models, []), r.stdout
