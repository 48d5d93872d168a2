"""The public Python API: ``cosyserve.load(path)`` and the model it returns."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["CosyVoiceModel", "load", "resolve_bundle"]


class CosyVoiceModel:
    """A loaded CosyVoice-300M model: ``speakers``, ``sample_rate`` and ``synthesize``.

    Build it with :func:`load`; the constructor takes already-built parts.
    """

    def __init__(self, pipeline: Any, model_dir: Path, clock: Any, bundle: Any = None) -> None:
        self._pipeline = pipeline
        self.model_dir = model_dir
        self.clock = clock
        self.bundle = bundle
        self._parts: Any = None

    def warm_up(self, text: str = "Hello.") -> None:
        """Run one short synthesis so kernels, caches and the touched weight pages are ready for requests."""
        speakers = self.speakers
        if speakers:
            for _ in self._pipeline.synthesize(text, speakers[0], seed=0, normalize=False):
                pass

    @property
    def speakers(self) -> list[str]:
        """Pre-defined speaker ids (from spk2info.pt), sorted."""
        return sorted(self._pipeline.speakers)

    @property
    def sample_rate(self) -> int:
        return self._pipeline.sample_rate

    def synthesize(
        self,
        text: str,
        speaker: str,
        *,
        stream: bool = False,
        speed: float = 1.0,
        seed: int | None = None,
    ) -> Iterator[np.ndarray]:
        """Yield float32 mono audio chunks (1-D numpy arrays at ``sample_rate``) of ``speaker`` saying ``text``.

        Args:
            text: text to speak (split into sentences internally).
            speaker: one of :attr:`speakers`.
            stream: yield ~2 s chunks as soon as they exist (True) or one chunk per sentence (False).
            speed: tempo in [0.5, 2.0]; only with ``stream=False``, as in the reference.
            seed: makes the audio reproducible; ``None`` picks a random seed.
        Raises:
            cosyserve.engine.pipeline.SynthesisError: unknown speaker, empty text or a bad option.
        """
        return self._pipeline.synthesize(text, speaker, stream=stream, speed=speed, seed=seed)

    def synthesize_all(self, text: str, speaker: str, **kwargs: Any) -> np.ndarray:
        """The whole utterance as one float32 array (same arguments as :meth:`synthesize`)."""
        chunks = list(self.synthesize(text, speaker, **kwargs))
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)


def _load_text_frontend_in_background() -> None:
    # wetext's FSTs take ~0.4 s to load: after READY, not before, so the first request rarely waits for them
    import threading

    from cosyserve.frontend.text import load_normalizers

    def run() -> None:
        try:
            load_normalizers()
        except Exception:  # noqa: BLE001 - the request path raises the same error with its context
            logger.warning("background load of the text normaliser failed", exc_info=True)

    threading.Thread(target=run, name="cosyserve-text-frontend", daemon=True).start()


def resolve_bundle(path: str | Path, *, progress: bool = True) -> Path:
    """A bundle for ``path``: the path itself if it is a bundle; for an official model dir, a bundle converted
    into the cache dir (``COSYSERVE_CACHE_DIR``), reused while the source files are unchanged.
    """
    import hashlib

    from cosyserve.bundle.loader import is_bundle
    from cosyserve.bundle.official import ModelDirError
    from cosyserve.settings import cache_dir

    path = Path(path)
    if is_bundle(path):
        return path
    if not path.is_dir():
        raise ModelDirError(f"model directory not found: {path}")
    if not (path / "cosyvoice.yaml").is_file():
        raise ModelDirError(
            f"{path} is neither a bundle (manifest.json) nor an official model dir (cosyvoice.yaml)"
        )
    key = hashlib.sha256(str(path.resolve()).encode())
    for f in sorted(path.iterdir()):
        if f.is_file():
            st = f.stat()
            key.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    target = cache_dir() / "bundles" / f"{path.resolve().name}-{key.hexdigest()[:16]}"
    if not is_bundle(target):
        from cosyserve.bundle.convert import convert

        logger.warning("converting %s into the bundle cache %s (once; later starts reuse it)", path, target)
        convert(path, target, force=True, progress=progress)
    return target


def load(
    path: str | Path,
    *,
    threads: int | None = None,
    strategy: str | None = None,
    verify: str | None = None,
    warmup: bool | None = None,
    warmup_text: str | None = None,
    use_mmap: bool | None = None,
    clock: Any = None,
) -> CosyVoiceModel:
    """Load a model: a bundle (``cosyserve convert``), or an official CosyVoice-300M model directory
    (cosyvoice.yaml, llm.pt, flow.pt, hift.pt, spk2info.pt), converted once into the cache and reused.

    Nothing in a model directory is executed: the yaml is read by a safe loader, the weights with
    ``torch.load(weights_only=True)`` (conversion only) and safetensors (serving). Arguments left ``None``
    come from the environment (see :mod:`cosyserve.settings`).

    Args:
        path: bundle or official model directory.
        threads: torch intra-op threads (env ``COSYSERVE_THREADS``; default torch's choice).
        strategy: ``preload`` / ``lazy`` / ``prefetch`` (env ``COSYSERVE_PRELOAD``).
        verify: bundle checksum policy ``stamp`` / ``full`` / ``none`` (env ``COSYSERVE_VERIFY``).
        warmup: run a short synthesis before returning (env ``PREWARM_MODELS``; default on).
        warmup_text: the warm-up text (env ``COSYSERVE_WARMUP_TEXT``; default "Hello.").
        use_mmap: map the weights (True) or copy them into private memory (env ``USE_MMAP_LOADING``).
        clock: a :class:`cosyserve.startup.PhaseClock` to record the phases in.
    Returns:
        A :class:`CosyVoiceModel`.
    Raises:
        ConfigError, ModelDirError, BundleError, SettingsError (all ValueError): the input cannot be used.
    """
    from cosyserve import settings
    from cosyserve.startup import PhaseClock

    clock = clock or PhaseClock()
    strategy = strategy or settings.load_strategy()
    verify = verify or settings.env_choice("COSYSERVE_VERIFY", ("stamp", "full", "none"), "stamp")
    warmup = settings.prewarm() if warmup is None else warmup
    warmup_text = warmup_text or os.environ.get("COSYSERVE_WARMUP_TEXT") or "Hello."
    use_mmap = settings.env_bool("USE_MMAP_LOADING", True) if use_mmap is None else use_mmap
    threads = threads or settings.env_int("COSYSERVE_THREADS", None)
    with clock.phase("imports"):
        import torch

        from cosyserve.bundle.loader import LoadOptions, open_bundle, start_prefetch
        from cosyserve.engine.pipeline import Pipeline
        from cosyserve.engine.token2wav import StreamPolicy
        from cosyserve.frontend.tokenizer import get_tokenizer

    if threads:
        torch.set_num_threads(threads)
    bundle_dir = resolve_bundle(path)
    with clock.phase("manifest"):
        bundle = open_bundle(bundle_dir)
    parts = bundle.load(LoadOptions(strategy=strategy if use_mmap else "lazy", verify=verify), clock)  # type: ignore[arg-type]
    if not use_mmap:
        with clock.phase("first_touch"):
            for module in parts.modules.values():
                for p in module.parameters():
                    p.data = p.data.clone()
    with clock.phase("construct"):
        cfg = bundle.config
        flow = parts.modules["flow"]
        policy = StreamPolicy(input_frame_rate=flow.input_frame_rate, sample_rate=cfg.sample_rate)
        get_tokenizer()
        pipeline = Pipeline(
            parts.modules["llm"], flow, parts.modules["hift"], parts.speakers, cfg.sample_rate, policy
        )
    model = CosyVoiceModel(pipeline, Path(path), clock, bundle)
    if warmup:
        with clock.phase("warmup"):
            model.warm_up(warmup_text)
    clock.mark("ready")
    if strategy == "prefetch" and use_mmap:
        start_prefetch(parts)
    _load_text_frontend_in_background()
    model._parts = parts
    logger.info("ready in %.0f ms since process start (%s)", clock.points["ready"], clock.durations)
    return model
