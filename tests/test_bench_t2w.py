"""The incremental-token2wav benches cannot rot: bench/stream_chunks.py and bench/voice_states.py run their dry
runs (the full-size runs' code on the tiny CosyVoice3 model, the cheaper tiny one) and report every figure their
targets name."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _script(name: str) -> ModuleType:
    sys.path.insert(0, str(BENCH))  # voice_states imports stream_chunks from beside it
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stream_chunks_dry_run_reports_each_chunk_and_the_targets_ratios(
    cv3_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "chunks.json"
    argv = ["stream_chunks.py", "--dry-run", "--family", "cosyvoice3", "--model", str(cv3_model_dir)]
    argv += ["--policy", "low-latency", "--seconds", "8", "--prompt-seconds", "1", "--json", str(out)]
    argv += ["--flow-context", "2"]  # the bounded flow context (exact otherwise: the same code, other calls)
    monkeypatch.setattr(sys, "argv", argv)
    _script("stream_chunks").main()
    result = json.loads(out.read_text())
    s = result["incremental"][
        "summary"
    ]  # (--compare adds the cumulative path's: the same code on other calls)
    assert s["audio_s"] == pytest.approx(8.0) and s["total_s"] > 0 and s["late_over_early"] > 0, s
    printed = capsys.readouterr().out
    assert (
        "the two before the final" in printed
        and "incremental" in printed
        and "MiB per audio second" in printed
        and "flow context 2 s" in printed
        and "measured peak" in printed
    )


def test_stream_chunks_runs_on_the_lite_runtime(
    cv3_lite_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--runtime lite`` streams through the lite runtime's token2wav (its flow and vocoder graphs) and reports
    the same figures; if this fails the lead cannot measure a lite chunk's cost on a full-size bundle."""
    out = tmp_path / "chunks.json"
    argv = [
        "stream_chunks.py",
        "--dry-run",
        "--runtime",
        "lite",
        "--bundle",
        str(cv3_lite_bundle),
        "--compare",
    ]
    argv += ["--policy", "low-latency", "--seconds", "8", "--prompt-seconds", "1", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    _script("stream_chunks").main()
    result = json.loads(out.read_text())
    for path in ("incremental", "cumulative"):
        s = result[path]["summary"]
        assert s["audio_s"] == pytest.approx(8.0) and s["total_s"] > 0 and s["late_over_early"] > 0, (path, s)


def test_voice_states_dry_run_reports_first_audio_ratios_and_bytes_per_voice(
    cv3_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "voices.json"
    argv = ["voice_states.py", "--dry-run", "--family", "cosyvoice3", "--model", str(cv3_model_dir)]
    argv += ["--text", "Hi.", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    _script("voice_states").main()
    result = json.loads(out.read_text())
    assert set(result["first_audio_s"]) == {"v2/cached", "v2/uncached", "v12/cached", "v12/uncached"}
    assert all(r > 0 for r in result["ratios"].values())
    # the 12 s voice holds about six times the 2 s voice's frames (whole 2 s chunks of its frames)
    held = result["state_bytes"]
    assert 0 < held["2 s"] < held["12 s"] <= 12 * result["bytes_per_second"]


def test_stream_budget_dry_run_reports_drops_and_peaks_under_the_bound(
    cv2_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/stream_budget.py: two concurrent tiny streams, with and without a bound of half their end state:
    the bounded run holds at most the bound (some stream dropped its state), the unbounded one drops nothing,
    and both give their bytes back at the end; ``--stack`` adds the run with the vocoder stacked."""
    out = tmp_path / "budget.json"
    argv = [
        "stream_budget.py",
        "--dry-run",
        "--family",
        "cosyvoice2",
        "--model",
        str(cv2_model_dir),
        "--stack",
    ]
    argv += ["--seconds", "3", "--prompt-seconds", "1", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    _script("stream_budget").main()
    result = json.loads(out.read_text())
    (bounded,), (unbounded,) = result["bounded"], result["unbounded"]
    assert bounded["drops"] >= 1 and bounded["peak_mb"] <= result["budget_mb"], bounded
    assert unbounded["drops"] == 0 and unbounded["peak_mb"] > result["budget_mb"], unbounded
    assert bounded["left_mb"] == unbounded["left_mb"] == 0
    assert bounded["audio_s"] == pytest.approx(unbounded["audio_s"]) and bounded["audio_s"] > 0
    (stacked,) = result["stacked"]
    assert stacked["audio_s"] == pytest.approx(unbounded["audio_s"]) and stacked["vocoder_mean_batch"] >= 1
