"""bench/lm_batching.py cannot rot: its dry run (the real run's code on a tiny CosyVoice2 model: two worker
processes for the interleaved first-audio pairs, then concurrent requests in one process) prints every figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_lm_batching_dry_run_prints_every_figure(tmp_path: Path, cv2_model_dir: Path) -> None:
    """If this fails, the bench of the issue's batching targets no longer runs end to end, or lost a figure."""
    out = tmp_path / "figures.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "lm_batching.py"),
            "--dry-run",
            "--model",
            str(cv2_model_dir),
            "--json",
            str(out),
            "--stream",
            "--batch-flow",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    figures = json.loads(out.read_text())
    first = figures["first_audio"]
    assert first["rounds"] == 2 and set(first["median_s"]) == {"baseline", "this tree"}
    assert all(s > 0 for s in first["median_s"].values()) and first["ratio"] > 0
    t = figures["throughput"]
    assert t["batch_size"] >= 2, "batching is the default"
    assert t["one"] > 0 and t["concurrent"] > 0 and t["mean_rows"] >= 1.0
    # streamed, token2wav stacked where the family allows (CosyVoice2: the flow's streamed chunks and the vocoder):
    # their calls are counted
    stacked = t["stacked"]
    assert t["stream"] and set(stacked) == {"flow", "hift"}, stacked
    assert stacked["flow"]["calls"] > 0 and stacked["hift"]["calls"] > 0, stacked
    assert (
        "this tree / baseline" in r.stdout and "LM rows per step" in r.stdout and "calls stacked" in r.stdout
    )
