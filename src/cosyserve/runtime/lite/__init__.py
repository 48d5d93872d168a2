"""The lite runtime: a bundle's ``lite/`` ONNX graphs on ONNX Runtime, driven by numpy; no torch in the process.

:func:`load` reads the bundle's manifest and speakers (safetensors, numpy), checks the lite files, opens the LM's
step graph (no weight prepacking: it opens in ~0.1 s over mapped weights), runs one decode step and returns
READY; the text tier and the other graphs' sessions follow in one background thread. ONNX Runtime's Python
binding holds the GIL while a session opens (~1.7 s for the flow and vocoder graphs at full size on 2 cores):
a request that arrives in that window waits for it, later ones do not.

CosyVoice2 and CosyVoice3 bundles are served by the shared :class:`~cosyserve.runtime.pipeline.Pipeline`
(numpy arrays through its :class:`~cosyserve.core.sampling.ArrayOps`) over
:class:`~cosyserve.runtime.lite.lm.LiteQwenLM` and the chunk flow's and vocoder's graphs
(:mod:`cosyserve.runtime.lite.chunkflow`) under the family's own token2wav: every mode that needs no new
prompt audio analysed (sft, and zero_shot, cross_lingual, instruct2 with a registered voice), one-shot,
streamed and with streamed text; a prompt recording is refused with a client error until the numpy frontend
serves these families (:func:`lite_frontend_serves`). CosyVoice-300M bundles are served by
:class:`LitePipeline` (still a pipeline of its own, over
:class:`~cosyserve.runtime.lite.models.LiteToken2Wav`) in every mode the torch runtime serves (sft, instruct
on an -Instruct model, zero_shot, cross_lingual, vc). Both keep the same chunking and the same voice registry
as the torch runtime (numpy arrays; importing or exporting a reference ``spk2info.pt`` needs torch). Speech
tokens are the torch runtime's for a seed (one sampler, one decode loop: :mod:`cosyserve.runtime.decode`), and
audio equals the torch runtime's up to float32 rounding when both get the same random draws: CosyVoice3 draws
none (its fixed noise replayed), the others' flow and vocoder noise is numpy's, so a seed's audio differs from
the torch runtime's.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from cosyserve.core.errors import BundleError
from cosyserve.core.request import SynthesisRequest
from cosyserve.core.sampling import row_key
from cosyserve.core.stop import Stopped, check, latched
from cosyserve.runtime import PIECE_SECONDS_MAX, RuntimeOptions
from cosyserve.runtime.decode import DecodeLoop
from cosyserve.runtime.lm import OneShot, one_shot
from cosyserve.runtime.modes import ModelModes, RuntimeVoices
from cosyserve.runtime.oneoff import generate
from cosyserve.system.cpus import default_threads

logger = logging.getLogger(__name__)

__all__ = ["LitePipeline", "LiteRuntime", "load"]


def _ids(ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray([ids], dtype=np.int32).reshape(1, -1), np.asarray([len(ids)], dtype=np.int32)


def _flat(a: Any) -> list[int]:
    return [int(x) for x in np.asarray(a).reshape(-1)]


class LitePipeline(ModelModes):
    """Requests -> model inputs -> speech tokens -> audio on the lite models (the torch
    :class:`~cosyserve.runtime.pipeline.Pipeline`'s rules, numpy arrays instead of tensors)."""

    def __init__(self, llm: Any, token2wav: Any, speakers: dict[str, dict[str, Any]], **kwargs: Any) -> None:
        super().__init__(speakers, **kwargs)
        self.llm = llm
        self.decoder = DecodeLoop(llm, 1, name="lite")  # the runtime gives it its batch_size rows
        self.token2wav = token2wav
        # one piece's speech tokens at most (as the torch pipeline's)
        self.max_piece_tokens = PIECE_SECONDS_MAX * int(token2wav.flow.input_frame_rate)
        self._frontend_lock = threading.Lock()

    def frontend(self) -> Any:
        """The prompt frontend (:class:`cosyserve.runtime.lite.frontend.LiteFrontend`), made on first use."""
        if self._frontend is None:
            with self._frontend_lock:
                if self._frontend is None:
                    from cosyserve.runtime.lite.frontend import LiteFrontend

                    campplus, tokenizer = (self.onnx_paths[n] for n in self.onnx_files)
                    assert campplus is not None and tokenizer is not None, "require() the prompt modes first"
                    self._frontend = LiteFrontend(campplus, tokenizer, self.tokenizer.encode, self.onnx_check)
        return self._frontend

    def extract_prompt(self, prompt_wav: Any, prompt_text: str, *, mode: str = "zero_shot") -> dict[str, Any]:
        self.require(mode)
        return self.frontend().prompt_features(prompt_text, prompt_wav)  # type: ignore[no-any-return]

    def prepare(
        self, request: SynthesisRequest
    ) -> tuple[SynthesisRequest, list[dict[str, Any]] | Iterator[dict[str, Any]]]:
        """The request as this model runs it and one reference model-input dict per text piece (vc: one); for text
        given as pieces, an iterator that builds each dict as its sentence arrives."""
        r = self.resolved(request)
        mode = r.mode
        if mode == "vc":
            return r, [self.frontend().vc(r.source_wav, r.prompt_wav)]
        make = self.input_builder(r, lambda text: _ids(self.tokenizer.encode(text)))
        pieces = self.text_pieces(r)
        if isinstance(pieces, list):
            return r, [make(_ids(self.tokenizer.encode(p))) for p in pieces]
        return r, (make(_ids(self.tokenizer.encode(p))) for p in pieces)

    def run(self, request: SynthesisRequest, should_stop: Callable[[], bool]) -> Iterator[np.ndarray]:
        """Prepare now (errors raise here), then a generator of float32 chunks."""
        r, inputs = self.prepare(request)
        # the seed keys the LM's sampler (each text piece its own key) and seeds the flow's and vocoder's noise
        seed = r.seed if r.seed is not None else secrets.randbits(63)
        # the decode loop's thread and ORT's terminate watcher ask it too: once stopped, nobody asks again
        should_stop = latched(should_stop)
        return self._generate(r, inputs, seed, np.random.default_rng(seed), should_stop)

    def _generate(
        self,
        r: SynthesisRequest,
        inputs: list[dict[str, Any]],
        seed: int,
        rng: np.random.Generator,
        should_stop: Callable[[], bool],
    ) -> Iterator[np.ndarray]:
        try:
            for n, model_input in enumerate(inputs):
                yield from self._tts(r, model_input, row_key(seed, n), rng, should_stop)
        except Stopped:
            return  # the generators below are closed by the unwinding: the LM's caches go with them

    def _tts(
        self,
        r: SynthesisRequest,
        model_input: dict[str, Any],
        key: int,
        rng: np.random.Generator,
        should_stop: Callable[[], bool],
    ) -> Iterator[np.ndarray]:
        if "source_speech_token" in model_input:  # vc: the LM is bypassed
            tokens: Iterator[int] = iter(_flat(model_input["source_speech_token"]))
        else:
            spec = one_shot(self.llm, model_input, max_tokens=self.max_piece_tokens)
            tokens = self.decoder.generate(spec, key, should_stop=should_stop)
        feat = model_input.get("prompt_speech_feat")
        for chunk in self.token2wav(
            tokens,
            embedding=np.asarray(model_input["flow_embedding"]).reshape(-1),
            prompt_token=_flat(model_input.get("flow_prompt_speech_token", [])),
            prompt_feat=None if feat is None else np.asarray(feat, dtype=np.float32).reshape(-1, 80),
            stream=r.stream,
            speed=r.speed,
            generator=rng,
            should_stop=should_stop,
        ):
            yield chunk.astype(np.float32, copy=False)
            check(should_stop)


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
        from cosyserve.families.cosyvoice.streampolicy import StreamPolicy
        from cosyserve.runtime.lite.lm import lite_lm
        from cosyserve.runtime.lite.models import LiteFlow, LiteToken2Wav, LiteVocoder
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
        family = bundle.family
        token_rate = int(lite.config["flow"]["input_frame_rate"])
        registry = SpeakerRegistry(registry_root, arrays="numpy", token_rate=token_rate)
        self.pipeline: Any
        if CHUNK_FLOW_GRAPH in lite.graphs:
            # CosyVoice2/3: the shared pipeline and the family's own token2wav over the chunk flow's graphs
            self.pipeline = _pipeline(bundle, lite, tables, self.llm, speakers, options, registry)
        else:
            flow = LiteFlow(lite, tables)
            policy = StreamPolicy.named(
                options.chunk_policy,
                options.first_hop,
                input_frame_rate=flow.input_frame_rate,
                sample_rate=self.sample_rate,
            )
            self.pipeline = LitePipeline(
                self.llm,
                LiteToken2Wav(flow, LiteVocoder(lite, tables), policy, options.flow_steps),
                speakers,
                registry=registry,
                model_dir=bundle.path,
                family=family,
                instruct=bundle.instruct,
                default_voice=options.default_voice,
            )
        self.token2wav = self.pipeline.token2wav
        self.pipeline.set_onnx_paths(
            {name: bundle.onnx_path(name) for name in self.pipeline.onnx_files},
            check=lambda p: bundle.check_onnx(p.name),
        )
        # the LM's decode loop: batch_size rows (the step graph runs a step's rows one after another)
        self.pipeline.decoder = DecodeLoop(self.llm, options.batch_size, name=self.path.name)
        self.background: threading.Thread | None = None

    def start(self, request: SynthesisRequest, should_stop: Callable[[], bool]) -> Iterator[np.ndarray]:
        # the decode loop and ORT's terminate watcher ask it too: once stopped, nobody asks again
        return self.pipeline.run(request, latched(should_stop))  # type: ignore[no-any-return]

    def on_lm_step(self, record: Callable[[int], None]) -> None:
        self.pipeline.decoder.on_step = record

    def warm_up(self) -> None:
        with self.clock.phase("warmup"):
            _warm_up_lm(self.llm)

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
        self.pipeline.decoder.close()
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


def lite_frontend_serves(family: Any) -> bool:
    """Whether the lite runtime's numpy frontend analyses this family's prompt audio (its conformance covers the
    prompt frontend kinds)."""
    return "zero_shot_frontend" in family.lite_kinds


def _pipeline(
    bundle: Any,
    lite: Any,
    tables: dict[str, np.ndarray],
    llm: Any,
    speakers: dict[str, dict[str, Any]],
    o: RuntimeOptions,
    registry: Any,
) -> Any:
    """The shared :class:`~cosyserve.runtime.pipeline.Pipeline` over the lite LM and the chunk flow's and
    vocoder's graphs (numpy arrays throughout), the family's stream policy and token2wav."""
    from cosyserve.core.errors import ModeUnavailableError
    from cosyserve.runtime.lite.chunkflow import LiteCausalVocoder, LiteChunkFlow, LiteVocoder2
    from cosyserve.runtime.pipeline import Pipeline

    family = bundle.family
    config = _config_view(bundle.manifest["config"])
    flow = LiteChunkFlow(lite, tables)
    hift = (LiteCausalVocoder if lite.config["hift"].get("causal") else LiteVocoder2)(lite, tables)
    pipeline: Pipeline

    def frontend() -> Any:
        # a new prompt recording's features: the numpy frontend, where it serves the family
        if not lite_frontend_serves(family):
            raise ModeUnavailableError(
                f"the lite runtime cannot analyse prompt audio for {family.title} yet (its numpy prompt frontend "
                "serves CosyVoice-300M only): speak with a pre-defined speaker or a voice registered by name "
                "(registered on the torch runtime), or serve this model on the torch runtime",
                param="prompt_wav",
            )
        from cosyserve.runtime.lite.frontend import LiteFrontend

        campplus, tokenizer = (pipeline.onnx_paths[n] for n in pipeline.onnx_files)
        assert campplus is not None and tokenizer is not None, "require() the prompt modes first"
        return LiteFrontend(campplus, tokenizer, pipeline.tokenizer.encode, pipeline.onnx_check)

    pipeline = Pipeline(
        llm,
        flow,
        hift,
        speakers,
        int(lite.config["sample_rate"]),
        family.stream_policy(config, flow, o.chunk_policy, o.first_hop),
        registry=registry,
        model_dir=bundle.path,
        instruct=bundle.instruct,
        default_voice=o.default_voice,
        flow_steps=o.flow_steps,
        family=family,
        tokenizer=family.tokenizer(bundle.path, check=bundle.check_onnx),
        config=config,
        frontend=frontend,
    )
    return pipeline


def _read_speakers(bundle: Any) -> dict[str, dict[str, Any]]:
    """The bundle's pre-defined speakers as ``{name: {"embedding": [1, 192] float32}}`` (numpy)."""
    entry = bundle.manifest.get("speakers")
    if not entry:
        return {}
    from cosyserve.runtime.lite.models import map_safetensors

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
        if not family.lite:
            raise BundleError(
                f"{path}: the lite runtime does not serve {family.title} bundles: serve it on the torch runtime"
            )
        bundle.verify = o.verify
        threads = o.threads or default_threads()
        lite = LiteBundle(
            bundle.path, verify=o.verify, threads=threads, int8=o.llm_quantize == "int8", bundle=bundle
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
            _run_steps([("text_tier", _load_text_tier)], clock)  # pure Python: shared by the children
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
        runtime.lite.session("llm_step")  # the text encoder's and the rest open after READY
    if o.warmup:
        with clock.phase("warmup"):
            _warm_up_lm(runtime.llm)


def _warm_up_lm(lm: Any) -> None:
    # a one-position prefill, a decode step and sampling (ORT's first call costs no more than a later one), on a
    # copy with caches of its own (requests may be running): nothing is left behind
    import copy

    lm = copy.copy(lm)
    lm.release()
    list(generate(lm, OneShot(lm.warmup_prompt(), 2, 2), 0))


def _run_steps(steps: list[tuple[str, Callable[[], Any]]], clock: Any) -> None:
    for phase, work in steps:
        start, t = clock.now_ms(), time.perf_counter()
        try:
            work()
        except Exception:  # noqa: BLE001 - the first request that needs it raises the same error
            logger.warning("background %s failed", phase, exc_info=True)
            continue
        clock.add(phase, (time.perf_counter() - t) * 1e3, start)


def _after_ready(runtime: LiteRuntime) -> threading.Thread:
    """The rest of the start, in one thread after READY: the text tier, the text encoder's session, the flow's
    and vocoder's sessions (and the zero-shot tier's when asked)."""
    o = runtime.options
    steps: list[tuple[str, Callable[[], Any]]] = []
    if o.text_tier == "background" and not o.fork_template:
        steps.append(("text_tier", _load_text_tier))
    graphs = runtime.lite.graphs
    if "llm_text" in graphs:  # CosyVoice-300M's text encoder (the Qwen LM's text embedding is a table)
        steps.append(("sessions_llm_text", lambda: runtime.lite.session("llm_text")))
    # no flow/vocoder warm-up run: ORT's first call costs no more than a later one, and a warm-up would take the
    # cores from a first request that arrives meanwhile (measured: ~1.1 s of CPU at full size)
    token2wav = [n for n in graphs if not n.startswith("llm_")]
    steps.append(("sessions_token2wav", lambda: [runtime.lite.session(n) for n in token2wav]))
    if (
        o.zero_shot_tier == "background"
        and "zero_shot" in runtime.pipeline.available_modes()
        and lite_frontend_serves(runtime.bundle.family)
    ):
        steps.append(("zero_shot_tier", lambda: runtime.pipeline.frontend().load_sessions()))
    thread = threading.Thread(
        target=_run_steps, args=(steps, runtime.clock), name="cosyserve-lite-after-ready", daemon=True
    )
    thread.start()
    return thread


def _load_text_tier() -> None:
    from cosyserve.frontend.text import load_normalizers
    from cosyserve.frontend.tokenizer import get_tokenizer

    get_tokenizer()
    load_normalizers()
