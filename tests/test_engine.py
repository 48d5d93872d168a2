"""Engine state machine, admission, cancellation and queue bound, on fake models (fast, exact).

One test runs the tiny real model through the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any

import numpy as np
import pytest

from cosyserve.core.errors import (
    ClientError,
    DeadlineExceededError,
    EngineDeadError,
    EngineStateError,
    InternalError,
    ModeUnavailableError,
    NotReadyError,
    OverloadedError,
)
from cosyserve.core.request import SynthesisRequest
from cosyserve.engine.engine import Engine
from cosyserve.engine.state import STATE_TRANSITION_ERROR, EngineState
from fake_runtime import FakeRuntime
from server_util import wait_until

S = EngineState


def req(text: str = "hello", **kw: Any) -> SynthesisRequest:
    return SynthesisRequest(text=text, speaker=kw.pop("speaker", "alice"), **kw)


def loaded(model: FakeRuntime | None = None, **kw: Any) -> tuple[Engine, FakeRuntime]:
    m = model or FakeRuntime()
    e = Engine("fake", lambda: m, **kw)
    e.load_sync(5)
    return e, m


# -- state machine --------------------------------------------------------------------------------------------


def test_lifecycle_transitions_are_recorded_and_illegal_ones_raise() -> None:
    seen: list[tuple[str, str]] = []
    e = Engine("m", FakeRuntime)
    e.add_listener(lambda eng, tr: seen.append((tr.old.value, tr.new.value)))
    assert e.state is S.NEW
    with pytest.raises(EngineStateError, match="illegal state transition NEW -> READY"):
        e.transition(S.READY)
    e.load_sync(5)
    assert (
        e.state is S.READY
        and e.sample_rate == FakeRuntime.sample_rate
        and e.runtime.speakers() == ["alice", "bob"]
    )
    with pytest.raises(EngineStateError):
        e.transition(S.LOADING)  # READY cannot go back to LOADING
    e.release_sync(5)
    assert e.state is S.RELEASED
    with pytest.raises(EngineStateError):
        e.transition(S.READY)  # RELEASED is terminal
    assert seen == [("new", "loading"), ("loading", "ready"), ("ready", "draining"), ("draining", "released")]
    assert [t.new for t in e.transitions] == [S.LOADING, S.READY, S.DRAINING, S.RELEASED]
    assert all(a.at <= b.at for a, b in zip(e.transitions, e.transitions[1:], strict=False))
    assert "{old} -> {new}" in STATE_TRANSITION_ERROR


def test_failed_load_reports_cause_and_refuses_requests() -> None:
    def bad_loader() -> Any:
        raise OSError("disk gone")

    e = Engine("m", bad_loader)
    with pytest.raises(EngineDeadError, match="failed to load") as info:
        e.load_sync(5)
    assert isinstance(info.value.__cause__, OSError)
    assert e.state is S.FAILED and isinstance(e.cause, OSError)
    with pytest.raises(EngineDeadError):
        e.synthesize_sync(req())
    e.release_sync(5)  # release of a failed engine is a no-op, not an error
    assert e.state is S.FAILED


def test_concurrent_loaders_share_one_load() -> None:
    calls = []
    gate = threading.Event()

    def loader() -> FakeRuntime:
        calls.append(1)
        gate.wait(5)
        return FakeRuntime()

    e = Engine("m", loader)

    async def main() -> list[Engine]:
        tasks = [asyncio.ensure_future(e.load()) for _ in range(20)]
        await asyncio.sleep(0.01)
        assert e.state is S.LOADING
        gate.set()
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    assert calls == [1], "concurrent load() callers must share one load"
    assert all(r is e for r in results) and e.state is S.READY


def test_requests_before_ready_are_refused_never_served_half_loaded() -> None:
    gate = threading.Event()
    e = Engine("m", lambda: (gate.wait(5), FakeRuntime())[1])
    with pytest.raises(NotReadyError, match="new"):
        e.synthesize_sync(req())
    fut = e.start_load()
    with pytest.raises(NotReadyError, match="loading"):
        e.synthesize_sync(req())
    gate.set()
    fut.result(5)
    assert len(list(e.synthesize_sync(req()))) == 3


def test_race_many_threads_load_synthesize_release() -> None:
    """Threads race load, synthesize and release: every request either gets the full audio or a typed refusal;
    nothing deadlocks; afterwards nothing is in flight and the engine is RELEASED."""
    for _ in range(5):
        _race_once()


def _race_once() -> None:
    models: list[FakeRuntime] = []

    def loader() -> FakeRuntime:
        time.sleep(0.005)
        m = FakeRuntime(chunks=4)
        models.append(m)
        return m

    e = Engine("m", loader, instances=2, queue_limit=64)
    outcomes: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(17)

    def client(i: int) -> None:
        start.wait()
        for _ in range(20):
            try:
                if i % 4 == 0:
                    e.start_load()
                chunks = list(e.synthesize_sync(req(seed=i)))
                assert len(chunks) == 4 and chunks[3][0] == i + 3, "a request saw partial output"
                r = "ok"
            except (NotReadyError, EngineDeadError):
                r = "refused"
            except EngineStateError:
                r = "state"  # start_load after release
            with lock:
                outcomes.append(r)
            time.sleep(0.001)

    def releaser() -> None:
        start.wait()
        time.sleep(0.03)
        e.start_release(5).result(10)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    threads.append(threading.Thread(target=releaser))
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
        assert not t.is_alive(), "deadlock: a thread did not finish"
    assert e.state is S.RELEASED and e.in_flight == 0 and e.active == 0
    assert len(outcomes) == 320 and "ok" in outcomes and "refused" in outcomes
    assert all(m.running == 0 for m in models)
    # one instance serves one request at a time (its KV cache is per module)
    assert all(m.max_running <= 1 for m in models)


# -- requests -------------------------------------------------------------------------------------------------


def test_async_stream_yields_chunks_and_records_stats() -> None:
    e, m = loaded()

    async def main() -> list[np.ndarray]:
        return [c async for c in e.synthesize(req(seed=7))]

    chunks = asyncio.run(main())
    assert [float(c[0]) for c in chunks] == [7.0, 8.0, 9.0]
    s = e.stats.snapshot()
    assert s["requests"] == 1 and s["outcomes"] == {"ok": 1}
    assert s["audio_s"] == pytest.approx(3 * 50 / FakeRuntime.sample_rate) and s["ttfa_p50_s"] is not None
    assert m.closed_in and m.closed_in[0].startswith("cosyserve-fake"), "model work must run on a worker"
    e.release_sync()


def test_bad_requests_fail_at_once_with_client_errors() -> None:
    e, _ = loaded()
    with pytest.raises(ClientError, match="unknown speaker 'zed'"):
        list(e.synthesize_sync(req(speaker="zed")))
    # what needs no model is refused when the request is built, whoever builds it
    with pytest.raises(ClientError, match="empty"):
        req(text="  ")
    with pytest.raises(ClientError, match="speed") as bad:
        req(speed=4.5)
    assert bad.value.param == "speed"
    with pytest.raises(ClientError, match="instruct mode needs instruct_text"):
        req(mode="instruct")
    with pytest.raises(ModeUnavailableError, match="sft only"):
        list(e.synthesize_sync(req(mode="instruct", instruct_text="calm")))
    with pytest.raises(InternalError, match=r"synthesis failed \(RuntimeError\)") as info:
        list(e.synthesize_sync(req(text="boom")))
    assert isinstance(info.value.__cause__, RuntimeError) and "kaboom" in str(info.value.__cause__)
    # the exception's own text (which may name server paths) stays in the log, out of the client's message
    assert "kaboom" not in str(info.value), str(info.value)
    assert e.in_flight == 0
    e.release_sync()


def test_queue_bound_gives_overloaded_with_retry_after() -> None:
    hold = threading.Event()
    e, _ = loaded(FakeRuntime(hold=hold), queue_limit=2)
    streams = [e.synthesize_sync(req()) for _ in range(3)]  # 1 running + 2 waiting
    wait_until(lambda: e.active == 1)
    with pytest.raises(OverloadedError) as info:
        e.synthesize_sync(req())  # at once: a call that waited for room would wait for the hold, set below
    assert e.active == 1 and e.in_flight == 3, (
        "the refusal came while the running request still held its slot"
    )
    assert info.value.retry_after > 0
    assert e.stats.snapshot()["rejected"] == {"overloaded": 1}
    hold.set()
    for s in streams:
        assert len(list(s)) == 3
    assert len(list(e.synthesize_sync(req()))) == 3  # room again
    e.release_sync()


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def serve_for(e: Engine, hold: threading.Event, clock: FakeClock, seconds: float) -> None:
    """One request that holds its slot for ``seconds`` on the engine's fake clock."""
    stream = e.synthesize_sync(req())
    wait_until(lambda: e.active == 1)
    clock.t += seconds
    hold.set()
    assert len(list(stream)) == 1
    hold.clear()
    wait_until(lambda: e.in_flight == 0)


def test_retry_after_is_when_the_first_running_request_should_end() -> None:
    """A refused client needs one slot: Retry-After is the time left of the running request (median of recent
    service times minus its elapsed time), not the whole queue times a mean (a 50-request burst was told 336 s
    while the queue drained in 6 s), and one long request does not inflate it for everyone after."""
    clock, hold = FakeClock(), threading.Event()
    e, _ = loaded(FakeRuntime(chunks=1, hold=hold), queue_limit=4, clock=clock, default_service_s=1.0)
    for _ in range(4):
        serve_for(e, hold, clock, 8.0)
    serve_for(e, hold, clock, 300.0)  # one long text among them
    streams = [e.synthesize_sync(req(request_id=f"r{i}")) for i in range(5)]  # 1 running + 4 queued
    wait_until(lambda: e.active == 1)
    clock.t += 3.0  # the running request is 3 s into its expected 8 s
    with pytest.raises(OverloadedError) as info:
        e.synthesize_sync(req())
    assert info.value.retry_after == pytest.approx(5.0), (
        "Retry-After must be the running request's expected time left (8 s - 3 s), "
        f"not the queue's drain time nor an average skewed by one long request: {info.value.retry_after}"
    )
    assert e.retry_after(["r0"]) == pytest.approx(5.0), "r0 runs (one worker, first come first served)"
    assert e.retry_after(["r3", "r4"]) == pytest.approx(5.0 + 8.0), (
        "a queued request starts when a slot frees"
    )
    hold.set()
    for s in streams:
        assert len(list(s)) == 1
    e.release_sync()


def test_retry_after_of_short_requests_is_not_the_long_ones_time() -> None:
    """If this fails, a burst of one-sentence requests after a few long texts is told to wait the long texts'
    time (the hostile pass: Retry-After 47 s where each request took a second): a request's expected time is its
    own text's length at the recent seconds per character, not the median of whatever ran before."""
    clock, hold = FakeClock(), threading.Event()
    e, _ = loaded(FakeRuntime(chunks=1, hold=hold), queue_limit=0, clock=clock)
    long_text = "A long text of many sentences. " * 20  # 620 characters
    for _ in range(3):
        stream = e.synthesize_sync(req(text=long_text))
        wait_until(lambda: e.active == 1)
        clock.t += 62.0  # 0.1 s a character
        hold.set()
        assert len(list(stream)) == 1
        hold.clear()
        wait_until(lambda: e.in_flight == 0)
    short = e.synthesize_sync(req(text="Hi there, how are you?", request_id="short"))  # 22 characters
    wait_until(lambda: e.active == 1)
    clock.t += 0.5
    with pytest.raises(OverloadedError) as info:
        e.synthesize_sync(req())
    assert info.value.retry_after == pytest.approx(2.2 - 0.5), (
        f"the short request's own expected time left (22 x 0.1 s - 0.5 s), not the long texts': {info.value.retry_after}"
    )
    hold.set()
    assert len(list(short)) == 1
    e.release_sync()


@pytest.mark.parametrize(("service_s", "expected"), [(0.2, 1.0), (500.0, 60.0)])
def test_retry_after_stays_within_bounds(service_s: float, expected: float) -> None:
    """Whole seconds from 1 (the header's unit; sooner only hits the full queue again) to 60 (a few recent
    requests say nothing reliable about the next minute)."""
    clock, hold = FakeClock(), threading.Event()
    e, _ = loaded(FakeRuntime(chunks=1, hold=hold), queue_limit=0, clock=clock)
    for _ in range(3):
        serve_for(e, hold, clock, service_s)
    stream = e.synthesize_sync(req())
    wait_until(lambda: e.active == 1)
    with pytest.raises(OverloadedError) as info:
        e.synthesize_sync(req())
    assert info.value.retry_after == expected, f"Retry-After {info.value.retry_after} out of [1, 60] s"
    hold.set()
    assert len(list(stream)) == 1
    e.release_sync()


def test_cancel_stops_the_generation_in_the_worker_and_frees_state() -> None:
    # 100 s of chunks: only the close can end it (the worker may run ahead of the reader by its buffer meanwhile)
    e, m = loaded(FakeRuntime(chunks=10_000, delay=0.01))

    async def main() -> None:
        stream = e.synthesize(req())
        first = await stream.__anext__()
        assert first.shape == (50,)
        await stream.aclose()

    asyncio.run(main())
    wait_until(lambda: e.in_flight == 0 and e.active == 0)
    assert m.running == 0, "the model generator must be closed"
    assert m.closed_in[-1].startswith("cosyserve-fake"), "closing must happen in the worker thread"
    assert e.stats.snapshot()["outcomes"] == {"cancelled": 1}
    yielded = m.yielded
    time.sleep(0.05)
    assert m.yielded == yielded < 10_000, "generation went on after the stream was closed"
    e.release_sync()


def test_client_task_cancelled_stops_generation_at_next_token() -> None:
    """Non-streaming: the whole LM loop runs before any chunk; cancelling the client task must stop the LM
    within a token (the runtime asks should_stop after each), not after 10k tokens."""
    e, m = loaded()

    async def main() -> None:
        stream = e.synthesize(req(text="tokens"))

        async def consume() -> None:
            async for _ in stream:
                pass

        task = asyncio.ensure_future(consume())
        while m.made == 0:  # the LM loop has started
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    wait_until(lambda: e.in_flight == 0 and e.active == 0)
    made = m.made
    time.sleep(0.05)
    assert m.made == made, "the token loop kept running after cancellation"
    assert 0 < made < 10_000, "the token loop ran to its end"
    assert m.closed_in and m.closed_in[-1].startswith("cosyserve-fake")
    e.release_sync()


def test_deadline_stops_request() -> None:
    e, m = loaded(FakeRuntime(chunks=100, delay=0.01))
    with pytest.raises(DeadlineExceededError):
        for _ in e.synthesize_sync(req(deadline=time.monotonic() + 0.05)):
            pass
    wait_until(lambda: e.in_flight == 0 and m.running == 0)

    async def main() -> None:
        async for _ in e.synthesize(req(text="tokens", deadline=time.monotonic() + 0.05)):
            pass

    with pytest.raises(DeadlineExceededError):
        asyncio.run(main())
    wait_until(lambda: e.in_flight == 0 and e.active == 0)
    assert e.stats.snapshot()["outcomes"].get("deadline", 0) >= 1
    e.release_sync()


def test_cancel_while_queued_frees_slot_at_once() -> None:
    hold = threading.Event()
    e, _ = loaded(FakeRuntime(hold=hold), queue_limit=1)
    running = e.synthesize_sync(req())
    wait_until(lambda: e.active == 1)
    queued = e.synthesize_sync(req())
    assert e.in_flight == 2
    queued.close()  # never started: ends without a worker
    assert e.in_flight == 1
    hold.set()
    assert len(list(running)) == 3
    e.release_sync()


def test_drain_refuses_new_lets_in_flight_finish_then_releases() -> None:
    hold = threading.Event()
    e, m = loaded(FakeRuntime(hold=hold))
    stream = e.synthesize_sync(req())
    wait_until(lambda: e.active == 1)
    fut = e.start_release(timeout=5)
    wait_until(lambda: e.state is S.DRAINING)
    with pytest.raises(NotReadyError, match="draining"):
        e.synthesize_sync(req())
    hold.set()
    assert len(list(stream)) == 3, "an in-flight request must finish during DRAINING"
    fut.result(5)
    assert e.state is S.RELEASED and e.runtime is None and m.closed, "release must close the runtime"


def test_drain_deadline_cancels_leftovers() -> None:
    e, m = loaded(FakeRuntime(chunks=1000, delay=0.005))
    stream = e.synthesize_sync(req())
    next(stream)
    e.release_sync(timeout=0.05)
    assert e.state is S.RELEASED and m.running == 0
    with pytest.raises(EngineDeadError, match="released while serving"):
        list(stream)


def test_instances_serve_in_parallel() -> None:
    models: list[FakeRuntime] = []
    hold = threading.Event()

    def loader() -> FakeRuntime:
        models.append(FakeRuntime(hold=hold))
        return models[-1]

    e = Engine("m", loader, instances=2)
    e.load_sync(5)
    a, b = e.synthesize_sync(req()), e.synthesize_sync(req())
    wait_until(lambda: e.active == 2)
    assert sorted(m.running for m in models) == [1, 1]
    hold.set()
    assert len(list(a)) == len(list(b)) == 3
    e.release_sync()


# -- real model -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_bundle(tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from cosyserve.bundle.convert import convert

    out = tmp_path_factory.mktemp("bundles") / "tiny"
    convert(tiny_model_dir, out)
    return out


def test_real_tiny_model_through_engine_matches_direct_call(tiny_bundle: Any) -> None:
    from cosyserve.runtime import RuntimeOptions, load_runtime

    runtime = load_runtime(tiny_bundle, RuntimeOptions(warmup=False, worker_threads=1))
    e = Engine("tiny", lambda: runtime)
    e.load_sync(60)
    speaker = runtime.speakers()[0]
    text = "Hello there."

    def direct_call() -> np.ndarray:
        import torch

        torch.set_num_threads(1)  # as the engine's workers: the same reductions, bit-identical audio
        r = SynthesisRequest(text=text, speaker=speaker, seed=3)
        return np.concatenate(list(runtime.start(r, lambda: False)))

    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        direct = ex.submit(direct_call).result()

    async def main() -> np.ndarray:
        return np.concatenate([c async for c in e.synthesize(req(text=text, speaker=speaker, seed=3))])

    via_engine = asyncio.run(main())
    np.testing.assert_array_equal(via_engine, direct)

    # cancel a long streaming request mid-way: the worker stops within a token and frees its LM row
    decoder = runtime.pipeline.decoder
    long = SynthesisRequest(text="one two three four five six seven eight nine ten " * 4, speaker=speaker)
    it = e.synthesize_sync(long)
    wait_until(lambda: decoder.stats.tokens > 5, "the LM loop ran")
    it.close()
    # the row is freed (a row still held would go on decoding)
    wait_until(lambda: e.in_flight == 0 and e.active == 0 and decoder.active == 0, "the request ended")
    e.release_sync(30)
    assert e.state is S.RELEASED


def test_a_cancelled_waiter_does_not_cancel_the_shared_load() -> None:
    # a client that disconnects while its model loads must not cancel the load the others wait for
    gate = threading.Event()

    def loader() -> FakeRuntime:
        gate.wait(5)
        return FakeRuntime()

    e = Engine("m", loader)

    async def main() -> None:
        first = asyncio.ensure_future(e.load())
        second = asyncio.ensure_future(e.load())
        await asyncio.sleep(0.05)
        first.cancel()
        gate.set()
        assert await asyncio.wait_for(second, 5) is e
        assert first.cancelled()

    asyncio.run(main())
    assert e.state is EngineState.READY
    e.release_sync()


def test_a_consumer_that_stops_reading_holds_its_worker_at_a_bounded_buffer() -> None:
    """A client that stops reading (a full socket, a paused player) must not let its worker run ahead and buffer
    the whole utterance in memory: the worker waits once BUFFER_SECONDS of audio are untaken, and goes on when the
    consumer reads."""
    from cosyserve.engine.engine import BUFFER_SECONDS

    per_chunk = FakeRuntime.sample_rate // 2  # half a second each
    bound = int(BUFFER_SECONDS * FakeRuntime.sample_rate)
    e, m = loaded(FakeRuntime(chunks=10 * bound // per_chunk, chunk_len=per_chunk))
    stream = e.synthesize_sync(SynthesisRequest(text="hi", speaker="alice"))
    deadline = time.monotonic() + 30
    while m.yielded * per_chunk <= bound and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # time for a worker that did not wait to run far ahead (the check below is not timed)
    ahead = m.yielded * per_chunk
    assert bound < ahead <= bound + 2 * per_chunk, f"{ahead} samples made with none read (bound {bound})"
    total = sum(int(c.shape[0]) for c in stream)  # reading on lets it finish
    assert total == 10 * bound
    assert e.in_flight == 0
