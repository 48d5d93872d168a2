"""The lite runtime's incremental token2wav (CosyVoice2 and CosyVoice3): a streamed chunk computes its own frames
against the flow's kept per-Euler-step caches (the one ``flow_estimator`` graph's inputs and outputs) and, for
CosyVoice3, the causal vocoder's kept state, as the torch runtime's; and a registered voice's flow state is
computed once (the shared VoiceStates over the lite flow's prefill) and forked by its streams.

If these fail: the lite flow's or vocoder's stream state is not the torch one's (chunks differ beyond the
fixtures' tolerance), or a lite chunk's work grows with the utterance again (the estimator or the vocoder is
given every frame so far), or a lite stream of a registered voice computes its prompt's frames again.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cosyserve.runtime.lite.chunkflow import LiteChunkFlow

ATOL = 2e-3  # the fixtures' token2wav_stream tolerance (CosyVoice3's; CosyVoice2's is 5e-3)
# a 0.4 s prompt, then 6 s of speech in hops of 25 tokens (the first topped up to a whole chunk): 6 streamed chunks,
# each one attention chunk (50 frames at the tiny models' size) after more kept ones than the last
PROMPT, TOKENS, HOP = 10, 150, 25
STEPS = 2  # Euler steps: each keeps its own state, two show it as well as ten (the test's cost)


def _lite(bundle: Path) -> tuple[Any, Any, Any]:
    """(flow, hift, bundle) of the lite runtime over a converted bundle."""
    from cosyserve.runtime.lite.chunkflow import LiteCausalVocoder, LiteChunkFlow, LiteVocoder2
    from cosyserve.runtime.lite.models import LiteBundle

    lb = LiteBundle(bundle, verify="none", threads=1)
    tables = lb.tables()
    vocoder = LiteCausalVocoder if lb.config["hift"].get("causal") else LiteVocoder2
    return LiteChunkFlow(lb, tables), vocoder(lb, tables), lb


def _sides(bundle: Path) -> dict[str, Any]:
    """{"torch": (flow, hift), "lite": (flow, hift, bundle)} over the same converted bundle."""
    from cosyserve.bundle.loader import LoadOptions, open_bundle

    modules = open_bundle(bundle).load(LoadOptions(strategy="lazy", verify="none")).modules
    return {"torch": (modules["flow"].float().eval(), modules["hift"].float().eval()), "lite": _lite(bundle)}


def _inputs(seed: int, prompt: int = PROMPT, tokens: int = TOKENS) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "token": torch.randint(0, 4096, (1, tokens), generator=g, dtype=torch.int32),
        "prompt_token": torch.randint(0, 4096, (1, prompt), generator=g, dtype=torch.int32),
        "prompt_feat": torch.randn(1, 2 * prompt, 80, generator=g) * 0.5 - 5,
        "embedding": torch.randn(1, 192, generator=g),
    }


def _estimates(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Per lite estimator run from now on: (frames given, kept rows it attends to)."""
    runs: list[tuple[int, int]] = []
    estimate = LiteChunkFlow._estimate

    def spy(self: Any, h: Any, t: Any, mask: Any, offset: Any, step: Any, commit: int, stop: Any) -> Any:
        runs.append((h.shape[2], step.kept))
        return estimate(self, h, t, mask, offset, step, commit, stop)

    monkeypatch.setattr(LiteChunkFlow, "_estimate", spy)
    return runs


def _record(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, dict[str, Any]]]:
    # every graph run of the lite side: (session, feeds)
    from cosyserve.runtime.lite import terminate

    runs: list[tuple[Any, dict[str, Any]]] = []
    run = terminate.run

    def recorded(session: Any, feeds: dict[str, Any], should_stop: Any) -> list[Any]:
        runs.append((session, feeds))
        return run(session, feeds, should_stop)

    monkeypatch.setattr(terminate, "run", recorded)
    return runs


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_lite_flow_stream_equals_torch_chunk_by_chunk_on_new_frames_only(
    family: str, cv2_lite_bundle: Path, cv3_lite_bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long streamed utterance's flow calls (the reference's hops, then the final full-attention call) give the
    torch flow's mel chunk by chunk, and each streamed call runs the estimator over its new frames only, against
    the rows its stream keeps: the estimator's input never grows past a hop and an attention chunk; CosyVoice2's
    encoder (flow_mu_stream) likewise runs a call's own tokens only (its lookahead layer's 2 tokens of left context and
    the lookahead besides) against its kept state, not every token so far."""
    bundle = cv2_lite_bundle if family == "cosyvoice2" else cv3_lite_bundle
    sides = _sides(bundle)
    (tflow, _), (lflow, _, _) = sides["torch"], sides["lite"]
    x = _inputs(0)
    xl = {k: v.numpy() for k, v in x.items()}
    assert lflow.streams and tflow.streams
    look, ratio, g = lflow.pre_lookahead_len, lflow.token_mel_ratio, lflow.granularity
    # Token2Wav2's chunks: the first hop tops the prompt up to a whole chunk
    ends = [n + look for n in range(HOP + (-PROMPT) % HOP, TOKENS - look, HOP)]
    assert len(ends) >= 5, ends
    runs = _estimates(monkeypatch)
    encodes: list[tuple[int, int]] = []  # per encoder run: (tokens given, kept tokens it attends to)
    encode = LiteChunkFlow._encode

    def spy_encode(self: Any, states: Any, tokens: Any, lead: int, commit: int, *rest: Any) -> Any:
        encodes.append((tokens.shape[1], states[0].kept))
        return encode(self, states, tokens, lead, commit, *rest)

    monkeypatch.setattr(LiteChunkFlow, "_encode", spy_encode)
    ts, ls = tflow.new_stream(STEPS), lflow.new_stream(STEPS)
    kept = 0
    for end in ends:
        want = tflow.inference(x["token"][:, :end], x["prompt_token"], x["prompt_feat"], x["embedding"],
                               streaming=True, finalize=False, stream=ts, n_timesteps=STEPS)  # fmt: skip
        del runs[:], encodes[:]
        got = lflow.inference(xl["token"][:, :end], xl["prompt_token"], xl["prompt_feat"], xl["embedding"],
                              streaming=True, finalize=False, stream=ls, n_timesteps=STEPS)  # fmt: skip
        np.testing.assert_allclose(got, want.numpy(), atol=ATOL, err_msg=f"chunk ending at token {end}")
        frames = ratio * (PROMPT + end - look)
        assert runs == [(frames - kept, kept)] * STEPS, (end, kept)
        if family == "cosyvoice2":
            first = kept // ratio
            assert encodes == [(min(first, 2) + (frames - kept) // ratio + look, first)], (end, encodes)
        assert frames - kept <= ratio * HOP + g  # a hop's frames and an incomplete chunk at most
        kept = frames // g * g
    assert kept >= 4 * g  # the later chunks ran against many kept frames
    want = tflow.inference(x["token"], x["prompt_token"], x["prompt_feat"], x["embedding"], streaming=False,
                           finalize=True, stream=ts, n_timesteps=STEPS)  # fmt: skip
    got = lflow.inference(xl["token"], xl["prompt_token"], xl["prompt_feat"], xl["embedding"], streaming=False,
                          finalize=True, stream=ls, n_timesteps=STEPS)  # fmt: skip
    np.testing.assert_allclose(got, want.numpy(), atol=ATOL, err_msg="the final full-attention call")


def test_lite_cosyvoice3_token2wav_streams_torch_chunks_with_a_bounded_vocoder(
    cv3_lite_bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The family's one Token2Wav3 over the lite flow and causal vocoder gives the torch runtime's audio chunk by
    chunk for a long utterance (both incremental), and the lite vocoder's spectrum graph sees a bounded window of
    mel (its kept receptive field and the new frames), not the utterance so far; and past the streams' state bound
    (``stream_state_mb``) a lite stream drops its flow state and goes on cumulatively with the same audio."""
    from cosyserve.families.cosyvoice2.token2wav import StreamPolicy2
    from cosyserve.families.cosyvoice3.token2wav import Token2Wav3
    from cosyserve.models.causal_hift import source_noise
    from cosyserve.voices.voicestates import VoiceStates

    sides = _sides(cv3_lite_bundle)
    (tflow, thift), (lflow, lhift, lb) = sides["torch"], sides["lite"]
    x = _inputs(1)
    rand_ini, sine_waves = source_noise(2 * (PROMPT + TOKENS) * 480, torch.Generator().manual_seed(2))
    runs = _record(monkeypatch)
    chunks = {}
    bounded = VoiceStates(1 << 30, stream_max_bytes=1)  # the lite stream's state past stream_state_mb at once
    sides_run = (("torch", (tflow, thift), lambda t: t, None), ("lite", (lflow, lhift), lambda t: t.numpy(), None),
                 ("lite bounded", (lflow, lhift), lambda t: t.numpy(), bounded))  # fmt: skip
    for name, (flow, hift), conv, voices in sides_run:
        t2w = Token2Wav3(
            flow,
            hift,
            StreamPolicy2(token_hop_len=HOP, token_max_hop_len=HOP),
            flow_steps=STEPS,
            voices=voices,
        )
        noise = {"rand_ini": conv(rand_ini), "sine_waves": conv(sine_waves)}
        chunks[name] = list(
            t2w(x["token"][0].tolist(), embedding=conv(x["embedding"]), prompt_token=conv(x["prompt_token"]),
                prompt_feat=conv(x["prompt_feat"]), stream=True, draws=itertools.repeat(noise))
        )  # fmt: skip
    assert len(chunks["lite"]) == len(chunks["torch"]) >= 5
    for i, (got, want) in enumerate(zip(chunks["lite"], chunks["torch"], strict=True)):
        np.testing.assert_allclose(got, want.numpy(), atol=ATOL, err_msg=f"chunk {i}")
    # a lite stream's flow state is in the model's account as a torch one's: past its bound it is dropped and the
    # later chunks run on the cumulative path, with the same audio (else a long lite stream's memory grows without
    # a bound: ~180 MB per second of CosyVoice3 speech)
    assert bounded.stream_drops == 1 and bounded.stream_bytes == 0
    for i, (got, want) in enumerate(zip(chunks["lite bounded"], chunks["lite"], strict=True)):
        np.testing.assert_allclose(got, want, atol=ATOL, err_msg=f"bounded chunk {i}")
    decode = lb.session("hift_decode")
    n = len(chunks["lite"])
    widths = [feeds["mel"].shape[2] for session, feeds in runs if session is decode][:n]  # the unbounded run
    bound = 2 * HOP + lhift.cfg.context + lhift.lookahead + lhift.cfg.conv_pre_look_right
    assert len(widths) == len(chunks["lite"]) and max(widths[:-1]) <= bound, (widths, bound)


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_a_registered_voice_streams_on_lite_as_inline_computing_only_its_own_frames(
    family: str, cv2_lite_bundle: Path, cv3_lite_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A voice's flow state kept at registration on the lite flow (VoiceStates.keep over LiteChunkFlow.prefill, the
    torch flow's code path) speaks as the same voice given inline, chunk by chunk, while the registered request's
    first estimator runs are given its own frames only (after the voice's kept rows); a second request forked from
    the same state gives the same chunks (a fork never writes the voice's arrays, which are read-only); the state
    counts against the voice cache's bound (not kept past it) and, stored on disk as numpy arrays, is mapped back by
    a new VoiceStates of the same model tag. If this fails, a lite request of a registered voice recomputes its
    prompt's frames, or the kept state is not the one a stream resumes from."""
    from cosyserve.families.cosyvoice2.token2wav import StreamPolicy2, Token2Wav2
    from cosyserve.families.cosyvoice3.token2wav import Token2Wav3
    from cosyserve.models.causal_hift import source_noise
    from cosyserve.voices.voicestates import VoiceStates, bytes_per_second

    flow, hift, _ = _lite(cv2_lite_bundle if family == "cosyvoice2" else cv3_lite_bundle)
    prompt, tokens = 40, 80  # the prompt's kept frames: whole chunks of 2 x (40 - 3 lookahead) = 74 -> 50
    x = {k: v.numpy() for k, v in _inputs(3, prompt, tokens).items()}
    policy = StreamPolicy2(token_hop_len=HOP, token_max_hop_len=HOP)
    if family == "cosyvoice3":
        rand_ini, sine_waves = (
            t.numpy() for t in source_noise(2 * (prompt + tokens) * 480, torch.Generator())
        )
        make, kw = (
            Token2Wav3,
            lambda: {"draws": itertools.repeat({"rand_ini": rand_ini, "sine_waves": sine_waves})},
        )
    else:
        make, kw = (
            Token2Wav2,
            lambda: {"generator": np.random.default_rng(5)},
        )  # the same vocoder draws each time

    def speak(voices: Any) -> list[np.ndarray]:
        t2w = make(flow, hift, policy, flow_steps=STEPS, voices=voices)
        assert t2w.keeps_voices == (voices is not None)
        return list(
            t2w(x["token"][0].tolist(), embedding=x["embedding"], prompt_token=x["prompt_token"],
                prompt_feat=x["prompt_feat"], stream=True, **kw())
        )  # fmt: skip

    inline = speak(None)
    voices = VoiceStates(1 << 30, folder=lambda: tmp_path, model_tag="a")
    state = voices.keep(flow, x["prompt_token"], x["prompt_feat"], x["embedding"], STEPS).result()
    kept = flow.granularity
    assert state.frames == kept and not state.steps[0].kv.flags.writeable
    assert voices.nbytes == state.nbytes() >= kept * bytes_per_second(flow, STEPS) // flow.frame_rate > 0
    runs = _estimates(monkeypatch)
    first = speak(voices)
    # the first chunk: the first hop (25 + the prompt's pad of 10) and its lookahead make 2 x (40 + 35) frames
    assert runs[:STEPS] == [(2 * (prompt + HOP + 10) - kept, kept)] * STEPS, runs[:STEPS]
    assert voices.stream_bytes == 0 and len(voices) == 1  # the stream gave its bytes back; the voice is kept
    second = speak(voices)
    assert len(first) == len(inline) >= 3
    for i, (a, b, c) in enumerate(zip(first, second, inline, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"chunk {i}: the first request changed the voice's state")
        np.testing.assert_allclose(a, c, atol=ATOL, err_msg=f"chunk {i}: registered vs inline")
    stored = list((tmp_path / ".flow-states").glob("*.a.safetensors"))
    assert len(stored) == 1
    del runs[:]
    mapped = speak(VoiceStates(1 << 30, folder=lambda: tmp_path, model_tag="a"))
    assert runs[0][1] == kept, "the stored state was not used: the prompt's frames were computed again"
    assert all(np.array_equal(a, b) for a, b in zip(first, mapped, strict=True))
    small = VoiceStates(
        state.nbytes() - 1
    )  # voice_cache_mb below the state: computed for each request, not kept
    small.keep(flow, x["prompt_token"], x["prompt_feat"], x["embedding"], STEPS).result()
    assert len(small) == 0 and small.nbytes == 0


def test_a_cosyvoice2_lite_bundle_of_version_2_is_converted_again(
    cv2_lite_bundle: Path, cv3_lite_bundle: Path, tmp_path: Path
) -> None:
    """Lite version 3 changed CosyVoice2's flow_mu_stream graph only (its encoder keeps a stream state): a version 2
    CosyVoice2 bundle is refused with "convert again" (else its graph, which takes tokens alone, would be fed the
    encoder's state at the first streamed chunk), while a version 2 bundle without that graph's change is read."""
    import json

    from cosyserve.core.errors import BundleError
    from cosyserve.runtime.lite.models import LiteBundle

    def as_version_2(bundle: Path, out: Path, cosyvoice2: bool) -> Path:
        (out / "lite").mkdir(parents=True)  # the bundle's files linked, its lite manifest rewritten
        for p in [*bundle.iterdir(), *(bundle / "lite").iterdir()]:
            if p.name not in ("lite", "manifest.json") or p.parent == bundle and p.name == "manifest.json":
                (out / p.relative_to(bundle)).symlink_to(p)
        manifest = json.loads((bundle / "lite" / "manifest.json").read_text())
        manifest["version"] = 2
        if cosyvoice2:  # what version 2 wrote for CosyVoice2: no encoder state
            manifest["config"]["flow"]["mu_lead"] = None
            del manifest["config"]["flow"]["encoder_state"]
        (out / "lite" / "manifest.json").write_text(json.dumps(manifest))
        return out

    with pytest.raises(BundleError, match="convert again"):
        LiteBundle(as_version_2(cv2_lite_bundle, tmp_path / "cv2", True), verify="none")
    assert LiteBundle(as_version_2(cv3_lite_bundle, tmp_path / "cv3", False), verify="none").config["flow"]


def _fork_and_speak(bundle: Path, shares: bool) -> tuple[Any, np.ndarray]:
    """A voice's state kept on ``bundle``'s lite flow, a stream forked from it and two streamed calls, checked against
    an inline stream (``shares``: the graphs take the voice's rows as an input, the checks below hold); returns
    (the fork, its last mel)."""
    import onnxruntime as ort

    flow, _, _ = _lite(bundle)
    assert ("kv_voice" in flow._inputs("flow_estimator")) == shares
    x = {k: v.numpy() for k, v in _inputs(4, 40, 80).items()}
    prompt = (x["prompt_token"], x["prompt_feat"], x["embedding"])
    voice = flow.prefill(flow.new_stream(STEPS), *prompt)
    states = [*voice.steps, *voice.encoder]
    before = [s.kv.copy() for s in states]
    assert voice.frames == flow.granularity and all(s.kept == s.kv.shape[0] > 0 for s in states)
    fork, inline = voice.fork(), flow.new_stream(STEPS)
    assert fork.nbytes() == 0, "a fork holds nothing of its own before its first call"
    for n in (40, 80):  # a call that keeps 100 frames after the voice's 50, then one that keeps 50 more
        kw = {"streaming": True, "finalize": False, "n_timesteps": STEPS}
        got = flow.inference(x["token"][:, :n], *prompt, stream=fork, **kw)
        want = flow.inference(x["token"][:, :n], *prompt, stream=inline, **kw)
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=1e-3, err_msg=f"{n} tokens: forked vs inline")
    own = [*fork.steps, *fork.encoder]
    for voiced, old in zip(states, before, strict=True):
        np.testing.assert_array_equal(voiced.kv, old, err_msg="a fork wrote into the voice's kept rows")
    if not shares:
        return fork, got
    for voiced, mine in zip(states, own, strict=True):  # its buffers hold its own rows only, the voice's lent
        assert mine.voice is voiced.kv and not np.shares_memory(mine.kv, voiced.kv)
        assert mine.kept == voiced.kept + mine.own and mine.kv.shape[0] == mine.own > 0, mine.kv.shape
    mel = fork.mel.nbytes
    assert fork.nbytes() == sum(s.kv.nbytes + sum(t.nbytes for t in s.tails) for s in own) + mel
    wrapped = ort.OrtValue.ortvalue_from_numpy(states[0].kv)
    assert wrapped.data_ptr() == states[0].kv.ctypes.data, "ORT copied a read-only array it was given"
    return fork, got


def _without_voice_inputs(bundle: Path, out: Path) -> Path:
    # the bundle as converted before the voice's rows were an input of their own (and CosyVoice2's encoder's `ahead`):
    # its files linked, the flow graphs' kv*_voice inputs made empty constants (0 rows; the estimator's batch 2, the
    # encoder's 1) and `ahead` a constant 1 (not in its config: no bounded flow context), their sizes in the
    # lite manifest rewritten (the test's tmp folder is on the fixture's filesystem: hard links)
    import json

    import onnx
    from onnx import numpy_helper

    (out / "lite").mkdir(parents=True)
    graphs = ("flow_estimator.onnx", "flow_mu_stream.onnx", "manifest.json")
    for p in [*bundle.iterdir(), *(bundle / "lite").iterdir()]:
        if p.parent == bundle / "lite" and p.name not in graphs:
            (out / p.relative_to(bundle)).hardlink_to(p)  # ORT opens no data file outside the graph's folder
        elif p.name != "lite" and p.parent == bundle:
            (out / p.relative_to(bundle)).symlink_to(p)
    manifest = json.loads((bundle / "lite" / "manifest.json").read_text())
    for name in graphs[:2]:
        model = onnx.load(str(bundle / "lite" / name), load_external_data=False)
        for inp in [i for i in model.graph.input if i.name.endswith("_voice") or i.name == "ahead"]:
            dims = [d.dim_value or 2 for d in inp.type.tensor_type.shape.dim]
            model.graph.input.remove(inp)
            # before `ahead` too: CosyVoice2's encoder always read its lookahead tokens
            value = np.ones(1, np.float32) if inp.name == "ahead" else np.zeros([0, *dims[1:]], np.float32)
            model.graph.initializer.append(numpy_helper.from_array(value, inp.name))
        onnx.save_model(model, str(out / "lite" / name))
        manifest["files"][name]["bytes"] = (out / "lite" / name).stat().st_size
    (manifest["config"]["flow"].get("encoder_state") or {}).pop("ahead", None)
    (out / "lite" / "manifest.json").write_text(json.dumps(manifest))
    return out


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_a_lite_stream_forked_from_a_voice_reads_its_rows_where_they_are(
    family: str, cv2_lite_bundle: Path, cv3_lite_bundle: Path, tmp_path: Path
) -> None:
    """A stream forked from a voice's kept flow state (LiteFlowStream.fork) gives the inline stream's mel, chunk by
    chunk, while the graphs read the voice's read-only rows as their own input (kv*_voice, bound where they are:
    ORT wraps a read-only array without a copy): every step's (and CosyVoice2's encoder's) buffer holds the
    stream's own kept frames only, its nbytes counts none of the voice's, and the voice's arrays are unchanged.
    A bundle whose graphs lack that input (converted before it) gives the same mel, the voice's rows copied into
    the stream's buffer as before. If this fails, each stream copies its voice's frames again (~1.8 GB and ~1.3 s
    a request at full size), a fork writes into the voice's state, or an older bundle's forks stop working."""
    bundle = cv2_lite_bundle if family == "cosyvoice2" else cv3_lite_bundle
    _, got = _fork_and_speak(bundle, shares=True)
    older, old = _fork_and_speak(_without_voice_inputs(bundle, tmp_path / "older"), shares=False)
    np.testing.assert_allclose(
        old, got, atol=1e-5, err_msg="an older bundle's fork (the voice's rows copied)"
    )
    assert all(s.voice is None for s in (*older.steps, *older.encoder)), (
        "an older bundle's fork was not copied"
    )


# -- a bounded flow context (flow_context_seconds, opt-in) -----------------------------------------------------------


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_a_bounded_lite_stream_keeps_and_drops_the_torch_streams_frames(
    family: str, cv2_lite_bundle: Path, cv3_lite_bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream bounded to a 1 s flow context (one attention chunk) over 6 s of speech gives the torch bounded
    stream's mel chunk by chunk, keeps exactly the rows the torch stream keeps after every call (the prompt's chunk
    and the most recent generated ones: the shared rule, models/flow_window.py), attends to at most the prompt's,
    the window's and one chunk's rows whatever the utterance's length, and holds the same bytes once its window is
    full; its last call goes through the stream as the torch one's (its own frames only, chunk-causal, no
    lookahead; CosyVoice2's encoder graph zeroes its lookahead tokens' embeddings, `ahead`) and gives its mel.
    If this fails, a lite bounded stream drops other frames than the torch one (audio differs), keeps
    every frame (cost and memory grow with the utterance) or runs its last call whole."""
    bundle = cv2_lite_bundle if family == "cosyvoice2" else cv3_lite_bundle
    sides = _sides(bundle)
    (tflow, _), (lflow, _, _) = sides["torch"], sides["lite"]
    tokens = TOKENS
    x = _inputs(4, tokens=tokens)
    xl = {k: v.numpy() for k, v in x.items()}
    look, ratio, g = lflow.pre_lookahead_len, lflow.token_mel_ratio, lflow.granularity
    ends = [n + look for n in range(HOP + (-PROMPT) % HOP, tokens - look, HOP)]
    ts, ls = tflow.new_stream(STEPS), lflow.new_stream(STEPS)
    ts.context = ls.context = g  # 1 s at 50 frames a second
    runs = _estimates(monkeypatch)
    held = []
    for end in ends:
        want = tflow.inference(x["token"][:, :end], x["prompt_token"], x["prompt_feat"], x["embedding"],
                               streaming=True, finalize=False, stream=ts, n_timesteps=STEPS)  # fmt: skip
        got = lflow.inference(xl["token"][:, :end], xl["prompt_token"], xl["prompt_feat"], xl["embedding"],
                              streaming=True, finalize=False, stream=ls, n_timesteps=STEPS)  # fmt: skip
        np.testing.assert_allclose(got, want.numpy(), atol=ATOL, err_msg=f"chunk ending at token {end}")
        kept = sum(t.shape[2] for t in ts.steps[0].keys[0])  # the torch stream's kept frames
        assert [s.kept for s in ls.steps] == [kept] * STEPS, (end, kept)
        assert ls.frames == ts.frames
        held.append(sum(s.nbytes() for s in ls.steps))
    assert ls.frames >= 5 * g and ls.steps[0].kept == 2 * g, "only the prompt's chunk and the 1 s window kept"
    prompt_rows = -(-ratio * PROMPT // g) * g  # the prompt's frames, to the end of the chunk they end in
    assert max(rows for _, rows in runs) <= prompt_rows + 2 * g, "prompt + a 1 s window + one chunk at most"
    assert len(set(held[-4:])) == 1, f"the held state should stop growing: {held}"
    final = (x["token"], x["prompt_token"], x["prompt_feat"], x["embedding"])
    want = tflow.inference(*final, streaming=False, finalize=True, stream=ts, n_timesteps=STEPS)
    del runs[:]
    got = lflow.inference(*(a.numpy() for a in final), streaming=False, finalize=True, stream=ls,
                          n_timesteps=STEPS)  # fmt: skip
    np.testing.assert_allclose(got, want.numpy(), atol=ATOL, err_msg="the bounded stream's last call")
    assert runs == [(ratio * (PROMPT + tokens) - ls.frames, ls.steps[0].kept)] * STEPS, runs


def test_lite_cosyvoice3_token2wav_with_a_flow_context_streams_the_torch_audio_in_bounded_memory(
    cv3_lite_bundle: Path,
) -> None:
    """The family's one Token2Wav3 with ``flow_context`` 1 s (what ``flow_context_seconds`` sets) over the lite
    flow gives the torch runtime's bounded audio chunk by chunk, its last chunk included, for 6 s of speech of a
    voice whose state VoiceStates keeps and forks; the bytes the model's stream account charges it stop growing
    once its window is full (but for its kept mel, as the torch stream's; the exact stream's keep growing) and are
    all given back at its end. If this fails,
    the setting does not reach the lite flow, the lite audio differs from torch's, or a lite bounded stream is
    charged (or holds) more as it speaks."""
    from cosyserve.families.cosyvoice2.token2wav import StreamPolicy2
    from cosyserve.families.cosyvoice3.token2wav import Token2Wav3
    from cosyserve.models.causal_hift import source_noise
    from cosyserve.voices.voicestates import VoiceStates

    sides = _sides(cv3_lite_bundle)
    (tflow, thift), (lflow, lhift, _) = sides["torch"], sides["lite"]
    tokens = TOKENS
    x = _inputs(5, tokens=tokens)
    rand_ini, sine_waves = source_noise(2 * (PROMPT + tokens) * 480, torch.Generator().manual_seed(2))
    chunks, charged, accounts = {}, {}, {}
    runs = (("torch", tflow, thift, lambda t: t, 1.0), ("lite", lflow, lhift, lambda t: t.numpy(), 1.0),
            ("lite exact", lflow, lhift, lambda t: t.numpy(), 0.0))  # fmt: skip
    for name, flow, hift, conv, context in runs:
        voices = accounts[name] = VoiceStates(1 << 30)
        t2w = Token2Wav3(flow, hift, StreamPolicy2(token_hop_len=HOP, token_max_hop_len=HOP), flow_steps=STEPS,
                         voices=voices, flow_context=context)  # fmt: skip
        noise = {"rand_ini": conv(rand_ini), "sine_waves": conv(sine_waves)}
        chunks[name], charged[name] = [], []
        for chunk in t2w(x["token"][0].tolist(), embedding=conv(x["embedding"]), prompt_token=conv(x["prompt_token"]),
                         prompt_feat=conv(x["prompt_feat"]), stream=True, draws=itertools.repeat(noise)):  # fmt: skip
            chunks[name].append(chunk)
            charged[name].append(voices.stream_bytes)
    assert len(chunks["lite"]) == len(chunks["torch"]) >= 6
    for i, (got, want) in enumerate(zip(chunks["lite"], chunks["torch"], strict=True)):
        np.testing.assert_allclose(got, want.numpy(), atol=ATOL, err_msg=f"chunk {i}")
    assert not np.allclose(chunks["lite"][-1], chunks["lite exact"][-1], atol=ATOL), "the bound had no effect"
    lite, exact = charged["lite"][:-1], charged["lite exact"][:-1]  # the last: given back
    # its charge grows by its kept mel only (80 float32 a frame, as the torch stream's), not its flow state
    assert lite[-1] - lite[-4] == 3 * 2 * HOP * 80 * 4 and lite[-1] > 0, f"a bounded stream's charge: {lite}"
    assert exact[-1] > exact[-4] and exact[-1] > lite[-1], exact
    assert all(v.stream_bytes == 0 for v in accounts.values())


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3", "older cosyvoice2"])
def test_flow_context_seconds_reaches_the_lite_token2wav_or_is_ignored_with_a_warning(
    family: str,
    cv2_lite_bundle: Path,
    cv3_lite_bundle: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``flow_context_seconds`` on the lite runtime reaches the token2wav of a CosyVoice2 or CosyVoice3 bundle (its
    streams are bounded, no warning); a CosyVoice2 bundle converted before its encoder graph took ``ahead`` cannot
    run a bounded last call, so it still serves, the setting ignored with a warning that says why. If this fails,
    the setting is silently dropped on lite, or an older CosyVoice2 bundle's stream would fail at its last call."""
    import cosyserve

    bundle = cv3_lite_bundle if family == "cosyvoice3" else cv2_lite_bundle
    if family.startswith("older"):
        bundle = _without_voice_inputs(bundle, tmp_path / "older")
    with caplog.at_level("WARNING", logger="cosyserve.runtime.lite"):
        model = cosyserve.load(bundle, runtime="lite", flow_context_seconds=2, warmup=False, text_tier="lazy",
                               threads=1, verify="none")  # fmt: skip
    warned = [r.getMessage() for r in caplog.records if "flow_context_seconds" in r.getMessage()]
    t2w = model.runtime.pipeline.token2wav
    model.runtime.close()
    if family.startswith("older"):
        assert t2w.flow_context == 0.0 and len(warned) == 1 and "convert it again" in warned[0], warned
    else:
        assert t2w.flow_context == 2.0 and not warned, warned
