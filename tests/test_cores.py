"""The process's threads shared among running requests (cosyserve.runtime.cores)."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from cosyserve.runtime.cores import CoreShare  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_request_alone_gets_every_core_and_concurrent_ones_split_them():
    # a fixed count is either slow alone (one thread) or oversubscribed together (all cores each)
    share = CoreShare(4)
    assert share.threads() == 4
    share.enter()
    assert share.threads() == 4
    share.enter()
    assert share.threads() == 2
    for _ in range(6):
        share.enter()
    assert share.threads() == 1  # never zero
    for _ in range(8):
        share.leave()
    assert share.running == 0
    share.leave()
    assert share.running == 0  # an extra leave does not go negative (a later request would get too many)


def test_a_decode_step_gets_the_share_of_the_requests_whose_rows_it_serves():
    """8 requests running on 2 cores: a decode step serving all 8 rows (their consumers wait for it) gets both
    cores, one serving 4 gets one, and the stepping thread goes back to its own request's share after. If this
    failed, 8 one-shot requests' batched LM steps would run on one core while the other idled."""
    share = CoreShare(2)
    for _ in range(8):
        share.enter()
    assert share.apply(8) == 2 and torch.get_num_threads() == 2
    assert share.apply(4) == 1 and share.apply(1) == 1 and torch.get_num_threads() == 1
    assert share.apply(100) == 2  # never more than the cores


def test_share_counts_a_request_from_its_first_chunk_to_its_close_and_sets_the_iterating_threads_count():
    share = CoreShare(2)
    seen: list[tuple[int, int]] = []
    closed = []

    def chunks():
        try:
            for i in range(3):
                seen.append((share.running, torch.get_num_threads()))
                yield i
        finally:
            closed.append(True)

    torch.set_num_threads(1)
    it = share.share(chunks())
    assert share.running == 0  # not counted until it runs
    assert next(it) == 0
    assert seen[-1] == (1, 2)  # alone: both cores, set in the thread that iterates
    other = share.share(iter(range(5)))
    next(other)
    assert share.running == 2
    next(it)
    assert seen[-1] == (2, 1)  # two running: one thread each, re-applied when it resumed
    other.close()
    assert share.running == 1
    it.close()  # a client that drops its request: the count and the inner generator are released
    assert share.running == 0
    assert closed == [True]


def test_share_leaves_when_the_request_fails():
    share = CoreShare(2)

    def failing():
        yield 1
        raise RuntimeError("flow failed")

    it = share.share(failing())
    next(it)
    with pytest.raises(RuntimeError, match="flow failed"):
        next(it)
    assert share.running == 0


def test_threads_are_per_thread_so_concurrent_requests_do_not_reset_each_other():
    # torch's intra-op count is a per-thread setting: what one request's thread sets must not leak
    share = CoreShare(2)
    share.enter()
    share.enter()
    got = []

    def worker():
        got.append(share.apply())
        got.append(torch.get_num_threads())

    torch.set_num_threads(2)
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert got == [1, 1]
    assert torch.get_num_threads() == 2


def test_cores_must_be_positive():
    with pytest.raises(ValueError, match="cores"):
        CoreShare(0)
