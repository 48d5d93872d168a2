"""``cosyserve conformance DIR``: replay the reference's recorded cases and compare within their tolerances.

A fixture set is ``cases.json`` plus ``tensors.safetensors`` (format in ``shared/fixtures/README.md``). Each
case's kind names a function of the set's family (``Family.conformance_kinds``: the family's own ``conformance``
module, or :mod:`.kinds_features` for the audio features every family shares; :mod:`.kinds_lite` on the lite
runtime); the function computes the outputs from the inputs, and this module compares them: floats elementwise
``|got - exp| <= atol + rtol*|exp|``, integer tensors, integers and strings exactly. On the lite runtime, a kind the
lite runtime does not compute for the family yet (``Family.lite_kinds``) is reported as not served (``SKIP``),
neither passed nor failed.
"""

from __future__ import annotations

import importlib
import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CaseResult", "known_kinds", "run_conformance"]


@dataclass
class CaseResult:
    name: str
    kind: str
    passed: bool
    max_abs_err: float
    atol: float
    rtol: float
    seconds: float
    message: str = ""
    served: bool = True  # False: the runtime does not compute this kind for the family yet (not run)

    def line(self) -> str:
        err = "-" if math.isnan(self.max_abs_err) else f"{self.max_abs_err:.3g}"
        status = "SKIP" if not self.served else "PASS" if self.passed else "FAIL"
        msg = f"  {self.message}" if self.message else ""
        return (
            f"{self.name:<28} {self.kind:<22} max_abs_err={err:<10} tol=atol {self.atol:g} + rtol {self.rtol:g}"
            f"  {status} ({self.seconds * 1e3:.0f} ms){msg}"
        )


def known_kinds() -> set[str]:
    """Every kind some family's sets hold (each family declares its own: ``Family.conformance_kinds``)."""
    from cosyserve.families import FAMILIES, family_named

    return set().union(*(family_named(name).conformance_kinds for name in FAMILIES))


NOT_SERVED = "not yet served by the lite runtime"


def _kind_function(
    kind: str, family: Any, runtime: str = "torch"
) -> Callable[..., dict[str, Any]] | str | None:
    # a kind's function: the family's module for it (resolved lazily, so a run of one kind imports only what it
    # needs); on the lite runtime, the lite runtime's own where it has one, NOT_SERVED where the lite runtime does
    # not compute the kind for the family yet (its other kinds run torch-free code both runtimes share)
    if runtime == "lite":
        from cosyserve.families.base import import_string

        if kind in family.conformance_kinds and kind not in family.lite_kinds:
            return NOT_SERVED
        lite_kinds = import_string(family.lite_kinds_table)
        if kind in lite_kinds:
            return lite_kinds[kind]  # type: ignore[no-any-return]
    module_name = family.conformance_kinds.get(kind)
    if module_name is None:
        return None
    module = importlib.import_module(module_name)
    return module.KINDS.get(kind)  # type: ignore[no-any-return]


def _resolve_inputs(inputs: dict[str, Any], tensors: dict[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in inputs.items():
        if isinstance(value, dict) and set(value) == {"tensor"}:
            if value["tensor"] not in tensors:
                raise KeyError(
                    f"{where}: input {key!r} names tensor {value['tensor']!r}, not in tensors.safetensors"
                )
            out[key] = tensors[value["tensor"]]
        else:
            out[key] = value
    return out


def _compare(name: str, got: Any, exp: Any, atol: float, rtol: float) -> tuple[bool, float, str]:
    """Returns (ok, max_abs_err for float tensors or nan, message)."""
    import torch

    if isinstance(exp, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            try:
                got = torch.as_tensor(got)
            except (TypeError, ValueError):
                return False, math.nan, f"{name}: expected a tensor, got {type(got).__name__}"
        got = got.detach().cpu()
        if tuple(got.shape) != tuple(exp.shape):
            return False, math.nan, f"{name}: shape {tuple(got.shape)} != expected {tuple(exp.shape)}"
        if not exp.is_floating_point():
            if got.is_floating_point():
                return False, math.nan, f"{name}: expected integer tensor, got {got.dtype}"
            bad = int((got.long() != exp.long()).sum())
            return (
                bad == 0,
                0.0 if bad == 0 else math.nan,
                f"{name}: {bad} of {exp.numel()} ids differ" if bad else "",
            )
        if exp.numel() == 0:
            return True, 0.0, ""
        g64, e64 = got.double(), exp.double()
        if not torch.isfinite(g64).all():
            return False, math.inf, f"{name}: non-finite values"
        diff = (g64 - e64).abs()
        ok = bool((diff <= atol + rtol * e64.abs()).all())
        err = float(diff.max())
        return ok, err, "" if ok else f"{name}: max abs err {err:.3g} exceeds tolerance"
    if got != exp:
        return False, math.nan, f"{name}: {got!r} != expected {exp!r}"
    return True, math.nan, ""


def run_case(case: dict[str, Any], tensors: dict[str, Any], ctx: Any) -> CaseResult:
    name, kind = case.get("name", "?"), case.get("kind", "?")
    atol, rtol = float(case.get("atol", 0.0)), float(case.get("rtol", 0.0))
    t0 = time.perf_counter()
    try:
        fn = _kind_function(kind, ctx.family, ctx.runtime)
    except ImportError as e:
        return CaseResult(name, kind, False, math.nan, atol, rtol, 0.0, f"kind {kind!r} not available: {e}")
    if fn is None:
        return CaseResult(name, kind, False, math.nan, atol, rtol, 0.0, f"unknown kind {kind!r}")
    if isinstance(fn, str):
        return CaseResult(name, kind, False, math.nan, atol, rtol, 0.0, fn, served=False)
    try:
        inputs = _resolve_inputs(case.get("inputs", {}), tensors, name)
        expected = _resolve_inputs(case.get("outputs", {}), tensors, name)
        got = fn(ctx, inputs)
    except Exception as e:  # noqa: BLE001 - a crashing case is a failing case, reported with its cause
        return CaseResult(name, kind, False, math.nan, atol, rtol, time.perf_counter() - t0, f"error: {e!r}")
    seconds = time.perf_counter() - t0
    ok_all, worst, messages = True, math.nan, []
    for out_name, exp in expected.items():
        if out_name not in got:
            ok_all = False
            messages.append(f"missing output {out_name!r}")
            continue
        ok, err, msg = _compare(out_name, got[out_name], exp, atol, rtol)
        ok_all &= ok
        if not math.isnan(err):
            worst = err if math.isnan(worst) else max(worst, err)
        if msg:
            messages.append(msg)
    return CaseResult(name, kind, ok_all, worst, atol, rtol, seconds, "; ".join(messages))


def run_conformance(
    set_dir: str | Path,
    kinds: Iterable[str] | None = None,
    report: Callable[[str], None] | None = print,
    via_bundle: bool = False,
    runtime: str = "torch",
    llm_gemm: str = "auto",
) -> list[CaseResult]:
    """Run every case of a fixture set (optionally only some kinds) and report one line per case.

    Args:
        set_dir: folder holding ``cases.json`` and ``tensors.safetensors``.
        kinds: restrict the run to these kinds (an unknown name is an error).
        report: called with each case line and the summary line; ``None`` to stay quiet.
        via_bundle: convert the set's model dir into a temporary bundle and take the modules from it (proves
            that conversion and mmap loading change nothing).
        runtime: ``torch`` (our torch modules) or ``lite`` (the set's model converted with ``--runtime lite``, or
            for a family whose lite export covers some parts only, those parts: the kinds the lite runtime serves
            run on its ONNX graphs and numpy code, the others are reported as not served).
        llm_gemm: the torch LM's decode products, as the setting of that name serves them
            (:mod:`cosyserve.models.gemm`).
    Returns:
        The per-case results; the run passed when every case that was served (``served``) ``passed``.
    """
    from safetensors.torch import load_file

    from cosyserve.tools.conformance.context import CaseContext

    set_dir = Path(set_dir)
    cases_path = set_dir / "cases.json"
    try:
        doc = json.loads(cases_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read fixture cases {cases_path}: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != 1 or not isinstance(doc.get("cases"), list):
        raise ValueError(f"{cases_path}: expected {{'format': 1, 'cases': [...]}}")
    wanted = set(kinds) if kinds is not None else None
    if wanted is not None:
        known = known_kinds()
        unknown = sorted(wanted - known)
        if unknown:
            raise ValueError(f"unknown kind(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    tensors_path = set_dir / "tensors.safetensors"
    tensors = load_file(str(tensors_path)) if tensors_path.is_file() else {}
    if runtime not in ("torch", "lite"):
        raise ValueError(f"runtime must be torch or lite, got {runtime!r}")
    ctx = CaseContext(set_dir, set_dir / doc.get("model", "model"))
    ctx.runtime = runtime
    ctx.llm_gemm = llm_gemm
    if runtime == "lite" and not ctx.family.lite_parts:
        raise ValueError(f"{set_dir}: the lite runtime serves no part of {ctx.family.title}")
    tmp = None
    if via_bundle or runtime == "lite":
        import tempfile

        from cosyserve.bundle.convert import convert

        tmp = tempfile.TemporaryDirectory(prefix="cosyserve-conformance-")
        whole = runtime == "torch" or ctx.family.lite
        ctx.bundle_dir = convert(
            ctx.model_dir, Path(tmp.name) / "bundle", progress=False, runtime=runtime if whole else "torch"
        )
        if not whole:  # the parts the lite export covers so far (CosyVoice2/3: the LM)
            from cosyserve.bundle.lite.export import export_lite

            export_lite(ctx.bundle_dir, model_dir=ctx.model_dir, parts=ctx.family.lite_parts)
    results = []
    for case in doc["cases"]:
        if wanted is not None and case.get("kind") not in wanted:
            continue
        result = run_case(case, tensors, ctx)
        results.append(result)
        if report:
            report(result.line())
    if tmp is not None:
        tmp.cleanup()
    if report:
        passed = sum(r.passed for r in results)
        unserved = sum(not r.served for r in results)
        more = f", {unserved} {NOT_SERVED}" if unserved else ""
        report(f"conformance {set_dir}: {passed} passed, {len(results) - passed - unserved} failed{more}")
    return results
