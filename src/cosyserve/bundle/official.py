"""Read an official CosyVoice model directory without executing anything in it.

Weights are read with ``torch.load(weights_only=True)`` (no arbitrary unpickling), the yaml with a safe loader
(:mod:`cosyserve.families.modelconfig`). Every problem is a :class:`ModelDirError` naming the file and what is wrong.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cosyserve.core.errors import ModelDirError
from cosyserve.families import DEFAULT_FAMILY

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = [
    "COMPONENT_FILES",
    "ModelDirError",
    "load_component",
    "load_speakers",
    "module_class",
    "read_state_dict",
]

COMPONENT_FILES = {"llm": "llm.pt", "flow": "flow.pt", "hift": "hift.pt"}


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Load a ``.pt`` state dict safely: tensors only, no code. Raises :class:`ModelDirError`."""
    import pickle

    import torch

    if not path.is_file():
        raise ModelDirError(f"missing weights file {path}")
    try:
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            # legacy (pre-zip) serialization cannot be mapped; read it into memory instead
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
        raise ModelDirError(f"cannot read {path} as a weights-only torch checkpoint: {e}") from e
    if not isinstance(sd, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()
    ):
        raise ModelDirError(f"{path} is not a state dict (a mapping of parameter names to tensors)")
    # Some releases store bfloat16 tensors; the reference builds float32 modules and load_state_dict copies
    # (casts) each tensor into them, so cast here rather than adopt the file's dtype.
    return {k: v.float() if v.is_floating_point() and v.dtype != torch.float32 else v for k, v in sd.items()}


def _strict_load(module: torch.nn.Module, sd: dict[str, Any], path: Path) -> None:
    from cosyserve.bundle.construct import assert_materialized

    try:
        module.load_state_dict(sd, strict=True, assign=True)
    except RuntimeError as e:
        raise ModelDirError(f"{path} does not match the architecture in cosyvoice.yaml: {e}") from e
    assert_materialized(module, str(path))


def module_class(name: str, family: str = DEFAULT_FAMILY) -> type:
    """The module class of component ``name`` (llm, flow or hift) in model ``family`` (a name of
    :data:`cosyserve.families.FAMILIES`)."""
    from cosyserve.families import family_named

    if name not in COMPONENT_FILES:
        raise ValueError(f"unknown component {name!r}; expected one of {sorted(COMPONENT_FILES)}")
    return family_named(family).module_class(name)


def new_module(name: str, cfg: Any, family: str = DEFAULT_FAMILY) -> torch.nn.Module:
    """Construct component ``name`` ready for ``load_state_dict(assign=True)``: on the meta device with every
    initialiser skipped, and the vocoder with plain convolutions (its load hook folds the official weight-norm
    keys; registering the parametrizations, even on meta, would cost more than the rest of the load)."""
    from cosyserve.bundle.construct import empty_modules

    cls = module_class(name, family)
    with empty_modules():
        return cls(cfg, weight_norm=False) if name == "hift" else cls(cfg)


def load_component(
    model_dir: str | Path, name: str, cfg: Any, family: str = DEFAULT_FAMILY
) -> torch.nn.Module:
    """Build component ``name`` (llm, flow or hift) from its config and load the official weights strictly.

    Args:
        model_dir: official model directory.
        name: ``"llm"``, ``"flow"`` or ``"hift"``.
        cfg: that component's config from :func:`cosyserve.families.modelconfig.load_model_config`.
        family: the model family (``ModelConfig.family``).
    Returns:
        The module in eval mode on CPU.
    """
    model_dir = Path(model_dir)
    t0 = time.perf_counter()
    path = model_dir / COMPONENT_FILES[name]
    sd = read_state_dict(path)
    if name == "hift":
        # HiFiGAN training checkpoints nest the generator; the reference strips the prefix the same way.
        sd = {k.removeprefix("generator."): v for k, v in sd.items()}
    module = new_module(name, cfg, family)
    _strict_load(module, sd, path)  # the weights stay in the mapped checkpoint: no copy
    module.eval()
    logger.debug("loaded %s from %s in %.1f ms", name, path, (time.perf_counter() - t0) * 1e3)
    return module


def load_speakers(model_dir: str | Path, embed_dim: int = 192) -> dict[str, dict[str, torch.Tensor]]:
    """Read ``spk2info.pt`` (speaker id -> {"embedding": [1, 192], ...}); a dir without it has no speakers."""
    import torch

    path = Path(model_dir) / "spk2info.pt"
    if not path.is_file():
        return {}
    try:
        info = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
        raise ModelDirError(f"cannot read {path} as a weights-only torch file: {e}") from e
    if not isinstance(info, dict):
        raise ModelDirError(f"{path} should map speaker ids to dicts of tensors, got {type(info).__name__}")
    out: dict[str, dict[str, torch.Tensor]] = {}
    for spk, entry in info.items():
        if not isinstance(spk, str) or not isinstance(entry, dict):
            raise ModelDirError(f"{path}: entry {spk!r} should be a str -> dict of tensors")
        emb = entry.get("embedding")
        if emb is None and ("llm_embedding" in entry or "flow_embedding" in entry):
            # a voice the reference's add_zero_shot_spk saved: not a pre-defined speaker
            logger.warning(
                "%s: skipping zero-shot voice %r; bring it in with `cosyserve speakers import`", path, spk
            )
            continue
        if not isinstance(emb, torch.Tensor) or emb.numel() != embed_dim:
            raise ModelDirError(f"{path}: speaker {spk!r} has no {embed_dim}-value 'embedding' tensor")
        out[spk] = {k: v for k, v in entry.items() if isinstance(v, torch.Tensor)}
        out[spk]["embedding"] = emb.reshape(1, embed_dim).float()
    return out
