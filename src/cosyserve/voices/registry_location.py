"""Where a model's speaker registry lives, and moving the voices older versions kept elsewhere.

``COSYSERVE_REGISTRY_DIR`` if set (shared by every model), else ``<cache dir>/speakers/<model key>``, the key a
hash of the model's weight files' checksums (``Bundle.model_key``), so models in folders of the same name keep
separate voices. Older versions keyed the folder by the model folder's name; :func:`default_registry_dir` moves
such a folder to the model's key the first time the model opens it, when it is clear whose voices they are, and
leaves a link behind. What a registry holds and how it is written is :mod:`cosyserve.voices.registry`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from cosyserve.core.errors import RegistryError

logger = logging.getLogger(__name__)

__all__ = ["default_registry_dir"]


def default_registry_dir(
    model: str | os.PathLike[str], key: str | None = None, *, registry_dir: Path | None, cache_dir: Path
) -> Path:
    """Where a model's registry lives: ``registry_dir`` if given (used as is, by every model), else
    ``<cache_dir>/speakers/<key>`` (the settings ``registry_dir`` and ``cache_dir``: ``COSYSERVE_REGISTRY_DIR``,
    ``COSYSERVE_CACHE_DIR``).

    Args:
        model: the model's path (bundle or official dir).
        key: what identifies the model (``Bundle.model_key``: a hash of its weight files' checksums), so two
            models in folders of the same name keep separate voices, and a moved, renamed or re-converted
            model keeps its own. ``None``: keyed by the folder's name, as older versions did.
        registry_dir: the registry folder every model shares, or None.
        cache_dir: the cache folder.
    Returns:
        The folder.

    Voices that older versions kept under ``<cache dir>/speakers/<folder name>`` are moved to the key's folder
    the first time the model opens it, unless it is unclear whose they are (see :func:`_adopt_legacy`).
    """
    if registry_dir is not None:
        return registry_dir
    speakers = cache_dir / "speakers"
    if key is None:
        return speakers / _legacy_key(model)
    if not re.fullmatch(r"[0-9a-f]{32}", key):
        raise RegistryError(f"model key {key!r} is not 32 hex digits")
    _adopt_legacy(speakers, model, key)
    return speakers / key


def _legacy_key(model: str | os.PathLike[str]) -> str:
    # older versions' key: the model folder's name
    return _safe_name(Path(os.path.abspath(os.fspath(model))).name)


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "model"


def _adopt_legacy(speakers: Path, model: str | os.PathLike[str], key: str) -> None:
    """Move the voices an older version kept for ``model``'s folder name to ``key``'s folder, when it is clear
    they are this model's: the old folder is a real folder (not yet moved), this model has no folder of its own
    yet, and no other model served from a folder of that name is known (the bundle cache records the models it
    converted). The old name is left as a link to the new folder: older versions still find the voices, and a
    second model of that name sees they were claimed."""
    legacy = speakers / _legacy_key(model)
    new = speakers / key
    if legacy == new:
        return
    if legacy.is_symlink():
        if not os.path.lexists(new) and os.readlink(legacy) != key:
            logger.info(
                "speaker registry %s (keyed by a folder name, as older versions did) went to another model "
                "(%s); %s starts with its own registry %s",
                legacy,
                os.readlink(legacy),
                model,
                new,
            )
        return
    if not legacy.is_dir():
        return
    if os.path.lexists(new):
        logger.warning(
            "speaker registry %s (keyed by the folder name, as older versions did) left as it is: %s already has "
            "its registry %s; move the voices there yourself if they are this model's",
            legacy,
            model,
            new,
        )
        return
    others = _other_models_named(speakers.parent, legacy.name, key)
    if others:
        logger.warning(
            "speaker registry %s (keyed by the folder name, as older versions did) left as it is: other models "
            "were served from a folder of that name too (keys %s), so it is unclear whose voices these are; "
            "%s starts with its own registry %s (move the voices there yourself if they are this model's)",
            legacy,
            ", ".join(sorted(others)),
            model,
            new,
        )
        return
    try:
        os.rename(legacy, new)
    except FileNotFoundError:  # another process moved it first
        return
    except OSError as e:
        logger.warning("could not move speaker registry %s to %s: %s; it stays where it is", legacy, new, e)
        return
    try:
        os.symlink(key, legacy, target_is_directory=True)
    except OSError as e:
        logger.info("could not leave a link from %s to %s: %s", legacy, new, e)
    logger.warning(
        "moved the registered voices of %s from %s (keyed by the folder name) to %s (keyed by the model's "
        "weights, so another model in a folder of the same name no longer sees them)",
        model,
        legacy,
        new,
    )


def _other_models_named(cache: Path, legacy_name: str, key: str) -> set[str]:
    # the keys of the other models the bundle cache converted from folders of this name
    from cosyserve.bundle.loader import model_key

    found: set[str] = set()
    try:
        entries = list((cache / "bundles").iterdir())
    except OSError:
        return found
    for entry in entries:
        stem, dash, digest = entry.name.rpartition("-")
        if not dash or _safe_name(stem) != legacy_name or not re.fullmatch(r"[0-9a-f]{16}", digest):
            continue
        try:
            other = model_key(json.loads((entry / "manifest.json").read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if other != key:
            found.add(other)
    return found
