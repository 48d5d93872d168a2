"""Per-component dtypes, int8 LLM linears and the flow's step count: at convert and at load time, checked."""

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from torch import nn

from cosyserve.bundle.convert import convert, parse_component_dtypes, parse_quantize
from cosyserve.bundle.loader import LoadOptions, open_bundle
from cosyserve.core.errors import BundleError, SettingsError
from cosyserve.models.precision import Int8Linear, cast_floating, quantize_per_channel
from cosyserve.runtime import RuntimeOptions

MIXED = "llm=float32,flow=bfloat16,hift=bfloat16"


@pytest.fixture(scope="module")
def fp32_bundle(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert(tiny_model_dir, tmp_path_factory.mktemp("bundles") / "fp32", progress=False)


@pytest.fixture(scope="module")
def fast_bundle(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bundles") / "mixed-int8"
    return convert(tiny_model_dir, out, dtype=MIXED, quantize="llm=int8", progress=False)


def _synth(path: Path, **options: object) -> torch.Tensor:
    import cosyserve

    m = cosyserve.load(path, warmup=False, **options)
    return torch.from_numpy(m.synthesize_all("Hello there.", m.speakers[0], seed=3))


# -- convert ---------------------------------------------------------------------------------------------------


def test_mixed_int8_bundle_records_each_component_and_synthesizes(fast_bundle: Path) -> None:
    bundle = open_bundle(fast_bundle)
    # an int8 bundle is version 2: a reader that cannot build int8 linears refuses it instead of failing later
    assert bundle.manifest["version"] == 2 and bundle.dtype == "mixed"
    assert [bundle.component_dtype(c) for c in ("llm", "flow", "hift")] == ["float32", "bfloat16", "bfloat16"]
    assert bundle.quantized("llm") == "int8" and bundle.quantized("flow") == "none"
    llm_tensors = bundle.manifest["components"]["llm"]["tensors"]
    assert llm_tensors["llm_decoder.weight"]["dtype"] == "int8"
    assert llm_tensors["llm_decoder.scales"]["dtype"] == "float32"
    # the text encoder and the position projection are not quantized (run once per request / per position)
    assert llm_tensors["text_encoder_affine_layer.weight"]["dtype"] == "float32"
    assert llm_tensors["llm.encoders.0.self_attn.linear_pos.weight"]["dtype"] == "float32"
    hift = bundle.manifest["components"]["hift"]["tensors"]
    # pitch and phase stay float32 in a bf16 vocoder; the rest is bf16
    assert {v["dtype"] for k, v in hift.items() if k.startswith(("f0_predictor.", "m_source."))} == {
        "float32"
    }
    assert hift["conv_pre.weight"]["dtype"] == "bfloat16"

    parts = bundle.load(LoadOptions(verify="full"))
    llm = parts.modules["llm"]
    assert isinstance(llm.llm_decoder, Int8Linear) and isinstance(
        llm.llm.encoders[0].feed_forward.w_1, Int8Linear
    )
    audio = _synth(fast_bundle)
    assert audio.numel() > 0 and torch.isfinite(audio).all()


def test_tampered_int8_tensor_is_refused(fast_bundle: Path, tmp_path: Path) -> None:
    b = tmp_path / "b"
    shutil.copytree(fast_bundle, b)
    (b / ".verified.json").unlink(missing_ok=True)
    path = b / "llm.safetensors"
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    raw[8 + n + header["llm_decoder.weight"]["data_offsets"][0]] ^= 0x7F
    path.write_bytes(bytes(raw))
    with pytest.raises(
        BundleError, match=r"llm.safetensors: checksum mismatch in tensor 'llm_decoder.weight'"
    ):
        open_bundle(b).load(LoadOptions(verify="full"))


def test_old_manifest_without_component_dtypes_still_loads(fp32_bundle: Path, tmp_path: Path) -> None:
    b = tmp_path / "old"
    shutil.copytree(fp32_bundle, b)
    manifest = json.loads((b / "manifest.json").read_text())
    for entry in manifest["components"].values():
        entry.pop("dtype")
    (b / "manifest.json").write_text(json.dumps(manifest))
    bundle = open_bundle(b)
    assert bundle.manifest["version"] == 1 and bundle.component_dtype("flow") == "float32"
    assert bundle.quantized("llm") == "none"
    bundle.load(LoadOptions(verify="none"))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("bf16", r"--dtype 'bf16': expected one of float32, bfloat16, float16 or COMPONENT=VALUE"),
        ("llm=float32,vocoder=bfloat16", r"unknown component 'vocoder'; expected llm, flow, hift"),
        ("flow=int8", r"flow='int8'; expected one of float32, bfloat16, float16"),
        ("llm=float32,llm=bfloat16", r"'llm' given twice"),
        ("llm", r"expected one of"),
    ],
)
def test_bad_dtype_specs_name_the_flag(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_component_dtypes(spec, "--dtype")


def test_dtype_and_quantize_specs() -> None:
    assert parse_component_dtypes("bfloat16") == dict.fromkeys(("llm", "flow", "hift"), "bfloat16")
    assert parse_component_dtypes("flow=bfloat16") == {
        "llm": "float32",
        "flow": "bfloat16",
        "hift": "float32",
    }
    assert parse_quantize("none") == {} and parse_quantize("llm=int8") == {"llm": "int8"}
    assert parse_quantize("int8") == {"llm": "int8"}
    with pytest.raises(ValueError, match=r"--quantize 'flow=int8': unknown component 'flow'; expected llm"):
        parse_quantize("flow=int8")
    with pytest.raises(ValueError, match=r"llm='int4'; expected one of none, int8"):
        parse_quantize("llm=int4")


def test_cli_convert_refuses_a_bad_dtype_in_one_line(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cosyserve.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["convert", str(tiny_model_dir), str(tmp_path / "x"), "--dtype", "llm=float8"])
    assert exc.value.code != 0
    assert (
        "--dtype 'llm=float8': llm='float8'; expected one of float32, bfloat16, float16"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "x").exists()


# -- int8 kernel -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rows", [1, 3, 40]
)  # the int8pack kernel (decode) and dequantize-then-linear (prefill)
def test_int8_linear_stays_within_its_rounding_bound(rows: int) -> None:
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(256, 96)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 256, generator=g) / 16)
        lin.bias.copy_(torch.randn(96, generator=g))
    x = torch.randn(2, rows, 256, generator=g)
    q = Int8Linear.from_linear(lin)
    with torch.inference_mode():
        ref, got = lin(x), q(x)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    # each weight is off by at most half a step (scale / 2): |dy_n| <= scale_n / 2 * ||x||_1; the decode kernel
    # also rounds x and y to bfloat16 (relative 2^-8 each), bounded by 2^-7 * (|x| @ |w|.T) + 2^-8 * |y|
    _, scales = quantize_per_channel(lin.weight)
    bound = (
        scales / 2 * x.abs().sum(-1, keepdim=True)
        + 2**-7 * (x.abs() @ lin.weight.abs().T)
        + 2**-8 * ref.abs()
    )
    assert ((got - ref).abs() <= bound + 1e-5).all()
    # and it is not trivially loose: the typical error is a small fraction of the output's scale
    assert (got - ref).abs().mean() < 0.02 * ref.abs().mean()


def test_cast_keeps_float32_parts_and_int8() -> None:
    from cosyserve.models.hift import HiFTGenerator

    class Voc(nn.Module):
        FLOAT32_PARTS = HiFTGenerator.FLOAT32_PARTS

        def __init__(self) -> None:
            super().__init__()
            self.f0_predictor = nn.Linear(4, 4)
            self.conv_pre = nn.Conv1d(4, 4, 3)
            self.q = Int8Linear.from_linear(nn.Linear(4, 4))

    v = cast_floating(Voc(), torch.bfloat16)
    assert v.f0_predictor.weight.dtype == torch.float32 and v.conv_pre.weight.dtype == torch.bfloat16
    assert v.q.weight.dtype == torch.int8 and v.q.scales.dtype == torch.float32


# -- load time ---------------------------------------------------------------------------------------------------


def test_load_time_cast_and_quantize(fp32_bundle: Path, fast_bundle: Path) -> None:
    import cosyserve

    m = cosyserve.load(
        fp32_bundle, warmup=True, llm_quantize="int8", flow_dtype="bfloat16", hift_dtype="bfloat16"
    )
    p = m.runtime.pipeline
    assert isinstance(p.llm.llm_decoder, Int8Linear)
    assert p.token2wav.flow.encoder_proj.weight.dtype == torch.bfloat16
    assert p.token2wav.hift.conv_pre.weight.dtype == torch.bfloat16
    assert p.token2wav.hift.f0_predictor.classifier.weight.dtype == torch.float32
    assert "precision" in m.clock.durations
    # the same weights quantized at load and at conversion give the same audio
    loaded = torch.from_numpy(m.synthesize_all("Hello there.", m.speakers[0], seed=3))
    assert torch.equal(loaded, _synth(fast_bundle, flow_dtype="bfloat16", hift_dtype="bfloat16"))
    # an int8 bundle with llm_quantize=none stays as stored (the float weights are not in it)
    m = cosyserve.load(fast_bundle, warmup=False, llm_quantize="none")
    assert isinstance(m.runtime.pipeline.llm.llm_decoder, Int8Linear)


def test_defaults_leave_a_float32_load_as_it_was(fp32_bundle: Path) -> None:
    import cosyserve

    m = cosyserve.load(fp32_bundle, warmup=False)
    assert "precision" not in m.clock.durations
    assert isinstance(m.runtime.pipeline.llm.llm_decoder, nn.Linear)
    assert m.runtime.pipeline.token2wav.flow_steps is None


def test_a_cpu_without_native_bf16_computes_a_bf16_bundle_in_float32(
    fast_bundle: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On a fake AVX2 CPU (no AVX512-BF16/AMX flags) the bundle's bfloat16 flow and vocoder are cast to float32
    at load, said in one INFO line and in the runtime's precision (the startup report's line); a dtype asked for
    still wins, with a warning. If this fails, a bf16 bundle runs emulated bf16 (3x slower first audio, measured)
    or the choice is silent."""
    import logging

    import cosyserve
    from cosyserve.models import precision

    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"sse4_2", "avx2", "fma"}))
    with caplog.at_level(logging.INFO, logger="cosyserve.runtime.pytorch"):
        m = cosyserve.load(fast_bundle, warmup=False)
    t2w = m.runtime.pipeline.token2wav
    assert (
        t2w.flow.encoder_proj.weight.dtype == torch.float32
        and t2w.hift.conv_pre.weight.dtype == torch.float32
    )
    why = "float32 (stored bfloat16: this CPU has no native bfloat16)"
    assert m.runtime.precision == {"llm": "float32", "flow": why, "hift": why}
    assert [r.message for r in caplog.records if r.message.startswith("precision:")] == [
        f"precision: llm float32, flow {why}, hift {why}"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cosyserve.runtime.pytorch"):
        m = cosyserve.load(fast_bundle, warmup=False, flow_dtype="bfloat16")
    assert m.runtime.pipeline.token2wav.flow.encoder_proj.weight.dtype == torch.bfloat16
    assert m.runtime.precision["flow"] == "bfloat16"
    assert any("flow asked to compute in a half dtype" in r.message for r in caplog.records)


def test_precision_choice_per_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Half dtypes stay where they compute faster (a GPU: as stored); float32 always stays; a request wins; on a
    CPU with the dtype's instructions the choice is timed (a component slower in bf16 there gets float32)."""
    from cosyserve.models import precision
    from cosyserve.models.precision import choose_precision, cpu_native, half_is_fast

    stored = {"llm": "float32", "flow": "bfloat16", "hift": "float16"}
    none = dict.fromkeys(stored)
    bf16_only = choose_precision(stored, none, "cpu", fast=lambda d, c: d == "bfloat16")
    assert {n: p.dtype for n, p in bf16_only.items()} == {
        "llm": "float32",
        "flow": "bfloat16",
        "hift": "float32",
    }
    gpu = choose_precision(stored, none, "cuda", fast=lambda d, c: False)
    assert {n: p.dtype for n, p in gpu.items()} == stored
    asked = choose_precision(stored, {**none, "llm": "bfloat16"}, "cpu", fast=lambda d, c: False)
    assert str(asked["llm"]) == "bfloat16 (asked for; stored float32)"
    flags = frozenset({"avx2", "avx512_bf16"})
    assert cpu_native("bfloat16", flags) and not cpu_native("float16", flags) and cpu_native("float32", flags)
    # a CPU with AVX512-BF16 on which bf16 convolutions are slower and matrix products faster
    monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
    slower = {("conv", torch.bfloat16), ("linear", torch.float32)}
    monkeypatch.setattr(precision, "_probe", lambda op, dtype: (op, dtype))
    monkeypatch.setattr(precision, "_timed", lambda runs: [2.0 if run in slower else 1.0 for run in runs])
    precision._timed_faster.cache_clear()
    try:
        assert half_is_fast("bfloat16", "llm") and not half_is_fast("bfloat16", "flow")
        assert not half_is_fast("bfloat16", "hift") and not half_is_fast("float16", "llm")
    finally:
        precision._timed_faster.cache_clear()


# -- flow steps ----------------------------------------------------------------------------------------------------


def test_flow_steps_reach_the_euler_loop(fp32_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import cosyserve.models.flow as flow_mod

    seen: list[int] = []
    schedule = flow_mod._euler_schedule

    def spy(n_timesteps: int, *args: object) -> torch.Tensor:
        seen.append(n_timesteps)
        return schedule(n_timesteps, *args)

    monkeypatch.setattr(flow_mod, "_euler_schedule", spy)
    default = _synth(fp32_bundle)
    assert seen == [flow_mod.MaskedDiffWithXvec.N_TIMESTEPS] == [10]
    assert torch.equal(_synth(fp32_bundle, flow_steps=10), default)  # the default is the model's count
    seen.clear()
    fewer = _synth(fp32_bundle, flow_steps=3)
    assert seen == [3] and fewer.shape == default.shape and not torch.equal(fewer, default)


def test_bad_values_are_named(monkeypatch: pytest.MonkeyPatch, fp32_bundle: Path) -> None:
    import cosyserve

    monkeypatch.setenv("COSYSERVE_FLOW_STEPS", "0")
    with pytest.raises(SettingsError, match=r"COSYSERVE_FLOW_STEPS='0': must be between 1 and 1000"):
        cosyserve.load(fp32_bundle)
    monkeypatch.delenv("COSYSERVE_FLOW_STEPS")
    monkeypatch.setenv("COSYSERVE_LLM_DTYPE", "fp8")
    with pytest.raises(SettingsError, match=r"COSYSERVE_LLM_DTYPE='fp8': expected one of float32, bfloat16"):
        cosyserve.load(fp32_bundle)
    monkeypatch.delenv("COSYSERVE_LLM_DTYPE")
    monkeypatch.setenv("COSYSERVE_LLM_QUANTIZE", "int4")
    with pytest.raises(SettingsError, match=r"COSYSERVE_LLM_QUANTIZE='int4': expected one of none, int8"):
        cosyserve.load(fp32_bundle)
    monkeypatch.delenv("COSYSERVE_LLM_QUANTIZE")
    with pytest.raises(SettingsError, match=r"cosyserve.load\(hift_dtype='half'\)"):
        cosyserve.load(fp32_bundle, hift_dtype="half")
    with pytest.raises(ValueError, match="flow_steps must be an integer >= 1"):
        RuntimeOptions(flow_steps=0)
    with pytest.raises(ValueError, match="llm_quantize must be none or int8"):
        RuntimeOptions(llm_quantize="int4")  # type: ignore[arg-type]


def test_int8_weights_mapped_misaligned_are_copied_aligned() -> None:
    """A bundle may place an int8 weight at an address that is not 64-byte aligned (safetensors aligns to the
    element size only); the int8pack kernel then crashes the process (SIGSEGV) on 4+ rows. Loading copies such a
    weight into aligned memory, so a forward on 4 rows works and equals the aligned one."""
    from cosyserve.models.precision import INT8_ALIGN, Int8Linear

    torch.manual_seed(0)
    ref = Int8Linear.from_linear(torch.nn.Linear(256, 128))
    raw = torch.empty(ref.weight.numel() + INT8_ALIGN, dtype=torch.int8)
    start = (INT8_ALIGN - raw.data_ptr() % INT8_ALIGN) % INT8_ALIGN + 24  # 24 bytes past an aligned address
    view = raw[start : start + ref.weight.numel()].view(128, 256)
    view.copy_(ref.weight)
    assert view.data_ptr() % INT8_ALIGN == 24
    q = Int8Linear(256, 128)
    q.load_state_dict({"weight": view, "scales": ref.scales, "bias": ref.bias}, assign=True)
    assert q.weight.data_ptr() % INT8_ALIGN == 0
    x = torch.randn(4, 256)
    torch.testing.assert_close(q(x), ref(x))


def test_int8_bundle_lays_int8_weights_out_aligned(tiny_model_dir: Path, tmp_path: Path) -> None:
    """convert --quantize llm=int8 writes every int8 weight at a 64-byte aligned file offset (so the torch
    runtime maps it instead of copying it), and the file stays a valid safetensors file."""
    from safetensors import safe_open

    from cosyserve.bundle.convert import convert
    from cosyserve.bundle.mmap_safetensors import MappedFile

    out = convert(tiny_model_dir, tmp_path / "b", quantize="llm=int8", progress=False)
    f = MappedFile(out / "llm.safetensors")
    int8 = {k: i for k, i in f.tensors.items() if i.dtype == "I8"}
    assert int8 and all(i.begin % 64 == 0 for i in int8.values()), {k: i.begin % 64 for k, i in int8.items()}
    with safe_open(str(out / "llm.safetensors"), framework="pt") as st:  # the library reads it too
        for k in list(int8)[:3]:
            assert torch.equal(st.get_tensor(k), f.tensor(k))
