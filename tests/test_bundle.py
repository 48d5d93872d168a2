"""The fast bundle: conversion round trip, atomicity, every corruption refused, zero-copy loading."""

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_util import run_main
from cosyserve.bundle.convert import convert
from cosyserve.bundle.loader import LoadOptions, is_bundle, open_bundle
from cosyserve.bundle.official import load_component
from cosyserve.core.errors import BundleError
from proc_util import run_python

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module")
def bundle_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert(tiny_model_dir, tmp_path_factory.mktemp("bundles") / "tiny", progress=False)


def _copy(bundle: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "b"
    shutil.copytree(bundle, dst)
    (dst / ".verified.json").unlink(missing_ok=True)
    return dst


def test_roundtrip_equals_official_weights(tiny_model_dir: Path, bundle_dir: Path) -> None:
    from cosyserve.families.modelconfig import load_model_config

    cfg = load_model_config(tiny_model_dir)
    parts = open_bundle(bundle_dir).load(LoadOptions(verify="full"))
    for name in ("llm", "flow", "hift"):
        official = load_component(tiny_model_dir, name, getattr(cfg, name)).state_dict()
        ours = parts.modules[name].state_dict()
        assert official.keys() == ours.keys(), name
        for k in official:
            assert torch.equal(official[k], ours[k]), f"{name}.{k} changed in conversion"
    assert sorted(parts.speakers) == open_bundle(bundle_dir).speaker_names
    src = torch.load(tiny_model_dir / "spk2info.pt", weights_only=True)
    for name, entry in src.items():
        assert torch.equal(parts.speakers[name]["embedding"], entry["embedding"].reshape(1, -1))


def test_bundle_config_equals_the_official_dirs(tiny_model_dir: Path, bundle_dir: Path) -> None:
    """If this fails, a model served from its bundle is built with other hyperparameters than the same model read
    from its official dir: the manifest's config and the yaml must go through one builder to one result."""
    import dataclasses

    from cosyserve.families.modelconfig import load_model_config

    official = load_model_config(tiny_model_dir)
    stored = open_bundle(bundle_dir).config
    assert stored.source.endswith("manifest.json") and official.source.endswith("cosyvoice.yaml")
    assert dataclasses.replace(stored, source="") == dataclasses.replace(official, source="")


def test_bundle_config_errors_name_the_manifest_key(bundle_dir: Path, tmp_path: Path) -> None:
    import json

    from cosyserve.core.errors import ModelConfigError

    bundle = _copy(bundle_dir, tmp_path)
    manifest = json.loads((bundle / "manifest.json").read_text())
    del manifest["config"]["flow"]["encoder"]
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        ModelConfigError, match=r"manifest.json: missing required key 'config\.flow\.encoder'"
    ):
        _ = open_bundle(bundle).config


def test_weights_are_mapped_not_copied(bundle_dir: Path) -> None:
    parts = open_bundle(bundle_dir).load(LoadOptions(strategy="lazy", verify="none"))
    w = parts.modules["llm"].llm_decoder.weight
    f = parts.files["llm"]
    # the parameter's memory lies inside the file mapping: zero-copy
    import ctypes

    base = ctypes.addressof(ctypes.c_char.from_buffer(f._mm))
    assert base <= w.data_ptr() < base + f.size
    assert all(not p.is_meta for m in parts.modules.values() for p in m.parameters())


def test_bundle_conformance_passes(fixture_set_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kinds = "llm_logprobs,flow_inference,hift_inference,token2wav_stream,token2wav_full"
    r = run_main(capsys, "conformance", str(fixture_set_dir), "--kinds", kinds, "--via-bundle")
    assert r.returncode == 0, r.stdout + r.stderr
    assert " 0 failed" in r.stdout


def test_bfloat16_bundle_halves_the_files(tiny_model_dir: Path, bundle_dir: Path, tmp_path: Path) -> None:
    b16 = convert(tiny_model_dir, tmp_path / "b16", dtype="bfloat16", progress=False)
    parts = open_bundle(b16).load(LoadOptions(verify="full"))
    assert parts.modules["llm"].llm_decoder.weight.dtype == torch.bfloat16
    size = (b16 / "llm.safetensors").stat().st_size
    assert size < 0.55 * (bundle_dir / "llm.safetensors").stat().st_size


def test_existing_output_refused_without_force(tiny_model_dir: Path, bundle_dir: Path) -> None:
    with pytest.raises(FileExistsError, match="already exists"):
        convert(tiny_model_dir, bundle_dir, progress=False)


def test_interrupted_convert_leaves_no_bundle(tiny_model_dir: Path, tmp_path: Path) -> None:
    # kill -9 the converter in the middle of writing the second component
    out = tmp_path / "out"
    code = (
        "import os, signal, safetensors.torch as st\n"
        "orig = st.save_file\n"
        "calls = []\n"
        "def save(*a, **k):\n"
        "    calls.append(1)\n"
        "    orig(*a, **k)\n"
        "    if len(calls) == 2:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "st.save_file = save\n"
        "from cosyserve.bundle.convert import convert\n"
        f"convert({str(tiny_model_dir)!r}, {str(out)!r}, progress=False)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": SRC}, timeout=300)
    assert r.returncode == -9
    assert not out.exists()
    leftovers = list(tmp_path.iterdir())
    assert leftovers and not any(is_bundle(p) for p in leftovers), "a half-written dir looks like a bundle"


def test_failed_convert_cleans_up(tiny_model_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, bad)
    (bad / "hift.pt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="hift.pt"):
        convert(bad, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad"]


def _flip_byte_in_tensor(bundle: Path, component: str, tensor: str) -> None:
    path = bundle / f"{component}.safetensors"
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    begin = 8 + n + header[tensor]["data_offsets"][0]
    raw[begin] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_checksum_mismatch_names_tensor(bundle_dir: Path, tmp_path: Path) -> None:
    b = _copy(bundle_dir, tmp_path)
    open_bundle(b).load(LoadOptions(verify="stamp"))  # verified once, stamp written
    _flip_byte_in_tensor(b, "flow", "encoder_proj.weight")  # the rewrite changes mtime/ctime: re-verified
    with pytest.raises(
        BundleError, match=r"flow.safetensors: checksum mismatch in tensor 'encoder_proj.weight'"
    ):
        open_bundle(b).load(LoadOptions(verify="stamp"))


def test_stamp_skips_rehash_of_unchanged_files(
    bundle_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cosyserve.bundle import loader

    b = _copy(bundle_dir, tmp_path)
    open_bundle(b).load(LoadOptions(verify="stamp"))
    assert (b / ".verified.json").is_file()

    def fail(*args: object) -> None:
        raise AssertionError("re-hashed a file whose stat did not change")

    monkeypatch.setattr(loader.Bundle, "_hash_check", fail)
    open_bundle(b).load(LoadOptions(verify="stamp"))
    with pytest.raises(AssertionError):
        open_bundle(b).load(LoadOptions(verify="full"))


def test_truncated_file_refused(bundle_dir: Path, tmp_path: Path) -> None:
    b = _copy(bundle_dir, tmp_path)
    path = b / "llm.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(BundleError, match="llm.safetensors.*(truncated|past the end)"):
        open_bundle(b).load()


def test_missing_tensor_refused(bundle_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    b = _copy(bundle_dir, tmp_path)
    sd = load_file(str(b / "hift.safetensors"))
    del sd["conv_post.weight"]
    save_file(sd, str(b / "hift.safetensors"))
    manifest = json.loads((b / "manifest.json").read_text())
    manifest["components"]["hift"]["bytes"] = (b / "hift.safetensors").stat().st_size
    (b / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="missing tensor.*conv_post.weight"):
        open_bundle(b).load()


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (
            lambda m: m["components"]["llm"]["tensors"]["llm_decoder.weight"].update(dtype="float16"),
            "is F32, the manifest says float16",
        ),
        (lambda m: m["components"]["llm"]["tensors"]["llm_decoder.weight"].update(shape=[1, 2]), "has shape"),
        (lambda m: m.update(version=99), "format version 99"),
        (lambda m: m["components"].pop("flow"), "no 'flow' component"),
        (lambda m: m["components"]["llm"].update(bytes=1), "the manifest says 1"),
    ],
)
def test_manifest_mismatch_refused(bundle_dir: Path, tmp_path: Path, edit, needle: str) -> None:  # type: ignore[no-untyped-def]
    b = _copy(bundle_dir, tmp_path)
    manifest = json.loads((b / "manifest.json").read_text())
    edit(manifest)
    (b / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=needle):
        open_bundle(b).load()


def test_instruct_models_are_told_by_the_reference_rule_and_recorded(
    tmp_path: Path, bundle_dir: Path
) -> None:
    """An instruct model (CosyVoice-300M-Instruct) is one whose model dir's name contains '-Instruct', as the
    reference decides; a Hugging Face snapshot is named by its repo. If this fails, instruct mode is refused on
    an official -Instruct download, or allowed on -SFT (the reference refuses it there)."""
    from cosyserve.bundle.loader import Bundle
    from cosyserve.families.cosyvoice import is_instruct_model_dir

    snap = tmp_path / "hub" / "models--FunAudioLLM--CosyVoice-300M-Instruct" / "snapshots" / "0123abc"
    for d in (
        snap,
        tmp_path / "CosyVoice-300M-Instruct",
        tmp_path / "CosyVoice-300M-SFT",
        tmp_path / "x-instruct",
    ):
        d.mkdir(parents=True)
    assert is_instruct_model_dir(snap) and is_instruct_model_dir(tmp_path / "CosyVoice-300M-Instruct")
    assert not is_instruct_model_dir(tmp_path / "CosyVoice-300M-SFT")
    assert not is_instruct_model_dir(tmp_path / "x-instruct"), "the reference's test is case-sensitive"
    (tmp_path / "link-Instruct").symlink_to(tmp_path / "CosyVoice-300M-SFT")
    assert not is_instruct_model_dir(tmp_path / "link-Instruct"), (
        "the real directory decides, as the cache key"
    )
    # the tiny test model's dir is named like an instruct model; conversion records that
    manifest = json.loads((bundle_dir / "manifest.json").read_text())
    assert manifest["instruct"] is True
    # a bundle converted before the field existed is judged by the source dir its manifest names
    del manifest["instruct"]
    assert Bundle(bundle_dir, manifest).instruct is True
    manifest["source"]["dir"] = str(tmp_path / "CosyVoice-300M-SFT")
    assert Bundle(bundle_dir, manifest).instruct is False
    with pytest.raises(BundleError, match="instruct must be true or false"):
        _ = Bundle(bundle_dir, {**manifest, "instruct": "yes"}).instruct


def test_not_a_bundle(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="no manifest.json"):
        open_bundle(tmp_path)


def test_official_dir_converted_once_into_cache(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cosyserve.api import resolve_bundle

    monkeypatch.setenv("COSYSERVE_CACHE_DIR", str(tmp_path / "cache"))
    first = resolve_bundle(tiny_model_dir, progress=False)
    assert is_bundle(first) and first.is_relative_to(tmp_path / "cache")
    mtime = (first / "manifest.json").stat().st_mtime_ns
    assert resolve_bundle(tiny_model_dir, progress=False) == first
    assert (first / "manifest.json").stat().st_mtime_ns == mtime, "an unchanged source was converted again"


def test_sft_path_never_loads_zero_shot_tier(bundle_dir: Path) -> None:
    code = (
        "import sys, cosyserve\n"
        f"m = cosyserve.load({str(bundle_dir)!r}, warmup=True)\n"
        "list(m.synthesize('Hello there.', m.speakers[0], seed=1))\n"
        "assert 'onnxruntime' not in sys.modules, 'the SFT path imported onnxruntime'\n"
    )
    r = run_python(code)
    assert r.returncode == 0, r.stderr


def test_env_settings_are_checked(monkeypatch: pytest.MonkeyPatch, bundle_dir: Path) -> None:
    import cosyserve
    from cosyserve.core.errors import SettingsError

    monkeypatch.setenv("COSYSERVE_PRELOAD", "sometimes")
    with pytest.raises(SettingsError, match="COSYSERVE_PRELOAD='sometimes'"):
        cosyserve.load(bundle_dir)
    monkeypatch.setenv("COSYSERVE_PRELOAD", "1")
    monkeypatch.setenv("USE_MMAP_LOADING", "maybe")
    with pytest.raises(SettingsError, match="USE_MMAP_LOADING"):
        cosyserve.load(bundle_dir)


@pytest.mark.parametrize("strategy", ["preload", "lazy", "prefetch"])
def test_strategies_give_same_audio(bundle_dir: Path, strategy: str) -> None:
    import cosyserve

    m = cosyserve.load(bundle_dir, strategy=strategy, warmup=False)
    a = m.synthesize_all("Hello.", m.speakers[0], seed=4)
    ref = cosyserve.load(bundle_dir, strategy="lazy", use_mmap=False, warmup=False).synthesize_all(
        "Hello.", m.speakers[0], seed=4
    )
    assert a.size > 0 and (a == ref).all()
    if strategy == "preload":
        assert m.clock.durations.get("first_touch", 0) > 0


def test_startup_report_json(bundle_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the command in this process: the starts it measures are processes of their own
    svg = tmp_path / "w.svg"
    r = run_main(
        capsys, "startup-report", "--model", str(bundle_dir), "--runs", "1", "--json", "--svg", str(svg)
    )
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout[: r.stdout.rindex("}") + 1])
    assert rep["runs"] == 1
    for key in ("ready_ms", "floor_ms", "first_audio_ms"):
        assert set(rep[key]) == {"min", "median", "max"}
    assert rep["ratio_ready_to_floor"] == pytest.approx(rep["ready_ms"]["median"] / rep["floor_ms"]["median"])
    assert {"interpreter", "imports", "manifest", "construct", "map_assign", "warmup"} <= set(
        rep["phases_ms"]
    )
    # ready comes after everything before it, and first audio after ready
    assert rep["first_audio_ms"]["median"] > rep["ready_ms"]["median"] > rep["phases_ms"]["imports"]["median"]
    assert svg.read_text().startswith("<svg")


def test_zero_shot_tier_loads_after_ready_when_configured(
    bundle_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cosyserve

    monkeypatch.setenv("COSYSERVE_ZERO_SHOT_TIER", "background")
    m = cosyserve.load(bundle_dir, warmup=False)
    assert m.runtime.zero_shot_thread is not None
    m.runtime.zero_shot_thread.join(timeout=60)
    # the sessions were created off the start path, and their load time is a recorded phase
    assert m.runtime.pipeline.frontend_loaded and m.clock.durations["zero_shot_tier"] > 0
    monkeypatch.setenv("COSYSERVE_ZERO_SHOT_TIER", "eager")
    from cosyserve.core.settings import SettingsError

    with pytest.raises(SettingsError, match="COSYSERVE_ZERO_SHOT_TIER"):
        cosyserve.load(bundle_dir, warmup=False)


# --- the output path: what --force may replace, atomically; stale temporaries; file modes --------------------


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", ["model", "parent", "inside", "link-to-model", "other-dir", "a-file"])
def test_force_never_replaces_the_model_or_what_is_not_a_bundle(
    tiny_model_dir: Path, tmp_path: Path, case: str
) -> None:
    from cosyserve.core.errors import ConvertError

    parent = tmp_path / "parent"
    model = parent / "m"
    shutil.copytree(tiny_model_dir, model)
    (parent / "notes.txt").write_text("unrelated")
    out = {
        "model": model,
        "parent": parent,
        "inside": model / "bundle",
        "link-to-model": tmp_path / "link",
        "other-dir": parent / "other",
        "a-file": parent / "notes.txt",
    }[case]
    if case == "link-to-model":
        out.symlink_to(model, target_is_directory=True)
    if case == "other-dir":
        out.mkdir()
        (out / "data.bin").write_bytes(b"user data")
    before = _tree(tmp_path)
    reason = {
        "model": "is the model directory",
        "parent": "contains the model directory",
        "inside": "lies inside the model directory",
        "link-to-model": "is the model directory",
        "other-dir": "exists and is a directory, not a cosyserve bundle",
        "a-file": "exists and is a file, not a cosyserve bundle",
    }[case]
    with pytest.raises(ConvertError, match=f"{re.escape(str(out))}.*{reason}"):
        convert(model, out, force=True, progress=False)
    assert _tree(tmp_path) == before, "a refused conversion changed files"
    assert sorted(p.name for p in parent.iterdir()) == sorted(
        ["m", "notes.txt"] + (["other"] if case == "other-dir" else [])
    ), "a refused conversion left something behind"


def test_convert_refusal_is_one_line_from_the_cli(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    r = run_main(capsys, "convert", str(model), str(model), "--force")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("cosyserve convert: error:") and str(model) in lines[0], lines[0]
    assert (model / "llm.pt").is_file() and _tree(model) == _tree(tiny_model_dir)


def test_force_replaces_a_bundle_atomically_and_cleans_killed_runs(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    convert(tiny_model_dir, out, progress=False)
    (tmp_path / "notes.txt").write_text("unrelated")
    old = _tree(out)
    # a --force conversion killed in the middle of writing leaves the old bundle in place, complete
    code = (
        "import os, signal, sys, safetensors.torch as st\n"
        "orig = st.save_file\n"
        "def save(*a, **k):\n"
        "    orig(*a, **k)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "st.save_file = save\n"
        "from cosyserve.bundle.convert import convert\n"
        "convert(sys.argv[1], sys.argv[2], force=True, progress=False)\n"
    )
    r = run_python(code, str(tiny_model_dir), str(out))
    assert r.returncode == -9, r.stderr
    assert _tree(out) == old, "a killed --force conversion changed the old bundle"
    open_bundle(out).load(LoadOptions(verify="full"))
    stale = [p for p in tmp_path.iterdir() if p.name.startswith(".out.converting.")]
    assert len(stale) == 1
    # the next conversion removes what the killed one left, and replaces the bundle
    convert(tiny_model_dir, out, dtype="bfloat16", force=True, progress=False)
    assert open_bundle(out).dtype == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "out"], "temporaries left behind"
    assert (tmp_path / "notes.txt").read_text() == "unrelated"


@pytest.mark.parametrize(("mask", "dir_mode", "mode"), [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_bundle_files_follow_the_umask(
    tiny_model_dir: Path, tmp_path: Path, mask: int, dir_mode: int, mode: int
) -> None:
    saved = os.umask(mask)
    try:
        out = convert(tiny_model_dir, tmp_path / "b", progress=False)
    finally:
        os.umask(saved)
    assert out.stat().st_mode & 0o777 == dir_mode
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert modes == dict.fromkeys(modes, oct(mode)), "bundle files must get the umask's mode, as open() does"


# --- the zero-shot tier's ONNX files are checked like the weights ---------------------------------------------


def test_damaged_onnx_is_refused_naming_the_file(bundle_dir: Path, tmp_path: Path) -> None:
    b = _copy(bundle_dir, tmp_path)
    onnx = b / "campplus.onnx"
    onnx.write_bytes(onnx.read_bytes()[:-100])
    bundle = open_bundle(b)
    with pytest.raises(
        BundleError, match=r"campplus.onnx: .* bytes, the manifest says .*truncated.*convert"
    ) as e:
        bundle.check_onnx("campplus.onnx")
    assert str(b) not in e.value.public_message and "campplus.onnx" in e.value.public_message

    raw = bytearray((bundle_dir / "campplus.onnx").read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, other content
    onnx.write_bytes(bytes(raw))
    for verify in ("stamp", "full"):
        bundle.verify = verify
        with pytest.raises(BundleError, match="campplus.onnx: checksum mismatch"):
            bundle.check_onnx("campplus.onnx")
    bundle.verify = "none"  # structure only, as for the weights
    bundle.check_onnx("campplus.onnx")


def test_damaged_onnx_fails_the_prompt_request_with_the_bundle_error(
    bundle_dir: Path, tmp_path: Path
) -> None:
    import numpy as np
    import soundfile as sf

    import cosyserve

    b = _copy(bundle_dir, tmp_path)
    onnx = b / "campplus.onnx"
    onnx.write_bytes(onnx.read_bytes()[:1000])
    wav = tmp_path / "p.wav"
    sf.write(wav, (0.3 * np.sin(np.arange(32000) / 16000 * 2 * np.pi * 220)).astype(np.float32), 16000)
    model = cosyserve.load(b, warmup=False)
    with pytest.raises(BundleError, match="campplus.onnx.*truncated"):
        model.synthesize("Hi.", mode="zero_shot", prompt_wav=wav, prompt_text="A prompt.")
