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
            "--flow-context",
            "0.5",
            "--prime",
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
    assert t[
        "primed"
    ]  # a first burst ran before the measured runs (and the packing it started was waited for)
    assert t["one"] > 0 and t["concurrent"] > 0 and t["mean_rows"] >= 1.0
    # streamed, token2wav stacked where the family allows (CosyVoice2: the flow's streamed chunks, bounded streams'
    # last calls among them, and the vocoder): their calls are counted
    stacked = t["stacked"]
    assert t["stream"] and t["flow_context_seconds"] == 0.5 and set(stacked) == {"flow", "hift"}, stacked
    assert stacked["flow"]["calls"] > 0 and stacked["hift"]["calls"] > 0, stacked
    # llm_gemm=auto: the concurrent run's batched steps packed the LM's linears, and what auto kept is shown
    # (a tiny model's small matrices may drop the copies again: the plain layouts win there)
    assert t["autopack"] in ("packing", "packed", "dropped") and t["layouts"], t
    assert (
        "this tree / baseline" in r.stdout and "LM rows per step" in r.stdout and "calls stacked" in r.stdout
    )


def test_lm_prefix_dry_run_prints_every_figure(tmp_path: Path) -> None:
    """If this fails, bench/lm_prefix.py (what a voice's kept LM prompt prefix saves, both LM architectures) no
    longer runs end to end, lost a figure, or keeps a prefix other than sos, [speaker,] prompt text."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_lm_prefix", ROOT / "bench" / "lm_prefix.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    assert bench.main(["--dry-run", "--threads", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["family"], r["voice_s"]) for r in rows] == [
        ("cosyvoice2", 2.0), ("cosyvoice2", 12.0), ("cosyvoice", 2.0), ("cosyvoice", 12.0)
    ]  # fmt: skip
    for r in rows:
        speaker = r["family"] == "cosyvoice"  # the 300M LM's prefix holds the speaker embedding too
        assert r["prefix_positions"] == 1 + speaker + round(r["voice_s"] * 3.5), r
        assert r["positions"] > r["prefix_positions"] and r["prefix_kib"] > 0, r
        assert r["whole_ms"] > 0 and r["kept_ms"] > 0 and r["cpu_whole_ms"] > 0, r
