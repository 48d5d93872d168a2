"""``cosyserve convert MODEL_DIR BUNDLE_DIR``: an official model dir -> the fast bundle, once.

The bundle is one safetensors file per component (``llm``, ``flow``, ``hift``, ``speakers``), and
``manifest.json`` with the format version, the parsed config, each component's dtype (and quantization), each
file's size and each tensor's dtype, shape and sha256, and the source files' sizes and sha256. Each component has
its own storage dtype (``--dtype llm=float32,flow=bfloat16``); the LLM's linears may be stored as int8 with
per-channel scales (``--quantize llm=int8``, see :mod:`cosyserve.models.precision`): such a bundle is format
version 2, which older readers refuse with "convert again" instead of failing on unknown tensors. Weight-norm is folded at conversion (the vocoder stores
plain weights). The official ONNX files, when present, are copied unchanged. Everything is written into a
temporary sibling directory that is moved into place in one rename only when complete (an existing bundle is
swapped out in the same rename, see :mod:`cosyserve.system.staging`), so an interrupted conversion never leaves a
directory that looks like a bundle, and a crash leaves the old bundle or the new one. The output may only be a new
path or an existing bundle (with ``force``): never the model dir, a folder around it or inside it, or any other
existing file or directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cosyserve.bundle.loader import BUNDLE_FORMAT, BUNDLE_VERSION, COMPONENTS, sha256_file
from cosyserve.core.errors import ConvertError, ModelDirError
from cosyserve.frontend.onnx_compat import copy_onnx

__all__ = [
    "ConvertError",
    "convert",
    "parse_component_dtypes",
    "parse_quantize",
]

logger = logging.getLogger(__name__)

DTYPE_CHOICES = ("float32", "bfloat16", "float16")
QUANTIZE_CHOICES = ("none", "int8")
QUANTIZABLE = ("llm",)  # components whose linears may be int8


def _component_spec(
    spec: str | Mapping[str, str], where: str, choices: tuple[str, ...], components: tuple[str, ...]
) -> dict[str, str]:
    # "VALUE" (every component) or "NAME=VALUE,NAME=VALUE" (the others keep the first choice)
    if isinstance(spec, str):
        text = spec.strip()
        if "=" not in text:
            if text not in choices:
                raise ValueError(
                    f"{where} {spec!r}: expected one of {', '.join(choices)} or COMPONENT=VALUE pairs "
                    f"({','.join(f'{c}={choices[1]}' for c in components)})"
                )
            return dict.fromkeys(components, text) if text != "none" else {}
        pairs: dict[str, str] = {}
        for item in text.split(","):
            name, sep, value = (part.strip() for part in item.partition("="))
            if not sep:
                raise ValueError(f"{where} {spec!r}: {item.strip()!r} is not COMPONENT=VALUE")
            if name in pairs:
                raise ValueError(f"{where} {spec!r}: {name!r} given twice")
            pairs[name] = value
    else:
        pairs = dict(spec)
    for name, value in pairs.items():
        if name not in components:
            raise ValueError(
                f"{where} {spec!r}: unknown component {name!r}; expected {', '.join(components)}"
            )
        if value not in choices:
            raise ValueError(f"{where} {spec!r}: {name}={value!r}; expected one of {', '.join(choices)}")
    return pairs


def parse_component_dtypes(spec: str | Mapping[str, str], where: str = "--dtype") -> dict[str, str]:
    """Storage dtype per component from ``float32`` (all) or ``llm=float32,flow=bfloat16,hift=bfloat16``.

    Args:
        spec: the value as given, or a mapping component -> dtype.
        where: the flag or argument that gave it (starts the error message).
    Returns:
        {llm, flow, hift} -> dtype; components not named are float32.
    Raises:
        ValueError: an unknown component or dtype, a malformed pair, a component given twice.
    """
    pairs = _component_spec(spec, where, DTYPE_CHOICES, COMPONENTS)
    return {name: pairs.get(name, "float32") for name in COMPONENTS}


def parse_quantize(spec: str | Mapping[str, str], where: str = "--quantize") -> dict[str, str]:
    """Quantization per component from ``none`` or ``llm=int8``.

    Args:
        spec: the value as given, or a mapping component -> method.
        where: the flag or argument that gave it (starts the error message).
    Returns:
        component -> method for the quantized components only (``{}`` for none).
    Raises:
        ValueError: an unknown component (only the LLM is quantizable) or method.
    """
    pairs = _component_spec(spec, where, QUANTIZE_CHOICES, QUANTIZABLE)
    return {name: method for name, method in pairs.items() if method != "none"}


def _tensor_sha256(t: Any) -> str:
    import torch

    flat = t.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat
    return hashlib.sha256(memoryview(raw.numpy())).hexdigest()


def _progress(label: str) -> Callable[[str], None]:
    # one line per step on a terminal, silent otherwise (a converter run from a server's log stays readable)
    tty = sys.stderr.isatty()
    t0 = time.perf_counter()

    def step(msg: str) -> None:
        if tty:
            print(
                f"\r[{time.perf_counter() - t0:6.1f}s] {label}: {msg:<60}",
                end="",
                file=sys.stderr,
                flush=True,
            )
        logger.info("%s: %s", label, msg)

    return step


def _is_bundle_dir(path: Path) -> bool:
    # any version of our format: an older bundle is still ours to replace
    try:
        manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return path.is_dir() and isinstance(manifest, dict) and manifest.get("format") == BUNDLE_FORMAT


def _check_out(model_dir: Path, out: Path, force: bool) -> None:
    """Refuse an output that would overwrite or nest with the model dir, or replace what is not a bundle."""
    src, dst = model_dir.resolve(), out.resolve()
    keep = "nothing was changed; choose a new path for the bundle"
    if dst == src:
        raise ConvertError(f"output {out} is the model directory {model_dir}: {keep}")
    if dst in src.parents:
        raise ConvertError(f"output {out} contains the model directory {model_dir}: {keep}")
    if src in dst.parents:
        raise ConvertError(f"output {out} lies inside the model directory {model_dir}: {keep}")
    if not os.path.lexists(out):
        return
    empty_dir = out.is_dir() and not out.is_symlink() and not any(out.iterdir())
    if not (_is_bundle_dir(out) or empty_dir):
        what = "a directory" if out.is_dir() else "a file"
        raise ConvertError(
            f"{out} exists and is {what}, not a cosyserve bundle (no manifest.json of format "
            f"{BUNDLE_FORMAT!r}): --force replaces only a bundle; {keep}, or remove {out} yourself"
        )
    if not force:
        raise FileExistsError(f"{out} already exists (use --force to replace it)")


# int8 weights are laid out at file offsets that are multiples of this (the int8 kernel's aligned reads, see
# cosyserve.models.precision.INT8_ALIGN; the mapping itself starts on a page)
INT8_FILE_ALIGN = 64
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int8": "I8", "uint8": "U8",
              "int32": "I32", "int64": "I64", "bool": "BOOL", "float64": "F64"}  # fmt: skip


def _save(tensors: dict[str, Any], path: Path, metadata: dict[str, str]) -> None:
    from cosyserve.system.staging import file_mode

    if any(str(v.dtype) == "torch.int8" for v in tensors.values()):
        _save_aligned(tensors, path, metadata)
    else:
        from safetensors.torch import save_file

        save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, file_mode())  # save_file makes the file private (0600) whatever the umask


def _save_aligned(tensors: dict[str, Any], path: Path, metadata: dict[str, str]) -> None:
    """A safetensors file whose int8 tensors start at offsets that are multiples of :data:`INT8_FILE_ALIGN`.

    safetensors' own writer orders tensors by dtype and name and aligns each only to its element size, so an int8
    weight lands wherever the float tensors before it end (24 mod 64 was seen), and the torch runtime must copy
    it. Here the header is padded (with spaces, as safetensors pads) so the data starts aligned, the int8 tensors
    whose sizes are multiples of the alignment come first, the rest after: still a valid safetensors file (the
    tensors cover the data without holes; the order is free)."""
    import struct

    import torch

    def nbytes(t: Any) -> int:
        return int(t.numel() * t.element_size())

    def first(name: str) -> bool:
        t = tensors[name]
        return t.dtype == torch.int8 and nbytes(t) % INT8_FILE_ALIGN == 0

    order = sorted(tensors, key=lambda k: (not first(k), k))
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    pos = 0
    for name in order:
        t = tensors[name]
        header[name] = {
            "dtype": _ST_DTYPES[str(t.dtype).removeprefix("torch.")],
            "shape": list(t.shape),
            "data_offsets": [pos, pos + nbytes(t)],
        }
        pos += nbytes(t)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * ((-(8 + len(raw))) % INT8_FILE_ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in order:
            flat = tensors[name].detach().contiguous().reshape(-1)
            if flat.numel():
                f.write(memoryview(flat.view(torch.uint8).numpy()))


def _component_tensors(
    model_dir: Path, name: str, cfg: Any, quantize: str | None, family: str
) -> dict[str, Any]:
    """The component's state dict as we store it: strict-loaded into our module (so keys and shapes are
    checked against the yaml), weight norm folded by the vocoder's load hook, quantized if asked, back out."""
    from cosyserve.bundle.official import load_component

    module = load_component(model_dir, name, cfg, family)
    if quantize == "int8":
        from cosyserve.models.precision import quantize_llm

        quantize_llm(module)
    return {k: v.detach() for k, v in module.state_dict().items()}


def _tensors_entry(tensors: Mapping[str, Any]) -> dict[str, Any]:
    # each tensor's manifest line: its dtype, shape and checksum
    return {
        k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape), "sha256": _tensor_sha256(v)}
        for k, v in tensors.items()
    }


def _write_component(
    model_dir: Path,
    tmp: Path,
    name: str,
    cfg: Any,
    dtypes: Mapping[str, str],
    quantized: Mapping[str, str],
    step: Callable[[str], None],
) -> dict[str, Any]:
    """Component ``name`` read, checked, cast and written to ``tmp``; returns its manifest entry."""
    import torch

    from cosyserve.bundle.official import module_class
    from cosyserve.models.precision import keeps_float32

    step(f"{name}: reading and checking")
    tensors = _component_tensors(model_dir, name, getattr(cfg, name), quantized.get(name), cfg.family)
    torch_dtype, cls = getattr(torch, dtypes[name]), module_class(name, cfg.family)
    tensors = {
        k: (v.to(torch_dtype) if v.is_floating_point() and not keeps_float32(cls, k) else v).contiguous()
        for k, v in tensors.items()
    }
    step(f"{name}: hashing {sum(v.numel() for v in tensors.values()) / 1e6:.1f}M values")
    entry = _tensors_entry(tensors)
    step(f"{name}: writing")
    fname = f"{name}.safetensors"
    _save(tensors, tmp / fname, {"format": BUNDLE_FORMAT, "component": name})
    return {
        "dtype": dtypes[name],
        **({"quantize": quantized[name]} if name in quantized else {}),
        "file": fname,
        "bytes": (tmp / fname).stat().st_size,
        "tensors": entry,
    }


def _write_speakers(model_dir: Path, tmp: Path, cfg: Any) -> dict[str, Any]:
    """The model's pre-defined speakers written to ``tmp``; returns their manifest entry."""
    from cosyserve.bundle.official import load_speakers

    speakers = load_speakers(model_dir, getattr(cfg.llm, "spk_embed_dim", 192))
    names = sorted(speakers)
    spk_tensors = {
        f"{i}.{field}": t.contiguous() for i, s in enumerate(names) for field, t in speakers[s].items()
    }
    _save(spk_tensors, tmp / "speakers.safetensors", {"format": BUNDLE_FORMAT})
    return {
        "file": "speakers.safetensors",
        "bytes": (tmp / "speakers.safetensors").stat().st_size,
        "names": names,
        "tensors": _tensors_entry(spk_tensors),
    }


def _copy_extras(model_dir: Path, tmp: Path, family: Any, step: Callable[[str], None]) -> dict[str, Any]:
    """The family's tokenizer and frontend files checked and copied to ``tmp``; returns their manifest entries."""
    extras: dict[str, Any] = {}
    step("checking the tokenizer and frontend files")
    family.check_model_dir(model_dir)
    for fname in family.bundle_files:
        src = model_dir / fname
        if src.is_file():
            step(f"copying {fname}")
            (tmp / fname).parent.mkdir(exist_ok=True)
            if src.suffix == ".onnx":
                # campplus's AveragePool(ceil_mode) nodes rewritten to the reference's (ONNX Runtime 1.18's)
                # arithmetic, which later versions change; any other graph copied as it is
                try:
                    if count := copy_onnx(src, tmp / fname):
                        step(f"{fname}: {count} AveragePool nodes set to ONNX Runtime 1.18's arithmetic")
                except ValueError as e:
                    raise ModelDirError(f"{e}: replace it with the model's original file") from e
            else:
                shutil.copyfile(src, tmp / fname)
            extras[fname] = {
                "bytes": (tmp / fname).stat().st_size,
                "sha256": sha256_file(tmp / fname),
            }
    return extras


def _source_files(model_dir: Path) -> dict[str, Any]:
    # the size and checksum of each source file (weights, yaml, graphs) the bundle was made from
    return {
        src.name: {"bytes": src.stat().st_size, "sha256": sha256_file(src)}
        for src in sorted(model_dir.iterdir())
        if src.is_file() and (src.suffix in (".pt", ".yaml", ".onnx"))
    }


def convert(
    model_dir: str | Path,
    out: str | Path,
    *,
    dtype: str | Mapping[str, str] = "float32",
    quantize: str | Mapping[str, str] = "none",
    force: bool = False,
    progress: bool = True,
    runtime: str = "torch",
) -> Path:
    """Convert an official CosyVoice-300M model directory into a bundle.

    Args:
        model_dir: official directory (cosyvoice.yaml, llm.pt, flow.pt, hift.pt, optional spk2info.pt and ONNX).
        out: bundle directory to create.
        dtype: storage dtype of floating-point weights: float32, bfloat16 or float16, for every component, or
            per component (``llm=float32,flow=bfloat16,hift=bfloat16`` or a mapping; unnamed ones: float32).
        quantize: ``none``, or ``llm=int8``: the LLM's transformer and speech-head linears as int8 weights with
            per-channel float32 scales (their biases and every other tensor in the LLM's dtype).
        force: replace ``out`` if it is a bundle (or an empty directory); anything else there is refused.
        progress: report steps on stderr.
        runtime: ``lite`` also writes ``lite/``, the lite runtime's ONNX graphs, each checked against its torch
            module (:func:`cosyserve.bundle.lite.export.export_lite`); ``torch`` (default) does not.
    Returns:
        ``out`` as a Path.
    Raises:
        ConvertError: ``out`` is, contains or lies inside ``model_dir``, or exists and is not a bundle.
        FileExistsError: ``out`` is a bundle and ``force`` is False.
        ValueError: a bad ``dtype`` or ``quantize``.
    """
    import torch  # noqa: F401 - conversion needs torch: a missing one stops it before any work

    from cosyserve.core.version import __version__
    from cosyserve.families.modelconfig import config_tree, load_model_config
    from cosyserve.system.staging import Staging

    if runtime not in ("torch", "lite"):
        raise ValueError(f"runtime must be torch or lite, got {runtime!r}")
    dtypes = parse_component_dtypes(dtype, "dtype")
    quantized = parse_quantize(quantize, "quantize")
    model_dir, out = Path(model_dir), Path(out)
    if not model_dir.is_dir():
        raise ModelDirError(f"model directory not found: {model_dir}")
    _check_out(model_dir, out, force)
    step = _progress(f"convert {model_dir.name}") if progress else (lambda msg: None)
    cfg = load_model_config(model_dir)
    family = cfg.family_spec
    if runtime == "lite":
        from cosyserve.bundle.lite.export import require_lite

        require_lite(family)  # before any work
    with Staging(out, "converting") as staging:
        tmp = staging.path
        manifest: dict[str, Any] = {
            "format": BUNDLE_FORMAT,
            "version": 2 if quantized else BUNDLE_VERSION,
            "converter": f"cosyserve {__version__}",
            # one dtype for all (what readers of version 1 know), or "mixed" (see each component's)
            "dtype": dtypes["llm"] if len(set(dtypes.values())) == 1 else "mixed",
            "family": cfg.family,
            # takes instruct mode (see is_instruct_model_dir; CosyVoice2 and 3 have instruct2 instead)
            "instruct": family.is_instruct_dir(model_dir),
            "config": config_tree(cfg),
            "components": {},
            "source": {"dir": str(model_dir.resolve()), "files": {}},
            "extras": {},
        }
        for name in COMPONENTS:
            manifest["components"][name] = _write_component(
                model_dir, tmp, name, cfg, dtypes, quantized, step
            )
        manifest["speakers"] = _write_speakers(model_dir, tmp, cfg)
        manifest["extras"] = _copy_extras(model_dir, tmp, family, step)
        step("hashing source files")
        manifest["source"]["files"] = _source_files(model_dir)
        # the manifest is written last: a directory without it is never taken for a bundle (the staging
        # directory is not yet one: it is moved into place below)
        (tmp / "manifest.json").write_text(
            json.dumps(manifest, indent=1, ensure_ascii=False), encoding="utf-8"
        )
        if runtime == "lite":
            from cosyserve.bundle.lite.export import export_lite

            export_lite(tmp, step, model_dir=model_dir, int8=quantized.get("llm") == "int8")
        # checked again: the path may have changed during the conversion
        _check_out(model_dir, out, force)
        staging.commit(replace=force)
        step("done")
        if progress and sys.stderr.isatty():
            print(file=sys.stderr)
    return out
