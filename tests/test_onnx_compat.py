"""AveragePool(ceil_mode=1, count_include_pad=1) computes ONNX Runtime 1.18's numbers (the reference's) on the ONNX
Runtime we ship: campplus.onnx rewritten at conversion and in memory (cosyserve.frontend.onnx_compat)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper

from cosyserve.frontend import onnx_compat
from cosyserve.frontend.onnx_compat import MARK_KEY, MARK_VALUE, copy_onnx, rewrite_average_pools, scan

# What ONNX Runtime 1.18.0 (CPU, the reference's version) computes for AveragePool(ceil_mode=1,
# count_include_pad=1) on x = arange(1, 2 * prod(shape) + 1) as float32 [1, 2, *shape]: recorded with
# `pip install onnxruntime==1.18.0 "numpy<2"` in a throwaway venv, running the graph _pool_model builds; 1.18.0
# to 1.28.0 give the same numbers, 1.29.0 divides each partial window by its real elements instead
# (A, shape 10: [[2.5, 6.5, 9.5], [12.5, 16.5, 19.5]]). {name: (kernel, strides, pads, {shape: output[0]})}
ORT_1_18 = {
    # CAM++'s segment pooling: kernel = stride, no pads
    "A": (
        [4],
        [4],
        [0, 0],
        {
            (3,): [[1.5], [3.75]],
            (5,): [[2.5, 1.25], [7.5, 2.5]],
            (10,): [[2.5, 6.5, 4.75], [12.5, 16.5, 9.75]],
        },
    ),
    # overlapping windows and a begin pad
    "B": (
        [4],
        [3],
        [1, 0],
        {
            (2,): [[0.75], [1.75]],
            (7,): [[1.5, 4.5, 3.25], [6.75, 11.5, 6.75]],
            (11,): [[1.5, 4.5, 7.5, 7.5], [9.75, 15.5, 18.5, 15.75]],
        },
    ),
    # two spatial axes
    "C": (
        [3, 4],
        [2, 3],
        [1, 0, 0, 1],
        {
            (5, 7): [
                [[4.0, 6.0, 1.75], [16.5, 19.5, 5.25], [18.0, 20.0, 5.25]],
                [[27.333334, 29.333334, 7.583334], [51.5, 54.5, 14.0], [41.333332, 43.333332, 11.083333]],
            ]
        },
    ),
}


def _pool(name: str = "", *, domain: str = "", **attrs: Any) -> Any:
    return helper.make_node("AveragePool", ["x"], ["y"], name=name, domain=domain, **attrs)


def _model(nodes: list[Any], nd: int = 1) -> Any:
    dims: list[Any] = [1, 2, *(f"d{i}" for i in range(nd))]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _pool_model(kernel: list[int], strides: list[int], pads: list[int]) -> Any:
    node = _pool(kernel_shape=kernel, strides=strides, pads=pads, ceil_mode=1, count_include_pad=1)
    return _model([node], nd=len(kernel))


def _run(model: Any, x: np.ndarray) -> np.ndarray:
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"x": x})[0])


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:2])


@pytest.mark.parametrize("name", sorted(ORT_1_18))
def test_rewritten_pool_computes_onnxruntime_1_18_numbers(name: str, tmp_path: Path) -> None:
    """If this fails, the rewrite (ceil_mode=0, end pad + stride - 1) does not reproduce what the reference's ONNX
    Runtime computed: speaker embeddings differ from the reference's on the last partial segment of CAM++."""
    kernel, strides, pads, cases = ORT_1_18[name]
    model = _pool_model(kernel, strides, pads)
    original = onnx.ModelProto()
    original.CopyFrom(model)
    assert rewrite_average_pools(model) == 1
    (node,) = model.graph.node
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["ceil_mode"] == 0 and attrs["count_include_pad"] == 1
    for shape, expected in cases.items():
        x = np.arange(1, 2 * int(np.prod(shape)) + 1, dtype=np.float32).reshape(1, 2, *shape)
        got = _run(model, x)[0]
        np.testing.assert_allclose(got, np.asarray(expected, dtype=np.float32), rtol=0, atol=1e-5)
        if _version(onnxruntime.__version__) >= (1, 29):
            # else the test would pass without the rewrite
            assert _run(original, x)[0].shape != got.shape or not np.allclose(_run(original, x)[0], got)
    path = tmp_path / "pool.onnx"
    onnx.save(model, str(path))
    assert scan(path) == onnx_compat.OnnxScan(sensitive=0, marked=True)
    assert rewrite_average_pools(model) == 0, "a rewritten graph has nothing left to rewrite"


def _prompt_cases(set_dir: Path) -> list[tuple[str, str, str]]:
    cases = json.loads((set_dir / "cases.json").read_text(encoding="utf-8"))["cases"]
    return [
        (c["name"], c["inputs"]["prompt_wav"], c["outputs"]["flow_embedding"]["tensor"])
        for c in cases
        if "prompt_wav" in c["inputs"] and "flow_embedding" in c["outputs"]
    ]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("set_fixture", ["fixture_set_dir", "cv2_set_dir", "cv3_set_dir"])
def test_model_dir_campplus_gives_the_reference_embedding(
    set_fixture: str, request: pytest.FixtureRequest
) -> None:
    """The public sets' frontend cases (zero_shot, cross_lingual, instruct2, vc): campplus.onnx opened from the
    model dir gives the reference's flow_embedding to ~1e-7 (without the in-memory rewrite, 1e-4 to 4e-3 on ONNX
    Runtime 1.29), and the model dir's file is not written. If this fails, every cloned voice's speaker embedding
    differs from the reference's."""
    from safetensors.numpy import load_file

    from cosyserve.frontend import features_np
    from cosyserve.frontend.audio import load_wav_np
    from cosyserve.frontend.prompt import OnnxModel

    set_dir: Path = request.getfixturevalue(set_fixture)
    campplus = set_dir / "model" / "campplus.onnx"
    before = _sha(campplus)
    tensors = load_file(str(set_dir / "tensors.safetensors"))
    model = OnnxModel(campplus)
    plain = onnxruntime.InferenceSession(str(campplus), providers=["CPUExecutionProvider"])
    cases = _prompt_cases(set_dir)
    assert cases, f"{set_dir} has no case with a prompt and a flow_embedding"
    for name, wav, key in cases:
        feat = features_np.speaker_fbank(load_wav_np(str(set_dir / wav), 16000))[None].astype(np.float32)
        err = float(np.abs(model.run(feat) - tensors[key]).max())
        assert err < 1e-5, f"{name}: flow_embedding max abs err {err:.3g}"
        if _version(onnxruntime.__version__) >= (1, 29):
            plain_err = float(np.abs(plain.run(None, {"input": feat})[0] - tensors[key]).max())
            assert plain_err > 1e-5, f"{name}: the file as it is already matches; the rewrite is not tested"
    assert _sha(campplus) == before


def test_copy_onnx_rewrites_campplus_and_copies_other_graphs(fixture_set_dir: Path, tmp_path: Path) -> None:
    """Conversion's copy: campplus.onnx gets its 52 CAM++ pools rewritten and marked, a second pass and the speech
    tokenizer (no such nodes) are byte-for-byte copies. If this fails, a bundle's embeddings follow the installed
    ONNX Runtime, or conversion changes files it has no reason to touch."""
    src = fixture_set_dir / "model" / "campplus.onnx"
    assert scan(src) == onnx_compat.OnnxScan(sensitive=52, marked=False)
    assert copy_onnx(src, tmp_path / "campplus.onnx") == 52
    assert scan(tmp_path / "campplus.onnx") == onnx_compat.OnnxScan(sensitive=0, marked=True)
    model = onnx.load(str(tmp_path / "campplus.onnx"))
    assert {p.key: p.value for p in model.metadata_props} == {MARK_KEY: MARK_VALUE}
    assert copy_onnx(tmp_path / "campplus.onnx", tmp_path / "again.onnx") == 0
    assert (tmp_path / "again.onnx").read_bytes() == (tmp_path / "campplus.onnx").read_bytes()
    tokenizer = fixture_set_dir / "model" / "speech_tokenizer_v1.onnx"
    assert copy_onnx(tokenizer, tmp_path / "tok.onnx") == 0
    assert (tmp_path / "tok.onnx").read_bytes() == tokenizer.read_bytes()


def test_convert_writes_the_rewritten_campplus(
    tiny_model_dir: Path, fixture_set_dir: Path, tmp_path: Path
) -> None:
    """`cosyserve convert` of a model dir whose campplus.onnx has CAM++'s pools: the bundle holds the rewritten
    graph, the manifest's size and sha256 are of that file, the source's hash is the original's. If this fails, a
    bundle serves ONNX Runtime 1.29's embeddings, or refuses its own campplus.onnx as damaged."""
    from cosyserve.bundle.convert import convert
    from cosyserve.bundle.loader import open_bundle, sha256_file

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir, copy_function=os.link)
    (model_dir / "campplus.onnx").unlink()
    shutil.copyfile(fixture_set_dir / "model" / "campplus.onnx", model_dir / "campplus.onnx")
    bundle = convert(model_dir, tmp_path / "bundle", progress=False)
    manifest = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    out = bundle / "campplus.onnx"
    assert scan(out) == onnx_compat.OnnxScan(sensitive=0, marked=True)
    assert manifest["extras"]["campplus.onnx"] == {"bytes": out.stat().st_size, "sha256": sha256_file(out)}
    assert manifest["source"]["files"]["campplus.onnx"]["sha256"] == sha256_file(model_dir / "campplus.onnx")
    open_bundle(bundle).check_onnx("campplus.onnx")


def test_without_onnx_the_file_opens_as_it_is_with_one_warning(
    fixture_set_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The lite base install has no `onnx`: a graph still to rewrite opens unchanged and one WARNING (per process)
    says why embeddings may differ; a rewritten graph opens without one. If this fails, a lite server either
    cannot open campplus or floods its log (or stays silent about the difference)."""
    monkeypatch.setattr(onnx_compat, "_onnx", lambda: None)
    monkeypatch.setattr(onnx_compat, "_warned", threading.Event())
    campplus = fixture_set_dir / "model" / "campplus.onnx"
    with caplog.at_level(logging.WARNING, logger=onnx_compat.__name__):
        assert onnx_compat.session_source(campplus) == str(campplus)
        assert onnx_compat.session_source(campplus) == str(campplus)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "pip install onnx" in warnings[0].getMessage()

    caplog.clear()
    monkeypatch.setattr(onnx_compat, "_warned", threading.Event())
    model = onnx.load(str(campplus))
    rewrite_average_pools(model)
    onnx.save(model, str(tmp_path / "campplus.onnx"))
    with caplog.at_level(logging.WARNING, logger=onnx_compat.__name__):
        assert onnx_compat.session_source(tmp_path / "campplus.onnx") == str(tmp_path / "campplus.onnx")
        assert copy_onnx(campplus, tmp_path / "copied.onnx") == 0
    assert (tmp_path / "copied.onnx").read_bytes() == campplus.read_bytes()
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 1 and "copied unchanged" in messages[0], messages


def test_scan_counts_what_the_rewrite_rewrites(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The framing-only scan (no onnx) finds the version-sensitive pools of the main graph and of subgraphs, and
    only those; a pool the rewrite cannot make exact stays as it is, with a warning. If this fails, a model dir is
    opened unrewritten without a word, or a graph is rewritten that computes the same on every version."""
    sensitive = dict(kernel_shape=[4], strides=[4], ceil_mode=1, count_include_pad=1)
    branch = helper.make_graph(
        [_pool("inner", **sensitive)],
        "then",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    nodes = [
        _pool("main", **sensitive),
        _pool("floor", kernel_shape=[4], strides=[4], ceil_mode=0, count_include_pad=1),
        _pool(
            "excl", kernel_shape=[4], strides=[4], ceil_mode=1
        ),  # count_include_pad 0: same on every version
        _pool("custom", domain="com.example", **sensitive),
        _pool("inexact", kernel_shape=[5], strides=[3], ceil_mode=1, count_include_pad=1),
        helper.make_node("If", ["c"], ["z"], then_branch=branch, else_branch=branch),
    ]
    model = _model(nodes)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    assert scan(path) == onnx_compat.OnnxScan(sensitive=4, marked=False)  # main, inexact, inner twice
    with caplog.at_level(logging.WARNING, logger=onnx_compat.__name__):
        assert rewrite_average_pools(model) == 3
    assert "inexact" in caplog.text
    onnx.save(model, str(path))
    assert scan(path) == onnx_compat.OnnxScan(sensitive=1, marked=True)


def test_a_damaged_onnx_file_is_refused_by_name(fixture_set_dir: Path, tmp_path: Path) -> None:
    """A truncated or foreign file: the scan raises ValueError, conversion's copy names the file, and an
    OnnxModel raises BundleError as for any file ONNX Runtime cannot load. If this fails, a damaged campplus.onnx
    crashes with an unrelated error or is copied into a bundle."""
    from cosyserve.core.errors import BundleError
    from cosyserve.frontend.prompt import OnnxModel

    damaged = tmp_path / "campplus.onnx"
    damaged.write_bytes((fixture_set_dir / "model" / "campplus.onnx").read_bytes()[:100_000])
    with pytest.raises(ValueError):
        scan(damaged)
    with pytest.raises(ValueError, match=r"campplus\.onnx is not an ONNX model"):
        copy_onnx(damaged, tmp_path / "out.onnx")
    with pytest.raises(BundleError, match="cannot load ONNX model"):
        OnnxModel(damaged).session()
    (tmp_path / "empty.onnx").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        scan(tmp_path / "empty.onnx")
