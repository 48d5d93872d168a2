"""The lite runtime: ONNX graphs exported at conversion, checked against the torch modules, served with no torch.

If these fail: a graph computes something else than its torch module (the lite runtime's audio would not be the
torch runtime's), the numpy parts (Euler loop, sine source, STFT/iSTFT, streaming fades) drift from the torch
ones, a damaged lite file is served, or the lite path imports torch after all.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cosyserve.core.errors import BundleError, ConvertError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def both(tiny_lite_bundle: Path) -> tuple[dict, dict]:
    """(torch modules, lite models) over the same bundle."""
    from cosyserve.bundle.loader import LoadOptions, open_bundle
    from cosyserve.runtime.lite.lm import LiteLM
    from cosyserve.runtime.lite.models import LiteBundle, LiteFlow, LiteVocoder

    parts = open_bundle(tiny_lite_bundle).load(LoadOptions(strategy="lazy", verify="none"))
    lb = LiteBundle(tiny_lite_bundle, verify="full", threads=1)
    tables = lb.tables()
    lite = {"llm": LiteLM(lb, tables), "flow": LiteFlow(lb, tables), "hift": LiteVocoder(lb, tables)}
    return parts.modules, lite


def _t(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([ids], dtype=torch.int32), torch.tensor([len(ids)], dtype=torch.int32)


def test_manifest_lists_every_graph_and_its_check(tiny_lite_bundle: Path) -> None:
    """Every graph is written, checked (the batch step too) and keeps its weights outside the graph, which ORT maps;
    the batch step's are the step graph's, read from its data file (stored and mapped once)."""
    from cosyserve.bundle.lite import BATCH_STEP, GRAPHS

    m = json.loads((tiny_lite_bundle / "lite" / "manifest.json").read_text())
    assert set(m["checked"]) == set(GRAPHS)
    assert max(m["checked"].values()) < 1e-4
    for graph, name in GRAPHS.items():
        assert m["files"][name]["bytes"] == (tiny_lite_bundle / "lite" / name).stat().st_size
        if graph != BATCH_STEP:
            assert (tiny_lite_bundle / "lite" / (name + ".data")).is_file()
    own = m["files"].get("llm_batch.onnx.data", {"bytes": 0})["bytes"]
    assert own < 0.05 * m["files"]["llm_step.onnx.data"]["bytes"], own


def _inputs(
    text: list[int], prompt_text: list[int], prompt_speech: list[int], emb: np.ndarray | None
) -> dict:
    # the model input of each runtime: torch tensors, numpy arrays
    t = {
        "text": _t(text)[0],
        "prompt_text": _t(prompt_text)[0],
        "llm_prompt_speech_token": _t(prompt_speech)[0],
    }
    n = {k: v.numpy() for k, v in t.items()}
    if emb is not None:
        t["llm_embedding"], n["llm_embedding"] = torch.from_numpy(emb)[None], emb[None]
    return {"torch": t, "lite": n}


def _teacher_forced(lm: Any, model_input: dict, teach: list[int]) -> Any:
    from cosyserve.runtime.lm import one_shot
    from cosyserve.runtime.oneoff import teacher_forced

    return teacher_forced(lm, one_shot(lm, model_input), teach).logprobs


def test_lm_logprobs_equal_torch(both: tuple[dict, dict]) -> None:
    torch_m, lite = both
    text, prompt_text, prompt_speech, teach = [5, 6, 7, 8, 9], [11, 12], [3, 4, 5], [1, 2, 3, 4, 5, 6, 7]
    emb = np.random.default_rng(0).standard_normal(192).astype(np.float32)
    inputs = _inputs(text, prompt_text, prompt_speech, emb)
    want = _teacher_forced(torch_m["llm"], inputs["torch"], teach)
    got = _teacher_forced(lite["llm"], inputs["lite"], teach)
    assert got.shape == tuple(want.shape)
    np.testing.assert_allclose(got, want.numpy(), atol=1e-4)
    # no speaker (instruct mode keeps it out of the LM)
    inputs = _inputs(text, [], [], None)
    want = _teacher_forced(torch_m["llm"], inputs["torch"], teach[:3])
    np.testing.assert_allclose(
        _teacher_forced(lite["llm"], inputs["lite"], teach[:3]), want.numpy(), atol=1e-4
    )


def test_lite_and_torch_sample_the_same_tokens_for_a_seed(both: tuple[dict, dict]) -> None:
    """One sampler for both runtimes: its draws are a function of the seed, the token index and the vocabulary
    id, so the lite runtime's tokens are the torch runtime's for a seed (their log-probabilities differ by float
    rounding only, ~1e-6 here). If this failed, the runtimes' samplers, masks or stop rules would differ."""
    from cosyserve.core.sampling import row_key
    from cosyserve.runtime.lm import one_shot
    from cosyserve.runtime.oneoff import generate

    torch_m, lite = both
    emb = np.random.default_rng(1).standard_normal(192).astype(np.float32)
    inputs = _inputs([5, 6, 7, 8, 9, 10], [11, 12], [3, 4, 5], emb)
    for seed in (1, 2):
        runs = {
            name: list(generate(lm, one_shot(lm, inputs[name]), row_key(seed)))
            for name, lm in (("torch", torch_m["llm"]), ("lite", lite["llm"]))
        }
        assert len(runs["torch"]) >= 12 and runs["lite"] == runs["torch"], seed


def test_lite_rows_share_batch_steps_and_keep_their_tokens(both: tuple[dict, dict]) -> None:
    """CosyVoice-300M's lite rows share decode steps through its batch graph (one run per step, each row at its own
    position with its own relative distances, the cache rows of rows that do not step fed padding): rows joining
    and leaving mid-run get the tokens each gets alone (the step graph); a step of rows that all stopped is ended
    early. If this failed, the batch graph's mask, distances or cache writes would change a row's speech with its
    neighbours; if no batch step ran, the rows would still step one after another. (The 300M LM takes no streamed
    text: its rows are one-shot.)"""
    from cosyserve.core.sampling import row_key
    from cosyserve.runtime.lm import OneShot, one_shot
    from lm_util import batch_run_ends_when_every_row_stopped, join_and_leave

    lm = both[1]["llm"]
    assert lm.batch_graph == "llm_batch" and lm.unbatched is None
    emb = np.random.default_rng(2).standard_normal(192).astype(np.float32)
    specs = []
    for i, n in enumerate((20, 12, 25, 15)):  # prompts of different lengths: the rows' positions differ
        inputs = _inputs(list(range(5, 7 + 2 * i)), [11, 12][: i % 3], [3, 4, 5][:i], emb if i % 2 else None)
        row = one_shot(lm, inputs["lite"])
        specs.append(OneShot(row.prompt, n, n))
    join_and_leave(lm, specs, [row_key(40 + i) for i in range(4)])
    assert lm.batch_steps > 0, "no step ran the batch graph"
    batch_run_ends_when_every_row_stopped(lm)
    lm.release()


def test_a_bundle_without_the_batch_graph_steps_rows_one_by_one(tiny_lite_bundle: Path) -> None:
    """A lite bundle converted before its LM had a batch graph still serves: its rows step one after another through
    the step graph, with the same log-probabilities as a batch step's, and the LM says why (the runtime logs it
    once). If this failed, an older bundle would be refused or would fail at its first step of two rows."""
    from cosyserve.bundle.lite import BATCH_STEP
    from cosyserve.runtime.lite.lm import LiteLM
    from cosyserve.runtime.lite.models import LiteBundle

    lms = []
    for drop in (False, True):
        lb = LiteBundle(tiny_lite_bundle, verify="none", threads=1)
        if drop:  # as an older manifest lists its graphs
            del lb.graphs[BATCH_STEP]
        lms.append(LiteLM(lb, lb.tables()))
    batched, older = lms
    assert older.batch_graph is None and "convert it again" in (older.unbatched or "")
    prompt = batched.prompt(_inputs([5, 6, 7], [11], [3, 4], None)["lite"])[0]
    for lm in lms:
        lm.reserve(2, 16)
        lm.extend(prompt, 0, 0)
        lm.extend(prompt[:, :4], 1, 0)
    tokens, pos = np.array([7, 9]), np.array([prompt.shape[1], 4])
    np.testing.assert_allclose(
        older.decode(tokens, pos, 16, None), batched.decode(tokens, pos, 16, None), atol=1e-4
    )
    assert (older.batch_steps, batched.batch_steps) == (0, 1)
    assert "llm_batch" not in older.bundle.sessions


@pytest.mark.parametrize(
    "n_tokens", [30, 60]
)  # 60: the regulator interpolates the first/last 20 tokens apart
def test_flow_equals_torch(both: tuple[dict, dict], n_tokens: int) -> None:
    from cosyserve.models.flow import mel_length

    torch_m, lite = both
    rng = np.random.default_rng(n_tokens)
    toks, ptok = list(range(50, 50 + n_tokens)), [1, 2, 3]
    pfeat = rng.standard_normal((6, 80)).astype(np.float32)
    emb = rng.standard_normal(192).astype(np.float32)
    noise = rng.standard_normal((80, 6 + mel_length(n_tokens, 50))).astype(np.float32)
    mel_t, cache_t = torch_m["flow"].inference(
        *_t(toks), *_t(ptok), torch.from_numpy(pfeat)[None], torch.tensor([6]), torch.from_numpy(emb)[None],
        torch.zeros(1, 80, 0, 2), noise=torch.from_numpy(noise)[None],
    )  # fmt: skip
    mel_l, cache_l = lite["flow"].inference(
        np.asarray([toks]), [n_tokens], np.asarray([ptok]), [3], pfeat[None], [6], emb[None],
        np.zeros((1, 80, 0, 2), np.float32), noise=noise[None],
    )  # fmt: skip
    np.testing.assert_allclose(mel_l, mel_t.numpy(), atol=1e-4)
    np.testing.assert_allclose(cache_l, cache_t.numpy(), atol=1e-5)


def test_vocoder_equals_torch(both: tuple[dict, dict]) -> None:
    torch_m, lite = both
    mel = np.random.default_rng(5).standard_normal((80, 23)).astype(np.float32) - 3
    phase, noise = lite["hift"].draws(23, np.random.default_rng(6))
    cache = np.random.default_rng(7).standard_normal(100).astype(np.float32) * 0.01
    sp_t, so_t = torch_m["hift"].inference(
        torch.from_numpy(mel)[None], torch.from_numpy(cache)[None, None],
        sine_phase=torch.from_numpy(phase), sine_noise=torch.from_numpy(noise),
    )  # fmt: skip
    sp_l, so_l = lite["hift"].inference(mel[None], cache[None, None], sine_phase=phase, sine_noise=noise)
    assert sp_l.shape == tuple(sp_t.shape)
    np.testing.assert_allclose(so_l, so_t.numpy(), atol=2e-4)
    np.testing.assert_allclose(sp_l, sp_t.numpy(), atol=2e-4)


def test_dsp_matches_torch_ops() -> None:
    import torch.nn.functional as F

    from cosyserve.models import lite_dsp as dsp

    x = np.random.default_rng(0).standard_normal((4, 37)).astype(np.float32)
    for size in (5, 37, 64, 101):
        want = F.interpolate(torch.from_numpy(x)[None], size=size, mode="linear")[0].numpy()
        np.testing.assert_allclose(dsp.interp_linear(x, size), want, atol=2e-5)  # torch fuses a multiply-add
    sig = np.random.default_rng(1).standard_normal(400).astype(np.float32)
    win = torch.hann_window(16, periodic=True, dtype=torch.float64).float()
    spec = torch.stft(torch.from_numpy(sig), 16, 4, 16, window=win, return_complex=True).numpy()
    np.testing.assert_allclose(dsp.stft(sig, 16, 4), spec, atol=1e-5)
    back = torch.istft(torch.from_numpy(spec), 16, 4, 16, window=win).numpy()
    np.testing.assert_allclose(dsp.istft(spec, 16, 4), back, atol=1e-5)


def test_token2wav_stream_equals_torch(both: tuple[dict, dict]) -> None:
    """The family's one token2wav over the torch modules and over the lite graphs: the same draws give the same
    chunks (streaming windows, caches and fades are one code, its arrays torch's or numpy's)."""
    from cosyserve.families.cosyvoice.streampolicy import StreamPolicy
    from cosyserve.families.cosyvoice.token2wav import CallDraws, Token2Wav
    from cosyserve.runtime.lite.models import mel_length

    torch_m, lite = both
    policy = StreamPolicy.named("low-latency", 21)
    tokens = [int(t) for t in np.random.default_rng(2).integers(0, 4096, 130)]
    emb = np.random.default_rng(3).standard_normal((1, 192)).astype(np.float32)
    # the windows the policy cuts: draws made for each in advance, fed to both
    windows = [(len(w), final) for w, final in policy.windows(tokens, stream=True)]
    rng = np.random.default_rng(4)
    draws, mel_cache = [], 0
    for i, (n, final) in enumerate(windows):
        frames = mel_length(n, 50)
        mel_in = frames + mel_cache - (0 if final else policy.mel_overlap_len)
        phase, noise = lite["hift"].draws(mel_in, rng)
        draws.append((rng.standard_normal((1, 80, frames), dtype=np.float32), phase, noise))
        mel_cache = policy.mel_cache_len if i == 0 or mel_cache else 0
    want = list(
        Token2Wav(torch_m["flow"], torch_m["hift"], policy)(
            iter(tokens), embedding=torch.from_numpy(emb), stream=True,
            draws=iter(CallDraws(*(torch.from_numpy(a) for a in d)) for d in draws),
        )
    )  # fmt: skip
    t2w = Token2Wav(lite["flow"], lite["hift"], policy)
    got = list(t2w(iter(tokens), embedding=emb, stream=True, draws=iter(CallDraws(*d) for d in draws)))
    assert t2w.ops.xp is np and all(isinstance(c, np.ndarray) for c in got)
    assert [c.shape for c in got] == [tuple(c.shape) for c in want]
    np.testing.assert_allclose(np.concatenate(got, 1), torch.cat(want, dim=1).numpy(), atol=5e-4)


def test_export_check_refuses_a_graph_that_differs(tiny_lite_bundle: Path) -> None:
    from cosyserve.bundle.lite.export import _check

    graph = tiny_lite_bundle / "lite" / "hift_f0.onnx"
    wrong = torch.nn.Conv1d(80, 1, 1)  # not the f0 predictor

    with pytest.raises(ConvertError, match="differs from the torch module"):
        _check("hift_f0", graph, lambda mel: wrong(mel)[:, 0], [(torch.randn(1, 80, 9),)], ["mel"], 1e-4)


def test_damaged_lite_files_are_refused(tiny_lite_bundle: Path, tmp_path: Path) -> None:
    from cosyserve.runtime.lite.models import LiteBundle

    copy = tmp_path / "b"
    shutil.copytree(tiny_lite_bundle, copy)
    data = copy / "lite" / "llm_step.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))  # same size, one byte changed
    with pytest.raises(BundleError, match="llm_step.onnx.data: checksum mismatch"):
        LiteBundle(copy, verify="full")
    data.write_bytes(bytes(raw[:-8]))
    with pytest.raises(BundleError, match="llm_step.onnx.data: .* truncated"):
        LiteBundle(copy, verify="none")
    shutil.rmtree(copy / "lite")
    with pytest.raises(BundleError, match="--runtime lite"):
        LiteBundle(copy)


def test_convert_lite_refuses_a_family_whose_graphs_do_not_cover_every_part(
    cv2_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A family whose lite export lacks a part is refused by name, and nothing is half-written."""
    from cosyserve.bundle.convert import convert
    from cosyserve.families.cosyvoice2 import CosyVoice2

    monkeypatch.setattr(CosyVoice2, "lite_parts", ("llm",))
    with pytest.raises(ConvertError, match="CosyVoice2's lite graphs cover the llm so far"):
        convert(cv2_model_dir, tmp_path / "b", runtime="lite", progress=False)
    assert not (tmp_path / "b").exists()  # nothing half-written


def _blocker(tmp: Path) -> Path:
    """A folder whose ``torch`` package raises on import: first on PYTHONPATH, torch is unimportable."""
    pkg = tmp / "block" / "torch"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(
        "raise ImportError('torch is blocked in this test: the lite path imported it')\n"
    )
    return tmp / "block"


LITE_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["torch"] = None  # any `import torch` in the process now raises
    import numpy as np
    import cosyserve
    from cosyserve.core.errors import AudioError, RegistryError

    model = cosyserve.load(sys.argv[1], runtime="lite", threads=1)
    assert model.sample_rate == 22050
    speaker = model.speakers[0]
    one = model.synthesize_all("Hello world.", speaker=speaker, seed=3)
    again = model.synthesize_all("Hello world.", speaker=speaker, seed=3)
    assert one.dtype == np.float32 and one.size > 0 and np.isfinite(one).all()
    assert np.array_equal(one, again), "the same seed gave different audio"
    text = "Hello world, this is a longer test of streaming."
    chunks = list(model.synthesize(text, speaker=speaker, seed=4, stream=True))
    assert len(chunks) >= 2 and all(np.isfinite(c).all() for c in chunks), [len(c) for c in chunks]
    inst = model.synthesize_all("Hello.", speaker=speaker, mode="instruct", instruct_text="Speak slowly.", seed=1)
    assert inst.size > 0
    modes = model.runtime.modes()
    assert all(modes[m] is None for m in ("sft", "instruct", "zero_shot", "cross_lingual", "vc")), modes
    wav = sys.argv[2]
    zs = model.synthesize_all("Hello.", mode="zero_shot", prompt_text="A prompt.", prompt_wav=wav, seed=1)
    cl = model.synthesize_all("Hello.", mode="cross_lingual", prompt_wav=wav, seed=1)
    vc = model.synthesize_all(mode="vc", prompt_wav=wav, source_wav=wav, seed=1)
    assert min(zs.size, cl.size, vc.size) > 0
    model.runtime.add_voice("me", wav, "A prompt.")
    assert [v.name for v in model.runtime.voices() if v.kind == "registered"] == ["me"]
    again = model.synthesize_all("Hello.", speaker="me", seed=1)  # a registered voice: zero_shot by default
    assert np.array_equal(again, zs), "the registered voice spoke otherwise than its prompt"
    try:
        model.runtime.import_voices(wav)
        raise AssertionError("a spk2info.pt was read without torch")
    except RegistryError as e:
        assert "needs torch" in str(e)
    model.runtime.remove_voice("me")
    try:
        model.synthesize_all("Hi.", mode="zero_shot", prompt_text="x", prompt_wav=b"RIFF")
        raise AssertionError("a broken prompt was accepted")
    except AudioError:
        pass
    print("torch" in sys.modules and sys.modules["torch"] is not None)
    """
)


def _prompt_wav(path: Path, sr: int = 22050, seconds: float = 1.5) -> Path:
    import soundfile

    t = np.arange(int(sr * seconds)) / sr
    voice = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    noise = 0.01 * np.random.default_rng(0).standard_normal(t.size)
    soundfile.write(path, (voice + noise).astype(np.float32), sr)
    return path


def test_lite_path_without_torch(tiny_lite_bundle: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COSYSERVE_REGISTRY_DIR": str(tmp_path / "voices")}
    wav = _prompt_wav(tmp_path / "prompt.wav")
    p = subprocess.run(
        [sys.executable, "-c", LITE_SCRIPT, str(tiny_lite_bundle), str(wav)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    assert p.stdout.strip().splitlines()[-1] == "False"
    # the CLI, with torch unimportable at the package level
    out = tmp_path / "o.wav"
    env["PYTHONPATH"] = os.pathsep.join([str(_blocker(tmp_path)), str(ROOT / "src")])
    p = subprocess.run(
        [sys.executable, "-m", "cosyserve", "synth", "--model", str(tiny_lite_bundle), "--runtime", "lite",
         "--text", "Hello.", "--seed", "1", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    with wave.open(str(out)) as w:
        assert w.getframerate() == 22050 and w.getnframes() > 0


def test_server_on_lite_runtime_without_torch(tiny_lite_bundle: Path, tmp_path: Path) -> None:
    from server_util import running_server

    env = {
        "PYTHONPATH": os.pathsep.join([str(_blocker(tmp_path)), str(ROOT / "src")]),
        "COSYSERVE_RUNTIME": "lite",
        "COSYSERVE_THREADS": "1",
    }
    with running_server(tiny_lite_bundle, tmp_path / "srv", env=env) as s, s.client(timeout=120) as c:
        r = c.post(
            "/v1/audio/speech", json={"input": "Hello there.", "voice": "英文女", "response_format": "wav"}
        )
        assert r.status_code == 200, r.text
        with wave.open(io.BytesIO(r.content)) as w:  # OpenAI's 24 kHz, resampled (soxr: no torch either)
            assert w.getframerate() == 24000 and w.getnframes() > 0
        with c.stream(
            "POST", "/v1/audio/speech",
            json={"input": "Hello there, streaming now.", "voice": "英文女", "response_format": "pcm", "stream": True},
        ) as r:  # fmt: skip
            assert r.status_code == 200
            body = b"".join(r.iter_bytes())
        assert len(body) > 0 and len(body) % 2 == 0
        wav = _prompt_wav(tmp_path / "prompt.wav", sr=16000).read_bytes()
        r = c.post(
            "/inference_zero_shot",
            data={"tts_text": "Hi there.", "prompt_text": "A prompt."},
            files={"prompt_wav": ("p.wav", wav, "audio/wav")},
        )
        assert r.status_code == 200, r.text
        assert len(r.content) > 0
        r = c.post(
            "/inference_zero_shot",
            data={"tts_text": "Hi.", "prompt_text": "x"},
            files={"prompt_wav": ("p.wav", b"RIFF", "audio/wav")},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_wav", r.text
        assert c.get("/health/ready").status_code == 200
    assert "torch is blocked" not in s.log()


def test_prompt_features_equal_torch_frontend(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The numpy prompt path (resampler, fbank, whisper log-mel, prompt mel) gives the torch frontend's entry."""
    from cosyserve.frontend.tokenizer import get_tokenizer
    from cosyserve.frontend.zeroshot import Frontend
    from cosyserve.runtime.lite.frontend import LiteFrontend

    wav = _prompt_wav(tmp_path / "p.wav", sr=44100, seconds=2.0)  # resampled to both 16 and 24 kHz
    want = Frontend(tiny_model_dir).prompt_features("A prompt.", wav)
    got = LiteFrontend(
        tiny_model_dir / "campplus.onnx", tiny_model_dir / "speech_tokenizer_v1.onnx", get_tokenizer().encode
    ).prompt_features("A prompt.", wav)
    assert set(got) == set(want)
    for key, value in want.items():
        if value.is_floating_point():
            np.testing.assert_allclose(got[key], value.numpy(), atol=1e-3, err_msg=key)
        else:
            np.testing.assert_array_equal(got[key], value.numpy(), err_msg=key)


def test_lite_frontend_takes_the_family_prompt_rules() -> None:
    """A CosyVoice2/3 bundle's lite frontend computes the mel its manifest's feat_extractor names and trims
    zero-shot prompts to 2 frames per token; a config without (or with an unusable) feat_extractor is refused
    naming it, where the 300M default would silently give a 24 kHz model the wrong prompt mel."""
    from cosyserve.families import family_named
    from cosyserve.runtime.lite.frontend import LiteFrontend

    family = family_named("cosyvoice3")
    paths = {name: Path(name) for name in family.onnx_files}  # sessions open on first use: never here
    mel = {
        "n_fft": 1920,
        "num_mels": 80,
        "sampling_rate": 24000,
        "hop_size": 480,
        "win_size": 1920,
        "fmax": None,
    }
    frontend = LiteFrontend.for_family(family, {"feat_extractor": mel}, paths, str.split)
    assert frontend.mel.fmax is None and frontend.mel.sampling_rate == 24000 and frontend.mel_per_token == 2
    with pytest.raises(BundleError, match="no feat_extractor"):
        LiteFrontend.for_family(family, {}, paths, str.split)
    with pytest.raises(BundleError, match=r"feat_extractor.*n_fft"):
        LiteFrontend.for_family(family, {"feat_extractor": {**mel, "n_fft": 0}}, paths, str.split)
    with pytest.raises(BundleError, match="speech_tokenizer_v3.onnx"):
        LiteFrontend.for_family(family, {"feat_extractor": mel}, {"campplus.onnx": Path("c")}, str.split)


def test_int8_step_graph(tiny_model_dir: Path, tiny_lite_bundle: Path, tmp_path: Path) -> None:
    """convert --runtime lite --quantize llm=int8 writes the quantized step graph and records its distance from
    the float one; llm_quantize=int8 serves it, and a bundle without it (the session's lite bundle, converted
    without --quantize) is refused by name."""
    from cosyserve.bundle.convert import convert
    from cosyserve.runtime.lite.lm import LiteLM
    from cosyserve.runtime.lite.models import LiteBundle

    out = convert(tiny_model_dir, tmp_path / "b8", runtime="lite", quantize="llm=int8", progress=False)
    m = json.loads((out / "lite" / "manifest.json").read_text())
    assert "llm_step.int8.onnx" in m["files"] and m["int8"]["top1_agree"] > 0
    lb = LiteBundle(out, int8=True, threads=1)
    model_input = _inputs([5, 6, 7, 8], [], [], None)["lite"]
    q = _teacher_forced(LiteLM(lb, lb.tables()), model_input, [1, 2, 3])
    f = LiteBundle(out, threads=1)
    ref = _teacher_forced(LiteLM(f, f.tables()), model_input, [1, 2, 3])
    assert not np.array_equal(q, ref)  # another graph ran ...
    np.testing.assert_allclose(q, ref, atol=0.5)  # ... computing nearly the same thing
    # READY opens the int8 step graph unprepacked, the after-READY thread swaps the prepacked one in: the same
    # numbers from both (a request's tokens do not depend on when it ran); the float graph has no quick form
    quick = LiteBundle(out, int8=True, threads=1)
    assert quick.open_quick("llm_step") and not f.open_quick("llm_step")
    before = quick.session("llm_step")
    np.testing.assert_allclose(
        _teacher_forced(LiteLM(quick, quick.tables()), model_input, [1, 2, 3]), q, atol=1e-5
    )
    quick.upgrade("llm_step")
    assert quick.session("llm_step") is not before
    assert (out / "lite" / "llm_step.int8.onnx.data") in lb.data_files()
    # its rows step one by one: ORT's dynamic int8 scales a run's activations across its rows
    assert LiteLM(lb, lb.tables()).batch_graph is None and "int8" in (LiteLM(lb, lb.tables()).unbatched or "")
    assert "int8" not in json.loads((tiny_lite_bundle / "lite" / "manifest.json").read_text())
    with pytest.raises(BundleError, match="--quantize llm=int8"):
        LiteBundle(tiny_lite_bundle, int8=True)


def test_prefork_workers_on_lite_runtime(tiny_lite_bundle: Path, tmp_path: Path) -> None:
    """The template imports ONNX Runtime and opens no session; each forked worker opens its own after the fork
    (an ORT thread pool does not survive fork: a session made before it would hang the workers)."""
    from server_util import running_server

    env = {"COSYSERVE_RUNTIME": "lite", "COSYSERVE_THREADS": "1"}
    with (
        running_server(tiny_lite_bundle, tmp_path / "srv", env=env, args=["--workers", "2"]) as s,
        s.client(timeout=120) as c,
    ):
        for _ in range(4):
            r = c.post(
                "/v1/audio/speech", json={"input": "Hi there.", "voice": "英文女", "response_format": "wav"}
            )
            assert r.status_code == 200, r.text

        assert c.get("/health/ready").json()["workers"]["ready"] == 2


def test_damaged_manifest_or_speakers_are_refused(tiny_lite_bundle: Path, tmp_path: Path) -> None:
    """A lite manifest that is not what conversion wrote, or a speakers file whose bytes changed, is a one-line
    BundleError naming the file, never a KeyError or wrong voices."""
    from cosyserve.runtime import RuntimeOptions
    from cosyserve.runtime.lite import load
    from cosyserve.runtime.lite.models import LiteBundle

    copy = tmp_path / "b"
    shutil.copytree(tiny_lite_bundle, copy)
    manifest = copy / "lite" / "manifest.json"
    good = manifest.read_text()
    for bad in ("[]", json.dumps({**json.loads(good), "config": {}})):
        manifest.write_text(bad)
        with pytest.raises(BundleError, match="manifest.json"):
            LiteBundle(copy, verify="none")
    manifest.write_text(good)
    speakers = copy / "speakers.safetensors"
    raw = bytearray(speakers.read_bytes())
    raw[-3] ^= 0x10  # inside the last embedding's floats: same size, other values
    speakers.write_bytes(bytes(raw))
    with pytest.raises(BundleError, match="speakers.safetensors: tensor .* does not match"):
        load(copy, RuntimeOptions(threads=1, warmup=False, verify="none", registry_dir=str(tmp_path / "r")))
