"""Export a bundle's torch modules as the lite runtime's ONNX graphs (``cosyserve convert --runtime lite``).

Needs torch and onnx (a machine that converts); the lite runtime that reads the result needs neither. Every model
computation becomes one graph; what is cheap, stateful or random stays in numpy
(:mod:`cosyserve.models.lite_dsp`, :mod:`cosyserve.runtime.lite.lm`, :mod:`cosyserve.runtime.lite.models`:
sampling, the Euler loop, the sine source, STFT and iSTFT, the length regulator's interpolation, prompt assembly
from tables). Each graph keeps its weights in one external data file beside it, which ONNX Runtime maps; each is
checked against the torch module on inputs of two lengths (a length baked in by tracing shows up as a mismatch at
the other) and a bundle whose graph does not match is not written.

A family's graphs are its own (``Family.lite_export``: :mod:`cosyserve.bundle.lite.export_300m` for CosyVoice-300M,
:mod:`cosyserve.bundle.lite.export_qwen` for the Qwen LM of CosyVoice2 and 3); this module drives them through an
:class:`Exporter` (export, check, int8 variant of the step graph, tables, config) and writes the manifest. Every
LM step graph takes its KV cache as inputs and returns only the new positions' keys and values: the runtime keeps
one buffer per cache, binds its prefix as the input and the next positions of the same buffer as the output
(:mod:`cosyserve.runtime.lite.lm`), so no cache is copied between steps.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from cosyserve.bundle.lite import INT8_STEP, LITE_DIR, LITE_FORMAT, LITE_PARTS, LITE_VERSION, TABLES_FILE
from cosyserve.core.errors import ConvertError

logger = logging.getLogger(__name__)

__all__ = ["BatchReference", "Exporter", "StepReference", "export_lite", "require_lite"]

OPSET = 17
CHECK_ATOL = 1e-4  # a graph's largest difference from its module, relative to 1 + |x|


# --- exporting and checking one graph --------------------------------------------------------------------------------------------------


def _export(
    module: nn.Module,
    args: tuple[Tensor, ...],
    path: Path,
    inputs: list[str],
    outputs: list[str],
    dynamic: dict[str, dict[int, str]],
) -> None:
    import tempfile

    import onnx

    # the exporter writes into a folder of its own (a graph past 2 GB would put its tensors beside it), removed after
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".export-") as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
        tmp = Path(d) / "graph.onnx"
        torch.onnx.export(
            module,
            args,
            str(tmp),
            dynamo=False,
            input_names=inputs,
            output_names=outputs,
            dynamic_axes=dynamic,
            opset_version=OPSET,
            do_constant_folding=True,
        )
        model = onnx.load(str(tmp), load_external_data=True)
    _constants_to_initializers(model)
    data = path.name + ".data"
    # every initializer in one data file beside the graph, each at a page-aligned offset (ORT maps it)
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=data,
        size_threshold=0,
        convert_attribute=False,
    )
    (path.parent / data).chmod(0o644)


def _optimize_offline(path: Path) -> None:
    """Replace the graph at ``path`` by ONNX Runtime's own rewrite of it (extended level: constant folding, shape
    arithmetic folded, CPU fusions), weights again in one data file beside it. Why: ORT's Python binding holds the
    GIL while a session opens, and a session's open time grows with the graph's nodes: the flow estimator's 5900
    traced nodes took 1.3-1.8 s to open (every thread of the process stalled meanwhile, a first request
    included), the rewrite has half of them and opens in about 1 s; the Qwen LM step's 2605 nodes at full size
    become 1540 (~0.4 s instead of ~0.8 s to open on a busy 2-core machine, its steps no slower). The rewrite is
    checked against the torch module like the traced graph was."""
    import onnxruntime as ort

    tmp = path.with_name(path.stem + ".opt.onnx")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(tmp)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", tmp.name + ".data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "64")
    so.add_session_config_entry("session.disable_prepacking", "1")
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    import onnx

    model = onnx.load(str(tmp), load_external_data=True)
    data = path.name + ".data"
    (path.parent / data).unlink()
    onnx.save_model(
        model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data,
        size_threshold=1024, convert_attribute=False,  # small shape constants stay inline: ORT reads them there
    )  # fmt: skip
    (path.parent / data).chmod(0o644)
    tmp.unlink()
    (tmp.parent / (tmp.name + ".data")).unlink()


def _constants_to_initializers(model: Any) -> None:
    """Large traced constants (the relative-position tables) become initializers, so they go to the external
    data file with the weights instead of into the graph (ORT reads small attribute tensors only inline)."""
    from onnx import numpy_helper

    keep = []
    for node in model.graph.node:
        if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
            t = node.attribute[0].t
            if numpy_helper.to_array(t).size >= 1024:
                t.name = node.output[0]
                model.graph.initializer.append(t)
                continue
        keep.append(node)
    del model.graph.node[:]
    model.graph.node.extend(keep)


def _session(path: Path) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _check(
    name: str,
    path: Path,
    module: Callable[..., Any],
    cases: list[tuple[Tensor, ...]],
    inputs: list[str],
    atol: float,
) -> float:
    """Run the graph and the module on each case; refuse (ConvertError) a graph whose outputs differ. An input
    the graph does not read is not fed (the exporter drops it: CosyVoice2's estimator has no positions)."""
    sess = _session(path)
    read = {i.name for i in sess.get_inputs()}
    worst = 0.0
    for case in cases:
        with torch.inference_mode():
            want = module(*case)
        want = want if isinstance(want, tuple) else (want,)
        got = sess.run(None, {n: c.numpy() for n, c in zip(inputs, case, strict=True) if n in read})
        for w, g in zip(want, got, strict=True):
            w = w.float().numpy()
            if w.shape != g.shape:
                raise ConvertError(f"lite export: graph {name} gives shape {g.shape}, the module {w.shape}")
            finite = np.isfinite(w)
            if not np.array_equal(finite, np.isfinite(g)):
                raise ConvertError(f"lite export: graph {name} differs from the module in where it is finite")
            err = float(np.max(np.abs(w[finite] - g[finite]) / (1.0 + np.abs(w[finite])))) if w.size else 0.0
            worst = max(worst, err)
    if worst > atol:
        raise ConvertError(
            f"lite export: graph {name} differs from the torch module by {worst:.2e} (relative to 1 + |x|; "
            f"allowed {atol:.0e}); the bundle is not written"
        )
    return worst


def _quantize_step(out: Path, cases: list[tuple[Tensor, ...]], names: list[str]) -> dict[str, float]:
    """``llm_step.int8.onnx``: ORT's dynamic quantization (int8 weights per tensor, activations quantized per
    call) of the step graph's matrix products; returns how far its log-probabilities are from the float graph's
    on ``cases`` (max |difference|, mean KL divergence in nats, top-1 agreement)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    src, dst = out / "llm_step.onnx", out / INT8_STEP
    tmp = out / "int8.tmp.onnx"
    model = onnx.load(str(src), load_external_data=True)
    onnx.save_model(
        model, str(tmp)
    )  # inline weights: the quantizer reads them from the graph (< 2 GB at 300M)
    del model
    root = logging.getLogger()
    level = root.level
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        root.setLevel(logging.ERROR)  # the quantizer's "consider pre-processing" goes to the root logger
        try:
            quantize_dynamic(
                str(tmp), str(tmp.with_suffix(".q.onnx")), weight_type=QuantType.QInt8,
                op_types_to_quantize=["MatMul"], extra_options={"MatMulConstBOnly": True},
            )  # fmt: skip
        finally:
            root.setLevel(level)
    tmp.unlink()
    quantized = onnx.load(str(tmp.with_suffix(".q.onnx")))
    tmp.with_suffix(".q.onnx").unlink()
    _constants_to_initializers(quantized)
    onnx.save_model(
        quantized, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
        location=dst.name + ".data", size_threshold=0,
    )  # fmt: skip
    (out / (dst.name + ".data")).chmod(0o644)
    # ORT's own rewrite (its int8 matrix products fused): 3497 -> fewer nodes at full size, 0.19 s less to open
    _optimize_offline(dst)
    base, q = _session(src), _session(dst)
    worst, kls, agree = 0.0, [], []
    for case in cases:
        feeds = {n: c.numpy() for n, c in zip(names, case, strict=True)}
        a, b = base.run(["logp"], feeds)[0][0], q.run(["logp"], feeds)[0][0]
        worst = max(worst, float(np.abs(a - b).max()))
        kls.append(float(np.sum(np.exp(a) * (a - b))))
        agree.append(float(np.argmax(a) == np.argmax(b)))
    return {"max_abs_logp": worst, "mean_kl": float(np.mean(kls)), "top1_agree": float(np.mean(agree))}


def _share_data(out: Path, name: str, base: str) -> int:
    """Point every initializer of graph ``name`` that equals one of graph ``base``'s (dtype, shape and bytes) at
    ``base``'s copy in its data file, and keep only the others in ``name``'s own data file: two graphs over the same
    weights (the LM's step and batch graphs) store and map them once. Returns the bytes shared."""
    import hashlib

    import onnx

    def key(t: Any, data: bytes) -> tuple[int, tuple[int, ...], bytes]:
        return t.data_type, tuple(t.dims), hashlib.sha256(data).digest()

    index: dict[tuple[int, tuple[int, ...], bytes], list[tuple[str, str]]] = {}
    for t in onnx.load(str(out / f"{base}.onnx"), load_external_data=False).graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        with open(out / info["location"], "rb") as f:
            f.seek(int(info.get("offset", 0)))
            index[key(t, f.read(int(info["length"])))] = [(e.key, e.value) for e in t.external_data]
    path = out / f"{name}.onnx"
    model = onnx.load(str(path), load_external_data=True)
    shared = 0
    for t in model.graph.initializer:
        where = index.get(key(t, t.raw_data)) if len(t.raw_data) >= 1024 else None
        if where is None:
            continue
        shared += len(t.raw_data)
        t.ClearField("raw_data")
        t.data_location = onnx.TensorProto.EXTERNAL
        del t.external_data[:]
        for k, v in where:
            t.external_data.add(key=k, value=v)
    data = out / (path.name + ".data")
    data.unlink()
    onnx.save_model(
        model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name,
        size_threshold=1024, convert_attribute=False,
    )  # fmt: skip
    if data.exists():
        data.chmod(0o644)
    return shared


class StepReference:
    """An LM step graph's outputs computed by the model's own code (a :class:`~cosyserve.models.llm.SpeechLM`):
    its KV caches set up for one row holding the case's past, then
    :meth:`~cosyserve.models.llm.SpeechLM.extend` of x from position P, the new positions' keys and values read
    back. What is the family's is how its graph lays the caches out.

    Args:
        lm: the torch LM.
        to_model: the graph's inputs after x (one row's) -> the model's caches' past, each (heads, P, head_dim),
            in :meth:`~cosyserve.models.llm.SpeechLM.save_prefix` order (per layer, keys then values); inputs the
            model computes itself (the 300M LM's projected distances) are not read.
        to_graph: the model's new positions, each (heads, T, head_dim) in that order -> the graph's cache outputs.
    """

    def __init__(
        self,
        lm: nn.Module,
        to_model: Callable[[tuple[Tensor, ...]], list[Tensor]],
        to_graph: Callable[[list[Tensor]], list[Tensor]],
    ) -> None:
        self.lm, self.to_model, self.to_graph = lm, to_model, to_graph

    def __call__(self, x: Tensor, *inputs: Tensor) -> tuple[Tensor, ...]:
        lm = self.lm
        past = self.to_model(inputs)
        p, t = past[0].shape[1], x.shape[1]
        lm.release()
        lm.reserve(1, p + t)
        try:
            lm.load_prefix(past, 0)
            logp = lm.extend(x, 0, p)
            new = [c[:, p:] for c in lm.save_prefix(0, p + t)]
            return (logp, *self.to_graph(new))
        finally:
            lm.release()


class BatchReference:
    """An LM batch graph's outputs (one token for each of B rows, row b's at position ``pos[b]``) computed by the
    model's own code: each row alone (a :class:`StepReference` of its token after the first ``pos[b]`` positions of
    its past, ``row(inputs, b, pos[b])`` its inputs after x), its outputs concatenated along their first axis."""

    def __init__(
        self, step: StepReference, row: Callable[[tuple[Tensor, ...], int, int], list[Tensor]]
    ) -> None:
        self.step, self.row = step, row

    def __call__(self, x: Tensor, pos: Tensor, *inputs: Tensor) -> tuple[Tensor, ...]:
        rows = [self.step(x[b : b + 1], *self.row(inputs, b, p)) for b, p in enumerate(pos.tolist())]
        return tuple(torch.cat([r[j] for r in rows]) for j in range(len(rows[0])))


class Exporter:
    """What a family's lite export writes into (``lite/``): its graphs, each exported and checked, the int8 step
    graph's distance from the float one, its numpy tables and the config numbers the runtime reads.

    Args:
        out: the ``lite/`` folder.
        step: reports progress.
    """

    def __init__(self, out: Path, step: Callable[[str], None]) -> None:
        self.out = out
        self.step = step
        self.gen = torch.Generator().manual_seed(1234)  # the check inputs
        self.graphs: dict[str, str] = {}  # graph name -> file
        self.errors: dict[str, float] = {}  # graph name -> its check's largest difference
        self.int8: dict[str, float] | None = None
        self.tables: dict[str, np.ndarray] = {}
        self.config: dict[str, Any] = {}
        self._checks: dict[str, tuple[Callable[..., Any], list[tuple[Tensor, ...]], list[str]]] = {}

    def randn(self, *shape: int) -> Tensor:
        return torch.randn(*shape, generator=self.gen)

    def ints(self, hi: int, n: int) -> Tensor:
        return torch.randint(0, hi, (1, n), generator=self.gen, dtype=torch.int64)

    def graph(
        self,
        name: str,
        module: nn.Module,
        example: tuple[Tensor, ...],
        inputs: list[str],
        outputs: list[str],
        dynamic: dict[str, dict[int, str]],
        cases: list[tuple[Tensor, ...]],
        *,
        optimize: bool = False,
        reference: Callable[..., Any] | None = None,
        shares: str | None = None,
    ) -> None:
        """Export ``module`` as graph ``name`` (traced on ``example``; ``optimize``: rewritten by ONNX Runtime,
        :func:`_optimize_offline`) and check it on ``cases`` against ``reference`` (default: ``module`` itself; a
        graph wrapper that re-states a computation is checked against the model's own code). ``shares``: a graph
        over the same weights (an LM's batch step over its step graph's), whose data file it reads them from
        (:meth:`share`)."""
        path = self.out / f"{name}.onnx"
        _export(module, example, path, inputs, outputs, dynamic)
        if optimize:
            _optimize_offline(path)
        self._checks[name] = (reference or module, cases, inputs)
        self.errors[name] = _check(name, path, reference or module, cases, inputs, CHECK_ATOL)
        self.graphs[name] = path.name
        if shares is not None:
            self.step(f"lite: {name}, the weights it shares read from {shares}'s")
            shared = self.share(name, shares)
            logger.info("lite: graph %s reads %.1f MB of graph %s's weights", name, shared / 1e6, shares)

    def optimize(self, name: str) -> None:
        """Rewrite graph ``name`` by ONNX Runtime (:func:`_optimize_offline`) after what needed the traced graph
        (the int8 quantizer reads it), and check the rewrite as the traced graph was checked."""
        path = self.out / self.graphs[name]
        _optimize_offline(path)
        reference, cases, inputs = self._checks[name]
        self.errors[name] = max(self.errors[name], _check(name, path, reference, cases, inputs, CHECK_ATOL))

    def quantize_step(self, cases: list[tuple[Tensor, ...]], names: list[str]) -> None:
        """Write ``llm_step.int8.onnx`` (see :func:`_quantize_step`) and record its distance from the float one."""
        self.int8 = _quantize_step(self.out, cases, names)

    def share(self, name: str, base: str) -> int:
        """Graph ``name`` reads the weights it shares with graph ``base`` from ``base``'s data file
        (:func:`_share_data`), and is checked again as it will be read; the bytes shared."""
        shared = _share_data(self.out, name, base)
        reference, cases, inputs = self._checks[name]  # the graph as it will be read, checked again
        path = self.out / self.graphs[name]
        self.errors[name] = max(self.errors[name], _check(name, path, reference, cases, inputs, CHECK_ATOL))
        return shared


def require_lite(family: Any) -> None:
    """Refuse (ConvertError) ``convert --runtime lite`` of a family whose lite graphs do not cover every part."""
    if not set(LITE_PARTS) <= set(family.lite_parts):
        raise ConvertError(
            f"--runtime lite exports every part of a model; {family.title}'s lite graphs cover the "
            f"{', '.join(family.lite_parts) or 'nothing'} so far (use the torch runtime)"
        )


@torch.no_grad()
def export_lite(
    bundle_dir: Path,
    step: Callable[[str], None] = lambda msg: None,
    *,
    model_dir: Path | None = None,
    int8: bool = False,
    parts: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Write ``bundle_dir/lite/`` from the bundle's weights and check every graph; returns its manifest.

    Args:
        bundle_dir: the bundle (its float components are exported).
        step: reports progress.
        model_dir: the official model dir the bundle came from: its float LLM is exported when the bundle stores
            the LLM as int8 (torch's int8 is not ONNX's).
        int8: also write ``llm_step.int8.onnx``, the step graph with ONNX Runtime's dynamic int8 quantization of
            its matrix products (what ``llm_quantize=int8`` serves); its distance from the float graph is recorded.
        parts: the parts to export (of ``llm``, ``flow``, ``hift``). None: all of them, which a bundle needs to
            serve on the lite runtime (``convert --runtime lite``); a family whose export does not cover every
            part yet is refused then. A subset (the LM of CosyVoice2/3: ``("llm",)``) writes a bundle the lite
            runtime refuses to serve but whose LM the tools run (conformance, tests, benchmarks).

    Raises:
        ConvertError: a family or part the lite export does not cover, or a graph that differs from its module.
    """
    from safetensors.numpy import save_file

    from cosyserve.bundle.loader import LoadOptions, open_bundle, sha256_file
    from cosyserve.families.base import import_string

    bundle = open_bundle(bundle_dir)
    cfg = bundle.config
    family = cfg.family_spec
    if parts is None:
        require_lite(family)
        parts = LITE_PARTS
    missing = [p for p in parts if p not in family.lite_parts]
    if missing or not parts:
        raise ConvertError(
            f"the lite export of {family.title} covers its {', '.join(family.lite_parts) or 'nothing'}, not "
            f"{', '.join(missing) or 'an empty list of parts'}"
        )
    loaded = bundle.load(LoadOptions(strategy="lazy", verify="none"))
    modules = dict(loaded.modules)
    if bundle.quantized("llm") != "none":
        if model_dir is None:
            raise ConvertError("--runtime lite exports float weights; this bundle stores the LLM as int8")
        from cosyserve.bundle.official import load_component

        modules["llm"] = load_component(model_dir, "llm", cfg.llm, cfg.family)
    modules = {k: v.float().eval() for k, v in modules.items()}
    out = bundle_dir / LITE_DIR
    out.mkdir(exist_ok=True)
    ex = Exporter(out, step)
    import_string(family.lite_export)(ex, modules, tuple(parts), int8)
    step("lite: tables")
    save_file(ex.tables, str(out / TABLES_FILE), metadata={"format": LITE_FORMAT})
    (out / TABLES_FILE).chmod(0o644)
    files = {}
    for f in sorted(out.iterdir()):
        files[f.name] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
    manifest = {
        "format": LITE_FORMAT,
        "version": LITE_VERSION,
        "opset": OPSET,
        "parts": list(parts),
        "config": {"family": cfg.family, "sample_rate": cfg.sample_rate, **ex.config},
        "graphs": ex.graphs,
        "files": files,
        "checked": {k: float(f"{v:.3g}") for k, v in ex.errors.items()},
        **({"int8": ex.int8} if ex.int8 is not None else {}),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    logger.info("lite graphs checked against the modules: %s", ex.errors)
    return manifest
