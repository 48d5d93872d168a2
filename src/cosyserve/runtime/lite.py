"""The lite runtime: a bundle's ``lite/`` ONNX graphs on ONNX Runtime, driven by numpy; no torch in the process.

:func:`load` reads the bundle's manifest and speakers (safetensors, numpy), checks the lite files, opens the LM's
sessions (no weight prepacking: each opens in milliseconds over mapped weights), warms the LM and returns READY;
the text tier, the flow and vocoder sessions and their warm-up follow in one background thread. It serves what
the torch runtime serves for CosyVoice-300M in ``sft`` and ``instruct`` modes with the same chunking; the prompt
modes (zero_shot, cross_lingual, vc) and registered voices are reported unavailable (their frontend and registry
are torch code today). Its audio equals the torch runtime's up to float32 rounding when both get the same random
draws; its random stream is numpy's, so a seed gives reproducible audio that differs from the torch runtime's.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from cosyserve.errors import BundleError, ClientError, ModeUnavailableError, RegistryError, UnknownVoiceError
from cosyserve.request import MODES, Mode, SynthesisRequest
from cosyserve.runtime import RuntimeOptions, Voice

logger = logging.getLogger(__name__)

__all__ = ["LiteRuntime", "load"]

_NO_PROMPT = (
    "the lite runtime does not serve the prompt modes yet (their audio frontend and voice registry are torch "
    "code); serve this model with the torch runtime (--runtime torch) for zero_shot, cross_lingual and vc"
)


class LiteRuntime:
    """A CosyVoice-300M bundle on ONNX Runtime: implements :class:`cosyserve.runtime.Runtime`."""

    def __init__(
        self, bundle_dir: Path, manifest: dict[str, Any], lite: Any, speakers: dict[str, np.ndarray],
        options: RuntimeOptions, clock: Any,
    ) -> None:  # fmt: skip
        from cosyserve.lite.models import LiteFlow, LiteLM, LiteToken2Wav, LiteVocoder
        from cosyserve.runtime.streampolicy import StreamPolicy

        self.path = bundle_dir
        self.manifest = manifest
        self.lite = lite
        self.options = options
        self.clock = clock
        self.sample_rate = int(lite.config["sample_rate"])
        self.slots = options.batch_size
        self.instruct = bool(manifest.get("instruct", False))
        self._speakers = speakers  # name -> embedding (192,)
        tables = lite.tables()
        self.llm = LiteLM(lite, tables)
        flow = LiteFlow(lite, tables)
        policy = StreamPolicy.named(
            options.chunk_policy,
            options.first_hop,
            input_frame_rate=flow.input_frame_rate,
            sample_rate=self.sample_rate,
        )
        self.token2wav = LiteToken2Wav(flow, LiteVocoder(lite, tables), policy, options.flow_steps)
        self.background: threading.Thread | None = None

    # -- what it serves -------------------------------------------------------------------------------------------

    def speakers(self) -> list[str]:
        return sorted(self._speakers)

    def voices(self, tenant: str = "default") -> list[Voice]:
        return [Voice(s, "pre-defined", "sft") for s in self.speakers()]

    def voice(self, name: str, tenant: str = "default") -> Voice | None:
        return Voice(name, "pre-defined", "sft") if name in self._speakers else None

    def modes(self) -> dict[Mode, str | None]:
        why: dict[Mode, str | None] = dict.fromkeys(MODES)
        why["instruct2"] = (
            "instruct2 is CosyVoice2's instruction mode; this is a CosyVoice-300M model: use instruct with a "
            "CosyVoice-300M-Instruct model"
        )
        if not self.instruct:
            why["instruct"] = (
                "this model is not an instruct model (a CosyVoice-300M-Instruct); use sft mode, or an -Instruct model"
            )
        for m in ("zero_shot", "cross_lingual", "vc"):
            why[m] = _NO_PROMPT
        return why

    def _require(self, mode: str) -> None:
        why = self.modes().get(mode)  # type: ignore[call-overload]
        if why is not None:
            available = ", ".join(m for m, w in self.modes().items() if w is None)
            err = ModeUnavailableError(
                f"{mode} synthesis is unavailable: {why} (available modes: {available})"
            )
            err.param = "instruct_text" if mode == "instruct" else None
            raise err

    def _default_speaker(self) -> str:
        if self.options.default_voice is not None:
            return self.options.default_voice
        if not self._speakers:
            raise ClientError(
                "this model has no pre-defined speakers (spk2info.pt); the lite runtime serves sft and instruct "
                "with a pre-defined speaker only",
                param="speaker",
            )
        return sorted(self._speakers)[0]

    def resolve(self, request: SynthesisRequest) -> SynthesisRequest:
        import dataclasses

        mode = request.mode or "sft"
        self._require(mode)
        speaker = request.speaker or self._default_speaker()
        if speaker not in self._speakers:
            known = ", ".join(self.speakers()) or "none"
            raise UnknownVoiceError(
                f"unknown speaker {speaker!r}; known speakers: {known} (the lite runtime serves pre-defined "
                "speakers only)",
                param="speaker",
            )
        if mode == request.mode and speaker == request.speaker:
            return request
        return dataclasses.replace(request, mode=mode, speaker=speaker)

    # -- synthesis ------------------------------------------------------------------------------------------------

    def _tokenize(self, text: str) -> list[int]:
        from cosyserve.frontend.tokenizer import get_tokenizer

        return list(get_tokenizer().encode(text))

    def start(self, request: SynthesisRequest, should_stop: Callable[[], bool]) -> Iterator[np.ndarray]:
        from cosyserve.frontend.text import normalize_and_split, nothing_to_speak, text_normalize

        r = self.resolve(request)
        if r.normalize:
            pieces = normalize_and_split(r.text, self._tokenize)
        else:
            pieces = [] if nothing_to_speak(r.text) else [r.text]
        if not pieces:
            raise ClientError(
                f"text {r.text!r} has nothing to speak: no letter or digit, only punctuation, symbols, blanks "
                "or invisible characters",
                param="text",
            )
        embedding = self._speakers[r.speaker or ""]
        instruction: list[int] = []
        if r.mode == "instruct":
            text = r.instruct_text
            if r.normalize:
                text = str(text_normalize(text, split=False, tokenize=self._tokenize))
            instruction = self._tokenize(text)
        texts = [self._tokenize(p) for p in pieces]
        rng = np.random.default_rng(r.seed if r.seed is not None else secrets.randbits(63))
        return self._generate(r, texts, instruction, embedding, rng, should_stop)

    def _generate(
        self,
        r: SynthesisRequest,
        texts: list[list[int]],
        instruction: list[int],
        embedding: np.ndarray,
        rng: np.random.Generator,
        should_stop: Callable[[], bool],
    ) -> Iterator[np.ndarray]:
        for text in texts:
            # instruct: the instruction is the LM's prompt text and the speaker stays out of the LM
            llm_embedding = None if r.mode == "instruct" else embedding
            tokens = self.llm.generate(text, instruction, [], llm_embedding, rng)
            stopped = False

            def until(tokens: Iterator[int] = tokens) -> Iterator[int]:
                nonlocal stopped
                for tok in tokens:
                    yield tok
                    if should_stop():
                        stopped = True
                        return

            for chunk in self.token2wav(
                until(), embedding=embedding, stream=r.stream, speed=r.speed, rng=rng
            ):
                if stopped:
                    return
                yield chunk.astype(np.float32, copy=False)
                if should_stop():
                    return
            if stopped:
                return

    def warm_up(self) -> None:
        with self.clock.phase("warmup"):
            self.llm.warm_up(self.options.warmup_tokens)
            self.warm_up_token2wav()

    def warm_up_token2wav(self) -> None:
        from cosyserve.lite.models import mel_length

        t2w = self.token2wav
        rng = np.random.default_rng(0)
        n = max(self.options.warmup_tokens, 2)
        noise = rng.standard_normal((80, mel_length(n, t2w.flow.input_frame_rate)), dtype=np.float32)
        empty = np.zeros((0, 80), np.float32)
        mel, _ = t2w.flow.inference([0] * n, [], empty, np.zeros(192, np.float32), None, noise, n_timesteps=1)
        phase, noise = t2w.hift.draws(mel.shape[1], rng)
        t2w.hift.inference(mel, None, phase, noise)

    # -- memory ---------------------------------------------------------------------------------------------------

    def mapped_files(self) -> list[Path]:
        return self.lite.data_files()

    def mapped_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.mapped_files())

    # -- voices ---------------------------------------------------------------------------------------------------

    def _no_registry(self) -> RegistryError:
        return RegistryError(
            "the lite runtime has no voice registry yet (registering a voice needs the prompt frontend, which is "
            "torch code today): serve the model with the torch runtime to add, remove, import or export voices"
        )

    def add_voice(self, name: str, prompt_wav: Any, prompt_text: str, *, tenant: str = "default",
                  overwrite: bool = False) -> Any:  # fmt: skip
        raise self._no_registry()

    def remove_voice(self, name: str, *, tenant: str = "default") -> None:
        raise self._no_registry()

    def import_voices(self, path: str | Path, *, tenant: str = "default", overwrite: bool = False) -> Any:
        raise self._no_registry()

    def export_voices(
        self, path: str | Path, *, tenant: str = "default", include_builtin: bool = False
    ) -> list[str]:
        raise self._no_registry()

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def join_background(self, timeout: float | None = None) -> None:
        if self.background is not None:
            self.background.join(timeout)

    def after_fork(self) -> None:
        # ORT sessions own thread pools, which do not survive fork(): a fork template opens none, and each child
        # opens the LM's and warms it here, the flow's and vocoder's in the background
        self.lite.sessions.clear()
        self.llm._pos_lock = threading.Lock()
        self.lite._lock = threading.Lock()
        _open_lm(self)
        self.background = _after_ready(self)

    def close(self) -> None:
        self.lite.sessions.clear()


def _read_speakers(bundle_dir: Path, manifest: dict[str, Any]) -> dict[str, np.ndarray]:
    entry = manifest.get("speakers")
    if not entry:
        return {}
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = bundle_dir / entry["file"]
    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as e:
        raise BundleError(f"{path}: cannot read the speakers ({e}); convert the model again") from e
    names = list(entry.get("names", []))
    out: dict[str, np.ndarray] = {}
    for key, value in tensors.items():
        idx, fld = key.split(".", 1)
        if fld == "embedding":
            out[names[int(idx)]] = np.ascontiguousarray(value, dtype=np.float32).reshape(-1)
    return out


def load(path: str | Path, options: RuntimeOptions, clock: Any = None) -> LiteRuntime:
    """Load the bundle at ``path`` (converted with ``--runtime lite``) on ONNX Runtime; see
    :func:`cosyserve.runtime.load_runtime`. Official model dirs and hub ids need the torch runtime to convert."""
    from cosyserve.clock import PhaseClock

    clock = clock or PhaseClock()
    o = options
    with clock.phase("imports"):
        import onnxruntime  # noqa: F401 - the one heavy import, timed as the torch runtime's imports are

        from cosyserve.lite.models import LiteBundle
    bundle_dir = Path(str(path))
    with clock.phase("manifest"):
        where = bundle_dir / "manifest.json"
        try:
            manifest = json.loads(where.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise BundleError(
                f"{bundle_dir} is not a bundle (no manifest.json): the lite runtime loads a bundle converted with "
                "`cosyserve convert MODEL_DIR BUNDLE --runtime lite` on a machine with torch"
            ) from None
        except (OSError, ValueError) as e:
            raise BundleError(f"{where}: unreadable ({e})") from e
        if manifest.get("family", "cosyvoice") != "cosyvoice":
            raise BundleError(f"{bundle_dir}: the lite runtime serves CosyVoice-300M bundles only")
        threads = o.threads or os.cpu_count() or 1
        lite = LiteBundle(bundle_dir, verify=o.verify, threads=threads)
        speakers = _read_speakers(bundle_dir, manifest)
    with clock.phase("construct"):
        runtime = LiteRuntime(bundle_dir, manifest, lite, speakers, o, clock)
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


TOKEN2WAV_GRAPHS = ("flow_encoder", "flow_regulator", "flow_estimator", "hift_f0", "hift_decode")


def _open_lm(runtime: LiteRuntime) -> None:
    clock, o = runtime.clock, runtime.options
    with clock.phase("sessions"):
        runtime.lite.session("llm_step")  # the text encoder's and the rest open after READY
    if o.warmup:
        with clock.phase("warmup"):
            runtime.llm.warm_up(1)  # one step: ORT's first call costs no more than later ones (see warm_up)


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
    """The rest of the start, in one thread after READY: text tier, the token2wav sessions and their warm-up."""
    o = runtime.options
    steps: list[tuple[str, Callable[[], Any]]] = []
    if o.text_tier == "background" and not o.fork_template:
        steps.append(("text_tier", _load_text_tier))
    steps.append(("sessions_llm_text", lambda: runtime.lite.session("llm_text")))
    # no flow/vocoder warm-up run: ORT's first call costs no more than a later one, and a warm-up would take the
    # cores from a first request that arrives meanwhile (measured: ~1.1 s of CPU at full size)
    steps.append(("sessions_token2wav", lambda: [runtime.lite.session(n) for n in TOKEN2WAV_GRAPHS]))
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
