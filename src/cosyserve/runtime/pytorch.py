"""The torch runtime: our PyTorch modules over a bundle's mapped weights, every CosyVoice-300M mode.

:func:`load` opens the bundle (converting an official model dir once into the cache), builds the modules on the
meta device and assigns the mapped tensors, wires the :class:`~cosyserve.runtime.pipeline.Pipeline` with the
LM's decode loop (``batch_size`` rows) and the flow/vocoder batchers its options ask for, warms the LM up and returns READY. The rest of the
start (text normalisers, flow and vocoder warm-up, optionally the zero-shot tier's ONNX sessions) runs in one
background thread right after: a request needs them only later.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cosyserve.core.request import SynthesisRequest
from cosyserve.runtime import RuntimeOptions
from cosyserve.runtime.cores import CoreShare
from cosyserve.runtime.decode import DecodeLoop
from cosyserve.runtime.modes import RuntimeVoices
from cosyserve.runtime.pipeline import Pipeline
from cosyserve.system.device import factory_device

logger = logging.getLogger(__name__)

__all__ = ["TorchRuntime", "load"]


class TorchRuntime(RuntimeVoices):
    """A loaded CosyVoice-300M model on torch: implements :class:`cosyserve.runtime.Runtime`.

    Build it with :func:`load`. ``pipeline`` (its modules and input assembly) is public for this runtime's own
    tests, benchmarks and tools (the quality gate holds a TorchRuntime, typed so); nothing that holds a
    :class:`~cosyserve.runtime.Runtime` reads it (tests/test_contracts.py).
    """

    def __init__(
        self,
        pipeline: Pipeline,
        options: RuntimeOptions,
        clock: Any,
        bundle: Any,
        parts: Any,
        threads: int | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.options = options
        self.clock = clock
        self.bundle = bundle
        self.sample_rate = int(pipeline.sample_rate)
        self.slots = options.batch_size
        self.precision: dict[str, str] = {}  # component -> its compute dtype and why (set by load)
        self._parts = parts
        self._lm = pipeline.llm  # the model itself (what warm-up runs)
        self._batchers: list[Any] = []
        # the threads its requests share (worker_threads: a fixed count per request instead)
        self.cores = CoreShare(threads or options.threads or torch.get_num_threads())
        # what a fork template leaves to its children
        self._after_fork: list[tuple[str, Callable[[], None]]] = []
        self.text_thread: threading.Thread | None = None  # the text tier, when it loads after READY
        self.warmup_thread: threading.Thread | None = None  # the flow and vocoder warm-up after READY
        self.background: threading.Thread | None = None  # the thread of both (and pipeline.after_ready)
        self.zero_shot_thread: threading.Thread | None = None  # the ONNX sessions, when they load after READY
        name = self.bundle.path.name if self.bundle is not None else "model"
        # the runtime's slots share one model: their LM steps run as one batch in the model's decode loop, whose
        # thread takes the cores' share of a request (or worker_threads) before every step
        self.autopack = _autopack(pipeline.llm, options, name)
        pipeline.decoder = DecodeLoop(
            pipeline.llm, options.batch_size, before_step=self._before_step(options), name=name
        )
        self._batchers.append(pipeline.decoder)
        if options.batch_size > 1:
            self._install_batchers(options, name)

    def _before_step(self, options: RuntimeOptions) -> Callable[[int], Any]:
        threads = self._loop_threads(options)
        if self.autopack is None:
            return threads
        pack = self.autopack.rows

        def before(serves: int = 1) -> None:
            pack(serves)  # llm_gemm=auto: a first batched step packs the LM's decode linears (models/gemm.py)
            threads(serves)

        return before

    def _loop_threads(self, options: RuntimeOptions) -> Callable[[int], Any]:
        if not options.worker_threads:
            return self.cores.apply
        n = options.worker_threads

        def fixed(serves: int = 1) -> None:
            if torch.get_num_threads() != n:
                torch.set_num_threads(n)

        return fixed

    def _install_batchers(self, options: RuntimeOptions, name: str) -> None:
        # flow and vocoder run concurrently in the request threads (they keep no per-call state on the modules),
        # or stacked where shapes match
        from cosyserve.runtime.stacking import ChunkFlowBatcher, FlowBatcher, Gathering, VocoderBatcher

        if not options.batch_flow:
            return
        family = self.pipeline.family
        t2w, stacks = self.pipeline.token2wav, family.stacks
        gathering = Gathering()  # a stream waiting in one stacker is not waited for in the other
        if "flow" in stacks:
            # a flow that streams by re-running on every token so far keeps its frames in per-stream states: its
            # streams' chunks stack; a windowed flow's calls carry their cache in their arguments
            stacker = ChunkFlowBatcher if family.reruns_flow else FlowBatcher
            t2w.flow = stacker(t2w.flow, options.batch_size, name=f"{name} flow", gathering=gathering)
        if "hift" in stacks:
            t2w.hift = VocoderBatcher(
                t2w.hift, options.batch_size, name=f"{name} vocoder", gathering=gathering
            )
        alone = [part for part in ("flow", "hift") if part not in stacks]
        if alone:
            logger.warning(
                "%s: batch_flow stacks %s; this family's %s calls run alone (their state is per request)",
                name,
                " and ".join(stacks) or "nothing",
                " and ".join(alone),
            )

    def on_lm_step(self, record: Callable[[int], None]) -> None:
        self.pipeline.decoder.on_step = record

    # -- synthesis ------------------------------------------------------------------------------------------------

    def start(self, request: SynthesisRequest, should_stop: Callable[[], bool]) -> Iterator[np.ndarray]:
        if self.options.worker_threads:
            torch.set_num_threads(self.options.worker_threads)  # this thread's OpenMP pool only
            return self.pipeline.run(request, should_stop)
        self.cores.apply()  # the request's preparation (prompt audio, text) runs here already
        return self.cores.share(self.pipeline.run(request, should_stop))  # type: ignore[return-value]

    def warm_up(self) -> None:
        """Run every component once on tiny dummy inputs (the LLM's prefill and a few decode steps, one flow step,
        the vocoder), so one-time costs (allocator, kernel set-up) are paid now, not by the first request. One
        layer of each stack of identical layers runs (the costs are per kernel and shape), and the modules are
        left as they were, so it may run while requests do."""
        with self.clock.phase("warmup"):
            with factory_device(self.pipeline.device):
                _warm_up_lm(self._lm, self.options.warmup_tokens)
            self.warm_up_token2wav()

    def warm_up_token2wav(self) -> None:
        """The flow and vocoder part of :meth:`warm_up` (what ``load`` runs right after READY)."""
        t2w = self.pipeline.token2wav
        with factory_device(self.pipeline.device):  # the warm-ups' dummy inputs made on the device
            mel = t2w.flow.warm_up(self.options.warmup_tokens)
            t2w.hift.warm_up(mel.shape[2])

    # -- memory ---------------------------------------------------------------------------------------------------

    def mapped_files(self) -> list[Path]:
        return [Path(f.path) for f in self._parts.files.values()] if self._parts is not None else []

    def mapped_bytes(self) -> int:
        return int(self._parts.mapped_bytes()) if self._parts is not None else 0

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def join_background(self, timeout: float | None = None) -> None:
        """Wait for the work that runs after READY (text tier, warm-up, zero-shot tier)."""
        for t in (self.background, self.zero_shot_thread):
            if t is not None:
                t.join(timeout)

    def after_fork(self) -> None:
        # the template warmed up on one intra-op thread (a libgomp team made before fork() hangs its children):
        # the child takes up the process's threads, and starts what would have started threads in the template
        torch.set_num_threads(self.cores.cores)
        if self._after_fork:
            self.zero_shot_thread = _after_ready(self._after_fork, self.clock)
            self._after_fork = []

    def close(self) -> None:
        for batcher in self._batchers:
            batcher.close()
        self._batchers = []
        if self.autopack is not None:
            self.autopack.close()
        if self.pipeline.prompt_prefixes is not None:
            self.pipeline.prompt_prefixes.close()  # the voice states (flow and LM)
        self._parts = None


def _autopack(llm: Any, options: RuntimeOptions, name: str) -> Any:
    """llm_gemm=auto with batches: the LM's decode linears packed once a step serves several rows (None: not)."""
    if options.llm_gemm != "auto" or options.batch_size < 2:
        return None
    from cosyserve.models.gemm import AutoPack, DecodeLinear

    linears = [m for m in llm.modules() if isinstance(m, DecodeLinear)]
    pack = AutoPack(linears, name)
    return pack if pack.linears else None


def _warm_up_lm(lm: Any, n_tokens: int) -> None:
    # n_tokens through one layer of each stack (cosyserve.models.one_layer_per_stack): every kernel the LM runs
    # (prefill, cached decode, sampling) pays its one-time costs; the copy's caches are released after. Not while
    # the LM serves requests: the first layer is the model's own
    from cosyserve.models import one_layer_per_stack
    from cosyserve.runtime.oneoff import warm_up

    warm_up(one_layer_per_stack(lm), lm.warmup_input(), n_tokens)


def _run_steps(steps: list[tuple[str, Callable[[], None]]], clock: Any) -> None:
    """Run each ``(phase, work)`` of ``steps`` in turn, timed as ``phase``; a failure is logged and the next step
    runs (the first request that needs a failed tier raises the same error with its context)."""
    for phase, work in steps:
        start, t = clock.now_ms(), time.perf_counter()
        try:
            work()
        except Exception:  # noqa: BLE001 - see above
            logger.warning("background %s failed", phase.replace("_", " "), exc_info=True)
            continue
        clock.add(phase, (time.perf_counter() - t) * 1e3, start)


def _after_ready(steps: list[tuple[str, Callable[[], None]]], clock: Any) -> threading.Thread:
    """:func:`_run_steps` in one thread after READY."""
    # not a daemon: a process that exits during a step waits for it (bounded, well under a second) instead of
    # tearing torch down under a kernel that still runs ("terminate called without an active exception")
    thread = threading.Thread(
        target=_run_steps, args=(steps, clock), name=f"cosyserve-{steps[0][0]}", daemon=False
    )
    thread.start()
    return thread


def _set_precision(modules: dict[str, Any], casts: dict[str, str], quantize: bool) -> None:
    """Cast components (name -> dtype) and quantize the LLM's linears to int8, in place: private copies of what
    changes (see :func:`cosyserve.models.precision.cast_floating` and ``quantize_llm``)."""
    from cosyserve.models.precision import cast_floating, quantize_llm

    for name, want in casts.items():
        logger.info("casting %s to %s", name, want)
        cast_floating(modules[name], getattr(torch, want))
    if quantize:
        logger.info("quantizing the LLM's linears to int8")
        quantize_llm(modules["llm"])


def _precision(bundle: Any, o: RuntimeOptions, device_type: str) -> dict[str, Any]:
    """Each component's compute dtype (:func:`cosyserve.models.precision.choose_precision`), said in one INFO
    line; a half dtype asked for on a CPU that emulates it is warned about."""
    from cosyserve.models.precision import choose_precision, cpu_native

    names = ("llm", "flow", "hift")
    requested = {"llm": o.llm_dtype, "flow": o.flow_dtype, "hift": o.hift_dtype}
    chosen = choose_precision({n: bundle.component_dtype(n) for n in names}, requested, device_type)
    logger.info("precision: %s", ", ".join(f"{n} {p}" for n, p in chosen.items()))
    # the measured cost of an emulated half dtype (see cosyserve.models.precision): 8x (flow) to 50x (vocoder)
    slow = [n for n in names if requested[n] and device_type == "cpu" and not cpu_native(chosen[n].dtype)]
    if slow:
        logger.warning(
            "%s asked to compute in a half dtype this CPU has no native instructions for (AVX512-BF16/FP16, AMX): "
            "many times slower than float32; leave %s unset to have it chosen",
            " and ".join(slow),
            ", ".join(f"{n}_dtype" for n in slow),
        )
    return chosen


def _voice_states(options: RuntimeOptions, bundle: Any, flow: Any, device: Any, registry: Any) -> Any:
    """The model's :class:`~cosyserve.voices.voicestates.VoiceStates`: its bounds, and with ``voice_cache_disk`` the
    registry's folder (``registry()`` at each use: it may move); stored states are named by the weights' key,
    the flow's dtype, the device kind and the Euler steps, so a change of any recomputes them."""
    from cosyserve.voices.voicestates import VoiceStates

    dtype = next(flow.parameters()).dtype
    return VoiceStates.for_model(
        options, f"{bundle.model_key}|{dtype}|{device.type}|{options.flow_steps}", registry
    )


def load(path: str | Path, options: RuntimeOptions, clock: Any = None) -> TorchRuntime:
    """Load ``path`` (a bundle, an official model dir, a hub id or ``demo``) on torch; see
    :func:`cosyserve.runtime.load_runtime`.

    Nothing in a model directory is executed: the yaml is read by a safe loader, the weights with
    ``torch.load(weights_only=True)`` (conversion only) and safetensors (serving).
    """
    from cosyserve.system.gchold import gc_held

    # no garbage collection while loading; what loading built is frozen after (cosyserve.system.gchold.hold_gc)
    with gc_held():
        return _load(path, options, clock)


def _load(path: str | Path, o: RuntimeOptions, clock: Any) -> TorchRuntime:
    from cosyserve.core.clock import PhaseClock

    clock = clock or PhaseClock()
    with clock.phase("imports"):
        import cosyserve.bundle.loader
        import cosyserve.models.flow
        import cosyserve.models.hift
        import cosyserve.models.llm  # noqa: F401 - the model code is import time, not load time
        import cosyserve.voices.registry
        import cosyserve.voices.registry_location  # noqa: F401 - the steps below import from these, loaded here

    threads = o.threads or torch.get_num_threads()
    if o.fork_template:
        # no libgomp team in a process that will fork (its children would wait on threads they do not have):
        # one intra-op thread runs no parallel region; each child takes up `threads` in after_fork
        torch.set_num_threads(1)
    elif o.threads:
        torch.set_num_threads(o.threads)
    bundle, bundle_dir, cache_dir, parts = _open(path, o, clock)
    o = o.for_family(bundle.config.family_spec)
    device, precision = _place(bundle, parts, o, clock)
    with clock.phase("construct"):
        pipeline = _pipeline(path, o, bundle, bundle_dir, cache_dir, parts, device)
    runtime = TorchRuntime(pipeline, o, clock, bundle, parts, threads=threads)
    runtime.precision = {name: str(p) for name, p in precision.items()}
    if o.warmup:
        # the LLM is what a request runs first; flow and vocoder run only once ~2 s of speech tokens exist,
        # seconds later, so they warm up after READY, below
        with clock.phase("warmup"), factory_device(device):  # the warm-ups' dummy inputs made on the device
            _warm_up_lm(runtime._lm, o.warmup_tokens)
    clock.mark("ready")
    return _after_ready_steps(runtime, pipeline, parts, o, clock)


def _open(path: str | Path, o: RuntimeOptions, clock: Any) -> tuple[Any, Path, Path, Any]:
    """The bundle of ``path`` (converted first where it is a model dir), opened, and its modules loaded: (bundle,
    its folder, the cache folder, its parts)."""
    from cosyserve.bundle.loader import LoadOptions, open_bundle
    from cosyserve.bundle.sources import cache_dir_of, resolve_bundle

    cache_dir = cache_dir_of(Path(o.cache_dir) if o.cache_dir is not None else None)
    bundle_dir = resolve_bundle(path, cache_dir=cache_dir)
    t_load = time.perf_counter()
    with clock.phase("manifest"):
        bundle = open_bundle(bundle_dir)
    parts = bundle.load(LoadOptions(strategy=o.strategy if o.use_mmap else "lazy", verify=o.verify), clock)
    # wall clock of the whole load (the phases above are summed over the loader threads)
    clock.add("load_wall", (time.perf_counter() - t_load) * 1e3)
    if not o.use_mmap:
        with clock.phase("first_touch"):
            for module in parts.modules.values():
                for p in module.parameters():
                    p.data = p.data.clone()
    return bundle, bundle_dir, cache_dir, parts


def _place(bundle: Any, parts: Any, o: RuntimeOptions, clock: Any) -> tuple[torch.device, dict[str, Any]]:
    """The loaded modules in the dtypes and on the device the options ask for: (the device, each component's
    precision)."""
    from cosyserve.system.device import resolve_device, to_device

    device = resolve_device(o.device)
    precision = _precision(bundle, o, device.type)
    casts = {name: p.dtype for name, p in precision.items() if p.dtype != p.stored}
    quantize = o.llm_quantize == "int8" and bundle.quantized("llm") == "none"
    if casts or quantize:
        with clock.phase("precision"):
            _set_precision(parts.modules, casts, quantize)
    if device.type == "cpu":
        from cosyserve.models.gemm import use_decode_linears

        # the LM's float linears decode in the layout timed fastest here, or packed (cosyserve.models.gemm)
        with clock.phase("gemm_pack") if o.llm_gemm == "packed" else contextlib.nullcontext():
            use_decode_linears(parts.modules["llm"], o.llm_gemm)
    else:
        # from the mapped files to the device tensor by tensor through pinned staging (no host copy of the model)
        with clock.phase("to_device"):
            for module in parts.modules.values():
                to_device(module, device)
    return device, precision


def _pipeline(
    path: str | Path,
    o: RuntimeOptions,
    bundle: Any,
    bundle_dir: Path,
    cache_dir: Path,
    parts: Any,
    device: torch.device,
) -> Pipeline:
    """The pipeline over the loaded modules: the family's stream policy, tokenizer and frontends, the voices'
    registry and states."""
    from cosyserve.voices.registry import SpeakerRegistry
    from cosyserve.voices.registry_location import default_registry_dir

    cfg = bundle.config
    family = cfg.family_spec
    flow = parts.modules["flow"]
    policy = family.stream_policy(cfg, flow, o.chunk_policy, o.first_hop)
    # one registry folder for every model (registry_dir) keeps each family's voices apart: the prompt
    # features of one (CosyVoice2's 25 Hz v2 tokens, 24 kHz mel) mean nothing to another's model
    shared = o.registry_dir
    if shared is not None:
        shared = Path(shared) / family.registry_folder if family.registry_folder else Path(shared)
    registry_root = shared or default_registry_dir(
        Path(str(path)),
        bundle.model_key,
        registry_dir=None,
        cache_dir=cache_dir,
    )
    voice_states = _voice_states(o, bundle, flow, device, lambda: pipeline.registry)
    pipeline = Pipeline(
        parts.modules["llm"],
        flow,
        parts.modules["hift"],
        parts.speakers,
        cfg.sample_rate,
        policy,
        registry=SpeakerRegistry(registry_root, token_rate=int(cfg.flow.input_frame_rate)),
        model_dir=path if Path(str(path)).exists() else bundle_dir,
        instruct=bundle.instruct,
        default_voice=o.default_voice,
        flow_steps=o.flow_steps,
        flow_context=o.flow_context_seconds,
        family=family,
        tokenizer=family.tokenizer(bundle.path, check=bundle.check_onnx),
        config=cfg,
        voice_states=voice_states,
    )
    pipeline.set_onnx_paths(
        {name: bundle.onnx_path(name) for name in pipeline.onnx_files},
        check=lambda p: bundle.check_onnx(p.name),
    )
    return pipeline


def _after_ready_steps(
    runtime: TorchRuntime, pipeline: Pipeline, parts: Any, o: RuntimeOptions, clock: Any
) -> TorchRuntime:
    """What follows READY: the text tier, the token2wav warm-up and the zero-shot tier, in threads after READY (a
    fork template: the first two now, the last after the fork), and the bundle's pages prefetched."""
    from cosyserve.bundle.loader import read_all, start_prefetch

    after: list[tuple[str, Callable[[], None]]] = []
    if o.text_tier == "background":
        # the tokenizer and wetext's normalisers: the first request's text needs them, a start does not (the
        # warm-up runs on token ids)
        after.append(("text_tier", pipeline.load_text_tier))
    # what a first request would pay once (CosyVoice3's vocoder noise), as the lite runtime runs it: before the
    # warm-up, which no request waits for
    after += pipeline.after_ready()
    if o.warmup:
        after.append(("warmup_token2wav", runtime.warm_up_token2wav))
    # the ONNX sessions (speaker embedding, speech tokenizer) never delay an SFT start
    zero_shot: list[tuple[str, Callable[[], None]]] = []
    if o.zero_shot_tier == "background" and "zero_shot" in pipeline.available_modes():
        zero_shot.append(("zero_shot_tier", lambda: pipeline.frontend().load_sessions()))
    if o.fork_template:
        # a fork template does it all now, in this thread, so that its children share it; but ONNX sessions
        # (thread pools of their own) wait for after_fork
        if o.strategy == "prefetch" and o.use_mmap:
            read_all(parts)
        _run_steps(after, clock)
        runtime._after_fork = zero_shot
        logger.info("template ready in %.0f ms since process start (%s)", clock.now_ms(), clock.durations)
        return runtime
    if o.strategy == "prefetch" and o.use_mmap:
        start_prefetch(parts)
    if after:
        runtime.background = thread = _after_ready(after, clock)
        runtime.text_thread = thread if o.text_tier == "background" else None
        runtime.warmup_thread = thread if o.warmup else None
    if zero_shot:
        runtime.zero_shot_thread = _after_ready(zero_shot, clock)
    logger.info("ready in %.0f ms since process start (%s)", clock.points["ready"], clock.durations)
    return runtime
