"""``serve --workers N``: workers forked from a template that loaded the model (cosyserve.server.prefork).

Real ``cosyserve serve`` processes on 127.0.0.1: the workers answer and share the template's memory, a killed
worker is replaced by a fresh fork, SIGTERM drains the workers and the master exits 0, a model that fails to
load in the template stops the start with exit code 3. Exact memory and time figures: bench/prefork.py.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_util import ServerProcess, running_server, start_server

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prefork needs Linux")

BODY = {"input": "Hello there.", "voice": "alloy", "response_format": "pcm", "stream": False}


def pool_status(server: ServerProcess) -> dict[str, Any]:
    with server.client() as c:  # a fresh connection: any worker
        r = c.get("/health/ready")
    assert "workers" in r.json(), r.text
    return dict(r.json()["workers"])


def rollup(pid: int) -> dict[str, int]:
    """/proc/PID/smaps_rollup in kB."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0])
    return out


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(
        tiny_model_dir, tmp_path_factory.mktemp("prefork"), args=["--workers", "2"], ready_timeout_s=180
    ) as s:
        end = time.monotonic() + 60  # /health/ready is per worker: wait for both
        while pool_status(s)["ready"] < 2:
            assert time.monotonic() < end, s.log()[-3000:]
            time.sleep(0.05)
        yield s


def test_prefork_workers_answer_and_share_the_template_memory(server: ServerProcess) -> None:
    pids = set()
    for _ in range(6):
        with server.client(timeout=120.0) as c:
            r = c.post("/v1/audio/speech", json=BODY)
            assert r.status_code == 200 and len(r.content) > 0, r.text
            pids.add(c.get("/health/ready").json()["workers"]["pid"])
    status = pool_status(server)
    assert status["wanted"] == 2 and status["alive"] == 2 and status["ready"] == 2, status
    assert pids <= set(status["pids"]), (pids, status)
    log = server.log()
    assert "template loaded" in log and log.count("ready") >= 2, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    # the workers' pages are mostly the template's: a loose bound (exact figures: bench/prefork.py)
    for pid in status["pids"]:
        m = rollup(pid)
        shared = m["Shared_Clean"] + m["Shared_Dirty"]
        assert shared > 0.5 * m["Rss"], (
            f"worker {pid} shares {shared} of {m['Rss']} kB with the template: {m}"
        )
        assert m["Private_Dirty"] < 200_000, (
            f"worker {pid} wrote {m['Private_Dirty']} kB of private pages: {m}"
        )


def test_a_killed_worker_is_replaced_by_a_fresh_fork(server: ServerProcess) -> None:
    before = pool_status(server)
    victim = before["pids"][0]
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    while True:
        status = pool_status(server)
        if victim not in status["pids"] and status["ready"] == 2:
            break
        assert time.monotonic() - t0 < 30, f"not replaced within 30 s: {status}\n{server.log()[-3000:]}"
        time.sleep(0.02)
    assert status["restarts"] == before["restarts"] + 1, status
    assert server.proc.poll() is None
    assert f"worker {victim} (slot" in server.log() and "killed by SIGKILL" in server.log()
    with server.client(timeout=120.0) as c:
        assert c.post("/v1/audio/speech", json=BODY).status_code == 200


def test_sigterm_drains_every_worker_and_exits_0(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = start_server(tiny_model_dir, tmp_path, args=["--workers", "2"], ready_timeout_s=180)
    try:
        pids = pool_status(server)["pids"]
        with httpx.Client(base_url=server.base_url, timeout=120.0) as c:
            long = {**BODY, "input": "Hello there, this is a long sentence to speak. " * 2, "stream": True}
            with c.stream("POST", "/v1/audio/speech", json=long) as r:
                assert r.status_code == 200
                chunks = r.iter_raw()
                first = next(chunks)  # the request is in flight on one worker
                server.proc.send_signal(signal.SIGTERM)
                rest = b"".join(chunks)  # it finishes: the drain lets in-flight requests end
        assert len(first) + len(rest) > 0
        assert server.proc.wait(60) == 0, server.log()[-3000:]
    finally:
        server.stop()
    log = server.log()
    assert "SIGTERM: draining 2 worker(s)" in log and "all workers stopped" in log, log[-3000:]
    for pid in pids:
        assert f"worker {pid} exited (exit code 0)" in log, log[-3000:]
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_model_that_fails_in_the_template_exits_3(tmp_path: Path) -> None:
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "cosyvoice.yaml").write_text("nonsense: [", encoding="utf-8")
    server = start_server(bad, tmp_path / "srv", args=["--workers", "2"], wait_ready=False)
    try:
        assert server.proc.wait(120) == 3, server.log()[-3000:]
    finally:
        server.stop()
    assert "start-up failed" in server.log() and "forked" not in server.log(), server.log()[-3000:]


def test_a_fork_template_load_leaves_no_thread_and_one_intra_op_thread(tiny_model_dir: Path) -> None:
    """What makes the template safe to fork: no thread started by the load, none running after it (native ones
    counted from /proc), torch on one intra-op thread; after_fork takes the process's threads up again."""
    import torch

    from cosyserve.runtime import RuntimeOptions, load_runtime
    from cosyserve.server.prefork import _threads

    before_threads = torch.get_num_threads()
    before = len(_threads())
    try:
        rt = load_runtime(tiny_model_dir, RuntimeOptions(fork_template=True, zero_shot_tier="background"))
        assert len(_threads()) <= before, f"the load left threads running: {_threads()}"
        assert torch.get_num_threads() == 1
        assert rt.zero_shot_thread is None, "ONNX sessions (thread pools) must wait for after_fork"
        assert "text_tier" in rt.clock.durations and "warmup_token2wav" in rt.clock.durations
        rt.after_fork()
        assert torch.get_num_threads() == before_threads
        assert rt.zero_shot_thread is not None
        rt.join_background()
        rt.close()
    finally:
        torch.set_num_threads(before_threads)


def test_a_worker_not_ready_in_time_is_killed_and_counts_as_an_early_death(tmp_path: Path) -> None:
    """A worker hung in its start-up (never READY) is SIGKILLed once --worker-ready-timeout passes, and its
    death goes through the early-death path (a respawn after back-off). If this failed, a deadlocked worker
    would hold its slot forever while the pool looks merely short of one worker."""
    import dataclasses
    import subprocess

    from cosyserve.core.settings import Settings
    from cosyserve.server.prefork import _Master, _Worker

    settings = dataclasses.replace(Settings.load(flags={}, env={}), worker_ready_timeout_s=5.0)
    master = _Master(settings, None, {}, str(tmp_path))
    stuck = subprocess.Popen(["sleep", "60"])
    ready = subprocess.Popen(["sleep", "60"])
    try:
        now = time.monotonic()
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        master.workers[stuck.pid] = _Worker(0, stuck.pid, r1, now - 6.0)
        master.workers[ready.pid] = _Worker(1, ready.pid, r2, now - 6.0, ready_ms=30.0)
        master.kill_stuck(now - 2.0)  # 4 s after the forks: nothing yet
        assert stuck.poll() is None
        master.kill_stuck(now)  # 6 s: the unready one goes, the READY one stays
        assert stuck.wait(timeout=5) == -signal.SIGKILL
        assert ready.poll() is None
        master.on_death(master.workers.pop(stuck.pid), -signal.SIGKILL)  # what reap() does with its status
        assert master.early_deaths == 1
        assert 0 in master.respawn_at, "the slot is refilled"
        for fd in (r1, w1, r2, w2):
            os.close(fd)
    finally:
        for p in (stuck, ready):
            p.kill()
            p.wait()


def test_a_stopped_server_takes_its_whole_process_group(tmp_path: Path) -> None:
    """The tests' stop (server_util, also run by conftest's finalizers after a failed or interrupted test) kills
    what the master left in its session, as an orphaned prefork worker. If this fails, a run of the prefork tests
    that is cut short leaves workers serving after pytest has gone."""
    import subprocess

    from proc_util import gone
    from server_util import LIVE, stop_servers, wait_until

    log = tmp_path / "master.log"
    # a stand-in master: dies of the SIGTERM at once and leaves its child (the "worker") running
    proc = subprocess.Popen(
        ["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, start_new_session=True
    )
    assert proc.stdout is not None
    worker = int(proc.stdout.readline())
    proc.stdout.close()
    LIVE.append(ServerProcess(proc, 0, log))  # as start_server registers its servers
    stop_servers(len(LIVE) - 1)
    assert proc.returncode == -signal.SIGTERM, proc.returncode
    assert all(s.proc is not proc for s in LIVE), "a stopped server is still listed as running"
    wait_until(lambda: gone(worker), f"worker {worker} gone with its master's stop")


def test_a_command_run_in_its_own_session_leaves_nothing_behind() -> None:
    """proc_util.run_in_session (the bench scripts' dry runs, which start servers of their own): what the command
    left running in its process group is killed when it returns. If this fails, a bench test that fails or is
    interrupted leaves its script's servers behind."""
    from proc_util import gone, run_in_session
    from server_util import wait_until

    r = run_in_session(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"], timeout=60)
    assert r.returncode == 0, r.stderr
    left = int(r.stdout)
    wait_until(lambda: gone(left), f"process {left}, left by the command, gone with its group")
