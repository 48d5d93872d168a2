"""bench/ws_load.py, bench/ws_first_audio.py, bench/wyoming_first_audio.py, bench/hostile.py and bench/first_byte.py cannot rot: their dry runs (the real runs' code against a real
``cosyserve serve`` of tiny random-weight models) print every figure, filled and consistent, and they refuse to
send traffic off the machine.

The dry runs send to two servers started once for them all (``--url``: each script's own server start is the same
``cosyserve serve`` of the bundle it would make): CosyVoice-300M's, with API keys and a voice registered for a key's
tenant (bench/hostile.py's cases), and CosyVoice2's, with Wyoming. Both tiny bundles are made here, in this
process, where bench/gpu.py ``made_bundle`` would find them (the files its ``make-test-model --size tiny --seed 0``
and ``convert`` commands write, without two fresh interpreters importing torch per family)."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proc_util import run_in_session
from server_util import LOAD_S, ServerProcess, free_port, running_server

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
pytest.importorskip("websockets.asyncio.client")


def run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # the servers a script starts inherit its environment: no 5 s drain delay when the script stops them (SIGTERM)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COSYSERVE_DRAIN_DELAY": "0"}
    # in a session of its own, ended with its process group: the servers it starts never outlive the test
    return run_in_session([sys.executable, str(BENCH / script), *args], timeout=300, env=env, cwd=cwd)


def rows_after(header: str, text: str) -> list[list[str]]:
    """The table whose header line starts with ``header`` (the last one printed): its rows, split on blanks."""
    lines = text.splitlines()
    start = max(i for i, line in enumerate(lines) if line.split()[:1] == [header])
    out: list[list[str]] = []
    for line in lines[start + 1 :]:
        cells = line.split()
        if not cells or (out and len(cells) != len(out[0])):  # a row has as many cells as the first
            break
        out.append(cells)
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory, cv2_model_dir: Path, plain_model_dir: Path) -> Path:
    """The two tiny bundles the servers serve, converted from conftest's models: CosyVoice2's ``cv2_model_dir``
    (``make-test-model --size tiny --family cosyvoice2 --seed 0``) and CosyVoice-300M's ``plain_model_dir`` (the
    same as ``--family cosyvoice``, under a plain (not -Instruct) name), each named as bench/gpu.py
    ``made_bundle`` names them: a script given ``--work`` here would reuse them."""
    from cosyserve.bundle.convert import convert

    work = tmp_path_factory.mktemp("ws-bench")
    convert(cv2_model_dir, work / "cosyvoice2-tiny-bundle", progress=False)
    convert(plain_model_dir, work / "cosyvoice-tiny-bundle", progress=False)
    return work


def bench_module(name: str) -> Any:
    """A bench script imported as a module (it imports its neighbours from beside it)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


VOICE = "hostile-voice"  # registered for the first API key's tenant on the 300M server


@pytest.fixture(scope="module")
def server_300m(work: Path) -> Iterator[tuple[ServerProcess, str]]:
    """``cosyserve serve`` of the tiny CosyVoice-300M bundle (low-latency chunks, one access log line a request, as
    the scripts start it) with bench/hostile.py's API keys and :data:`VOICE` registered for the first key's tenant:
    (the server, that key)."""
    hostile = bench_module("hostile")
    key = next(iter(hostile.KEYS))
    env = {
        "OMP_NUM_THREADS": "1",
        "COSYSERVE_API_KEYS": ",".join(f"{k}={t}" for k, t in hostile.KEYS.items()),
        "COSYSERVE_CHUNK_POLICY": "low-latency",
        "COSYSERVE_SERVE_LOG_LEVEL": "info",
    }
    bundle = work / "cosyvoice-tiny-bundle"
    with running_server(bundle, work / "serve-300m", env=env, ready_timeout_s=LOAD_S) as server:
        hostile.register_voice(hostile.Target("127.0.0.1", server.port, server.proc.pid, key), VOICE)
        yield server, key


@pytest.fixture(scope="module")
def server_cv2(work: Path) -> Iterator[tuple[ServerProcess, str]]:
    """``cosyserve serve`` of the tiny CosyVoice2 bundle with Wyoming on a free loopback port and one request at a
    time (as bench/wyoming_first_audio.py starts it): (the server, its Wyoming URI)."""
    uri = f"tcp://127.0.0.1:{free_port()}"
    env = {
        "OMP_NUM_THREADS": "1",
        "COSYSERVE_WYOMING_URI": uri,
        "COSYSERVE_BATCH_SIZE": "1",
        "COSYSERVE_CHUNK_POLICY": "low-latency",
        "COSYSERVE_SERVE_LOG_LEVEL": "info",
    }
    bundle = work / "cosyvoice2-tiny-bundle"
    with running_server(bundle, work / "serve-cv2", env=env, ready_timeout_s=LOAD_S) as server:
        yield server, uri


def test_load_dry_run_reports_every_level_and_what_the_loop_left(
    server_300m: tuple[ServerProcess, str], tmp_path: Path
) -> None:
    """If this fails, bench/ws_load.py no longer runs end to end (sessions at LLM pace with an API key, the loop of
    sessions, the server's /proc counts), or a level lost a figure, or it counts an error on a healthy server."""
    server, key = server_300m
    out = tmp_path / "load.json"
    # the fewest utterances and loop sessions that run every path (the dry run's defaults: 2 and 15): the loop's
    # three kinds of session (closed, spoken to the end, left at first audio) once in its warm-up, once counted
    r = run(
        "ws_load.py", "--dry-run", "--url", server.base_url, "--server-pid", str(server.proc.pid), "--api-key",
        key, "--utterances", "1", "--churn", "3", "--json", str(out), cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = rows_after("sessions", r.stdout)
    assert [row[0] for row in rows] == ["1", "2"], r.stdout  # one line per --sessions level, in one table
    result = json.loads(out.read_text())
    for level, row in zip(result["levels"], rows, strict=True):
        n = level["sessions"]
        assert level["utterances"] == n and level["errors"] == 0, level  # 1 utterance per session
        assert level["cut"] == 0, "a 300M utterance makes the one-shot request's audio: none is cut"
        # the last word is sent 100 ms after the first text
        assert 0 < level["last_word_p50_ms"] < level["first_text_p50_ms"], level
        assert level["first_text_p50_ms"] <= level["first_text_p99_ms"]
        assert level["xrt"] > 0 and level["wall_s"] > 0 and level["audio_s"] > 0
        assert row[1] == str(n) and row[3] == "0", row  # the table shows the same figures
    loop = result["churn"]
    assert loop["sessions"] == 3 and loop["errors"] == 0, loop
    before, after = loop["before"], loop["after"]
    # nothing left behind in the server process: its threads and descriptors (its memory is reported: a few sessions
    # move RSS by less than its noise; tests/test_server_ws.py counts the Python heap and the sessions exactly)
    assert after["threads"] <= before["threads"] and after["fds"] <= before["fds"], loop
    assert before["rss_kib"] > 0 and after["rss_kib"] > 0
    assert re.search(
        r"^3 sessions opened and closed .* server threads \d+ -> \d+, file descriptors", r.stdout, re.M
    )


def test_first_audio_dry_run_gives_the_target_ratio_of_each_family(
    server_300m: tuple[ServerProcess, str], server_cv2: tuple[ServerProcess, str], tmp_path: Path
) -> None:
    """If this fails, bench/ws_first_audio.py no longer measures both sides of issue 27's target, or counts the
    WebSocket's first audio from the wrong moment for a family (the last word for the 300M family, the first text
    for CosyVoice2/3)."""
    got: dict[str, dict[str, Any]] = {}
    for family, server, key in (
        ("cosyvoice", server_300m[0], ("--api-key", server_300m[1])),
        ("cosyvoice2", server_cv2[0], ()),
    ):
        out = tmp_path / f"first-{family}.json"
        # one round: each kind of measurement once (more rounds repeat the same code for the medians)
        r = run(
            "ws_first_audio.py", "--dry-run", "--url", server.base_url, "--family", family, *key, "--rounds", "1",
            "--json", str(out), cwd=tmp_path,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert [row[0] for row in rows_after("family", r.stdout)] == [family], r.stdout
        (got[family],) = json.loads(out.read_text())["families"]
    for family, counted_from, ws_key in (
        ("cosyvoice", "last word", "ws_last_word_ms"),
        ("cosyvoice2", "first text", "ws_first_text_ms"),
    ):
        f = got[family]
        assert f["counted_from"] == counted_from, f
        assert f["ratio"] == pytest.approx(f[ws_key] / f["http_ms"]), f
        assert f["met"] == (f["ratio"] <= 1.2)
        samples = f["samples_ms"]
        assert [len(samples[k]) for k in ("ws_first_text", "ws_last_word", "http")] == [1, 1, 1], samples
        assert all(x > 0 for x in samples["http"] + samples["ws_first_text"]), samples
        # the words take (6 - 1) x 20 ms to send: the first text comes at least that long before the last word
        gaps = [a - b for a, b in zip(samples["ws_first_text"], samples["ws_last_word"], strict=True)]
        assert all(g >= 100 - 1 for g in gaps), gaps


def test_wyoming_first_audio_dry_run_gives_one_shot_and_streamed_figures(
    server_cv2: tuple[ServerProcess, str], tmp_path: Path
) -> None:
    """If this fails, bench/wyoming_first_audio.py no longer measures Wyoming's first audio both ways (a synthesize,
    and text streamed word by word as Home Assistant sends it) against a server started with its variable, or
    compares the streamed figure from the wrong moment."""
    pytest.importorskip("wyoming")
    server, uri = server_cv2
    out = tmp_path / "wyoming.json"
    r = run(
        "wyoming_first_audio.py", "--dry-run", "--url", server.base_url, "--wyoming", uri, "--family",
        "cosyvoice2", "--rounds", "1", "--json", str(out), cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (f,) = json.loads(out.read_text())["families"]
    assert (f["family"], f["rate"], f["compare_from"]) == ("cosyvoice2", 24000, "first text"), f
    assert f["ratio"] == pytest.approx(f["streamed_first_text_ms"] / f["one_shot_ms"]), f
    samples = f["samples_ms"]
    assert [len(v) for v in samples.values()] == [1, 1, 1], samples
    assert all(x > 0 for x in samples["one_shot"] + samples["streamed_first_text"]), samples
    # the words take (6 - 1) x 20 ms to send: the first text comes at least that long before the last word
    gaps = [a - b for a, b in zip(samples["streamed_first_text"], samples["streamed_last_word"], strict=True)]
    assert all(g >= 100 - 1 for g in gaps), gaps


def test_hostile_dry_run_answers_every_case_and_keeps_the_server_responsive(
    server_300m: tuple[ServerProcess, str], tmp_path: Path
) -> None:
    """If this fails, bench/hostile.py no longer replays issue 32's hostile pass (a case lost its row or its
    figures), or the server lets one of its cases through a limit, or stops answering /health/live for 2 s."""
    server, key = server_300m
    out = tmp_path / "hostile.json"
    r = run(
        "hostile.py", "--dry-run", "--url", server.base_url, "--server-pid", str(server.proc.pid), "--api-key", key,
        "--voice", VOICE, "--json", str(out), cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["case"]: row for row in json.loads(out.read_text())}
    refused = {
        "ws-ref_text-1MB": "naming ref_text",
        "ws-ref_text-5000": "naming ref_text",
        "ws-instructions-120k": "naming instructions",
        "ws-instructions-1MB": "naming instructions",
        "ws-text-piece-1MB": "naming text",
        "post-input-1MB": "naming input",
    }
    for case, needle in refused.items():
        assert needle in rows[case]["answer"], rows[case]
    assert "audio bytes" in rows["ws-text-1MB-in-pieces"]["answer"], rows["ws-text-1MB-in-pieces"]
    assert f"in voice {VOICE}" in rows["ws-tenant-voice"]["answer"], rows["ws-tenant-voice"]
    for row in rows.values():
        assert row["live_worst_ms"] > 0 and row["rss_growth_mib"] is not None, (
            row
        )  # the figures, not their bound
        assert row["case"] in r.stdout


def test_first_byte_dry_run_times_every_shape_a_client_sends(
    server_300m: tuple[ServerProcess, str], tmp_path: Path
) -> None:
    """If this fails, bench/first_byte.py (issue 33's figures: first byte, streamed and one-shot) no longer runs
    end to end, loses a row, or the streamed rows stop meeting the target on the tiny model: their first byte came
    at the end (the body not streamed)."""
    server, key = server_300m
    out = tmp_path / "first-byte.json"
    r = run(
        "first_byte.py", "--dry-run", "--url", server.base_url, "--api-key", key, "--json", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    got = {(row["format"], row["mode"]): row for row in rows}
    modes = {
        ("pcm", "streamed"),
        ("pcm", "one-shot"),
        ("mp3", "streamed"),
        ("mp3", "one-shot"),
        ("mp3", "sse"),
    }
    assert set(got) == modes, sorted(got)
    for (_, mode), row in got.items():
        assert 0 < row["first_ms"] <= row["total_ms"] and row["rate"] == "24000", row
        if mode == "one-shot":
            assert row["first_ms"] > 0.9 * row["total_ms"], f"a one-shot body comes whole: {row}"
        else:  # the first of two sentences' audio, long before the end
            assert row["met"] == "yes", row
    assert server.base_url in r.stdout  # the rows name what they measured


def test_traffic_stays_on_the_machine(tmp_path: Path) -> None:
    """If this fails, the load scripts would send sessions to another host than the loopback interface."""
    for script, extra in (
        ("ws_load.py", ()),
        ("ws_first_audio.py", ("--family", "cosyvoice")),
        ("hostile.py", ()),
        ("wyoming_first_audio.py", ("--wyoming", "tcp://127.0.0.1:10200", "--family", "cosyvoice")),
        ("first_byte.py", ()),
    ):
        r = run(script, "--url", "http://192.0.2.1:8000", *extra, cwd=tmp_path)
        assert r.returncode == 2 and "loopback" in r.stderr, (script, r.stderr[-500:])
    r = run(
        "wyoming_first_audio.py", "--url", "http://127.0.0.1:8000", "--wyoming", "tcp://192.0.2.1:10200",
        "--family", "cosyvoice", cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 2 and "loopback" in r.stderr, r.stderr[-500:]
    sys.path.insert(0, str(BENCH))
    try:
        from ws_load import loopback_target, words
    finally:
        sys.path.remove(str(BENCH))
    assert loopback_target("http://localhost:8000").ws_url == "ws://localhost:8000/v1/audio/speech/stream"
    assert loopback_target("ws://[::1]:9").ws_url == "ws://[::1]:9/v1/audio/speech/stream"
    with pytest.raises(ValueError, match="HOST:PORT"):
        loopback_target("http://127.0.0.1")
    # an LLM's pieces: each word with the blank after it, and nothing lost
    assert words(" Hello  there, you. ") == ["Hello ", "there, ", "you."]
