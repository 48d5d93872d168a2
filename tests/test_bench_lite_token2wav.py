"""bench/lite_token2wav.py cannot rot: one round on the tiny CosyVoice3 lite bundle prints and writes every figure
the lead's full-size run reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_lite_token2wav_bench_gives_every_figure(cv3_lite_bundle: Path, tmp_path: Path) -> None:
    """If this fails, the side-by-side bench of CosyVoice2/3 token2wav on the lite graphs and the torch modules (open
    time, first streamed chunk, whole stream, RTF) no longer runs end to end or lost a figure."""
    out = tmp_path / "figures.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "lite_token2wav.py"), str(cv3_lite_bundle), "--rounds", "1",
         "--tokens", "40", "--threads", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    figures = json.loads(out.read_text())
    for runtime in ("lite", "torch", "torch_cumulative"):
        for key in ("open_ms", "first_chunk_ms", "stream_s", "rtf", "audio_s"):
            assert figures[runtime][key] > 0, (runtime, key)
    assert figures["lite"]["audio_s"] == figures["torch"]["audio_s"], (
        "the runtimes made different amounts of audio"
    )
    assert "lite/torch rtf" in r.stdout
