"""The public Python API: ``cosyserve.load(path)`` and the model it returns."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from cosyserve.settings import Settings

logger = logging.getLogger(__name__)
# expected slow steps (a first conversion): INFO, not a warning; the CLI shows this logger as short lines on stderr
progress_logger = logging.getLogger("cosyserve.progress")

__all__ = ["CosyVoiceModel", "load", "resolve_bundle"]


class CosyVoiceModel:
    """A loaded CosyVoice-300M model: ``speakers``, ``sample_rate`` and ``synthesize``.

    Build it with :func:`load`; the constructor takes already-built parts.
    """

    def __init__(
        self, pipeline: Any, model_dir: Path, clock: Any, bundle: Any = None, settings: Settings | None = None
    ) -> None:
        from cosyserve.settings import Settings

        self.settings = settings if settings is not None else Settings()  # the defaults
        self._pipeline = pipeline
        self.model_dir = model_dir
        self.clock = clock
        self.bundle = bundle
        self._parts: Any = None
        self.zero_shot_thread: Any = None  # set when the zero-shot tier loads in the background
        self.text_thread: Any = None  # set when the text normalisers load in the background
        self.warmup_thread: Any = None  # set when the flow and vocoder warm up in the background
        self._configure_modes()

    def warm_up(self, max_tokens: int = 2) -> None:
        """Run every component once on tiny dummy inputs (the LLM's prefill and ``max_tokens`` decode steps, one
        flow step, the vocoder) so one-time costs (allocator, kernel set-up) are paid now, not by the first
        request. One layer of each stack of identical layers runs (the costs are per kernel and shape; a full pass
        costs ~5x as much here), and the first touch of the weights is the loader's job. The text frontend is not
        loaded here (see ``load``)."""
        with self.clock.phase("warmup"):
            self._pipeline.llm.warm_up(max_tokens)
            self._warm_up_token2wav(max_tokens)

    def _warm_up_token2wav(self, max_tokens: int) -> None:
        # leaves the modules as they were, so it may run while requests do (see one_layer_per_stack)
        t2w = self._pipeline.token2wav
        mel = t2w.flow.warm_up(max_tokens)
        t2w.hift.warm_up(mel.shape[2])

    @property
    def speakers(self) -> list[str]:
        """Pre-defined speaker ids (from spk2info.pt), sorted, then the default tenant's registered speakers
        (see :meth:`list_speakers`) that are not pre-defined, sorted."""
        builtin = sorted(self._pipeline.speakers)
        registry = self._pipeline.registry
        registered = registry.names() if registry is not None else []
        return builtin + [n for n in registered if n not in self._pipeline.speakers]

    @property
    def sample_rate(self) -> int:
        return self._pipeline.sample_rate

    def synthesize(
        self,
        text: str = "",
        speaker: str | None = None,
        *,
        stream: bool = False,
        speed: float = 1.0,
        seed: int | None = None,
        mode: str | None = None,
        prompt_text: str = "",
        prompt_wav: Any = None,
        source_wav: Any = None,
        instruct_text: str = "",
        tenant: str = "default",
    ) -> Iterator[np.ndarray]:
        """Yield float32 mono audio chunks (1-D numpy arrays at ``sample_rate``) of ``speaker`` saying ``text``.

        The request is checked and its prompt features extracted before this returns; errors raise here.

        Args:
            text: text to speak (split into sentences internally); not for vc.
            speaker: one of :attr:`speakers`: a pre-defined speaker (sft, instruct) or a registered voice
                (zero_shot, cross_lingual).
            stream: yield ~2 s chunks as soon as they exist (True) or one chunk per sentence (False).
            speed: tempo in [0.25, 4.0]; only with ``stream=False``, as in the reference.
            seed: makes the audio reproducible; ``None`` picks a random seed.
            mode: ``sft``, ``zero_shot``, ``cross_lingual``, ``instruct`` or ``vc`` (see
                :mod:`cosyserve.engine.modes` for the fields each takes). ``None``: ``zero_shot`` when
                ``speaker`` is a registered voice, else ``sft``.
            prompt_text: transcript of ``prompt_wav`` (zero_shot).
            prompt_wav: the voice to clone (zero_shot, cross_lingual, vc): a path or the file's bytes.
            source_wav: the recording to convert (vc): a path or bytes.
            instruct_text: the style instruction (instruct, with a -Instruct model).
            tenant: registry namespace in which ``speaker`` is looked up.
        Raises:
            cosyserve.engine.pipeline.SynthesisError: unknown speaker, empty text, bad option or field combination.
            cosyserve.frontend.zeroshot.ModeUnavailableError: the model lacks the mode's ONNX models, or instruct
                mode on a model that is not an instruct model.
            cosyserve.frontend.audio.AudioError: unusable prompt or source audio.
        """
        if mode is None:
            mode = "sft"
            registry = self._pipeline.registry
            if speaker and speaker not in self._pipeline.speakers and registry is not None:
                registered = registry.get(speaker, tenant)
                if registered is not None and registered.kind == "zero_shot":
                    mode = "zero_shot"
        return self.synthesize_request(
            self.request(
                mode=mode,
                text=text,
                speaker=speaker,
                prompt_text=prompt_text,
                prompt_wav=prompt_wav,
                source_wav=source_wav,
                instruct_text=instruct_text,
                stream=stream,
                speed=speed,
                seed=seed,
                tenant=tenant,
            )
        )

    def synthesize_all(self, text: str = "", speaker: str | None = None, **kwargs: Any) -> np.ndarray:
        """The whole utterance as one float32 array (same arguments as :meth:`synthesize`)."""
        chunks = list(self.synthesize(text, speaker, **kwargs))
        import numpy as np

        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)

    # --- modes and the speaker registry (issue 6) ---------------------------------------------------------------

    def _configure_modes(self) -> None:
        # ONNX paths from the bundle (nothing is loaded) and the registry location (nothing is read)
        from cosyserve.engine.pipeline import ONNX_FILES
        from cosyserve.registry import SpeakerRegistry, default_registry_dir

        if self.bundle is not None:
            bundle = self.bundle
            paths = {name: bundle.onnx_path(name) for name in ONNX_FILES}
            self._pipeline.set_onnx_paths(
                paths, self.model_dir, check=lambda path: bundle.check_onnx(path.name)
            )
            self._pipeline.instruct = bundle.instruct
        if self._pipeline.registry is None:
            key = self.bundle.model_key if self.bundle is not None else None
            root = default_registry_dir(
                self.model_dir,
                key,
                registry_dir=self.settings.registry_dir,
                cache_dir=self.settings.cache_dir,
            )
            self._pipeline.registry = SpeakerRegistry(root)

    @staticmethod
    def request(**fields: Any) -> Any:
        """A :class:`cosyserve.engine.pipeline.SynthesisRequest` (its fields as keyword arguments)."""
        from cosyserve.engine.pipeline import SynthesisRequest

        return SynthesisRequest(**fields)

    def synthesize_request(self, request: Any) -> Iterator[np.ndarray]:
        """Run a :class:`cosyserve.engine.pipeline.SynthesisRequest`; checks and prompt extraction happen before
        this returns, then the generator yields float32 audio chunks."""
        return self._pipeline.run(request)

    @property
    def available_modes(self) -> list[str]:
        """Modes this model can run: sft always; instruct on an instruct model (CosyVoice-300M-Instruct);
        zero_shot, cross_lingual and vc need campplus.onnx and speech_tokenizer_v1.onnx (see
        :meth:`unavailable_modes` for why one is missing)."""
        return self._pipeline.available_modes()

    def unavailable_modes(self) -> dict[str, str]:
        """mode -> why this model cannot run it (empty when all can)."""
        return self._pipeline.unavailable_modes()

    @property
    def registry(self) -> Any:
        """The :class:`cosyserve.registry.SpeakerRegistry` (the ``registry_dir`` setting or the cache dir)."""
        return self._pipeline.registry

    def use_registry(self, root: str | Path) -> None:
        """Keep registered speakers under ``root`` instead of the default location."""
        from cosyserve.registry import SpeakerRegistry

        self._pipeline.registry = SpeakerRegistry(root)

    def add_speaker(
        self,
        name: str,
        prompt_wav: Any,
        prompt_text: str,
        *,
        tenant: str = "default",
        overwrite: bool = False,
        normalize: bool = True,
    ) -> Any:
        """Clone a voice once and keep it under ``name``: later zero_shot / cross_lingual requests with
        ``speaker=name`` skip the extraction. Persists across restarts.

        Args:
            name: 1-64 characters, no path separators; not a pre-defined speaker.
            prompt_wav: the voice (a path or the file's bytes; at most 30 s).
            prompt_text: its transcript.
            tenant: registry namespace.
            overwrite: replace an existing registration of ``name``.
            normalize: run the text frontend on ``prompt_text`` first (as zero_shot requests do).
        Returns:
            The registered :class:`cosyserve.registry.Speaker`.
        """
        return self._pipeline.add_speaker(
            name, prompt_wav, prompt_text, tenant=tenant, overwrite=overwrite, normalize=normalize
        )

    def remove_speaker(self, name: str, *, tenant: str = "default") -> None:
        """Delete a registered speaker (pre-defined speakers cannot be removed)."""
        if name in self._pipeline.speakers:
            raise ValueError(
                f"{name!r} is a pre-defined speaker of the model (spk2info.pt); it cannot be removed"
            )
        self._pipeline.registry.remove(name, tenant)

    def list_speakers(self, tenant: str = "default") -> list[Any]:
        """The registered :class:`cosyserve.registry.Speaker` entries of ``tenant``, sorted by name."""
        return self._pipeline.registry.list(tenant)

    def import_speakers(self, path: str | Path, *, tenant: str = "default", overwrite: bool = False) -> Any:
        """Register the entries of a reference ``spk2info.pt`` (read with ``torch.load(weights_only=True)``); this
        model's pre-defined speakers in it are skipped. Returns an :class:`cosyserve.registry.ImportResult`."""
        return self._pipeline.registry.import_spk2info(
            path, tenant=tenant, overwrite=overwrite, reserved=self._pipeline.speakers
        )

    def export_speakers(
        self, path: str | Path, *, tenant: str = "default", include_builtin: bool = False
    ) -> list[str]:
        """Write ``tenant``'s registered speakers (and with ``include_builtin`` the pre-defined ones) as a
        reference ``spk2info.pt``. Returns the names written."""
        extra = self._pipeline.speakers if include_builtin else None
        return self._pipeline.registry.export_spk2info(path, tenant=tenant, extra=extra)


def _load_text_tier() -> None:
    from cosyserve.frontend.text import load_normalizers
    from cosyserve.frontend.tokenizer import get_tokenizer

    get_tokenizer()
    load_normalizers()


def _after_ready(steps: list[tuple[str, Any]], clock: Any) -> Any:
    """Run each ``(phase, work)`` of ``steps`` in turn in one thread after READY, timed as ``phase``; a
    failure is logged and the next step runs (the first request that needs a failed tier raises the same error
    with its context)."""
    import threading

    def run() -> None:
        for phase, work in steps:
            start, t = clock.now_ms(), time.perf_counter()
            try:
                work()
            except Exception:  # noqa: BLE001 - see above
                logger.warning("background %s failed", phase.replace("_", " "), exc_info=True)
                continue
            clock.add(phase, (time.perf_counter() - t) * 1e3, start)

    # not a daemon: a process that exits during a step waits for it (bounded, well under a second) instead of
    # tearing torch down under a kernel that still runs ("terminate called without an active exception")
    thread = threading.Thread(target=run, name=f"cosyserve-{steps[0][0]}", daemon=False)
    thread.start()
    return thread


def resolve_bundle(path: str | Path, *, progress: bool = True, settings: Settings | None = None) -> Path:
    """A bundle for ``path``: the path itself if it is a bundle; for an official model dir, a bundle converted
    into the cache dir (the ``cache_dir`` setting), reused while the source files are unchanged; for a hub id
    (``iic/...``, ``FunAudioLLM/...``: :func:`cosyserve.hub.resolve_model`), the same for its download.

    Args:
        path: bundle, official model directory or hub id.
        progress: log the conversion's steps.
        settings: a :class:`cosyserve.settings.Settings` (default: read from the environment).
    Returns:
        The bundle's folder.
    """
    import hashlib

    from cosyserve.bundle.loader import is_bundle
    from cosyserve.errors import ModelDirError
    from cosyserve.hub import resolve_model
    from cosyserve.settings import Settings

    cache_dir = (settings if settings is not None else Settings.load()).cache_dir
    path = resolve_model(path)
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
    target = cache_dir / "bundles" / f"{path.resolve().name}-{key.hexdigest()[:16]}"
    if not is_bundle(target):
        from cosyserve.bundle.convert import convert

        progress_logger.info(
            "converting %s into the bundle cache %s (once; later runs reuse it)", path, target
        )
        convert(path, target, force=True, progress=progress)
    return target


def load(
    path: str | Path,
    *,
    settings: Settings | None = None,
    threads: int | None = None,
    strategy: str | None = None,
    verify: str | None = None,
    warmup: bool | None = None,
    warmup_tokens: int | None = None,
    use_mmap: bool | None = None,
    clock: Any = None,
    **overrides: Any,
) -> CosyVoiceModel:
    """Load a model: a bundle (``cosyserve convert``), or an official CosyVoice-300M model directory
    (cosyvoice.yaml, llm.pt, flow.pt, hift.pt, spk2info.pt), converted once into the cache and reused.

    Nothing in a model directory is executed: the yaml is read by a safe loader, the weights with
    ``torch.load(weights_only=True)`` (conversion only) and safetensors (serving). Keyword arguments left
    ``None`` come from ``settings``; without ``settings``, from the environment (see :mod:`cosyserve.settings`).

    Args:
        path: bundle, official model directory or hub id (``iic/CosyVoice-300M-SFT``; needs the ``hub`` extra).
        settings: a :class:`cosyserve.settings.Settings` (default: ``Settings.load()``, the environment).
        threads: torch intra-op threads (env ``COSYSERVE_THREADS``; default torch's choice).
        strategy: ``preload`` / ``lazy`` / ``prefetch`` (env ``COSYSERVE_PRELOAD``).
        verify: bundle checksum policy ``stamp`` / ``full`` / ``none`` (env ``COSYSERVE_VERIFY``).
        warmup: run every component once on dummy inputs: the LLM before returning, the flow and the vocoder
            right after, in the background (``warmup_thread``; env ``PREWARM_MODELS``; default on).
        warmup_tokens: speech tokens the warm-up generates (env ``COSYSERVE_WARMUP_TOKENS``; default 2).
        use_mmap: map the weights (True) or copy them into private memory (env ``USE_MMAP_LOADING``).
        clock: a :class:`cosyserve.startup.PhaseClock` to record the phases in.
        overrides: any other setting by name (``text_tier="lazy"``, ``registry_dir=...``).
    Returns:
        A :class:`CosyVoiceModel`.
    Raises:
        ConfigError, ModelDirError, BundleError, SettingsError (all ValueError): the input cannot be used.
    """
    from cosyserve.settings import Settings
    from cosyserve.startup import gc_held

    given = dict(
        threads=threads, strategy=strategy, verify=verify, warmup=warmup, warmup_tokens=warmup_tokens,
        use_mmap=use_mmap, **overrides,
    )  # fmt: skip
    settings = (settings if settings is not None else Settings.load()).replace(
        where="cosyserve.load", **given
    )
    # no garbage collection while loading; what loading built is frozen after (cosyserve.startup.hold_gc)
    with gc_held():
        model = _load(path, settings, clock)
    return model


def _load(path: str | Path, settings: Settings, clock: Any) -> CosyVoiceModel:
    from cosyserve.startup import PhaseClock

    clock = clock or PhaseClock()
    strategy, verify, warmup, use_mmap = (
        settings.strategy,
        settings.verify,
        settings.warmup,
        settings.use_mmap,
    )
    warmup_tokens, threads = settings.warmup_tokens, settings.threads
    tier, text_tier = settings.zero_shot_tier, settings.text_tier
    with clock.phase("imports"):
        import torch

        import cosyserve.models.flow
        import cosyserve.models.hift
        import cosyserve.models.llm  # noqa: F401 - the model code is import time, not load time
        from cosyserve.bundle.loader import LoadOptions, open_bundle, start_prefetch
        from cosyserve.engine.pipeline import Pipeline
        from cosyserve.engine.token2wav import StreamPolicy

    if threads:
        torch.set_num_threads(threads)
    from cosyserve.hub import resolve_model

    path = resolve_model(path)  # a hub id -> its download, which is the model dir from here on
    bundle_dir = resolve_bundle(path, settings=settings)
    t_load = time.perf_counter()
    with clock.phase("manifest"):
        bundle = open_bundle(bundle_dir)
    parts = bundle.load(LoadOptions(strategy=strategy if use_mmap else "lazy", verify=verify), clock)  # type: ignore[arg-type]
    # wall clock of the whole load (the phases above are summed over the loader threads)
    clock.add("load_wall", (time.perf_counter() - t_load) * 1e3)
    if not use_mmap:
        with clock.phase("first_touch"):
            for module in parts.modules.values():
                for p in module.parameters():
                    p.data = p.data.clone()
    with clock.phase("construct"):
        cfg = bundle.config
        flow = parts.modules["flow"]
        policy = StreamPolicy(input_frame_rate=flow.input_frame_rate, sample_rate=cfg.sample_rate)
        pipeline = Pipeline(
            parts.modules["llm"], flow, parts.modules["hift"], parts.speakers, cfg.sample_rate, policy
        )
    model = CosyVoiceModel(pipeline, Path(path), clock, bundle, settings)
    if warmup:
        # the LLM is what a request runs first; flow and vocoder run only once ~2 s of speech tokens exist
        # (seconds later), so they warm up after READY, below (~0.1 s off the start)
        with clock.phase("warmup"):
            pipeline.llm.warm_up(warmup_tokens)
    clock.mark("ready")
    if strategy == "prefetch" and use_mmap:
        start_prefetch(parts)
    after: list[tuple[str, Any]] = []
    if text_tier == "background":
        # the tokenizer (~60 ms) and wetext's normalisers (~0.25 s): the first request's text needs them, a
        # start does not (the warm-up runs on token ids)
        after.append(("text_tier", _load_text_tier))
    if warmup:
        after.append(("warmup_token2wav", lambda: model._warm_up_token2wav(warmup_tokens)))
    if after:
        thread = _after_ready(after, clock)
        model.text_thread = thread if text_tier == "background" else None
        model.warmup_thread = thread if warmup else None
    if tier == "background" and "zero_shot" in pipeline.available_modes():
        # the ONNX sessions (speaker embedding, speech tokenizer) never delay an SFT start
        model.zero_shot_thread = _after_ready(
            [("zero_shot_tier", lambda: pipeline.frontend().load_sessions())], clock
        )
    model._parts = parts
    logger.info("ready in %.0f ms since process start (%s)", clock.points["ready"], clock.durations)
    return model
