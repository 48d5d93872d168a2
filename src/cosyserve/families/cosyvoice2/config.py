"""The model config of a CosyVoice2 or CosyVoice3 directory: its family's yaml plus the Qwen LM's
``CosyVoice-BlankEN/config.json``, which the LM's config carries (a bundle's manifest then holds both).

The families' :meth:`~cosyserve.families.base.Family.read_config` (found from the directory's yaml, as
transformers finds a model's classes from its ``config.json``); the yaml machinery they share is
:mod:`cosyserve.families.modelconfig`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cosyserve.families.modelconfig import (
    ModelConfig,
    ModelConfigError,
    Tagged,
    build_model_config,
    read_model_yaml,
)

if TYPE_CHECKING:
    from cosyserve.families.base import Family

__all__ = ["QWEN_DIR", "qwen_config", "read_config"]

QWEN_DIR = "CosyVoice-BlankEN"  # the Qwen LM's config and tokenizer, in a CosyVoice2/3 directory


def read_config(model_dir: Path, family: Family) -> ModelConfig:
    """The :class:`ModelConfig` of an official directory of ``family`` (CosyVoice2, CosyVoice3): its yaml and the
    Qwen config's fields the LM uses. The yaml's ``feat_extractor`` (the prompt mel) is kept too: CosyVoice3's
    differs from CosyVoice2's (fmax)."""
    path = model_dir / family.yaml
    doc = read_model_yaml(path)
    llm = doc["llm"]
    if not isinstance(llm, Tagged) or not isinstance(llm.value, dict):
        raise ModelConfigError(f"{path}: 'llm' should be a !new: record of Qwen2LM arguments")
    tree = {
        "family": family.name,
        "chunk_size": doc.get("chunk_size", 25),
        "sample_rate": doc["sample_rate"],
        "llm": Tagged(llm.kind, llm.target, {**llm.value, "qwen": _qwen_fields(model_dir)}),
        "flow": doc["flow"],
        "hift": doc["hift"],
    }
    if "feat_extractor" in doc:
        tree["feat_extractor"] = doc["feat_extractor"]
    return build_model_config(tree, source=path)


def qwen_config(model_dir: str | Path) -> dict[str, Any]:
    """``CosyVoice-BlankEN/config.json`` of a CosyVoice2/3 directory, checked for the keys the LM needs."""
    path = Path(model_dir) / QWEN_DIR / "config.json"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelConfigError(f"cannot read the Qwen config {path}: {e}") from e
    if not isinstance(doc, dict):
        raise ModelConfigError(f"{path}: expected a JSON object")
    for key, tp in (
        ("hidden_size", int),
        ("intermediate_size", int),
        ("num_attention_heads", int),
        ("num_hidden_layers", int),
        ("num_key_value_heads", int),
        ("vocab_size", int),
        ("rms_norm_eps", (int, float)),
        ("rope_theta", (int, float)),
    ):
        value = doc.get(key)
        if not isinstance(value, tp) or isinstance(value, bool) or value <= 0:
            raise ModelConfigError(f"{path}: '{key}' should be a positive number, got {value!r}")
    if (
        doc["hidden_size"] % doc["num_attention_heads"]
        or doc["num_attention_heads"] % doc["num_key_value_heads"]
    ):
        raise ModelConfigError(
            f"{path}: hidden_size {doc['hidden_size']} / num_attention_heads {doc['num_attention_heads']} / "
            f"num_key_value_heads {doc['num_key_value_heads']} do not divide"
        )
    return doc


def _qwen_fields(model_dir: Path) -> dict[str, Any]:
    """The Qwen config's fields the LM uses; a config asking for what the LM does not implement is refused."""
    from cosyserve.models.qwen2lm import Qwen2Config

    doc = qwen_config(model_dir)
    path = model_dir / QWEN_DIR / "config.json"
    if doc.get("rope_scaling") not in (None, {}):
        raise ModelConfigError(
            f"{path}: rope_scaling {doc['rope_scaling']!r} is not supported (plain rotary only)"
        )
    if doc.get("use_sliding_window"):
        raise ModelConfigError(f"{path}: use_sliding_window true is not supported (full attention only)")
    if doc.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"{path}: hidden_act {doc['hidden_act']!r} is not supported (silu only)")
    names = {f.name for f in dataclasses.fields(Qwen2Config)}
    return {k: v for k, v in doc.items() if k in names}
