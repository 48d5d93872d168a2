"""bench/lite.py cannot rot: one round on the tiny CosyVoice3 lite bundle (a fresh process per runtime) prints and
writes every figure and target verdict the lead's full-size run reports."""

from __future__ import annotations

from pathlib import Path

from proc_util import run_bench


def test_lite_bench_dry_run_gives_every_figure(tmp_path: Path, cv3_lite_bundle: Path) -> None:
    """If this fails, the side-by-side bench of the lite and torch runtimes (READY, first streamed audio, RTF,
    peak RSS, the issue's ratios) no longer runs end to end, lost a figure, or the lite process imported torch."""
    stdout, figures = run_bench("lite.py", str(cv3_lite_bundle), "--dry-run", cwd=tmp_path)
    assert figures["floor_onnxruntime_ms"] > 0 and figures["floor_torch_ms"] > 0
    f = figures["llm"]["fp32"]
    for side in ("lite", "torch"):
        for key in (
            "ready_ms",
            "first_audio_ms",
            "request_to_first_ms",
            "warm_ttfa_ms",
            "rtf",
            "peak_rss_mb",
        ):
            assert f[f"{side}_{key}"] > 0, (side, key)
    assert f["ready_ms_vs_torch"] > 0 and f["rtf_vs_torch"] > 0 and f["ready_vs_onnxruntime_floor"] > 0
    assert f["torch_in_lite_process"] is False
    assert "target READY <= 3.5x `import onnxruntime`" in stdout and "peak RSS" in stdout
