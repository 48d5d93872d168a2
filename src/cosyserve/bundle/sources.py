"""What ``--model`` names, made a bundle on this machine: a bundle, an official model dir, a hub id, or ``demo``.

- a bundle (``manifest.json``) is used as it is;
- an official model dir (``cosyvoice.yaml``) is converted once into the bundle cache and reused while its files
  are unchanged;
- a hub id (``iic/CosyVoice-300M-SFT`` on ModelScope, ``FunAudioLLM/...`` on Hugging Face; the ``hub`` extra) is
  downloaded by the hub library into its cache, then converted;
- ``demo`` is a tiny random-weight model (it makes noise, not speech) generated once into the cache.

A local path of that name always wins over a hub id or ``demo``.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from cosyserve.core.errors import ModelDirError
from cosyserve.core.settings import DEMO_MODEL

__all__ = [
    "cache_dir_of",
    "demo_model_dir",
    "has_lite_files",
    "resolve_bundle",
    "resolve_source",
]

logger = logging.getLogger(__name__)
# expected slow steps (a first conversion): INFO, not a warning; the CLI shows this logger as short lines on stderr
progress_logger = logging.getLogger("cosyserve.progress")


def has_lite_files(source: str | Path) -> bool:
    """Whether ``source`` is a bundle converted with ``--runtime lite`` (its ``lite/`` manifest is there; the
    lite runtime checks the files themselves when it loads)."""
    from cosyserve.bundle.lite import LITE_DIR

    path = Path(source)
    return (path / "manifest.json").is_file() and (path / LITE_DIR / "manifest.json").is_file()


def cache_dir_of(cache_dir: Path | None) -> Path:
    """``cache_dir``, or when None the ``cache_dir`` setting of the environment (for callers without settings)."""
    if cache_dir is not None:
        return Path(cache_dir)
    from cosyserve.core.settings import Settings

    return Settings.load().cache_dir  # a caller without settings: the environment's, read now


def demo_model_dir(cache_dir: Path | None = None) -> Path:
    """The demo model's directory in ``cache_dir`` (default: the ``cache_dir`` setting), generated the first time
    (a tiny random-weight model)."""
    from cosyserve.families.testmodel import make_test_model

    path = cache_dir_of(cache_dir) / "demo-model"
    if not (path / "cosyvoice.yaml").exists():
        logger.warning(
            "demo model: generating a tiny random-weight model in %s (it makes noise, not speech)", path
        )
        try:  # a folder there without the yaml is a broken one of ours: replaced
            make_test_model(path, force=path.exists())
        except FileExistsError:  # another process made it meanwhile
            pass
    return path


def resolve_source(source: str | Path, cache_dir: Path | None = None) -> Path:
    """A local directory for ``source``: the path itself when it exists, else the demo model for ``demo`` (in
    ``cache_dir``), a hub id's download, or the path as given (whose absence the caller reports)."""
    from cosyserve.bundle.hub import download, is_hub_id

    if Path(source).exists():
        return Path(source)
    if str(source) == DEMO_MODEL:
        return demo_model_dir(cache_dir)
    if is_hub_id(str(source)):
        return download(str(source))
    return Path(source)


def resolve_bundle(source: str | Path, *, progress: bool = True, cache_dir: Path | None = None) -> Path:
    """A bundle for ``source`` (see the module docstring): the path itself if it is a bundle; for an official
    model dir, a bundle converted into ``cache_dir`` (default: the ``cache_dir`` setting), reused while the
    source files are unchanged.

    Raises:
        ModelDirError: no such directory, or neither a bundle nor an official model dir.
        BundleError, ModelConfigError, HubError: the source cannot be used.
    """
    from cosyserve.bundle.loader import is_bundle

    cache = cache_dir_of(cache_dir)
    path = resolve_source(source, cache)
    if is_bundle(path):
        return path
    if not path.is_dir():
        raise ModelDirError(f"model directory not found: {path}")
    from cosyserve.families import family_of, family_yamls

    if family_of(path) is None:
        raise ModelDirError(
            f"{path} is neither a bundle (manifest.json) nor an official model dir (one of "
            f"{', '.join(family_yamls().values())})"
        )
    key = hashlib.sha256(str(path.resolve()).encode())
    qwen = path / "CosyVoice-BlankEN"
    for f in [*sorted(path.iterdir()), *(sorted(qwen.iterdir()) if qwen.is_dir() else [])]:
        if f.is_file():
            st = f.stat()
            key.update(f"{f.relative_to(path)}:{st.st_size}:{st.st_mtime_ns};".encode())
    target = cache / "bundles" / f"{path.resolve().name}-{key.hexdigest()[:16]}"
    if not is_bundle(target):
        from cosyserve.bundle.convert import convert

        progress_logger.info(
            "converting %s into the bundle cache %s (once; later runs reuse it)", path, target
        )
        convert(path, target, force=True, progress=progress)
    return target
