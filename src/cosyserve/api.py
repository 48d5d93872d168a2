"""The public Python API: ``cosyserve.load(path)`` and the model it returns."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["CosyVoiceModel", "load"]


class CosyVoiceModel:
    """A loaded CosyVoice-300M model: ``speakers``, ``sample_rate`` and ``synthesize``.

    Build it with :func:`load`; the constructor takes already-built parts.
    """

    def __init__(self, pipeline: Any, model_dir: Path, timings_ms: dict[str, float]) -> None:
        self._pipeline = pipeline
        self.model_dir = model_dir
        self.timings_ms = timings_ms

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


def load(path: str | Path, *, threads: int | None = None) -> CosyVoiceModel:
    """Load an official CosyVoice-300M model directory (cosyvoice.yaml, llm.pt, flow.pt, hift.pt, spk2info.pt).

    Nothing in the directory is executed: the yaml is read by a safe loader and the weights with
    ``torch.load(weights_only=True)``. Components load in parallel threads.

    Args:
        path: the model directory.
        threads: torch intra-op threads (default: torch's choice).
    Returns:
        A :class:`CosyVoiceModel`.
    Raises:
        cosyserve.config.ConfigError / cosyserve.bundle.official.ModelDirError: the directory cannot be used.
    """
    t0 = time.perf_counter()
    import torch

    from cosyserve.bundle.official import ModelDirError, load_component, load_speakers
    from cosyserve.config import load_model_config
    from cosyserve.engine.pipeline import Pipeline
    from cosyserve.engine.token2wav import StreamPolicy

    model_dir = Path(path)
    if not model_dir.is_dir():
        raise ModelDirError(f"model directory not found: {model_dir}")
    if threads:
        torch.set_num_threads(threads)
    timings = {"import_torch": (time.perf_counter() - t0) * 1e3}
    t1 = time.perf_counter()
    cfg = load_model_config(model_dir)
    timings["config"] = (time.perf_counter() - t1) * 1e3
    t1 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=3, thread_name_prefix="cosyserve-load") as pool:
        futures = {name: pool.submit(load_component, model_dir, name, getattr(cfg, name)) for name in ("llm", "flow", "hift")}
        speakers = load_speakers(model_dir, cfg.llm.spk_embed_dim)
        parts = {name: f.result() for name, f in futures.items()}
    timings["weights"] = (time.perf_counter() - t1) * 1e3
    policy = StreamPolicy(input_frame_rate=parts["flow"].input_frame_rate, sample_rate=cfg.sample_rate)
    pipeline = Pipeline(parts["llm"], parts["flow"], parts["hift"], speakers, cfg.sample_rate, policy)
    timings["total"] = (time.perf_counter() - t0) * 1e3
    logger.info("loaded %s in %.0f ms (%s)", model_dir, timings["total"], timings)
    return CosyVoiceModel(pipeline, model_dir, timings)
