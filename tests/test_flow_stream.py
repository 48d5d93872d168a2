"""Incremental token2wav (models/flow_stream.py, the flows' streams, causal_hift.VocoderStream, voicestates.py):
a streamed chunk computes its own frames only and equals the reference's cumulative computation within the
fixtures' tolerances; a registered voice's precomputed state speaks as the same voice given inline.

The models are the fixture sets' (their tolerances are the fixtures'); the utterances are longer than any case's,
with a prompt whose frames end inside an attention chunk and the low-latency policy's short first hop, so chunks
end inside attention chunks too (the frames computed again). The opt-in bounded flow context
(``flow_context_seconds``) is checked here too: what it keeps, what it changes and where it is set."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from cosyserve.families.cosyvoice2.token2wav import StreamPolicy2, Token2Wav2
from cosyserve.voices.voicestates import VoiceStates, prompt_key


def _load(set_dir: Path) -> dict[str, Any]:
    from cosyserve.bundle.official import load_component
    from cosyserve.families.modelconfig import load_model_config

    model = set_dir / "model"
    cfg = load_model_config(model)
    parts = {n: load_component(model, n, getattr(cfg, n), cfg.family) for n in ("flow", "hift")}
    cases = {c["name"]: c for c in json.loads((set_dir / "cases.json").read_text())["cases"]}
    parts["atol"] = {k: cases[k]["atol"] for k in ("token2wav_stream", "flow_prompt_stream")}
    parts["family"] = cfg.family
    parts["cfg"] = cfg
    return parts


@pytest.fixture(scope="module")
def cv2(cv2_set_dir: Path) -> dict[str, Any]:
    return _load(cv2_set_dir)


@pytest.fixture(scope="module")
def cv3(cv3_set_dir: Path) -> dict[str, Any]:
    return _load(cv3_set_dir)


def _t2w(parts: dict, **kw: Any) -> Token2Wav2:
    if parts["family"] == "cosyvoice3":
        from cosyserve.families.cosyvoice3.noise import VocoderNoise
        from cosyserve.families.cosyvoice3.token2wav import Token2Wav3

        return Token2Wav3(parts["flow"], parts["hift"], noise=VocoderNoise(parts["cfg"]), **kw)
    return Token2Wav2(parts["flow"], parts["hift"], **kw)


def _inputs(n: int, p: int, seed: int = 3) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "tokens": torch.randint(0, 6561, (n,), generator=g).tolist(),
        "prompt_token": torch.randint(0, 6561, (1, p), generator=g).to(torch.int32),
        "prompt_feat": torch.randn(1, 2 * p, 80, generator=g),
        "embedding": torch.randn(1, 192, generator=g),
    }


def _speak(t2w: Token2Wav2, x: dict[str, Any]) -> list[torch.Tensor]:
    kw = {k: v for k, v in x.items() if k != "tokens"}
    # CosyVoice2's vocoder draws: the same seed for both paths; CosyVoice3's noise is fixed
    return list(t2w(iter(x["tokens"]), stream=True, generator=torch.Generator().manual_seed(5), **kw))


class _Widths:
    """Records how many frames each estimator pass runs on."""

    def __init__(self, flow: Any) -> None:
        self.est, self.widths = flow.decoder.estimator, []
        self.inner = self.est.forward_packed

    def __enter__(self) -> list[int]:
        def record(h: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
            self.widths.append(h.shape[2])
            return self.inner(h, *a, **k)

        self.est.forward_packed = record
        return self.widths

    def __exit__(self, *exc: object) -> None:
        del self.est.forward_packed


@pytest.mark.parametrize("family", ["cv2", "cv3"])
def test_streamed_chunks_equal_the_cumulative_path_computing_only_their_frames(family: str, request) -> None:
    """A long streamed utterance (P=37 prompt tokens, 200 tokens, hops 5+13, 20, 25, 50 and the final call: the
    first ends mid-chunk, so the second computes that chunk's frames again)
    through the incremental path equals the cumulative one (the reference's: the flow on every token so far, the
    CosyVoice3 vocoder on every frame) chunk by chunk within the fixtures' token2wav tolerance, while each
    estimator pass runs only on the frames after the last whole attention chunk kept. A wrong offset (rotary,
    rel-pos, conv tail, noise column, source phase) breaks the equality; a silent fallback to the cumulative path
    breaks the widths."""
    parts = request.getfixturevalue(family)
    x = _inputs(200, 37)
    policy = StreamPolicy2.named("low-latency", 5)
    with _Widths(parts["flow"]) as widths:
        cached = _speak(_t2w(parts, policy=policy), x)
    cumulative = _speak(_t2w(parts, policy=policy, incremental=False), x)
    assert len(cached) == len(cumulative) == 5
    atol = parts["atol"]["token2wav_stream"]
    for i, (a, b) in enumerate(zip(cached, cumulative, strict=True)):
        assert a.shape == b.shape, i
        assert torch.allclose(a, b, atol=atol, rtol=1e-5), (i, (a - b).abs().max().item())
    # per call, 10 Euler steps of one pass each: the streamed calls' passes run on their frames after the kept
    # ones (whole 50-frame chunks), the final call on every frame (full attention)
    ends = [2 * (37 + 13 + h) for h in (5, 25, 50, 100)]
    kept = [0] + [e // 50 * 50 for e in ends[:-1]]
    want = [w for e, k in zip(ends, kept, strict=True) for w in [e - k] * 10] + [2 * (37 + 200)] * 10
    assert widths == want


@pytest.mark.parametrize("set_name", ["cosyvoice2-tiny", "cosyvoice3-tiny"])
def test_the_fixtures_token2wav_stream_cases_pass_through_the_incremental_path(
    set_name: str, request, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference's recorded streams (token2wav_stream cases) pass with chunks that compute their own frames:
    after the first call, no estimator pass of a streamed call runs on every frame so far."""
    from cosyserve.models.causal_flow_decoder import CausalConditionalDecoder
    from cosyserve.models.dit import DiT
    from cosyserve.tools.conformance import run_conformance

    set_dir = request.getfixturevalue("cv2_set_dir" if set_name.startswith("cosyvoice2") else "cv3_set_dir")
    calls: list[tuple[int, bool]] = []
    for cls in (CausalConditionalDecoder, DiT):
        inner = cls.forward_packed

        def record(self, h, t, streaming=False, should_stop=None, cache=None, inner=inner):  # type: ignore[no-untyped-def]
            calls.append((h.shape[2], cache is not None))
            return inner(self, h, t, streaming, should_stop, cache)

        monkeypatch.setattr(cls, "forward_packed", record)
    results = run_conformance(set_dir, kinds=["token2wav_stream"], report=None)
    assert results and all(r.passed for r in results), results
    # every streamed pass keeps its frames (a cache); the passes without one are the final full-attention calls
    assert any(cached for _, cached in calls)
    assert sum(1 for _, cached in calls if not cached) == 10 * len(results)


def test_stream_mel_equals_the_whole_sequence_flow(cv2: dict) -> None:
    """The CosyVoice2 flow's streamed calls (encoder caches at token and mel rate, the decoder's) give the mel of
    the whole-sequence streaming flow call within the fixture's flow tolerance, and keep whole chunks only."""
    flow = cv2["flow"]
    x = _inputs(160, 21)
    tokens = torch.tensor([x["tokens"]], dtype=torch.int32)
    stream = flow.new_stream()
    for n in (32, 57, 107):
        args = (tokens[:, :n], x["prompt_token"], x["prompt_feat"], x["embedding"], True, False)
        got = flow.inference(*args, stream=stream)
        want = flow.inference(*args)
        assert got.shape == want.shape and torch.allclose(got, want, atol=cv2["atol"]["flow_prompt_stream"])
        assert stream.frames == 2 * (21 + n - 3) // 50 * 50


def _chunk_args(flow: Any, x: dict[str, Any], stream: Any, n: int, last: bool = False) -> tuple[Any, ...]:
    # a streamed call whose frames end n after the ones the stream keeps (the last 3 tokens lookahead, but in a
    # bounded stream's last call)
    look = 0 if last else flow.pre_lookahead_len
    t = (stream.frames + n) // flow.token_mel_ratio - x["prompt_token"].shape[1] + look
    token = torch.tensor([x["tokens"][:t]], dtype=torch.int32)
    return token, x["prompt_token"], x["prompt_feat"], x["embedding"]


def _offset_streams(flow: Any, steps: int) -> tuple[list[dict[str, Any]], list[Any]]:
    # streams at three offsets: prompts of 0, 33 and 60 tokens keep 0, 50 and 100 frames after their prefill
    inputs = [_inputs(160, p, seed=p) for p in (0, 33, 60)]
    streams = [
        flow.prefill(flow.new_stream(steps), x["prompt_token"], x["prompt_feat"], x["embedding"])
        for x in inputs
    ]
    assert len({s.frames for s in streams}) == 3, [s.frames for s in streams]
    return inputs, streams


def _kept_keys(stream: Any) -> int:
    # the frames whose keys a stream's estimator attends to (every layer and step alike)
    return sum(k.shape[2] for k in stream.steps[0].keys[0])


@pytest.mark.parametrize("family", ["cv3", "cv2"])
def test_stacked_stream_chunks_equal_each_stream_alone(family: str, request) -> None:
    """Three streams at different offsets (0, 50 and 100 frames kept: rotary positions, conv tails, noise columns
    and attention over kept frames of different lengths), two of them bounded by different flow contexts (100 and
    50 frames: each drops its oldest chunks of speech as it goes, so the rows attend to 100, 150 and 250 kept
    frames in the last round) run four rounds of chunks as one batch (ChunkFlow.run_chunks: every stream's rows
    in one estimator call per Euler step; CosyVoice2's encoder per stream), the 50-frame stream's last call (no
    lookahead, chunk-causal) in the last round beside the others' chunks, and get the mel each gets alone within
    the fixture's flow tolerance, keeping (and dropping) what it keeps alone. A row computed at another's offset
    or lookahead, attending to another's frames, to a pad or to a dropped chunk, breaks the equality."""
    parts = request.getfixturevalue(family)
    flow, steps, atol = parts["flow"], 2, parts["atol"]["flow_prompt_stream"]  # steps: only time
    inputs, base = _offset_streams(flow, steps)
    stacked = [s.fork() for s in base]
    alone = [s.fork() for s in base]
    for s, context in zip(stacked + alone, (100, 50, 0) * 2, strict=True):
        s.context = context
    for last in (False, False, False, True):
        chunks, want = [], []
        for x, s, a in zip(inputs, stacked, alone, strict=True):
            final = last and s.context == 50
            args = _chunk_args(flow, x, s, 50, final)
            chunks.append(flow.chunk(*args, stream=s, finalize=final, n_timesteps=steps))
            want.append(flow.inference(*args, not final, final, n_timesteps=steps, stream=a))
        got = flow.run_chunks(chunks)
        for g, w, s, a in zip(got, want, stacked, alone, strict=True):
            assert g.shape == w.shape and torch.allclose(g, w, atol=atol, rtol=0), (g - w).abs().max().item()
            assert s.frames == a.frames and torch.allclose(s.mel, a.mel, atol=atol, rtol=0)
            assert _kept_keys(s) == _kept_keys(a)
    assert [s.frames for s in stacked] == [200, 200, 300]
    assert [_kept_keys(s) for s in stacked] == [100, 150, 300], "the bounded streams drop their oldest speech"


def test_concurrent_streams_chunks_run_stacked_and_a_lone_stream_never_waits(cv3: dict) -> None:
    """ChunkFlowBatcher (batch_flow's flow for CosyVoice2/3) gathers the chunks of three concurrent streams at
    different offsets into one run per round (each stream equal to itself alone), and a lone stream's chunks
    run at once through the same batcher with a 60 s gather (waiting for a partner would take minutes)."""
    from cosyserve.runtime.stacking import ChunkFlowBatcher

    flow, steps, atol = cv3["flow"], 2, cv3["atol"]["flow_prompt_stream"]
    batcher = ChunkFlowBatcher(flow, 3, gather_s=60.0)
    inputs, base = _offset_streams(flow, steps)
    streams = [s.fork() for s in base]
    for s in streams:  # live before their first chunk: each round's three chunks meet
        batcher.track(s)

    def speak(model: Any, x: dict[str, Any], s: Any) -> list[torch.Tensor]:
        out = [model.inference(*_chunk_args(flow, x, s, 50), True, False, n_timesteps=steps, stream=s)]
        out.append(model.inference(*_chunk_args(flow, x, s, 50), True, False, n_timesteps=steps, stream=s))
        last = _chunk_args(flow, x, s, 50)  # the last call: full attention, the stream done
        model.inference(*last, False, True, n_timesteps=steps, stream=s)
        return out

    with concurrent.futures.ThreadPoolExecutor(3, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        got = list(pool.map(lambda i: speak(batcher, inputs[i], streams[i]), range(3), timeout=120))
    stats = batcher.stats
    assert (stats.calls, stats.batches, stats.batched_calls, stats.peak, stats.timed_out) == (
        6,
        2,
        6,
        3,
        0,
    ), stats
    alone = [s.fork() for s in base]
    for x, a, g in zip(inputs, alone, got, strict=True):
        for gi, wi in zip(g, speak(flow, x, a), strict=True):
            assert gi.shape == wi.shape and torch.allclose(gi, wi, atol=atol, rtol=0)
    speak(batcher, inputs[0], base[0].fork())
    assert (stats.calls, stats.batches, stats.timed_out) == (8, 2, 0), stats


def test_vocoder_stream_equals_the_whole_mel(cv3: dict) -> None:
    """CosyVoice3's vocoder fed a mel in uneven pieces (one shorter than its context) emits the samples of one
    finalizing call on the whole mel: its kept context, source phase and noise position are exact."""
    from cosyserve.models.causal_hift import VocoderStream, source_noise

    hift = cv3["hift"]
    g = torch.Generator().manual_seed(1)
    mel = torch.randn(1, 80, 300, generator=g)
    rand_ini, sine_waves = source_noise(300 * 480, g)
    whole, _ = hift.inference(mel, True, rand_ini=rand_ini, sine_waves=sine_waves)
    state, out, cuts = VocoderStream(), [], [0, 40, 52, 170, 300]
    for a, b in itertools.pairwise(cuts):
        out.append(hift.stream(state, mel[:, :, a:b], b == 300, rand_ini=rand_ini, sine_waves=sine_waves))
        assert b == 300 or (state.mel is not None and state.mel.shape[2] <= hift.context + 8)  # bounded
    assert [o.shape[1] for o in out] == [(40 - 8) * 480, 12 * 480, 118 * 480, (130 + 8) * 480]
    assert torch.allclose(torch.cat(out, dim=1), whole, atol=1e-5)


def test_a_registered_voice_speaks_as_the_same_voice_inline(cv3: dict, tmp_path: Path) -> None:
    """A voice kept at registration (VoiceStates.keep) gives the same chunks as the same prompt given inline
    (computed in the request), and the registered request's passes skip the prompt's whole chunks; a second
    request forked from the same state is unchanged by the first; the state stored on disk is mapped back by a
    new VoiceStates of the same model tag, and recomputed (old file removed) under another tag."""
    x = _inputs(90, 60)
    flow = cv3["flow"]
    inline = _speak(_t2w(cv3), x)
    voices = VoiceStates(1 << 30, folder=lambda: tmp_path, model_tag="a")
    size = voices.keep(flow, x["prompt_token"], x["prompt_feat"], x["embedding"], None).result().nbytes()
    assert size == voices.nbytes > 0 and len(voices) == 1
    with _Widths(flow) as widths:
        first = _speak(_t2w(cv3, voices=voices), x)
    second = _speak(_t2w(cv3, voices=voices), x)
    # the prompt's frames 0..99 are kept (its last 3 tokens' lookahead is speech): the first call starts there
    assert widths[0] == 2 * (60 + 15 + 25) - 100
    atol = cv3["atol"]["token2wav_stream"]
    for a, b, c in zip(first, second, inline, strict=True):
        assert torch.equal(a, b)
        assert torch.allclose(a, c, atol=atol, rtol=1e-5)
    stored = list((tmp_path / ".flow-states").glob("*.safetensors"))
    assert len(stored) == 1 and stored[0].name.endswith(".a.safetensors")
    mapped = _speak(_t2w(cv3, voices=VoiceStates(1 << 30, folder=lambda: tmp_path, model_tag="a")), x)
    assert all(torch.equal(a, b) for a, b in zip(first, mapped, strict=True))
    other = VoiceStates(1 << 30, folder=lambda: tmp_path, model_tag="b")
    _speak(_t2w(cv3, voices=other), x)
    assert [p.name.split(".")[1] for p in (tmp_path / ".flow-states").glob("*.safetensors")] == ["b"]


def test_a_stream_past_its_state_bound_continues_on_the_cumulative_path(cv3: dict) -> None:
    """Past ``stream_max_bytes`` a request drops its flow state (its memory bound) and its later calls run on
    every token, with the same chunks."""
    x = {**_inputs(120, 0), "prompt_token": torch.zeros(1, 0, dtype=torch.int32)}
    x["prompt_feat"] = torch.zeros(1, 0, 80)
    bounded = VoiceStates(1 << 30, stream_max_bytes=1)
    with _Widths(cv3["flow"]) as widths:
        got = _speak(_t2w(cv3, voices=bounded), x)
    want = _speak(_t2w(cv3), x)
    # hops 25, 50 and the final call: the first call computes its 50 frames, the second all 150 again
    assert widths[::10] == [50, 150, 240]
    assert all(
        torch.allclose(a, b, atol=cv3["atol"]["token2wav_stream"]) for a, b in zip(got, want, strict=True)
    )


def test_the_streams_share_one_budget_and_give_back_their_bytes(cv3: dict) -> None:
    """The model's bound on every stream's state together (``streams_max_bytes``): two streams interleaved, with
    room for three first chunks' states (50 frames each), fit until the first one's second chunk (150 frames)
    would pass it; that one drops its state (its later chunks on the cumulative path) while the other keeps its
    own, and both speak the same audio; an ended stream, and one closed mid-way (a client gone), hold nothing
    after."""
    x = {**_inputs(80, 0), "prompt_token": torch.zeros(1, 0, dtype=torch.int32)}
    x["prompt_feat"] = torch.zeros(1, 0, 80)
    shared = VoiceStates(1 << 30)
    a, b = (_speak_lazily(_t2w(cv3, voices=shared, flow_steps=2), x) for _ in range(2))  # steps: time only
    got_a = [next(a)]
    first = shared.stream_bytes  # one stream's state after its first chunk
    got_b = [next(b)]
    assert first > 0 and shared.stream_bytes == 2 * first
    shared.streams_max_bytes = 3 * first
    got_a.append(next(a))  # 150 + 50 frames would not fit: `a` drops its state
    got_b.append(next(b))  # 150 frames: `b` keeps its own
    assert shared.stream_drops == 1 and first < shared.stream_bytes <= 3 * first
    got_a += list(a)
    got_b += list(b)
    assert shared.stream_peak <= 3 * first and shared.stream_bytes == 0, "ended streams should hold nothing"
    atol = cv3["atol"]["token2wav_stream"]
    assert all(torch.allclose(g, w, atol=atol) for g, w in zip(got_a, got_b, strict=True))
    closed = _speak_lazily(_t2w(cv3, voices=shared, flow_steps=2), x)
    next(closed)
    assert shared.stream_bytes > 0
    closed.close()
    assert shared.stream_bytes == 0, "a stream closed mid-way (its client gone) should give its bytes back"


def test_the_default_budget_is_a_quarter_of_the_memory_limit_shared_by_the_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unset, ``stream_state_budget_mb`` is a quarter of the memory limit divided among the worker processes
    (each loads its own models: four workers with a quarter each would take it all); 0 is no bound; a bad value
    names the field."""
    from cosyserve.runtime import RuntimeOptions
    from cosyserve.system import pagecache

    monkeypatch.setattr(pagecache, "memory_limit_bytes", lambda: 8 << 30)
    assert RuntimeOptions().stream_state_budget() == 2 << 30
    assert RuntimeOptions(stream_state_shares=4).stream_state_budget() == 512 << 20
    assert (
        RuntimeOptions(stream_state_budget_mb=100, stream_state_shares=4).stream_state_budget() == 100 << 20
    )
    assert RuntimeOptions(stream_state_budget_mb=0).stream_state_budget() is None
    with pytest.raises(ValueError, match="stream_state_budget_mb"):
        RuntimeOptions(stream_state_budget_mb=-1)


def _speak_lazily(t2w: Token2Wav2, x: dict[str, Any]) -> Any:
    kw = {k: v for k, v in x.items() if k != "tokens"}
    return t2w(iter(x["tokens"]), stream=True, generator=torch.Generator().manual_seed(5), **kw)


class _State:
    def __init__(self, n: int) -> None:
        self.n = n

    def nbytes(self) -> int:
        return self.n

    def fork(self) -> _State:
        return self


class _Flow:
    N_TIMESTEPS = 10

    def new_stream(self, steps: int) -> _State:
        return _State(0)

    def prefill(self, state: _State, prompt: torch.Tensor, *args: Any) -> _State:
        return _State(int(prompt.shape[1]))


def test_voice_states_are_bounded_unregistered_prompts_first() -> None:
    """The bound holds; an inline prompt is evicted before a registered voice even when used more recently; a
    state larger than the bound is never kept; the key follows the values, not the tensors' dtype."""
    voices, flow = VoiceStates(100), _Flow()

    def prompt(n: int, v: float = 0.0) -> tuple[torch.Tensor, ...]:
        return torch.zeros(1, n, dtype=torch.int32), torch.full((1, 2 * n, 80), v), torch.zeros(1, 192)

    voices.keep(flow, *prompt(40), None).result()  # registered, in the background
    voices.stream(flow, *prompt(30))  # inline
    voices.stream(flow, *prompt(50))  # inline: evicts the other inline prompt, not the voice
    assert voices.nbytes == 90 and len(voices) == 2
    voices.stream(flow, *prompt(200))  # too large: not kept
    assert voices.nbytes == 90
    a, f, e = prompt(3, 0.5)
    assert prompt_key(a, f, e, 10) == prompt_key(a.long(), f.double(), e, 10) != prompt_key(a, f, e, 9)
    voices.close()


def test_a_request_waits_for_its_voice_being_registered() -> None:
    """A request whose voice's state is still being computed (its registration, in the background) takes that
    state when it is ready instead of computing its own; it can be stopped while it waits."""
    import threading

    from cosyserve.core.stop import Stopped

    release, computed = threading.Event(), []

    class Slow(_Flow):
        def prefill(self, state: _State, prompt: torch.Tensor, *args: Any) -> _State:
            release.wait(10)
            computed.append(prompt.shape[1])
            return _State(int(prompt.shape[1]))

    voices, flow = VoiceStates(100), Slow()
    p = (torch.zeros(1, 7, dtype=torch.int32), torch.zeros(1, 14, 80), torch.zeros(1, 192))
    future = voices.keep(flow, *p, None)
    with pytest.raises(Stopped):
        voices.stream(flow, *p, should_stop=lambda: True)
    release.set()
    assert voices.stream(flow, *p).n == 7 and future.result().n == 7
    assert computed == [7]  # once, by the registration
    voices.close()


# -- a bounded flow context (flow_context_seconds, opt-in) -----------------------------------------------------------


def _watched(t2w: Token2Wav2) -> list[Any]:
    """The request states ``t2w`` makes, as it makes them."""
    made, states = t2w.new_stream, []

    def new_stream(*a: Any, **k: Any) -> Any:
        states.append(made(*a, **k))
        return states[-1]

    t2w.new_stream = new_stream  # type: ignore[method-assign]
    return states


@pytest.mark.parametrize("family", ["cv2", "cv3"])
def test_a_window_longer_than_the_utterance_changes_only_the_final_call(family: str, request) -> None:
    """With a flow context longer than the utterance nothing is dropped: every streamed call's mel equals the
    exact stream's bit for bit (the kept keys split per chunk concatenate to the same tensors). The final call,
    asked with ``streaming=False``, goes through the stream (the stream decides): only the frames after the kept
    ones are computed (the exact stream's final call re-runs all 474 with full attention), and the result is the
    whole sequence's chunk-causal final call (``streaming=True, finalize=True``: the lookahead sees zeros) within
    the fixture's flow tolerance. A final call still recomputed whole breaks the widths; a wrong lookahead, lead
    or offset in it breaks the last equality; a window that drops frames breaks the first. One Euler step: the
    state is per step alike."""
    parts = request.getfixturevalue(family)
    flow = parts["flow"]
    x = _inputs(200, 37)
    tokens = torch.tensor([x["tokens"]], dtype=torch.int32)
    prompt = (x["prompt_token"], x["prompt_feat"], x["embedding"])

    def run(context: int) -> list[torch.Tensor]:
        stream = flow.new_stream(1)
        stream.context = context
        out = [
            flow.inference(tokens[:, :n], *prompt, True, False, n_timesteps=1, stream=stream)
            for n in (21, 71)
        ]
        return [*out, flow.inference(tokens, *prompt, False, True, n_timesteps=1, stream=stream)]

    with _Widths(flow) as widths:
        bounded = run(10**6)
    assert widths == [110, 110, 474 - 200]
    exact = run(0)
    assert all(torch.equal(a, b) for a, b in zip(bounded[:-1], exact[:-1], strict=True))
    whole = flow.inference(tokens, *prompt, True, True, n_timesteps=1)
    assert bounded[-1].shape == exact[-1].shape == whole.shape == (1, 80, 2 * 200)
    atol = parts["atol"]["flow_prompt_stream"]
    assert torch.allclose(bounded[-1], whole, atol=atol), (bounded[-1] - whole).abs().max()
    assert not torch.allclose(exact[-1], whole, atol=atol), "full attention should differ from chunk-causal"


def test_a_small_window_bounds_the_keys_attended_and_the_state(
    cv2: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1 s flow context (one 50-frame chunk) over an 8 s CosyVoice2 stream forked from its voice's state: every estimator
    pass attends to its own frames plus at most the prompt's two chunks and one chunk of speech (the exact path's
    keys grow with the utterance), the flow's per-step state holds the same bytes after every chunk, the model's
    stream accounting (``VoiceStates.hold``) counts what the trimmed state holds (less than the exact path's; the
    CosyVoice2 encoder's own caches still grow, and on the tiny model, whose encoder is full width, they dominate),
    and the audio stays finite and near the exact path's. A window that never drops, drops the prompt or leaves
    dropped keys referenced (or counted) fails."""
    import cosyserve.models.flow_stream as flow_stream

    parts = cv2
    seen: list[tuple[int, int]] = []
    inner = flow_stream.attend

    def attend(q: torch.Tensor, keys: list, values: list, mask: Any) -> torch.Tensor:
        # every estimator attention of a lone stream's call (StepCache.attend)
        seen.append((q.shape[2], sum(k.shape[2] for k in keys)))
        return inner(q, keys, values, mask)

    monkeypatch.setattr(flow_stream, "attend", attend)
    x = _inputs(200, 37)
    voices = VoiceStates(1 << 30)
    t2w = _t2w(parts, flow_steps=1, flow_context=1.0, voices=voices)
    states = _watched(t2w)
    steps_bytes, accounted, bounded = [], [], []
    for chunk in _speak_lazily(t2w, x):
        bounded.append(chunk)
        flow = states[0].flow
        if flow is not None:  # None after the final call
            steps_bytes.append(sum(t.numel() * t.element_size() for s in flow.steps for t in s.tensors()))
            accounted.append((voices.stream_bytes, flow.nbytes() - states[0].shared))
    context = [keys - queries for queries, keys in seen]
    seen.clear()
    exact_voices = VoiceStates(1 << 30)
    exact = _speak(_t2w(parts, flow_steps=1, voices=exact_voices), x)
    # reference hops 38 (25 + the prompt's pad), 50, 100, then the final call
    assert len(bounded) == len(exact) == 4 and len(steps_bytes) == 3
    assert max(context) <= 150, "prompt (74 frames: 2 chunks) + a 1 s window (1 chunk)"
    assert max(k - q for q, k in seen) >= 2 * (37 + 88) // 50 * 50, "the exact path's context should grow"
    assert len(set(steps_bytes)) == 1, steps_bytes
    assert all(held == own for held, own in accounted), accounted
    assert voices.stream_peak < exact_voices.stream_peak and voices.stream_bytes == 0
    for i, (a, b) in enumerate(zip(bounded, exact, strict=True)):
        assert a.shape == b.shape and bool(torch.isfinite(a).all()), i
        # random weights: the audio is noise-like, so its relative RMS distance is the figure (two unrelated
        # chunks: ~1.4); the first chunk sees no dropped frame
        assert float((a - b).norm() / b.norm()) < (1e-5 if i == 0 else 0.5), i


def test_the_flow_context_setting_is_checked_on_every_entry(
    cv2_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``flow_context_seconds`` (a number of seconds in [0, 600], 0 the exact default) is checked wherever it
    enters, naming it as given (environment, flag, pool file, ``cosyserve.load``, RuntimeOptions), and a good
    value reaches the model's token2wav; else a bad window would be taken silently or a good one lost."""
    import cosyserve
    from cosyserve.cli.parser import build_parser, flags_of
    from cosyserve.core.settings import Settings, SettingsError
    from cosyserve.engine.poolfile import load_pool_config
    from cosyserve.runtime import RuntimeOptions

    assert Settings.load(env={}).flow_context_seconds == 0.0
    with pytest.raises(
        SettingsError, match=r"COSYSERVE_FLOW_CONTEXT_SECONDS='-1': must be between 0 and 600"
    ):
        Settings.load(env={"COSYSERVE_FLOW_CONTEXT_SECONDS": "-1"})
    with pytest.raises(SettingsError, match=r"COSYSERVE_FLOW_CONTEXT_SECONDS='nan'"):
        Settings.load(env={"COSYSERVE_FLOW_CONTEXT_SECONDS": "nan"})
    for command in ("serve", "synth"):
        argv = [command, "--flow-context-seconds", "abc"]
        argv += ["--text", "x", "--out", "x.wav"] if command == "synth" else []
        with pytest.raises(SettingsError, match=r"--flow-context-seconds"):
            Settings.load(flags=flags_of(build_parser().parse_args(argv)), env={})
    pool = tmp_path / "pool.toml"
    pool.write_text("[models.a]\npath='x'\nload={flow_context_seconds=-2}\n")
    with pytest.raises(SettingsError, match=r"\[models.a\] load.flow_context_seconds = -2: must be between"):
        load_pool_config(Settings.load(env={}, file=pool))
    pool.write_text("[models.a]\npath='x'\nload={flow_context_seconds=4}\n")
    options = load_pool_config(Settings.load(env={}, file=pool)).models["a"].load_options
    assert RuntimeOptions(**options).flow_context_seconds == 4.0
    monkeypatch.delenv("COSYSERVE_FLOW_CONTEXT_SECONDS", raising=False)
    with pytest.raises(SettingsError, match=r"cosyserve.load\(flow_context_seconds=-1\)"):
        cosyserve.load(tmp_path / "absent", flow_context_seconds=-1)
    for bad in (-1, float("inf"), "8"):
        with pytest.raises(ValueError, match="flow_context_seconds must be a number between 0 and 600"):
            RuntimeOptions(flow_context_seconds=bad)  # type: ignore[arg-type]
    model = cosyserve.load(cv2_model_dir, flow_context_seconds=8, warmup=False, text_tier="lazy")
    assert model.runtime.pipeline.token2wav.flow_context == 8.0
