"""The quality gate on the tiny model: the fp32 path against itself is exact, deliberately broken variants are
caught, bf16 moves the figures, the low-latency chunk policy stays within its bounds, and the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cli_util import Run, run_main
from cosyserve.runtime import RuntimeOptions, load_runtime
from cosyserve.tools import quality
from cosyserve.tools.quality import BOUNDS, QualityReport, compare, parse_options

# the gate's own reference options (tools.quality.run_quality): the LM's products pinned, so that a model compared
# with itself is exact (llm_gemm=auto changes the last bits once it has timed its two layouts)
OPTIONS = RuntimeOptions(warmup=False, text_tier="lazy", llm_gemm="linear")


@pytest.fixture(scope="module")
def tiny_bundle(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cosyserve.bundle.convert import convert

    return Path(convert(tiny_model_dir, tmp_path_factory.mktemp("q") / "fp32"))


@pytest.fixture(scope="module")
def reference(tiny_bundle: Path):  # type: ignore[no-untyped-def]
    return load_runtime(tiny_bundle, OPTIONS)


@pytest.fixture(scope="module")
def self_figures(reference) -> dict[str, float]:  # type: ignore[no-untyped-def]
    return compare(reference, reference)


def test_fp32_against_itself_is_exact(self_figures: dict[str, float]) -> None:
    # any distance here would be nondeterminism in the gate itself (draws, inputs), not a fast path's effect
    f = self_figures
    assert f["llm.top1"] == 1.0 and f["llm.dlogp"] == 0.0 and f["llm.steps"] > 0
    assert f["token2wav.flow_mel_l1"] == 0.0 and f["token2wav.mel_l1"] == 0.0 and f["token2wav.lsd_db"] == 0.0


def test_low_latency_chunks_stay_within_bounds(self_figures: dict[str, float]) -> None:
    f = self_figures
    # the low-latency policy's first flow call sees first_hop + 20 overlap tokens, the reference's 120
    assert f["chunks.low-latency.first_window"] == OPTIONS.first_hop + 20
    assert f["chunks.reference.first_window"] == 120
    assert f["chunks.low-latency.seams"] > f["chunks.reference.seams"] >= 1
    report = QualityReport("tiny", "tiny", f)
    assert report.failures() == [], report.table()


def test_one_call_stream_equals_one_shot(reference) -> None:  # type: ignore[no-untyped-def]
    # a policy whose first window holds every token streams in one finalizing call: the same audio as one-shot,
    # so what the chunk figures measure is the chunking alone (the draws are aligned)
    from cosyserve.families.cosyvoice.token2wav import StreamPolicy

    c = quality.chunk_distances(reference, StreamPolicy(first_hop_len=200), n_tokens=150)
    assert c.seams == 0 and c.overall.mel_l1 == 0.0 and c.overall.lsd_db == 0.0


def test_clicks_at_the_seams_fail_the_chunk_bounds(reference, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    # a broken seam (a click where every chunk starts) is what the chunk figures are for
    from cosyserve.families.cosyvoice import token2wav

    call = token2wav.Token2Wav._call

    def clicking(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        speech = call(self, *args, **kwargs)
        speech[:, :64] += 0.5
        return speech

    monkeypatch.setattr(token2wav.Token2Wav, "_call", clicking)
    c = quality.chunk_distances(reference, token2wav.StreamPolicy.named("low-latency", OPTIONS.first_hop))
    excess = c.seam.mel_l1 / c.overall.mel_l1
    assert c.seam.mel_l1 > BOUNDS["chunks.low-latency.seam.mel_l1"].limit or not BOUNDS[
        "chunks.low-latency.seam_excess"
    ].holds(excess), c


def _perturbed(tiny_bundle: Path, scale: float):  # type: ignore[no-untyped-def]
    rt = load_runtime(tiny_bundle, RuntimeOptions(warmup=False, text_tier="lazy", use_mmap=False))
    g = torch.Generator().manual_seed(0)
    for module in (rt.pipeline.llm.llm_decoder, rt.pipeline.token2wav.flow.encoder_proj):
        w = module.weight
        noise = torch.randn(w.shape, generator=g)
        module.weight = torch.nn.Parameter(w + scale * w.norm() / noise.norm() * noise, requires_grad=False)
    return rt


def test_a_perturbed_variant_fails_the_gate(reference, tiny_bundle: Path) -> None:  # type: ignore[no-untyped-def]
    # 10% of the weights' norm in the LLM's output layer and the flow's encoder projection: the gate must see it
    f = compare(reference, _perturbed(tiny_bundle, 0.1), parts=("llm", "token2wav"))
    failed = QualityReport("tiny", "perturbed", f).failures()
    assert any(line.startswith("llm.") for line in failed), f
    assert any(line.startswith("token2wav.flow_mel_l1") for line in failed), f


def test_bf16_bundle_moves_the_figures(reference, tiny_model_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from cosyserve.bundle.convert import convert

    bf16 = load_runtime(convert(tiny_model_dir, tmp_path / "bf16", dtype="bfloat16"), OPTIONS)
    f = compare(reference, bf16, parts=("llm", "token2wav"))
    # bf16 weights change every figure a little; a zero here would mean the variant was not what ran
    assert f["llm.dlogp"] > 0 and f["token2wav.flow_mel_l1"] > 0
    assert (
        f["llm.dlogp"] <= BOUNDS["llm.dlogp"].limit
        and f["token2wav.flow_mel_l1"] <= BOUNDS["token2wav.flow_mel_l1"].limit
    )


def test_fewer_flow_steps_reach_the_flow_figure(reference, tiny_bundle: Path) -> None:  # type: ignore[no-untyped-def]
    # if this fails, a flow_steps variant is measured with the model's own step count: the gate would pass any
    # step count, since the flow's mel (its sensitive figure) would not change
    fewer = load_runtime(tiny_bundle, RuntimeOptions(warmup=False, text_tier="lazy", flow_steps=2))
    f = compare(reference, fewer, parts=("token2wav",))
    assert f["token2wav.flow_mel_l1"] > 0, f


def test_parse_options_casts_by_declared_type() -> None:
    got = parse_options(["first_hop=21", "chunk_policy=reference", "use_mmap=false", "threads=none"])
    assert got == {"first_hop": 21, "chunk_policy": "reference", "use_mmap": False, "threads": None}
    with pytest.raises(ValueError, match="--option flow_stepz: unknown option; expected one of strategy"):
        parse_options(["flow_stepz=1"])
    with pytest.raises(ValueError, match="--option first_hop=x: expected an integer"):
        parse_options(["first_hop=x"])
    with pytest.raises(
        ValueError, match="--option chunk_policy=fast: expected one of reference, low-latency"
    ):
        parse_options(["chunk_policy=fast"])
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_options(["first_hop"])


def test_cli_quality_json_and_check(tiny_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the command in this process (cli_util.run_main: its main, exit status and output); the figures' code is
    # what the tests above measure
    def cli(*args: str) -> Run:
        return run_main(capsys, "quality", *args)

    r = cli("--model", str(tiny_bundle), "--parts", "llm,token2wav", "--json", "--check", "--threads", "1")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["failures"] == [] and out["figures"]["llm.top1"] == 1.0
    bad = cli("--model", str(tiny_bundle), "--option", "flow_stepz=1")
    assert bad.returncode == 1 and "--option flow_stepz: unknown option" in bad.stderr
    bad = cli("--model", str(tiny_bundle), "--parts", "llm,sound")
    assert bad.returncode == 1 and "--parts llm,sound" in bad.stderr


def test_cosyvoice2_gate_measures_llm_and_token2wav(cv2_model_dir: Path) -> None:
    """On a CosyVoice2 model the gate's LLM and token2wav parts run (its flow and vocoder compared with the same
    vocoder draws): fp32 against itself is exact, fewer flow steps move the flow figure, and the chunks part,
    built for the 300M streaming, is left out of the default and refused by name."""
    from cosyserve.core.errors import ClientError

    ref = load_runtime(cv2_model_dir, OPTIONS)
    same = compare(ref, ref)  # the default parts: llm and token2wav for this family
    assert same["llm.top1"] == 1.0 and same["llm.dlogp"] == 0.0, same
    assert same["token2wav.flow_mel_l1"] == 0.0 and same["token2wav.mel_l1"] == 0.0, same
    assert not any(k.startswith("chunks.") for k in same), same
    fewer = load_runtime(cv2_model_dir, RuntimeOptions(warmup=False, text_tier="lazy", flow_steps=2))
    assert compare(ref, fewer, parts=["token2wav"])["token2wav.flow_mel_l1"] > 0.0
    with pytest.raises(ClientError, match="chunks"):
        compare(ref, ref, parts=["chunks"])
