"""The lite runtime: a bundle's ``lite/`` ONNX graphs on ONNX Runtime, driven by numpy; no torch in the process.

:func:`load` reads the bundle's manifest and speakers (safetensors, numpy), checks the lite files, opens the LM's
step graph (no weight prepacking: it opens in ~0.1 s over mapped weights), runs it once (a one-position prefill)
and returns READY; the text tier and the other graphs' sessions follow in one background thread. ONNX Runtime's
Python binding holds the GIL while a session opens, so every Python thread (a first request's too) waits for an
open: the flow's and vocoder's graphs open first in a quick form (no weight prepacking, no graph rewrites: the
full-size CosyVoice3 estimator in ~0.25 s instead of ~2.3 with a request running), and their serving forms
(faster runs; the int8 LM step's prepacked form too) replace them when no request is in flight
(:data:`UPGRADE_WAIT_S` after the text tier at the latest).

Every bundle is served by the shared :class:`~cosyserve.runtime.pipeline.Pipeline` (numpy arrays through its
:class:`~cosyserve.core.sampling.ArrayOps`) over the lite LM (:mod:`cosyserve.runtime.lite.lm`) and the flow's
and vocoder's graphs: CosyVoice2's and CosyVoice3's chunk flow (:mod:`cosyserve.runtime.lite.chunkflow`) under
the family's own token2wav, CosyVoice-300M's flow and vocoder (:mod:`cosyserve.runtime.lite.models`) under its
family's windowed :class:`~cosyserve.families.cosyvoice.token2wav.Token2Wav`. Every mode the torch runtime serves (sft, instruct on a 300M -Instruct model, zero_shot, cross_lingual,
instruct2, vc; a new prompt recording analysed by the numpy frontend,
:class:`~cosyserve.runtime.lite.frontend.LiteFrontend`, with the family's prompt mel), one-shot, streamed and
with streamed text. The same chunking and the same voice registry as the torch runtime (numpy
arrays; importing or exporting a reference ``spk2info.pt`` needs torch). Speech tokens are the torch runtime's
for a seed (one sampler, one decode loop: :mod:`cosyserve.runtime.decode`), and audio equals the torch
runtime's up to float32 rounding when both get the same random draws: CosyVoice3 draws none (its fixed noise
replayed), the others' flow and vocoder noise is numpy's, so a seed's audio differs from the torch runtime's.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from cosyserve.core.errors import BundleError
from cosyserve.core.request import SynthesisRequest
from cosyserve.core.stop import latched
from cosyserve.runtime import RuntimeOptions
from cosyserve.runtime.cores import Running
from cosyserve.runtime.decode import DecodeLoop
from cosyserve.runtime.lm import OneShot
from cosyserve.runtime.modes import RuntimeVoices
from cosyserve.runtime.oneoff import generate
from cosyserve.system.cpus import default_threads

logger = logging.getLogger(__name__)

__all__ = ["UPGRADE_WAIT_S", "LiteRuntime", "load"]

UPGRADE_WAIT_S = 20.0  # the longest the quick sessions wait for no request in flight before their upgrades


class LiteRuntime(RuntimeVoices):
    """A CosyVoice-300M bundle on ONNX Runtime: implements :class:`cosyserve.runtime.Runtime`."""

    def __init__(
        self,
        bundle: Any,
        lite: Any,
        speakers: dict[str, dict[str, Any]],
        options: RuntimeOptions,
        clock: Any,
        registry_root: Path,
    ) -> None:
        from cosyserve.runtime.lite.lm import lite_lm
        from cosyserve.voices.registry import SpeakerRegistry

        self.bundle = bundle
        self.path = bundle.path
        self.lite = lite
        self.options = options
        self.clock = clock
        self.sample_rate = int(lite.config["sample_rate"])
        self.slots = options.batch_size
        self.precision = dict.fromkeys(
            ("llm", "flow", "hift"), "float32"
        )  # the exported graphs' (ONNX Runtime)
        tables = lite.tables()
        self.llm = lite_lm(lite, tables)
        token_rate = int(lite.config["flow"]["input_frame_rate"])
        registry = SpeakerRegistry(registry_root, arrays="numpy", token_rate=token_rate)
        self.pipeline = _pipeline(bundle, lite, tables, self.llm, speakers, options, registry)
        self.token2wav = self.pipeline.token2wav
        self.pipeline.set_onnx_paths(
            {name: bundle.onnx_path(name) for name in self.pipeline.onnx_files},
            check=lambda p: bundle.check_onnx(p.name),
        )
        # the LM's decode loop: batch_size rows (one batch graph run per step where the bundle has it)
        # llm_gemm=auto: the thread that prepacks the batch graph between requests, once steps batch
        self.batch_pack: threading.Thread | None = None
        self._closed = False
        self.pipeline.decoder = DecodeLoop(
            self.llm,
            options.batch_size,
            name=self.path.name,
            before_step=_prepack_when_batched(self, options),
        )
        if options.batch_size > 1 and self.llm.unbatched:
            logger.info(
                "%s: concurrent requests' LM rows step one after another: %s", self.path, self.llm.unbatched
            )
        self.background: threading.Thread | None = None
        # graphs opened before READY in a quick form (the int8 LM step), upgraded after READY between requests
        self.quick: list[str] = []
        self.in_flight = Running()  # the quick sessions' upgrades wait for none (their opens hold the GIL)

    def start(self, request: SynthesisRequest, should_stop: Callable[[], bool]) -> Iterator[np.ndarray]:
        # the decode loop and ORT's terminate watcher ask it too: once stopped, nobody asks again
        return self.in_flight.track(self.pipeline.run(request, latched(should_stop)))

    def on_lm_step(self, record: Callable[[int], None]) -> None:
        self.pipeline.decoder.on_step = record

    def warm_up(self) -> None:
        with self.clock.phase("warmup"):
            _fault_in_lm(self)

    # -- memory ---------------------------------------------------------------------------------------------------

    def mapped_files(self) -> list[Path]:
        return self.lite.data_files()

    def mapped_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.mapped_files())

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def join_background(self, timeout: float | None = None) -> None:
        if self.background is not None:
            self.background.join(timeout)

    def after_fork(self) -> None:
        # ORT sessions own thread pools, which do not survive fork(): a fork template opens none, and each child
        # opens the LM's and warms it here, the flow's and vocoder's in the background
        self.lite.sessions.clear()
        self.llm.after_fork()
        self.lite._lock = threading.Lock()
        _open_lm(self)
        self.background = _after_ready(self)

    def close(self) -> None:
        self._closed = True
        self.pipeline.decoder.close()
        if self.batch_pack is not None:
            self.batch_pack.join()
        self.lite.sessions.clear()


CHUNK_FLOW_GRAPH = (
    "flow_mu"  # a bundle whose flow is CosyVoice2/3's chunk flow (its token2wav is the family's)
)


def _config_view(config: Any) -> Any:
    # the manifest's stored model config (JSON) read as a ModelConfig is, by attribute: what the family reads of it
    # to build its stream policy and token2wav (chunk_size, the flow's and vocoder's fields)
    from types import SimpleNamespace

    if isinstance(config, dict):
        return SimpleNamespace(**{k: _config_view(v) for k, v in config.items()})
    return config


def _pipeline(
    bundle: Any,
    lite: Any,
    tables: dict[str, np.ndarray],
    llm: Any,
    speakers: dict[str, dict[str, Any]],
    o: RuntimeOptions,
    registry: Any,
) -> Any:
    """The shared :class:`~cosyserve.runtime.pipeline.Pipeline` over the lite LM and the flow's and vocoder's
    graphs (numpy arrays throughout), the family's stream policy and token2wav (CosyVoice2/3's over the chunk
    flow's graphs, CosyVoice-300M's over its flow's and vocoder's)."""
    from cosyserve.runtime.pipeline import Pipeline
    from cosyserve.voices.voicestates import VoiceStates

    family = bundle.family
    config = _config_view(bundle.manifest["config"])
    flow: Any
    hift: Any
    chunk_flow = CHUNK_FLOW_GRAPH in lite.graphs
    if chunk_flow:
        from cosyserve.runtime.lite.chunkflow import LiteCausalVocoder, LiteChunkFlow, LiteVocoder2

        flow = LiteChunkFlow(lite, tables)
        hift = (LiteCausalVocoder if lite.config["hift"].get("causal") else LiteVocoder2)(lite, tables)
    else:
        from cosyserve.runtime.lite.models import LiteFlow, LiteVocoder

        flow, hift = LiteFlow(lite, tables), LiteVocoder(lite, tables)
    flow_context = o.flow_context_seconds
    if flow_context and not getattr(flow, "bounds", True):
        logger.warning(
            "this CosyVoice2 bundle's encoder graph always reads its lookahead tokens, which a bounded stream's "
            "last call has none of (its streams attend to every frame, exact; convert it again to bound them): "
            "ignored flow_context_seconds=%g",
            flow_context,
        )
        flow_context = 0.0
    policy = family.stream_policy(config, flow, o.chunk_policy, o.first_hop)
    pipeline: Pipeline

    def frontend() -> Any:
        # a new prompt recording's features: the numpy frontend with the family's prompt mel and trim
        from cosyserve.runtime.lite.frontend import LiteFrontend

        return LiteFrontend.for_family(
            family,
            bundle.manifest["config"],
            pipeline.onnx_paths,
            pipeline.tokenizer.encode,
            pipeline.onnx_check,
        )

    factory = family.tokenizer(bundle.path, check=bundle.check_onnx)
    pipeline = Pipeline(
        llm,
        flow,
        hift,
        speakers,
        int(lite.config["sample_rate"]),
        policy,
        registry=registry,
        model_dir=bundle.path,
        instruct=bundle.instruct,
        default_voice=o.default_voice,
        flow_steps=o.flow_steps,
        flow_context=flow_context,
        family=family,
        tokenizer=factory,
        config=config,
        frontend=frontend,
        voice_states=VoiceStates.for_model(o, _voice_tag(bundle, lite, o), lambda: pipeline.registry),
    )
    return pipeline


def _voice_tag(bundle: Any, lite: Any, o: RuntimeOptions) -> str:
    # what a lite model's voice states depend on besides their prompt (VoiceStates.for_model): the weights, the lite
    # format and the flow's graphs (a conversion that changed them recomputes the stored states), float32 on the
    # CPU, the Euler steps
    files = lite.manifest.get("files", {})
    graphs = sorted(
        f"{name}:{entry.get('sha256')}" for name, entry in files.items() if name.startswith("flow")
    )
    version = lite.manifest.get("version")
    return f"{bundle.model_key}|lite {version} {','.join(graphs)}|float32|cpu|{o.flow_steps}"


def _read_speakers(bundle: Any) -> dict[str, dict[str, Any]]:
    """The bundle's pre-defined speakers as ``{name: {"embedding": [1, 192] float32}}`` (numpy)."""
    entry = bundle.manifest.get("speakers")
    if not entry:
        return {}
    from cosyserve.bundle.safetensors_np import map_safetensors

    path = bundle.path / entry["file"]
    if path.stat().st_size != entry["bytes"]:
        raise BundleError(
            f"{path}: {path.stat().st_size} bytes, the manifest says {entry['bytes']}: convert again"
        )
    names = bundle.speaker_names
    expected = entry.get("tensors", {})
    out: dict[str, dict[str, Any]] = {}
    for key, value in map_safetensors(path).items():
        want = expected.get(key, {}).get("sha256")
        # a few KB: checked on every start, whatever the verify policy (the torch loader hashes it too)
        if (
            want is None
            or hashlib.sha256(memoryview(np.ascontiguousarray(value)).cast("B")).hexdigest() != want
        ):
            raise BundleError(
                f"{path}: tensor {key!r} does not match the manifest: the file is corrupt; convert again"
            )
        idx, fld = key.split(".", 1)
        if fld == "embedding":
            out[names[int(idx)]] = {"embedding": np.array(value, dtype=np.float32).reshape(1, -1)}
    return out


def load(path: str | Path, options: RuntimeOptions, clock: Any = None) -> LiteRuntime:
    """Load the bundle at ``path`` (converted with ``--runtime lite``) on ONNX Runtime; see
    :func:`cosyserve.runtime.load_runtime`. An official model dir or hub id is converted by the torch side first
    (which needs torch): convert once with ``cosyserve convert MODEL_DIR BUNDLE --runtime lite``."""
    from cosyserve.core.clock import PhaseClock

    clock = clock or PhaseClock()
    o = options
    with clock.phase("imports"):
        import onnxruntime  # noqa: F401 - the one heavy import, timed as the torch runtime's imports are

        from cosyserve.bundle.loader import is_bundle, open_bundle
        from cosyserve.bundle.sources import cache_dir_of
        from cosyserve.runtime.lite.models import LiteBundle
        from cosyserve.system.device import check_device
        from cosyserve.voices.registry_location import default_registry_dir
    check_device(o.device, "lite")  # the start checked it already; a pool's lazy load did not
    cache_dir = cache_dir_of(Path(o.cache_dir) if o.cache_dir is not None else None)
    with clock.phase("manifest"):
        if not is_bundle(path):
            raise BundleError(
                f"{path} is not a bundle: the lite runtime loads a bundle converted with `cosyserve convert "
                "MODEL_DIR BUNDLE --runtime lite` (on a machine with torch)"
            )
        bundle = open_bundle(path)
        family = bundle.family
        o = o.for_family(family)
        if not family.lite:
            raise BundleError(
                f"{path}: the lite runtime does not serve {family.title} bundles: serve it on the torch runtime"
            )
        bundle.verify = o.verify
        threads = o.threads or default_threads()
        # llm_gemm=packed: the batch graph on MLAS's prepacked weights (steps of several rows ~2x cheaper on a Zen 4)
        packed = o.llm_gemm == "packed"
        lite = LiteBundle(
            bundle.path,
            verify=o.verify,
            threads=threads,
            int8=o.llm_quantize == "int8",
            bundle=bundle,
            prepack_batch=packed,
        )
        names = ("llm_dtype", "flow_dtype", "hift_dtype")
        ignored = [f"{n}={v}" for n in names if (v := getattr(o, n)) not in (None, "float32")]
        if ignored:
            logger.warning(
                "the lite runtime computes in float32 (or int8 LM steps); ignored %s", ", ".join(ignored)
            )
        speakers = _read_speakers(bundle)
        # one registry folder for every model (registry_dir) keeps each family's voices apart, as the torch
        # runtime's: a voice registered there serves here
        shared = o.registry_dir
        if shared is not None and family.registry_folder:
            shared = Path(shared) / family.registry_folder
        registry_root = (
            Path(shared)
            if shared is not None
            else default_registry_dir(bundle.path, bundle.model_key, registry_dir=None, cache_dir=cache_dir)
        )
    with clock.phase("construct"):
        runtime = LiteRuntime(bundle, lite, speakers, o, clock, registry_root)
    if o.fork_template:
        if o.text_tier == "background":
            _run_steps([("text_tier", runtime.pipeline.load_text_tier)], clock)  # shared by the children
        clock.mark("ready")
        return runtime
    _open_lm(runtime)
    clock.mark("ready")
    runtime.background = _after_ready(runtime)
    logger.info(
        "lite runtime ready in %.0f ms since process start (%s)", clock.points["ready"], clock.durations
    )
    return runtime


def _open_lm(runtime: LiteRuntime) -> None:
    clock, o = runtime.clock, runtime.options
    with clock.phase("sessions"):
        # the step graph's serving form when it is quick to open, else a quick form upgraded after READY; the
        # text encoder's and the rest open after READY
        runtime.quick = ["llm_step"] if runtime.lite.open_quick("llm_step") else []
    if o.warmup:
        with clock.phase("warmup"):
            _fault_in_lm(runtime)


def _fault_in_lm(runtime: LiteRuntime) -> None:
    # what a first request would pay: page faults over the step graph's mapped weights (~24,000 at full size fp32).
    # Not after READY: a first request's text and voice work takes both cores meanwhile, and the faults slowed it
    # as much as they took off READY. Mapped in with MADV_POPULATE_READ (~60 ms at full size fp32, 2-core Xeon)
    # rather than by a call of the graph (~150 ms: the faults, ~90, and a pass over the weights, ~70, that saves a
    # first request nothing: ORT's first call of a shape costs no more than a later one); the call where the
    # kernel cannot (before Linux 5.14, not Linux) or ORT did not map the weights (it copied or prepacked them)
    from cosyserve.system.pagecache import populate_mapped

    try:
        if populate_mapped(runtime.lite.weights_file("llm_step")):
            return
    except (OSError, AttributeError) as e:
        logger.debug("%s: the step graph's weights are faulted in by a call instead (%s)", runtime.path, e)
    _warm_up_lm(runtime.llm)


def _warm_up_lm(lm: Any) -> None:
    # a one-position prefill and sampling, on a copy with caches of its own (requests may be running): nothing is
    # left behind
    import copy

    lm = copy.copy(lm)
    lm.release()
    list(generate(lm, OneShot(lm.warmup_prompt(), 1, 1), 0))


def _run_steps(steps: list[tuple[str, Callable[[], Any]]], clock: Any) -> None:
    for phase, work in steps:
        start, t = clock.now_ms(), time.perf_counter()
        try:
            work()
        except Exception:  # noqa: BLE001 - the first request that needs it raises the same error
            logger.warning("background %s failed", phase, exc_info=True)
            continue
        clock.add(phase, (time.perf_counter() - t) * 1e3, start)


def _prepack_when_batched(runtime: LiteRuntime, options: RuntimeOptions) -> Callable[[int], Any] | None:
    """llm_gemm=auto on a batching model: the first decode step of several rows starts :func:`_prepack_batch_graph`
    in a thread (None: nothing to do)."""
    if options.llm_gemm != "auto" or (options.batch_size or 1) < 2 or runtime.llm.batch_graph is None:
        return None

    def rows(n: int = 1) -> None:
        if n >= 2 and runtime.batch_pack is None:
            runtime.batch_pack = threading.Thread(
                target=_prepack_batch_graph, args=(runtime,), name="cosyserve-lite-batch-pack", daemon=True
            )
            runtime.batch_pack.start()

    return rows


def _prepack_batch_graph(runtime: LiteRuntime) -> None:
    # the LM's batch graph again with MLAS's prepacked weights (2-8-row steps ~2x cheaper on a Zen 4, +the LM's
    # weights in memory), where memory holds twice that and at a moment with no request in flight (its ~1.2 s open
    # holds the GIL: every stream would stall), as llm_gemm=packed's after-READY upgrade
    from cosyserve.system.pagecache import memory_free

    size = runtime.lite.weights_file("llm_step").stat().st_size  # the batch graph's weights are the step's
    free = memory_free()
    if free < 2 * size:
        logger.info(
            "%s: the LM's batch graph stays unpacked: prepacking takes %.2f GB and the process may take %.2f GB "
            "more (twice that wanted)",
            runtime.path,
            size / 1e9,
            free / 1e9,
        )
        return
    while not runtime.in_flight.wait_idle(1.0):
        if runtime._closed:
            return
    if runtime._closed:
        return
    t = time.perf_counter()
    runtime.lite.prepack_batch_graph()
    logger.info(
        "%s: the LM's batch graph serves prepacked now (%.2f GB, opened in %.1f s between requests)",
        runtime.path,
        size / 1e9,
        time.perf_counter() - t,
    )


def _upgrade_between_requests(runtime: LiteRuntime, names: list[str]) -> None:
    # each graph at a moment with no request in flight, all by one deadline (a wait of UPGRADE_WAIT_S per graph
    # kept a long first request's successor on quick forms too). Not during a request: an open holds the GIL, and
    # a first request's LM steps (short ORT calls between Python) stop for all of it; measured without the wait
    # (full-size CosyVoice3, 2-core Xeon): a first streamed request with a registered voice gave its first audio
    # 1.10-1.16x torch's (fp32; int8 1.28-1.37x) instead of 0.95-0.97x, while a first zero-shot one (~10 s of flow
    # for its prompt, long ORT calls) gained 2-3 s
    deadline = time.monotonic() + UPGRADE_WAIT_S
    for name in names:
        if not runtime.in_flight.wait_idle(max(0.0, deadline - time.monotonic())):
            logger.info("%s: upgrading the %s session with requests in flight", runtime.path, name)
        runtime.lite.upgrade(name)


def _after_ready(runtime: LiteRuntime) -> threading.Thread:
    """The rest of the start, in one thread after READY: the flow's and vocoder's quick sessions, the text tier,
    the text encoder's session (and the zero-shot tier's when asked), then the serving forms of every graph
    serving a quick form (the int8 LM step's too) between requests (the phase ``upgrades``, its waits included)."""
    o = runtime.options
    steps: list[tuple[str, Callable[[], Any]]] = []
    graphs = runtime.lite.graphs
    token2wav = [n for n in graphs if not n.startswith("llm_")]
    # quick forms now (before a first request needs them), serving forms between requests, the int8 LM step's
    # too (its prepacked open held the GIL ~1.1-1.7 s right after READY, longer than its quick steps cost a first
    # request). No flow/vocoder warm-up run: ORT's first call costs no more than a later one, and a warm-up would
    # take the cores from a first request that arrives meanwhile (measured: ~1.1 s of CPU at full size)
    quick: list[str] = list(runtime.quick)

    def open_quick() -> None:
        from cosyserve.bundle.lite import BATCH_STEP

        quick.extend(n for n in token2wav if runtime.lite.open_quick(n))
        if runtime.lite.prepack_batch and BATCH_STEP in graphs:
            quick.append(BATCH_STEP)  # llm_gemm=packed: its prepacked open (~1.2 s) between requests too

    steps.append(("sessions_token2wav", open_quick))
    if o.text_tier == "background" and not o.fork_template:
        steps.append(("text_tier", runtime.pipeline.load_text_tier))
    if "llm_text" in graphs:  # CosyVoice-300M's text encoder (the Qwen LM's text embedding is a table)
        steps.append(("sessions_llm_text", lambda: runtime.lite.session("llm_text")))
    steps += runtime.pipeline.after_ready()  # CosyVoice3's fixed vocoder noise, not by a first request
    if o.zero_shot_tier == "background" and "zero_shot" in runtime.pipeline.available_modes():
        steps.append(("zero_shot_tier", lambda: runtime.pipeline.frontend().load_sessions()))
    steps.append(("upgrades", lambda: _upgrade_between_requests(runtime, quick)))
    thread = threading.Thread(
        target=_run_steps, args=(steps, runtime.clock), name="cosyserve-lite-after-ready", daemon=True
    )
    thread.start()
    return thread
