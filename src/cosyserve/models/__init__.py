"""Pure PyTorch CosyVoice modules, state-dict compatible with the official checkpoints."""

from __future__ import annotations

from typing import Any

__all__ = ["one_layer_per_stack"]


def one_layer_per_stack(module: Any) -> Any:
    """A shallow copy of ``module`` in which each stack of identical layers named in its ``REPEATED_STACKS``
    holds only its first layer. Every kernel, shape and code path runs as in the full model, at a fraction of the
    cost: what a warm-up needs (one-time costs are per kernel and shape, not per layer; weights are paged in
    separately). Parameters, buffers and all other submodules are shared, and ``module`` itself is untouched, so
    requests may use it while a warm-up runs on the copy."""
    import copy

    from torch import nn

    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    for path in getattr(module, "REPEATED_STACKS", ()):
        *owners, name = path.split(".")
        node = clone
        for part in owners:  # copy each module on the way down, so the original's lists stay as they are
            child = copy.copy(node._modules[part])
            child._modules = dict(child._modules)
            node._modules[part] = child
            node = child
        stack = node._modules[name]
        if not isinstance(stack, nn.ModuleList) or len(stack) == 0:
            raise TypeError(f"{type(module).__name__}.{path} is not a non-empty ModuleList")
        node._modules[name] = nn.ModuleList([stack[0]])
    return clone
