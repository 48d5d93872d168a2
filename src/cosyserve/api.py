"""The public Python API: ``cosyserve.load(path)`` and the model it returns.

The model is a thin face over a :class:`cosyserve.runtime.Runtime`: every call builds one
:class:`~cosyserve.core.request.SynthesisRequest` through the one constructor every entry point uses
(:meth:`cosyserve.core.limits.Limits.request`: the limits of the settings it was loaded with, as the server's requests
are checked) and runs it on the runtime in the caller's thread.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cosyserve.bundle.sources import resolve_bundle
from cosyserve.core.limits import Limits
from cosyserve.core.request import SynthesisRequest

if TYPE_CHECKING:
    import numpy as np

    from cosyserve.core.settings import Settings
    from cosyserve.runtime import Runtime, RuntimeOptions

logger = logging.getLogger(__name__)

__all__ = [
    "CosyVoiceModel",
    "apply_omp_wait_policy",
    "choose_runtime",
    "load",
    "quiet_onnxruntime",
    "resolve_bundle",
    "runtime_options",
]

# what a torch-free install lacks, and how to add it (docs/usage.md: Install)
TORCH_INSTALL = "pip install torch==2.13.0 (the CPU build; or 'cosyserve[torch]')"


class CosyVoiceModel:
    """A loaded model: ``speakers``, ``sample_rate``, ``synthesize`` and the voice registry.

    Build it with :func:`load`; ``runtime`` is the :class:`cosyserve.runtime.Runtime` it runs on, ``limits`` the
    :class:`~cosyserve.core.limits.Limits` its requests are built within (the settings' it was loaded with).
    """

    def __init__(self, runtime: Runtime, limits: Limits | None = None) -> None:
        self.runtime = runtime
        self.limits = limits if limits is not None else Limits()
        # a runtime serves `slots` requests at once (its LM keeps one request's caches on the module when it has
        # one slot): calls from more threads than that wait their turn instead of sharing the caches
        self._slots = threading.Semaphore(max(1, int(runtime.slots)))

    @property
    def clock(self) -> Any:
        """The start clock of the load (phases and points, as ``cosyserve startup-report`` shows them)."""
        return self.runtime.clock

    @property
    def sample_rate(self) -> int:
        return self.runtime.sample_rate

    @property
    def speakers(self) -> list[str]:
        """Pre-defined speaker ids (from spk2info.pt), sorted, then the default tenant's registered voices, sorted."""
        return [v.name for v in self.runtime.voices("default")]

    @property
    def available_modes(self) -> list[str]:
        """Modes this model can run: sft always; instruct on an instruct model (CosyVoice-300M-Instruct);
        zero_shot, cross_lingual and vc with campplus.onnx and speech_tokenizer_v1.onnx (see
        :meth:`unavailable_modes` for why one is missing)."""
        return [m for m, why in self.runtime.modes().items() if why is None]

    def unavailable_modes(self) -> dict[str, str]:
        """mode -> why this model cannot run it (empty when all can)."""
        return {m: why for m, why in self.runtime.modes().items() if why is not None}

    def warm_up(self) -> None:
        """Run every component once on dummy inputs (``cosyserve.load`` already warms the model up)."""
        self.runtime.warm_up()

    def synthesize(
        self,
        text: str | Iterable[str] = "",
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

        The request is checked (:meth:`request`) and its prompt features extracted before this returns; errors
        raise here.

        Args:
            text: text to speak (split into sentences internally); or an iterable of its pieces as they arrive (an
                LLM's output: spoken while it is still being written, see :mod:`cosyserve.core.textfeed`); not for vc.
            speaker: one of :attr:`speakers`: a pre-defined speaker (sft, instruct) or a registered voice
                (zero_shot, cross_lingual); None: the model's default voice (sft, instruct).
            stream: yield chunks as soon as they exist (True; the `chunk_policy` setting: by default a short
                first chunk, then longer ones) or one chunk per sentence (False).
            speed: tempo in [0.25, 4.0]; only with ``stream=False``, as in the reference.
            seed: makes the audio reproducible; ``None`` picks a random seed.
            mode: a mode of :data:`cosyserve.core.modes.MODE_TABLE` (the fields each takes, and what it
                does); the model's family says which it serves (:attr:`available_modes`). ``None``: ``zero_shot`` when
                ``speaker`` is a registered zero-shot voice, else ``sft``.
            prompt_text: transcript of ``prompt_wav`` (zero_shot).
            prompt_wav: the voice to clone (zero_shot, cross_lingual, vc): a path or the file's bytes.
            source_wav: the recording to convert (vc): a path or bytes.
            instruct_text: the style instruction (instruct, with a -Instruct model).
            tenant: registry namespace in which ``speaker`` is looked up.
        Raises:
            cosyserve.core.errors.ClientError: a bad request (a field over its limit; unknown speaker:
                UnknownVoiceError; a mode the model cannot run: ModeUnavailableError; unusable prompt or source
                audio: AudioError).
        """
        return self.synthesize_request(
            self.request(
                text,
                speaker,
                stream=stream,
                speed=speed,
                seed=seed,
                mode=mode,
                prompt_text=prompt_text,
                prompt_wav=prompt_wav,
                source_wav=source_wav,
                instruct_text=instruct_text,
                tenant=tenant,
            )
        )

    def request(
        self, text: str | Iterable[str] = "", speaker: str | None = None, **fields: Any
    ) -> SynthesisRequest:
        """The :class:`~cosyserve.core.request.SynthesisRequest` :meth:`synthesize` runs (same arguments), built within
        :attr:`limits` by the one constructor every entry point uses; text given as pieces is checked piece by
        piece as it is read.

        Raises:
            cosyserve.core.errors.ClientError: a field over its limit, or a request that cannot be served as given
                (``param`` names the field).
        """
        return self.limits.request(text=text, speaker=speaker, **fields)

    def synthesize_all(self, text: str = "", speaker: str | None = None, **kwargs: Any) -> np.ndarray:
        """The whole utterance as one float32 array (same arguments as :meth:`synthesize`)."""
        import numpy as np

        chunks = list(self.synthesize(text, speaker, **kwargs))
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)

    def synthesize_request(self, request: SynthesisRequest) -> Iterator[np.ndarray]:
        """Run a :class:`~cosyserve.core.request.SynthesisRequest` to its end in this thread (no deadline is enforced:
        that is the engine's job); checks and prompt extraction happen before this returns. The request runs as
        given: build it with :meth:`request` for the limits. A chunk with NaN or
        infinite samples raises :class:`~cosyserve.core.errors.InternalError` instead of being returned, as the
        server's engine does. Thread-safe: iterations from more threads than the runtime's ``slots`` (1 unless
        loaded with ``batch_size``) take turns, each holding a slot from its first chunk to its end (or close)."""
        return _finite(self.runtime.start(request, _never), self._slots)

    # -- the voice registry ---------------------------------------------------------------------------------------

    def add_speaker(
        self,
        name: str,
        prompt_wav: Any,
        prompt_text: str,
        *,
        tenant: str = "default",
        overwrite: bool = False,
    ) -> Any:
        """Clone a voice once and keep it under ``name``: later requests with ``speaker=name`` speak in it
        (zero_shot) and skip the extraction. Persists across restarts.

        Args:
            name: 1-64 characters, no path separators; not a pre-defined speaker.
            prompt_wav: the voice (a path or the file's bytes; at most 30 s).
            prompt_text: its transcript.
            tenant: registry namespace.
            overwrite: replace an existing registration of ``name``.
        Returns:
            The registered :class:`cosyserve.voices.registry.Speaker`.
        """
        return self.runtime.add_voice(name, prompt_wav, prompt_text, tenant=tenant, overwrite=overwrite)

    def remove_speaker(self, name: str, *, tenant: str = "default") -> None:
        """Delete a registered voice (pre-defined speakers cannot be removed)."""
        self.runtime.remove_voice(name, tenant=tenant)

    def list_speakers(self, tenant: str = "default") -> list[str]:
        """The names of the voices registered for ``tenant``, sorted."""
        return [v.name for v in self.runtime.voices(tenant) if v.kind == "registered"]

    def import_speakers(self, path: str | Path, *, tenant: str = "default", overwrite: bool = False) -> Any:
        """Register the entries of a reference ``spk2info.pt`` (read with ``torch.load(weights_only=True)``); this
        model's pre-defined speakers in it are skipped. Returns an :class:`cosyserve.voices.registry.ImportResult`."""
        return self.runtime.import_voices(path, tenant=tenant, overwrite=overwrite)

    def export_speakers(
        self, path: str | Path, *, tenant: str = "default", include_builtin: bool = False
    ) -> list[str]:
        """Write ``tenant``'s registered voices (and with ``include_builtin`` the pre-defined ones) as a
        reference ``spk2info.pt``. Returns the names written."""
        return self.runtime.export_voices(path, tenant=tenant, include_builtin=include_builtin)

    def close(self) -> None:
        """Stop the runtime's threads and drop its weights."""
        self.runtime.close()


def _finite(chunks: Iterator[np.ndarray], slots: threading.Semaphore) -> Iterator[np.ndarray]:
    from cosyserve.engine.engine import check_finite

    with slots:  # taken when the first chunk is asked for: a generator never iterated holds nothing
        try:
            for chunk in chunks:
                check_finite(chunk)
                yield chunk
        finally:
            getattr(chunks, "close", lambda: None)()  # a generator stopped early frees its state now


def _never() -> bool:
    return False


def runtime_options(settings: Settings | None = None, **overrides: Any) -> RuntimeOptions:
    """The :class:`~cosyserve.runtime.RuntimeOptions` that ``settings`` (default: the environment's, read now) ask
    for, with ``overrides`` (not None) winning: a setting's name is checked as that setting is (a bad value is a
    :class:`~cosyserve.core.errors.SettingsError` naming ``cosyserve.load``), any other field of the options is taken as
    given."""
    from cosyserve.core.settings import Settings, declared
    from cosyserve.runtime import RuntimeOptions

    given = {k: v for k, v in overrides.items() if v is not None}
    fields = {f.name for f in dataclasses.fields(RuntimeOptions)}
    names = {d.name for d in declared()}
    unknown = set(given) - fields - names
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(sorted(unknown))}")
    settings = (settings if settings is not None else Settings.load()).replace(
        where="cosyserve.load", **{k: v for k, v in given.items() if k in names}
    )
    # an option given here wins, checked as its setting where it is one (batch_size: a pool default otherwise)
    chosen = {k: getattr(settings, k) if k in names else v for k, v in given.items() if k in fields}
    return RuntimeOptions.from_settings(settings, **chosen)


def quiet_onnxruntime() -> None:
    """Turn ONNX Runtime's telemetry off in this process and its children, unless ``ORT_DISABLE_TELEMETRY`` is
    set already; effective when called before ``onnxruntime`` is first imported (it reads the variable then).

    From 1.29 on Linux, ONNX Runtime uploads usage events to Microsoft, keeps a device id file (``.ses``) and
    leaves an empty ``mat-debug-<pid>.log`` in the temp dir of every process that imports it.
    """
    os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")


def apply_omp_wait_policy(policy: str) -> None:
    """Set ``OMP_WAIT_POLICY`` for this process and its children from the ``omp_wait_policy`` setting, unless the
    environment sets it already or the setting is ``unset``. libgomp reads it once, when torch is first imported:
    call this before. Beside another busy process on the same cores, spinning threads take the time the other
    needs and both slow down (bench/omp_wait.py measures it)."""
    if policy != "unset" and not os.environ.get("OMP_WAIT_POLICY", "").strip():  # blank: libgomp ignores it
        os.environ["OMP_WAIT_POLICY"] = policy.upper()


def choose_runtime(source: str | Path, settings: Settings, runtime: str | None = None) -> str:
    """The runtime that loads ``source``: ``runtime`` when given, else the ``runtime`` setting, whose default is
    ``torch`` where torch is installed and ``lite`` where it is not (said at INFO).

    Args:
        source: the model (see :mod:`cosyserve.bundle.sources`).
        settings: the settings (their ``runtime``, and where it came from).
        runtime: a runtime the caller names itself (None: the setting's).
    Returns:
        ``torch`` or ``lite``.
    Raises:
        cosyserve.core.errors.InputError: torch is not installed and ``source`` needs it: the torch runtime was chosen,
            or the lite runtime by default for a model that is not a bundle converted with ``--runtime lite``.
        cosyserve.core.errors.SettingsError: the ``device`` setting names a device the chosen runtime cannot use here
            (:func:`cosyserve.system.device.check_device`: checked once at start, before anything loads).
    """
    from cosyserve.bundle.sources import has_lite_files
    from cosyserve.core.errors import InputError
    from cosyserve.core.settings import torch_installed
    from cosyserve.system.device import check_device, device_given

    chosen = runtime or settings.runtime
    lite_files = has_lite_files(source)
    if chosen == "torch" and not torch_installed():
        by = f"runtime={runtime!r}" if runtime else f"chosen by {settings.where('runtime')}"
        alternative = " (it is a lite bundle: --runtime lite serves it without torch)" if lite_files else ""
        raise InputError(
            f"{source}: the torch runtime ({by}) needs torch, which is not installed: {TORCH_INSTALL}"
            f"{alternative}"
        )
    if chosen == "lite" and runtime is None and settings.origin("runtime") == "default":
        if not lite_files:
            raise InputError(
                f"{source}: torch is not installed, and this is not a bundle converted with `--runtime lite`, which "
                f"is all that runs without torch: {TORCH_INSTALL}; or convert it with `cosyserve convert MODEL_DIR "
                "BUNDLE --runtime lite` where torch is, and serve that bundle"
            )
        logger.info("torch is not installed: %s runs on the lite runtime (ONNX Runtime)", source)
    check_device(settings.device, chosen, device_given(settings))
    return chosen


def load(
    path: str | Path,
    *,
    settings: Settings | None = None,
    clock: Any = None,
    runtime: str | None = None,
    **options: Any,
) -> CosyVoiceModel:
    """Load a model: a bundle (``cosyserve convert``), an official CosyVoice-300M model directory
    (cosyvoice.yaml, llm.pt, flow.pt, hift.pt, spk2info.pt; converted once into the cache and reused), a hub id
    (``iic/CosyVoice-300M-SFT``; needs the ``hub`` extra) or ``demo``.

    Nothing in a model directory is executed: the yaml is read by a safe loader, the weights with
    ``torch.load(weights_only=True)`` (conversion only) and safetensors (serving).

    Args:
        path: what to load (see :mod:`cosyserve.bundle.sources`).
        settings: a :class:`cosyserve.core.settings.Settings` (default: ``Settings.load()``, the environment).
        clock: a :class:`cosyserve.core.clock.PhaseClock` to record the phases in.
        runtime: which runtime runs it (a key of :data:`cosyserve.runtime.RUNTIMES`; None: the ``runtime``
            setting: ``torch``, or ``lite`` where torch is not installed, unless COSYSERVE_RUNTIME says otherwise).
        options: settings by name (``device``, ``threads``, ``strategy``, ``verify``, ``warmup``,
            ``warmup_tokens``, ``use_mmap``, ``text_tier``, ``registry_dir``, the limits of a request such as
            ``max_text_chars``, ...) or fields of
            :class:`cosyserve.runtime.RuntimeOptions` (``batch_size``, ``batch_flow``, ...); those not given (or
            None) come from ``settings``.
    Returns:
        A :class:`CosyVoiceModel`.
    Raises:
        cosyserve.core.errors.InputError: the model, a setting or an option cannot be used (ModelDirError,
            ModelConfigError, BundleError, SettingsError), needs torch where it is not installed, or ``device``
            names one this machine or the runtime does not have (``device='cuda'`` without CUDA).
    """
    from cosyserve.core.settings import Settings, declared
    from cosyserve.runtime import load_runtime

    quiet_onnxruntime()
    settings = settings if settings is not None else Settings.load()
    names = {d.name for d in declared()}
    given = {k: v for k, v in options.items() if v is not None and k in names}
    if given:  # checked now (the device with the runtime's choice), before anything loads; the limits kept
        settings = settings.replace(where="cosyserve.load", **given)
    runtime = choose_runtime(path, settings, runtime)
    return CosyVoiceModel(
        load_runtime(path, runtime_options(settings, **options), runtime=runtime, clock=clock),
        Limits.from_settings(settings),
    )
