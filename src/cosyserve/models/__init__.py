"""Pure PyTorch CosyVoice modules, state-dict compatible with the official checkpoints."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

__all__ = ["one_layer_per_stack"]


@contextmanager
def one_layer_per_stack(*modules: Any) -> Iterator[None]:
    """Within the block, each stack of identical layers named in a module's ``REPEATED_STACKS`` holds only its
    first layer. Every kernel, shape and code path runs as in the full model, at a fraction of the cost: what a
    warm-up needs (one-time costs are per kernel and shape, not per layer; weights are paged in separately).
    Not for a module that serves requests at the same time."""
    from torch import nn

    with ExitStack() as undo:
        for module in modules:
            for path in getattr(module, "REPEATED_STACKS", ()):
                owner_path, _, name = path.rpartition(".")
                owner = module.get_submodule(owner_path)
                stack = owner._modules[name]
                if not isinstance(stack, nn.ModuleList) or len(stack) == 0:
                    raise TypeError(f"{type(module).__name__}.{path} is not a non-empty ModuleList")
                owner._modules[name] = nn.ModuleList([stack[0]])
                undo.callback(owner._modules.__setitem__, name, stack)
        yield
