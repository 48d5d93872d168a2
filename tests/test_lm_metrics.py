"""``cosyserve_lm_batch_rows``: the rows of every LM decode step, from the runtime's decode loop through the
engine's model stats to /metrics, in one process and as one worker of several (prometheus multiprocess mode)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from cosyserve.core.request import SynthesisRequest
from cosyserve.core.settings import Settings
from cosyserve.engine.pool import ModelPool, ModelSpec
from cosyserve.server.app import create_app
from fake_runtime import FakeRuntime
from server_util import wait_until

STEPS = (1, 1, 2, 3, 3, 3)  # the rows of the fake LM's steps per request


class _Decoding(FakeRuntime):
    # a runtime whose LM reports its decode steps as the torch and lite runtimes' loops do
    def start(self, request: SynthesisRequest, should_stop: Callable[[], bool]) -> Iterator[np.ndarray]:
        for rows in STEPS:
            self.lm_step(rows)
        return super().start(request, should_stop)


def _pool() -> ModelPool:
    return ModelPool(
        [ModelSpec("m", policy="preload")], load_model=lambda spec, reload: _Decoding(), memory_probe=None
    )


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(r"(cosyserve_lm_batch_rows_(?:bucket|sum|count))\{([^}]*)\} (\S+)", line)
        if m:
            le = re.search(r'le="([^"]+)"', m.group(2))
            out[m.group(1) + (f"[{le.group(1)}]" if le else "")] = float(m.group(3))
    return out


def _speak(client: TestClient) -> None:
    r = client.post("/v1/audio/speech", json={"input": "Hi.", "voice": "alice", "response_format": "pcm"})
    assert r.status_code == 200, r.text


def test_lm_batch_rows_histogram_is_exported() -> None:
    """If this fails, /metrics lacks the histogram of rows per decode step, or its buckets, sum or count do not
    add up the steps the LM made (two requests: twice STEPS)."""
    with TestClient(create_app(Settings.load(), pool=_pool())) as client:
        wait_until(lambda: client.get("/health/ready").status_code == 200, "ready")
        _speak(client)
        _speak(client)
        got = _samples(client.get("/metrics").text)
    assert got["cosyserve_lm_batch_rows_count"] == 2 * len(STEPS)
    assert got["cosyserve_lm_batch_rows_sum"] == 2 * sum(STEPS)
    assert (got["cosyserve_lm_batch_rows_bucket[1.0]"], got["cosyserve_lm_batch_rows_bucket[2.0]"]) == (4, 6)
    assert got["cosyserve_lm_batch_rows_bucket[3.0]"] == got["cosyserve_lm_batch_rows_bucket[+Inf]"] == 12


def test_lm_batch_rows_as_one_worker_of_several(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With --workers N each worker publishes its pool's families to the shared directory and a scrape shows each
    worker's with its pid: the histogram goes the same way (sum without (pid) gives the server's)."""
    import os

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    settings: Any = Settings.load().replace(workers=2)
    with TestClient(create_app(settings, pool=_pool())) as client:
        wait_until(lambda: client.get("/health/ready").status_code == 200, "ready")
        _speak(client)
        text = client.get("/metrics").text
    lines = [x for x in text.splitlines() if x.startswith("cosyserve_lm_batch_rows_count{")]
    assert lines and f'pid="{os.getpid()}"' in lines[0] and lines[0].endswith(f" {float(len(STEPS))}"), lines
