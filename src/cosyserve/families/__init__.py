"""Model families: one object per family, looked up from the yaml an official model directory holds.

A family (:class:`~cosyserve.families.base.Family`) declares everything that differs between CosyVoice-300M,
CosyVoice2 and CosyVoice3: its yaml and config classes, its modules and their checkpoints, its tokenizer, its
frontend's files and prompt mel, its speech-token-to-audio rules and chunk policy, its modes, the files a bundle
copies, its conformance kinds and its test model. Code outside a family asks it (``family_of(model_dir)``,
``family_named(cfg.family)``) and never compares its name, as transformers finds a model's class from its
config's ``model_type``.

Registering a family is one line of :data:`FAMILIES`: its name, the yaml that marks its directories (in the
order the reference's ``AutoModel`` tries them), and its class by import string (imported on first use: reading
this table imports no family's code, and no family's module imports torch until it is asked for a model part).
"""

from __future__ import annotations

import importlib
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cosyserve.families.base import Family

__all__ = ["DEFAULT_FAMILY", "FAMILIES", "family_named", "family_of", "family_yamls"]

# name -> (the yaml that marks its model directories, its Family class)
FAMILIES: dict[str, tuple[str, str]] = {
    "cosyvoice": ("cosyvoice.yaml", "cosyserve.families.cosyvoice:CosyVoice"),
    "cosyvoice2": ("cosyvoice2.yaml", "cosyserve.families.cosyvoice2:CosyVoice2"),
    "cosyvoice3": ("cosyvoice3.yaml", "cosyserve.families.cosyvoice3:CosyVoice3"),
}

# The family of what names none: a bundle whose manifest predates its "family" field (every such bundle was
# CosyVoice-300M's), a pipeline built without one, a conformance set without a model dir, the test model's default.
DEFAULT_FAMILY = "cosyvoice"


@cache
def family_named(name: str) -> Family:
    """The family called ``name`` (a key of :data:`FAMILIES`; a bundle's manifest records it).

    Raises:
        ValueError: no such family (the message lists the known ones).
    """
    try:
        _, target = FAMILIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown model family {name!r}; expected one of {', '.join(FAMILIES)}") from None
    module, _, attr = target.partition(":")
    family: Family = getattr(importlib.import_module(module), attr)()
    return family


def family_yamls() -> dict[str, str]:
    """family name -> the yaml file name that marks its official model directories."""
    return {name: yaml for name, (yaml, _) in FAMILIES.items()}


def family_of(model_dir: str | Path) -> Family | None:
    """The family of an official model directory: the first of :data:`FAMILIES` whose yaml it holds (never
    guessed from names), or None when it holds none."""
    path = Path(model_dir)
    for name, (yaml, _) in FAMILIES.items():
        if (path / yaml).is_file():
            return family_named(name)
    return None
