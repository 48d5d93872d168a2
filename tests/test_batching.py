"""Batching through the engine (the LM's decode loop with several rows, cosyserve.runtime.decode; its own tests
are tests/test_decode.py) and stacked flow/vocoder calls (cosyserve.runtime.stacking): batched outputs equal
unbatched ones."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import cosyserve
from cosyserve.core.request import SynthesisRequest
from cosyserve.engine.engine import Engine
from cosyserve.runtime import RuntimeOptions, load_runtime
from cosyserve.runtime.stacking import ChunkFlowBatcher, FlowBatcher, VocoderBatcher

TEXTS = (
    "one two three four five six seven",
    "hello",
    "a somewhat longer sentence to speak",
    "short text",
)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Any:
    return cosyserve.load(tiny_model_dir, warmup=False)


def _args(model: Any, text: str) -> tuple[torch.Tensor, ...]:
    p = model.runtime.pipeline
    ids = torch.tensor([p.tokenizer.encode(text)], dtype=torch.int32)
    empty, zero = torch.zeros(1, 0, dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    embedding = p.speakers[sorted(p.speakers)[0]]["embedding"]
    return ids, torch.tensor([ids.shape[1]], dtype=torch.int32), empty, zero, empty, zero, embedding


def _in_thread(fn: Callable[[], Any], timeout: float = 60.0) -> Any:
    # run fn in a thread so a bug that blocks forever fails the test instead of hanging it; one torch thread,
    # as the decode loop, so unbatched references use the same reductions
    box: dict[str, Any] = {}

    def main() -> None:
        torch.set_num_threads(1)
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e

    t = threading.Thread(target=main, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the batched LM never finished the request (a row was not freed?)"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_engine_batch_size_serves_concurrently_with_unbatched_audio(tiny_model_dir: Path) -> None:
    reqs = [
        SynthesisRequest(text=TEXTS[0], speaker="中文女", seed=1, stream=True),
        SynthesisRequest(text=TEXTS[2], speaker="英文男", seed=2),
        SynthesisRequest(text=TEXTS[3], speaker="中文女", seed=3, stream=True),
    ]
    # batched only: a long streaming request whose client leaves after its first chunk
    leaver = SynthesisRequest(text=" ".join(TEXTS), speaker="英文男", seed=4, stream=True)

    def first_chunk_then_close(stream: Any) -> np.ndarray:
        chunk = next(stream)
        stream.close()  # cancels: its worker stops at the next token, its LM row is freed
        return chunk

    def run(batch_size: int) -> tuple[list[np.ndarray], Any, dict[str, Any]]:
        options = RuntimeOptions(warmup=False, batch_size=batch_size, worker_threads=1)
        e = Engine("tiny", lambda: load_runtime(tiny_model_dir, options))
        e.load_sync(60)
        streams = [e.synthesize_sync(r) for r in reqs]  # all admitted at once: none waits for a worker
        leaving = e.synthesize_sync(leaver) if batch_size > 1 else None
        batcher = e.runtime.pipeline.decoder
        with concurrent.futures.ThreadPoolExecutor(len(streams) + 1) as pool:
            futures = [pool.submit(lambda s: np.concatenate(list(s)), s) for s in streams]
            if leaving is not None:
                assert pool.submit(first_chunk_then_close, leaving).result(60).size > 0
            audio = [f.result(60) for f in futures]
        assert e.describe()["slots"] == batch_size
        e.release_sync(30)
        return audio, batcher, e.stats.snapshot()["outcomes"]

    single, one_row, _ = run(1)
    batched, batcher, outcomes = run(4)
    assert one_row.max_rows == 1 and batcher.max_rows == 4
    assert batcher.stats.prefills == len(reqs) + 1 and batcher.stats.peak_rows > 1
    assert batcher.active == 0
    assert outcomes == {"ok": len(reqs), "cancelled": 1}
    for a, b in zip(batched, single, strict=True):
        np.testing.assert_array_equal(a, b)


def test_pool_config_reads_batch_size(tmp_path: Path) -> None:
    from cosyserve.core.errors import SettingsError
    from cosyserve.core.settings import Settings
    from cosyserve.engine.poolfile import load_pool_config

    f = tmp_path / "pool.toml"
    f.write_text('[pool]\nbatch_size = 2\n[models.a]\npath = "a"\n[models.b]\npath = "b"\nbatch_size = 8\n')
    cfg = load_pool_config(Settings.load(env={}, file=f))
    assert (cfg.models["a"].batch_size, cfg.models["b"].batch_size) == (2, 8)
    cfg = load_pool_config(Settings.load(env={"COSYSERVE_BATCH_SIZE": "4"}, file=f))  # the environment wins
    assert (cfg.models["a"].batch_size, cfg.models["b"].batch_size) == (4, 4)
    with pytest.raises(SettingsError, match="COSYSERVE_BATCH_SIZE"):
        Settings.load(env={"COSYSERVE_BATCH_SIZE": "0"}, file=f)
    f.write_text('[models.a]\npath = "a"\n')
    assert load_pool_config(Settings.load(env={}, file=f)).models["a"].batch_size is None  # the family's


def test_a_model_serves_its_familys_batch_size_unless_one_is_set(
    tiny_model_dir: Path, cv2_model_dir: Path
) -> None:
    """If this fails, a model with no batch_size set serves another number of requests at once than its family
    says (CosyVoice2/3 8, CosyVoice-300M 4), or a batch_size given (an option, a pool model's own) is ignored."""
    import cosyserve
    from cosyserve.engine.entries import ModelSpec
    from cosyserve.runtime import RuntimeOptions

    assert cosyserve.load(cv2_model_dir, warmup=False).runtime.slots == 8
    assert cosyserve.load(tiny_model_dir, warmup=False).runtime.slots == 4
    assert cosyserve.load(cv2_model_dir, warmup=False, batch_size=2).runtime.slots == 2
    assert ModelSpec("m", str(cv2_model_dir), warmup=False).load(None, False).slots == 8
    base = RuntimeOptions(warmup=False, batch_size=3)  # the pool's (COSYSERVE_BATCH_SIZE)
    assert ModelSpec("m", str(cv2_model_dir), warmup=False).load(base, False).slots == 3
    assert ModelSpec("m", str(cv2_model_dir), warmup=False, batch_size=5).load(base, False).slots == 5


@torch.inference_mode()
def test_growing_the_cache_keeps_rows_being_decoded(model: Any) -> None:
    lm = model.runtime.pipeline.llm
    prompt = lm.embed_inputs(*_args(model, TEXTS[0]))
    t0 = prompt.size(1)
    tokens = torch.arange(12) + 7

    def run(grow_at: int | None) -> torch.Tensor:
        lm.llm.encoders[0].self_attn.kv_cache = None  # fresh caches: only just big enough for the prompt
        lm.setup_caches(2, t0 + (4 if grow_at is not None else 64))
        row = torch.tensor([1])
        out = [lm.extend(prompt, 1, 0)]
        for i, token in enumerate(tokens):
            if i == grow_at:
                lm.grow_caches(3, t0 + 64)  # more rows and positions while row 1 is mid-sequence
            out.append(lm.decode(token.reshape(1), torch.tensor([t0 + i]), t0 + i + 1, row))
        return torch.cat(out)

    grown, reference = run(grow_at=3), run(grow_at=None)
    assert lm.cache_shape() == (2, t0 + 64)
    # a regrown cache that lost row 1's keys or projected distances would change every later step
    torch.testing.assert_close(grown, reference, atol=1e-5, rtol=0)


# --- flow batching ------------------------------------------------------------------------------------------

# A stacked flow call runs the decoder's matrix products over 2B rows instead of 2: the same mel up to float
# rounding (measured ~1.5e-6 on the tiny model's mel of magnitude ~5).
MEL_ATOL = 1e-4
# Audio through stacked flow/vocoder calls: mel rounding passes through the vocoder's fades and convolutions
# (measured ~1e-5 on the tiny model's audio).
AUDIO_ATOL = 1e-4


def _flow_call(flow: Any, seed: int, t: int, p: int, f: int, c: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    n = lambda x: torch.tensor([x.shape[1]], dtype=torch.int32)  # noqa: E731
    token = torch.randint(0, 4096, (1, t), generator=g).int()
    prompt_token = torch.randint(0, 4096, (1, p), generator=g).int()
    prompt_feat = torch.randn(1, f, 80, generator=g)
    embedding, cache = torch.randn(1, 192, generator=g), torch.randn(1, 80, c, 2, generator=g)
    return token, n(token), prompt_token, n(prompt_token), prompt_feat, n(prompt_feat), embedding, cache


@pytest.mark.parametrize(("p", "f", "c"), [(0, 0, 0), (7, 23, 57)])  # sft first chunk; zero-shot with a cache
def test_stacked_flow_equals_per_item_calls(model: Any, p: int, f: int, c: int) -> None:
    flow = model.runtime.pipeline.token2wav.flow
    calls = [_flow_call(flow, seed, 60, p, f, c) for seed in range(3)]
    noise = [flow.draw_noise(60, f, torch.Generator().manual_seed(seed)) for seed in range(3)]
    single = _in_thread(
        lambda: [flow.inference(*call, noise=z) for call, z in zip(calls, noise, strict=True)]
    )
    stacked = [torch.cat(xs) for xs in zip(*calls, strict=True)]
    mel, cache = _in_thread(lambda: flow.inference(*stacked, noise=torch.cat(noise)))
    assert mel.shape[0] == cache.shape[0] == 3
    for i, (m1, c1) in enumerate(single):
        torch.testing.assert_close(mel[i : i + 1], m1, atol=MEL_ATOL, rtol=0)
        torch.testing.assert_close(cache[i : i + 1], c1, atol=MEL_ATOL, rtol=0)


def test_flow_batcher_stacks_same_shapes_and_keeps_random_streams(model: Any) -> None:
    flow = model.runtime.pipeline.token2wav.flow
    calls = [_flow_call(flow, seed, 50, 0, 0, 0) for seed in range(3)] + [_flow_call(flow, 9, 40, 0, 0, 0)]

    def gens() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(100 + i) for i in range(len(calls))]

    ref_gens = gens()
    ref = _in_thread(
        lambda: [flow.inference(*call, generator=g) for call, g in zip(calls, ref_gens, strict=True)]
    )
    # max 3: the three 50-token calls fill a group and run at once; the 40-token one waits out gather_s alone
    fb = FlowBatcher(flow, 3, gather_s=1.0)
    assert fb.input_frame_rate == flow.input_frame_rate  # the flow's attributes show through
    generators = gens()
    with concurrent.futures.ThreadPoolExecutor(
        len(calls), initializer=torch.set_num_threads, initargs=(1,)
    ) as pool:
        # the lone call goes once the group is done: a stacked run lends its callers' torch threads, and torch's
        # thread setting is not purely per thread, so a lone call running beside it may reduce in another order
        futures = [
            pool.submit(fb.inference, *c, generator=g) for c, g in zip(calls[:3], generators, strict=False)
        ]
        got = [fut.result(60) for fut in futures]
        got.append(pool.submit(fb.inference, *calls[3], generator=generators[3]).result(60))
    assert (fb.stats.calls, fb.stats.batches, fb.stats.batched_calls, fb.stats.peak) == (4, 1, 3, 3)
    for (m, c), (m1, c1) in zip(got, ref, strict=True):
        torch.testing.assert_close(m, m1, atol=MEL_ATOL, rtol=0)
        torch.testing.assert_close(c, c1, atol=MEL_ATOL, rtol=0)
    assert torch.equal(got[3][0], ref[3][0]), "a call without partners runs exactly as unbatched"
    for g, g1 in zip(generators, ref_gens, strict=True):  # each request drew the same numbers from its own
        assert torch.equal(g.get_state(), g1.get_state())


def test_vocoder_batcher_stacks_same_shapes_and_keeps_random_streams(model: Any) -> None:
    hift = model.runtime.pipeline.token2wav.hift
    g = torch.Generator().manual_seed(3)
    # three streaming middle chunks (same frames, 20 cached source frames) and a first chunk without a cache
    mels = [torch.randn(1, 80, 60, generator=g) for _ in range(4)]
    caches = [torch.randn(1, 1, 20 * 256, generator=g) for _ in range(3)] + [None]

    def gens() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(200 + i) for i in range(len(mels))]

    ref_gens = gens()
    ref = _in_thread(
        lambda: [hift.inference(m, c, generator=g) for m, c, g in zip(mels, caches, ref_gens, strict=True)]
    )
    vb = VocoderBatcher(hift, 3, gather_s=1.0)
    generators = gens()
    with concurrent.futures.ThreadPoolExecutor(4, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        # the lone call (no cache: another shape) goes once the group is done, as in the flow's test
        futures = [
            pool.submit(vb.inference, m, c, generator=g)
            for m, c, g in zip(mels[:3], caches, generators, strict=False)
        ]
        got = [fut.result(60) for fut in futures]
        got.append(pool.submit(vb.inference, mels[3], caches[3], generator=generators[3]).result(60))
    assert (vb.stats.calls, vb.stats.batches, vb.stats.batched_calls, vb.stats.peak) == (4, 1, 3, 3)
    for (speech, source), (speech1, source1) in zip(got, ref, strict=True):
        torch.testing.assert_close(speech, speech1, atol=AUDIO_ATOL, rtol=0)
        # the f0 predictor runs over B rows too: f0 rounding, summed into the sine phase along the chunk
        torch.testing.assert_close(source, source1, atol=AUDIO_ATOL, rtol=0)
    assert torch.equal(got[3][0], ref[3][0]), "a call without partners runs exactly as unbatched"
    for g, g1 in zip(generators, ref_gens, strict=True):
        assert torch.equal(g.get_state(), g1.get_state())


def test_engine_batch_flow_streaming_sft_equals_unbatched(tiny_model_dir: Path) -> None:
    # equal-length texts: random weights generate to max_len, so every request has the same windows
    text = TEXTS[0]
    reqs = [
        SynthesisRequest(text=text, speaker=spk, seed=20 + i, stream=True)
        for i, spk in enumerate(["中文女", "英文男", "中文女", "英文男"])
    ]

    def run(batch_size: int, batch_flow: bool) -> tuple[list[np.ndarray], Any]:
        options = RuntimeOptions(warmup=False, batch_size=batch_size, batch_flow=batch_flow, worker_threads=1)
        e = Engine("tiny", lambda: load_runtime(tiny_model_dir, options))
        e.load_sync(60)
        t2w = e.runtime.pipeline.token2wav
        stackers = [b for b in (t2w.flow, t2w.hift) if isinstance(b, FlowBatcher | VocoderBatcher)]
        for b in stackers:
            b.gather_s = 0.5  # generous on a busy machine; a full group (4 calls) runs without waiting
        streams = [e.synthesize_sync(r) for r in reqs]
        with concurrent.futures.ThreadPoolExecutor(len(streams)) as pool:
            audio = list(pool.map(lambda s: np.concatenate(list(s)), streams, timeout=60))
        e.release_sync(30)
        return audio, stackers

    single, plain = run(1, True)  # batch_flow needs batch_size > 1: ignored here
    batched, stackers = run(4, True)
    assert plain == [], "batch_size=1 must keep the plain flow and vocoder"
    assert len(stackers) == 2
    for b in stackers:
        assert b.stats.batches > 0 and b.stats.peak == len(reqs), f"the {b.name} calls were never stacked"
    diff = max(float(np.abs(a - b).max()) for a, b in zip(batched, single, strict=True))
    print(f"max abs audio diff, stacked vs unbatched: {diff:.2e}; {stackers[0].stats}")
    for a, b in zip(batched, single, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=AUDIO_ATOL, rtol=0)


def test_cosyvoice2_bounded_streams_stack_their_flow_and_vocoder_calls(cv2_model_dir: Path) -> None:
    """``batch_flow`` on a CosyVoice2 model stacks what its family stacks (the vocoder: its streamed calls carry
    their cached mel and source in their arguments; the flow's streamed chunks, each against its own FlowStream),
    here with a bounded flow context (``flow_context_seconds`` 0.5: each stream drops its oldest speech chunks
    and its last call is a chunk too, no lookahead): two concurrent streams of equal length stack every flow call
    (their chunks and last calls) and every vocoder call, and speak what each speaks alone within float rounding.
    A bounded last call left out of the stack, a row attending to another's frames or a wait
    across the stackers (60 s gathers) fails."""
    from cosyserve.families.cosyvoice2.token2wav import Token2Wav2

    options = RuntimeOptions(
        warmup=False, batch_size=2, batch_flow=True, flow_steps=2, flow_context_seconds=0.5
    )  # steps: only time
    rt = load_runtime(cv2_model_dir, options)
    try:
        t2w = rt.pipeline.token2wav
        assert isinstance(t2w.hift, VocoderBatcher) and isinstance(t2w.flow, ChunkFlowBatcher)
        # a pair runs as soon as both calls are in: the waits only bound a failure
        t2w.hift.gather_s = t2w.flow.gather_s = 60.0
        made, started = t2w.new_stream, threading.Barrier(2)

        def new_stream(*a: Any, **k: Any) -> Any:
            # each stream live in the flow's stacker from its start (a caller that knows its streams may track
            # them): the first chunks meet too
            state = made(*a, **k)
            t2w.flow.track(state.flow)
            started.wait(60)  # both streams made (at their first call) before either's first chunk
            return state

        t2w.new_stream = new_stream  # type: ignore[method-assign]
        g = torch.Generator().manual_seed(0)
        inputs = [
            (torch.randint(0, 6561, (80,), generator=g).tolist(), torch.randn(1, 192, generator=g))
            for _ in range(2)
        ]

        def speak(t2w: Any, i: int) -> torch.Tensor:
            out = t2w(
                iter(inputs[i][0]), embedding=inputs[i][1], stream=True,
                generator=torch.Generator().manual_seed(i),
            )  # fmt: skip
            return torch.cat(list(out), dim=1)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            batched = list(pool.map(lambda i: speak(t2w, i), range(2), timeout=120))
        stats, flow = t2w.hift.stats, t2w.flow.stats
        # every flow call of both streams (the tiny policy's chunks and the last call) ran in a pair
        assert flow.calls >= 6 and flow.batched_calls == flow.calls == 2 * flow.batches, flow
        assert flow.timed_out == 0, flow
        assert stats.calls >= 4 and stats.batched_calls == stats.calls == 2 * stats.batches, stats
        assert stats.timed_out == 0, stats
        alone = Token2Wav2(t2w.flow.module, t2w.hift.module, t2w.policy, t2w.flow_steps, flow_context=0.5)
        diff = 0.0
        for i, got in enumerate(batched):
            want = speak(alone, i)
            assert got.shape == want.shape
            diff = max(diff, float((got - want).abs().max()))
            # the unbatched audio's bound (seen: ~1e-5)
            torch.testing.assert_close(got, want, atol=AUDIO_ATOL, rtol=0)
        print(f"max abs audio diff, stacked vs alone: {diff:.2e}; vocoder {stats}; flow {flow}")
    finally:
        rt.close()


def _cv3_streams(n: int) -> list[dict[str, Any]]:
    # prompts of 7, 33 and 20 tokens: first hops of different lengths (28, 17 and 15 tokens on the tiny
    # policy), aligned to the same hops after them (the 20-token prompt's from its third chunk)
    g = torch.Generator().manual_seed(5)
    return [
        dict(
            tokens=torch.randint(0, 6561, (200,), generator=g).tolist(),
            prompt_token=torch.randint(0, 6561, (1, p), generator=g, dtype=torch.int32),
            prompt_feat=torch.randn(1, 2 * p, 80, generator=g),
            embedding=torch.randn(1, 192, generator=g),
        )
        for p in (7, 33, 20)[:n]
    ]


def test_cosyvoice3_streams_stack_their_causal_vocoder_calls(cv3_model_dir: Path) -> None:
    """``batch_flow`` on a CosyVoice3 model stacks the causal vocoder's calls of concurrent streams whose kept
    frames, new frames and output place match (each row keeps its stream's kept mel, phase and place in the
    fixed noise), and their flow chunks of as many frames (each against its own FlowStream): two streams of
    different prompt lengths stack their vocoder calls from their second chunk, and each speaks what it speaks
    alone. Neither stacker waits for a stream whose thread waits in the other."""
    from cosyserve.families.cosyvoice3.token2wav import Token2Wav3

    options = RuntimeOptions(warmup=False, batch_size=2, batch_flow=True, flow_steps=2)  # steps: only time
    rt = load_runtime(cv3_model_dir, options)
    try:
        t2w = rt.pipeline.token2wav
        assert isinstance(t2w.hift, VocoderBatcher)
        # a pair runs once both calls are in, a call runs alone once the other stream waits elsewhere (in a group
        # of either stacker: their Gathering) or is done: the waits only bound a failure (a flow chunk waiting for
        # a stream that waits in the vocoder's stacker, or the reverse, would take minutes)
        t2w.hift.gather_s = t2w.flow.gather_s = 60.0
        streams = _cv3_streams(2)

        def speak(t2w: Any, i: int) -> torch.Tensor:
            s = streams[i]
            out = t2w(
                iter(s["tokens"]),
                embedding=s["embedding"],
                prompt_token=s["prompt_token"],
                prompt_feat=s["prompt_feat"],
                stream=True,
            )
            return torch.cat(list(out), dim=1)

        # one torch thread each: three OpenMP teams of the machine's width would contend on a small CPU
        with concurrent.futures.ThreadPoolExecutor(
            2, initializer=torch.set_num_threads, initargs=(1,)
        ) as pool:
            batched = list(pool.map(lambda i: speak(t2w, i), range(2), timeout=120))
        stats = t2w.hift.stats
        # no gather ran out (60 s: a wait across the stackers would): each call ran once its partner came or no
        # live stream could come
        assert stats.timed_out == t2w.flow.stats.timed_out == 0, (stats, t2w.flow.stats)
        # the tiny policy's hops after the first (20, 40, 80 tokens) line up: the second, third and fourth
        # chunks pair (a full pair runs at once); the first and last chunks differ and run alone
        assert stats.batches == 3 and stats.batched_calls == 6, f"the vocoder calls were not stacked: {stats}"
        alone = Token2Wav3(t2w.flow.module, t2w.hift.module, t2w.policy, t2w.flow_steps, noise=t2w.noise)
        diff = 0.0
        for i, got in enumerate(batched):
            want = speak(alone, i)
            assert got.shape == want.shape
            diff = max(diff, float((got - want).abs().max()))
            # the fixtures' token2wav tolerance (token2wav_stream: atol 2e-3): flow and vocoder both stack (the
            # vocoder alone was within hift_stream's 2e-4; the flow's float rounding, within
            # flow_prompt_stream's 1e-5 in the mel, is amplified by the random-weight vocoder)
            torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
        print(f"max abs audio diff, stacked vs alone: {diff:.2e}; vocoder {stats}; flow {t2w.flow.stats}")
    finally:
        rt.close()
