"""The conformance runner against the reference fixtures, through the CLI as CI runs it.

The sets run in this process through the CLI's own ``main`` (what ``cosyserve conformance`` runs after parsing, its
exit status included): torch is imported once for every set, not once per run. One run goes through the real entry
point in a process of its own (``python -m cosyserve``), for its exit status."""

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from cli_util import Run, run_main

SRC = str(Path(__file__).resolve().parents[1] / "src")

# every kind of fixtures/KINDS.md
IMPLEMENTED = [
    "tokenize", "llm_logprobs", "flow_inference", "hift_inference", "token2wav_stream", "token2wav_full",
    "mel", "fbank", "whisper_logmel", "resample", "text_frontend", "zero_shot_frontend",
    "cross_lingual_frontend", "instruct_frontend",
]  # fmt: skip


@pytest.fixture
def conformance(capsys: pytest.CaptureFixture[str]) -> Callable[..., Run]:
    """``cosyserve conformance ARGS`` in this process (:func:`cli_util.run_main`); its output shown on a failure."""

    def run(*args: str) -> Run:
        r = run_main(capsys, "conformance", *args)
        print(r.stdout)
        return r

    return run


def entry_point(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "cosyserve", "conformance", *args]
    env = {**os.environ, "PYTHONPATH": SRC}  # read now: conftest has set the session's private cache dir
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)


def test_fixture_set_passes(conformance: Callable[..., Run], fixture_set_dir: Path) -> None:
    r = conformance(str(fixture_set_dir), "--kinds", ",".join(IMPLEMENTED))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.endswith(")") and " PASS " in ln]
    doc = json.loads((fixture_set_dir / "cases.json").read_text())
    assert len(lines) == sum(c["kind"] in IMPLEMENTED for c in doc["cases"])


def test_wrong_expectation_fails(fixture_set_dir: Path, tmp_path: Path) -> None:
    # a case whose expected output is wrong must fail the run: the runner really compares, and the real entry point
    # (python -m cosyserve, a process of its own) exits 1
    work = tmp_path / "set"
    work.mkdir()
    for name in ("tensors.safetensors", "model", "assets"):
        (work / name).symlink_to(fixture_set_dir / name)
    doc = json.loads((fixture_set_dir / "cases.json").read_text())
    case = next(c for c in doc["cases"] if c["kind"] == "tokenize" and c["inputs"]["text"] == "<|endoftext|>")
    case["inputs"]["text"] = "<|zh|>"
    doc["cases"] = [case]
    (work / "cases.json").write_text(json.dumps(doc))
    r = entry_point(str(work))
    assert r.returncode == 1 and "FAIL" in r.stdout and "1 failed" in r.stdout


def test_unknown_kind_fails(conformance: Callable[..., Run], fixture_set_dir: Path, tmp_path: Path) -> None:
    work = tmp_path / "set"
    shutil.copytree(fixture_set_dir / "assets", work / "assets")
    doc = {
        "format": 1,
        "model": "model",
        "cases": [{"name": "x", "kind": "no_such_kind", "inputs": {}, "outputs": {}}],
    }
    (work / "cases.json").write_text(json.dumps(doc))
    r = conformance(str(work))
    assert r.returncode == 1 and "unknown kind 'no_such_kind'" in r.stdout


def test_unknown_kind_filter_is_an_error(conformance: Callable[..., Run], fixture_set_dir: Path) -> None:
    r = conformance(str(fixture_set_dir), "--kinds", "bogus")
    assert r.returncode == 1 and "unknown kind(s) bogus" in r.stderr


def test_cosyvoice2_fixture_set_passes(conformance: Callable[..., Run], cv2_set_dir: Path) -> None:
    """Every case of the CosyVoice2 set (KINDS-cosyvoice2.md), straight from the model dir and through a bundle
    (conversion and mmap loading change nothing)."""
    doc = json.loads((cv2_set_dir / "cases.json").read_text())
    for extra in ([], ["--via-bundle"]):
        r = conformance(str(cv2_set_dir), *extra)
        assert r.returncode == 0, r.stdout + r.stderr
        lines = [ln for ln in r.stdout.splitlines() if ln.endswith(")") and " PASS " in ln]
        assert len(lines) == len(doc["cases"]), extra


def test_fixture_set_passes_on_the_lite_runtime(
    conformance: Callable[..., Run], fixture_set_dir: Path
) -> None:
    """Every case of the CosyVoice-300M set computed by the lite runtime (ONNX graphs + numpy), within the same
    tolerances as the torch runtime: if this fails, the lite runtime's audio is not the reference's."""
    doc = json.loads((fixture_set_dir / "cases.json").read_text())
    r = conformance(str(fixture_set_dir), "--runtime", "lite")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.endswith(")") and " PASS " in ln]
    assert len(lines) == len(doc["cases"])


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_qwen_sets_pass_on_the_lite_runtime(
    conformance: Callable[..., Run], family: str, cv2_set_dir: Path, cv3_set_dir: Path
) -> None:
    """The CosyVoice2 and CosyVoice3 sets on the lite runtime, every kind served: the LM cases (one-shot and, for
    CosyVoice3, streamed text), the flow, vocoder and token2wav cases on the ONNX graphs, and the numpy audio
    frontend (the 24 kHz prompt mel, speech tokens, the zero-shot, cross-lingual, instruct2 and vc frontends,
    CosyVoice3's silent-token filter), within the torch runtime's tolerances. If a case fails, the lite runtime
    computes something other than the reference; a kind the lite runtime stops serving shows as SKIP and fails
    here."""
    from cosyserve.families import family_named

    set_dir = cv2_set_dir if family == "cosyvoice2" else cv3_set_dir
    lite_kinds = family_named(family).lite_kinds
    doc = json.loads((set_dir / "cases.json").read_text())
    assert {c["kind"] for c in doc["cases"]} <= set(lite_kinds)
    r = conformance(str(set_dir), "--runtime", "lite")
    assert r.returncode == 0, r.stdout + r.stderr
    status = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.endswith(")") or "not yet served" in ln}
    for case in doc["cases"]:
        assert " PASS " in status[case["name"]], status[case["name"]]
    assert f"{len(doc['cases'])} passed, 0 failed" in r.stdout and "not yet served" not in r.stdout


def test_cosyvoice3_fixture_set_passes(conformance: Callable[..., Run], cv3_set_dir: Path) -> None:
    """Every case of the CosyVoice3 set (KINDS-cosyvoice3.md), every kind of it known: if a case fails, our
    CosyVoice3 computes something other than the reference."""
    doc = json.loads((cv3_set_dir / "cases.json").read_text())
    r = conformance(str(cv3_set_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.endswith(")") and " PASS " in ln]
    assert len(lines) == len(doc["cases"])


def test_cosyvoice3_fixture_set_passes_through_a_bundle(
    conformance: Callable[..., Run], cv3_set_dir: Path
) -> None:
    """The same cases with the modules converted into a bundle and mapped from it: if one fails, conversion or
    loading changes a CosyVoice3 model (e.g. its float64 f0 predictor rounded into the bundle's dtype)."""
    doc = json.loads((cv3_set_dir / "cases.json").read_text())
    r = conformance(str(cv3_set_dir), "--via-bundle")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.endswith(")") and " PASS " in ln]
    assert len(lines) == len(doc["cases"])


@pytest.mark.parametrize("mode", ["transposed", "linear", "packed"])
def test_lm_kinds_pass_in_either_decode_product_layout(
    conformance: Callable[..., Run],
    fixture_set_dir: Path,
    cv3_set_dir: Path,
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The LM kinds with the decode steps' products pinned to one layout (cosyserve.models.gemm; ``auto`` serves
    whichever this CPU runs faster, so each must meet the reference's tolerances): a transposed or padded product
    that computed anything but x·Wᵀ would move the log-probabilities far past them."""
    monkeypatch.setenv("COSYSERVE_LLM_GEMM", mode)
    for set_dir in (fixture_set_dir, cv3_set_dir):
        doc = json.loads((set_dir / "cases.json").read_text())
        kinds = {c["kind"] for c in doc["cases"] if c["kind"].startswith("llm_")}
        r = conformance(str(set_dir), "--kinds", ",".join(sorted(kinds)))
        assert r.returncode == 0, r.stdout + r.stderr
        cases = [c for c in doc["cases"] if c["kind"] in kinds]
        assert f"{len(cases)} passed, 0 failed" in r.stdout
