"""bench/lite_lm.py cannot rot: its dry run (a tiny CosyVoice3 bundle, its lite LM graphs exported, one fresh
process per runtime) prints and writes every figure the lead's full-size run reports."""

from __future__ import annotations

from pathlib import Path

from proc_util import run_bench


def test_lite_lm_bench_dry_run_gives_every_figure(
    tmp_path: Path, cv3_lite_bundle: Path, cv3_model_dir: Path
) -> None:
    """If this fails, the side-by-side bench of the lite Qwen LM (READY, prefill, ms/token, peak RSS) no longer
    runs end to end, lost a figure, or the lite process imported torch."""
    stdout, figures = run_bench(
        "lite_lm.py",
        str(cv3_lite_bundle),
        "--model-dir",
        str(cv3_model_dir),
        "--dry-run",
        "--quantize",
        "int8",
        cwd=tmp_path,
    )
    assert figures["floor_onnxruntime_ms"] > 0 and figures["floor_torch_ms"] > 0
    f = figures["quantize"]["int8"]
    for key in ("lite_lm_ready_ms", "torch_ready_ms", "lite_prefill_ms", "torch_prefill_ms", "lite_ms_per_token",
                "torch_ms_per_token", "lite_peak_rss_mb", "torch_peak_rss_mb", "ready_vs_torch",
                "ready_vs_onnxruntime_floor", "ms_per_token_vs_torch"):  # fmt: skip
        assert f[key] > 0, key
    assert f["torch_in_lite_process"] is False
    assert "LM ms/token" in stdout and "`import onnxruntime`" in stdout
