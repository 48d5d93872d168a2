"""``cosyserve make-test-model``: random-weight model directories in a family's official layout.

Each family writes its own files (``Family.test_model``: :mod:`cosyserve.families.cosyvoice.testmodel`,
:mod:`cosyserve.families.cosyvoice2.testmodel`, :mod:`cosyserve.families.cosyvoice3.testmodel`); this module holds
what they share: the command's entry point (a staging directory renamed into place, ``--force`` limited to
directories it wrote), the release's speaker ids and the vocoder's f0 rescaling. Random weights make noise, not
speech; the vocoder's f0 head is rescaled (as in the conformance fixtures) so the noise is voiced.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["HEADER_MARK", "SIZE_NAMES", "SPEAKERS", "make_test_model", "voice_f0_head"]

# the releases' spk2info ids
SPEAKERS = ("中文女", "中文男", "日语男", "粤语女", "英文女", "英文男", "韩语女")
# tiny: unit tests (a few MB); full: the release's dimensions, file sizes and compute cost
SIZE_NAMES = ("tiny", "full")
# in the first line of every yaml a family's writer renders (what --force may replace)
HEADER_MARK = "written by cosyserve make-test-model"


def voice_f0_head(hift: Any, generator: Any) -> None:
    # Random init leaves f0 ~0.02 Hz (always unvoiced). Rescale the f0 head's last Linear so f0 spans roughly
    # 0-300 Hz on random input, as the conformance fixtures do.
    import torch

    head = hift.f0_predictor.classifier
    seen: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda m, inp, out: seen.append(inp[0].detach()))
    try:
        with torch.no_grad():
            hift.f0_predictor(torch.randn(1, 80, 200, generator=generator))
    finally:
        hook.remove()
    z = seen[0] @ head.weight.detach().T  # (..., 1) without bias
    scale = 80.0 / float(z.std().clamp_min(1e-6))
    with torch.no_grad():
        head.weight.mul_(scale)
        head.bias.fill_(150.0 - scale * float(z.mean()))


def _is_test_model(path: Path) -> bool:
    # what --force may replace: an empty folder, or a folder whose yaml carries our header (never a real model)
    if path.is_symlink() or not path.is_dir():
        return False
    if not any(path.iterdir()):
        return True
    from cosyserve.families import family_yamls

    for name in family_yamls().values():
        try:
            with open(path / name, encoding="utf-8") as f:
                if HEADER_MARK in f.readline():
                    return True
        except (OSError, UnicodeDecodeError):
            continue
    return False


def make_test_model(
    out: str | Path,
    *,
    size: str = "tiny",
    seed: int = 0,
    force: bool = False,
    onnx: bool = True,
    family: str = "cosyvoice",
) -> dict[str, tuple[int, int]]:
    """Write a random-weight model directory in the official layout.

    Args:
        out: directory to create (written to a temporary sibling, then renamed: never left half-written).
        size: ``tiny`` (tests) or ``full`` (the release's dimensions: CosyVoice-300M ~1.7 GB, CosyVoice2-0.5B
            ~2 GB, CosyVoice3-0.5B ~3.5 GB).
        family: a name of :data:`cosyserve.families.FAMILIES` (its ``test_model`` writes the files).
        seed: seed for every random weight.
        force: replace ``out`` if it exists.
        onnx: also write small random campplus.onnx and the family's speech tokenizer (the zero-shot tier).
    Returns:
        component -> (parameter count, file size in bytes).
    """
    from cosyserve.families import family_named
    from cosyserve.system.staging import Staging

    spec = family_named(family)
    if size not in SIZE_NAMES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZE_NAMES)}")
    out = Path(out)
    if os.path.lexists(out):
        if not force:
            raise FileExistsError(f"{out} already exists (use --force to replace it)")
        if not _is_test_model(out):
            raise FileExistsError(
                f"{out} exists and is not a model that make-test-model wrote: --force replaces only those "
                "(or an empty folder); choose another path"
            )
    staging = Staging(out, "making").start()
    try:
        info = spec.write_test_model(staging.path, size, seed, onnx)
        staging.commit(replace=force)
    finally:
        staging.discard()
    return info
