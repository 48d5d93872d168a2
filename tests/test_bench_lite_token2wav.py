"""bench/lite_token2wav.py cannot rot: one round on the tiny CosyVoice3 lite bundle prints and writes every figure
the lead's full-size run reports."""

from __future__ import annotations

from pathlib import Path

from proc_util import run_bench


def test_lite_token2wav_bench_gives_every_figure(cv3_lite_bundle: Path, tmp_path: Path) -> None:
    """If this fails, the side-by-side bench of CosyVoice2/3 token2wav on the lite graphs and the torch modules (open
    time, first streamed chunk, whole stream, RTF) no longer runs end to end or lost a figure."""
    stdout, figures = run_bench(
        "lite_token2wav.py", str(cv3_lite_bundle), "--rounds", "1", "--tokens", "40", cwd=tmp_path
    )
    for runtime in ("lite", "torch", "torch_cumulative"):
        for key in ("open_ms", "first_chunk_ms", "stream_s", "rtf", "audio_s"):
            assert figures[runtime][key] > 0, (runtime, key)
    assert figures["lite"]["audio_s"] == figures["torch"]["audio_s"], (
        "the runtimes made different amounts of audio"
    )
    assert "lite/torch rtf" in stdout
