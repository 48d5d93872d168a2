"""Build modules without paying for weights that are about to be replaced.

Under :func:`empty_modules` parameters are created on the meta device (no memory) and no initialiser runs (on
meta, ``nn.Embedding``'s ``normal_`` alone imports sympy, which costs more than building every module). The
real tensors are then assigned with
``load_state_dict(assign=True)``: nothing is initialised twice and nothing is copied.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["assert_materialized", "empty_modules"]

_INIT_FUNCTIONS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
)  # fmt: skip

_lock = threading.RLock()
_depth = 0
_saved: dict[tuple[object, str], object] = {}


def _noop(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


def _patch() -> None:
    for name in _INIT_FUNCTIONS:
        if hasattr(nn.init, name):
            _saved[(nn.init, name)] = getattr(nn.init, name)
            setattr(nn.init, name, _noop)
    for cls in _module_classes():
        _saved[(cls, "reset_parameters")] = cls.__dict__["reset_parameters"]
        cls.reset_parameters = lambda self: None  # type: ignore[method-assign]


def _module_classes() -> list[type]:
    return [
        c
        for c in (
            nn.Linear,
            nn.Embedding,
            nn.LayerNorm,
            nn.GroupNorm,
            nn.modules.conv._ConvNd,
            nn.modules.batchnorm._NormBase,
        )
        if "reset_parameters" in c.__dict__
    ]


def _unpatch() -> None:
    for (owner, name), value in _saved.items():
        setattr(owner, name, value)
    _saved.clear()


@contextmanager
def empty_modules() -> Iterator[None]:
    """Construct modules on the meta device with every parameter initialiser skipped.

    Re-entrant and usable from several threads at once (the patch is process-wide while any user is inside,
    so do not initialise unrelated modules concurrently and expect random weights).
    """
    global _depth
    with _lock:
        if _depth == 0:
            _patch()
        _depth += 1
    try:
        with torch.device("meta"):
            yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _unpatch()


def assert_materialized(module: nn.Module, where: str) -> None:
    """Raise if any parameter or buffer of ``module`` is still on the meta device after loading."""
    left = [
        n for n, t in [*module.named_parameters(), *module.named_buffers()] if t is not None and t.is_meta
    ]
    if left:
        raise RuntimeError(f"{where}: tensors not loaded (still on meta): {', '.join(left[:8])}")
