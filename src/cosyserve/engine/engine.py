"""One model's serving engine: an explicit state machine, a bounded request queue, off-loop workers.

States::

    NEW -> LOADING -> READY -> DRAINING -> RELEASED
              |         |         |
              +-> FAILED <--------+          (NEW -> RELEASED too: released before it was ever loaded)

Every transition happens under one lock and is checked against :data:`_ALLOWED`; an illegal one raises
:class:`~cosyserve.errors.EngineStateError` with :data:`STATE_TRANSITION_ERROR`. Requests are admitted
under the same lock and only in READY, so no request ever sees a half-loaded or released model. Concurrency
is a count of requests in flight inside READY, not a state.

Model work runs on a bounded executor: one worker thread per model instance (``instances``), each owning its
instance (the LM's KV cache is per module, so one instance serves one request at a time). With ``batch_size``
N > 1 each instance gets N workers instead, and its LM is wrapped in a
:class:`~cosyserve.engine.batching.BatchingLM`: their LM steps run as one batch, flow and vocoder concurrently
in the workers (they keep no per-call state on the modules), or, with ``batch_flow``, stacked where shapes match. A request's audio
chunks travel from the worker to the request's own ``asyncio.Queue`` through ``loop.call_soon_threadsafe``;
nothing is polled. A cancelled request (client gone, stream closed, deadline passed) stops at the next speech
token where the model exposes its LM (:class:`_TokenGate`), else at the next chunk, and its generator is
closed in the worker thread, which frees its state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import itertools
import logging
import math
import queue
import statistics
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cosyserve.engine.modes import MODES, Mode, field_errors, present_fields, speed_error
from cosyserve.errors import (
    ClientError,
    CosyserveError,
    DeadlineExceededError,
    EngineDeadError,
    EngineStateError,
    InternalError,
    NotReadyError,
    OverloadedError,
    RequestCancelledError,
)
from cosyserve.gchold import collect_frozen

logger = logging.getLogger(__name__)

__all__ = [
    "STATE_TRANSITION_ERROR",
    "AudioStream",
    "MODES",
    "RETRY_AFTER_BOUNDS_S",
    "Engine",
    "shared",
    "EngineState",
    "ModelStats",
    "SyncAudioStream",
    "SynthesisRequest",
    "Transition",
]

# Fields of a request that a model's pipeline takes beyond text/speaker (all modes)
_PIPELINE_FIELDS = ("prompt_text", "prompt_wav", "source_wav", "instruct_text", "normalize", "tenant")


class EngineState(enum.Enum):
    NEW = "new"
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    RELEASED = "released"
    FAILED = "failed"


S = EngineState
_ALLOWED: dict[EngineState, frozenset[EngineState]] = {
    S.NEW: frozenset({S.LOADING, S.RELEASED}),
    S.LOADING: frozenset({S.READY, S.FAILED}),
    S.READY: frozenset({S.DRAINING, S.FAILED}),
    S.DRAINING: frozenset({S.RELEASED, S.FAILED}),
    S.RELEASED: frozenset(),
    S.FAILED: frozenset(),
}
STATE_TRANSITION_ERROR = "engine {name!r}: illegal state transition {old} -> {new}"

# Retry-After's range. At least 1 s: the header counts whole seconds, and retrying at once only hits the full
# queue again. At most 60 s: the median of a few recent requests says little about the next minute (one long
# text is not the next one), and a client that comes back early costs one cheap refusal with a fresh estimate,
# while one told to wait too long idles as slots free.
RETRY_AFTER_BOUNDS_S = (1.0, 60.0)


def _bounded(seconds: float) -> float:
    lo, hi = RETRY_AFTER_BOUNDS_S
    return min(hi, max(lo, seconds))


@dataclass(frozen=True)
class SynthesisRequest:
    """One synthesis request (frozen; derive variants with ``dataclasses.replace``).

    Args:
        text: what to say (every mode but ``vc``).
        speaker: a pre-defined speaker id, or a registered voice of ``tenant``.
        mode: ``sft``, ``zero_shot``, ``cross_lingual``, ``instruct`` or ``vc`` (see
            :mod:`cosyserve.engine.modes` for the fields each takes).
        prompt_text, prompt_wav, source_wav, instruct_text, normalize, tenant: as
            :class:`cosyserve.engine.pipeline.SynthesisRequest` (audio as a path or the encoded file's bytes).
        stream: yield chunks as they are made (True) or one chunk per sentence (False).
        speed: tempo in [0.25, 4.0] (:data:`~cosyserve.engine.modes.SPEED_MIN`, ``SPEED_MAX``; non-streaming only).
        seed: makes the audio reproducible; None draws one.
        deadline: absolute time on the engine's clock (``time.monotonic()`` by default) after which the
            request is stopped with :class:`DeadlineExceededError`; None for none.
        request_id: for logs and metrics.
    """

    text: str = ""
    speaker: str | None = None
    mode: Mode = "sft"
    prompt_text: str = ""
    prompt_wav: Any = None
    source_wav: Any = None
    instruct_text: str = ""
    normalize: bool = True
    tenant: str = "default"
    stream: bool = False
    speed: float = 1.0
    seed: int | None = None
    deadline: float | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])

    def present(self) -> set[str]:
        """Names of the content fields given (non-blank strings, non-None audio)."""
        return present_fields(self)

    def verify(self) -> None:
        """Raise :class:`ClientError` naming the first bad field (checks that need no model)."""
        if self.mode not in MODES:
            raise ClientError(f"unknown mode {self.mode!r}; expected one of {', '.join(MODES)}")
        if self.mode != "vc" and (not isinstance(self.text, str) or not self.text.strip()):
            raise ClientError("text is empty: give at least one word to speak", param="text")
        errors = field_errors(self.mode, self.present())
        if errors:
            raise ClientError("; ".join(errors))
        bad_speed = speed_error(self.speed)
        if bad_speed:
            raise ClientError(bad_speed, param="speed")
        if self.stream and self.speed != 1.0:
            raise ClientError("speed change is only supported with stream=False", param="speed")


@dataclass(frozen=True)
class Transition:
    """One state change: ``seq`` orders them, ``wall`` is ``time.time()``, ``at`` the engine clock."""

    seq: int
    old: EngineState
    new: EngineState
    wall: float
    at: float
    cause: BaseException | None = None


Listener = Callable[["Engine", Transition], None]


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class ModelStats:
    """Counters and recent latencies of one model, updated only through these methods (one lock).

    The pool passes the same object to every engine it builds for the model, so loads and evictions
    (pool events) and requests (engine events) land in one place.
    """

    WINDOW = 1024

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self.loads = 0
        self.load_failures = 0
        self.evictions: dict[str, int] = {}
        self.hits = 0
        self.misses = 0
        self.first_load_s: float | None = None
        self.last_load_s: float | None = None
        self.requests = 0
        self.rejected: dict[str, int] = {}
        self.outcomes: dict[str, int] = {}
        self.audio_s = 0.0
        self.compute_s = 0.0
        self.ttfa_s: deque[float] = deque(maxlen=self.WINDOW)
        self.rtf: deque[float] = deque(maxlen=self.WINDOW)

    def record_load(self, seconds: float, ok: bool) -> None:
        with self._lock:
            if not ok:
                self.load_failures += 1
                return
            self.loads += 1
            if self.first_load_s is None:
                self.first_load_s = seconds
            self.last_load_s = seconds

    def record_eviction(self, reason: str) -> None:
        with self._lock:
            self.evictions[reason] = self.evictions.get(reason, 0) + 1

    def record_lookup(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1

    def record_admit(self) -> None:
        with self._lock:
            self.requests += 1

    def record_reject(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def record_first_audio(self, ttfa_s: float) -> None:
        with self._lock:
            self.ttfa_s.append(ttfa_s)

    def record_finish(self, outcome: str, audio_s: float, compute_s: float) -> None:
        with self._lock:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            self.audio_s += audio_s
            self.compute_s += compute_s
            if outcome == "ok" and audio_s > 0:
                self.rtf.append(compute_s / audio_s)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            ttfa = list(self.ttfa_s)
            rtf = list(self.rtf)
            return {
                "loads": self.loads,
                "load_failures": self.load_failures,
                "evictions": dict(self.evictions),
                "hits": self.hits,
                "misses": self.misses,
                "first_load_s": self.first_load_s,
                "last_load_s": self.last_load_s,
                "requests": self.requests,
                "rejected": dict(self.rejected),
                "outcomes": dict(self.outcomes),
                "audio_s": self.audio_s,
                "compute_s": self.compute_s,
                "ttfa_p50_s": _quantile(ttfa, 0.5),
                "ttfa_p99_s": _quantile(ttfa, 0.99),
                "rtf_p50": _quantile(rtf, 0.5),
                "rtf_mean": (sum(rtf) / len(rtf)) if rtf else None,
            }


class _Stop(Exception):
    """Raised inside the model's token loop (by :class:`_TokenGate`) to stop a cancelled request."""


@dataclass(frozen=True)
class _End:
    error: BaseException | None = None


class _Job:
    """A request inside the engine: its sink, cancellation flag and timings."""

    def __init__(
        self, request: SynthesisRequest, sink: Callable[[Any], None], clock: Callable[[], float]
    ) -> None:
        self.request = request
        self.sink = sink
        self.clock = clock
        self.submitted = clock()
        self.started: float | None = None
        self.first_audio: float | None = None
        self.samples = 0
        self.cancel_reason: BaseException | None = None
        self.future: concurrent.futures.Future[None] | None = None
        self.finished = False
        self.on_done: list[Callable[[], None]] = []

    def cancel(self, reason: BaseException) -> None:
        # first reason wins; the worker reads it at the next token/chunk
        if self.cancel_reason is None:
            self.cancel_reason = reason

    def check(self) -> None:
        """Raise :class:`_Stop` if the request was cancelled or its deadline passed (worker thread)."""
        if self.cancel_reason is None:
            d = self.request.deadline
            if d is not None and self.clock() >= d:
                self.cancel(DeadlineExceededError(f"request {self.request.request_id}: deadline passed"))
        if self.cancel_reason is not None:
            raise _Stop


class _TokenGate:
    """Wraps a model's LM so each speech token passes ``check()`` of the request being served.

    The pipeline consumes ``llm.inference(...)`` lazily; raising from inside that generator stops the token
    loop at once and unwinds the pipeline's generators, so a cancelled request costs at most one more token.
    Every other attribute is the wrapped module's.
    """

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        self._local = threading.local()  # the check of the request this worker thread serves (batch_size > 1)
        self.tokens = 0

    @property
    def check(self) -> Callable[[], None] | None:
        return getattr(self._local, "check", None)

    @check.setter
    def check(self, check: Callable[[], None] | None) -> None:
        self._local.check = check

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def inference(self, *args: Any, **kwargs: Any) -> Iterator[int]:
        for token in self._llm.inference(*args, **kwargs):
            self.tokens += 1
            check = self.check
            if check is not None:
                check()
            yield token


@dataclass
class _Instance:
    model: Any
    gate: _TokenGate | None
    batcher: Any = None  # the BatchingLM shared by this instance's workers (batch_size > 1)
    flow_batcher: Any = None  # the FlowBatcher stacking their same-shape flow calls (batch_flow)
    vocoder_batcher: Any = None  # the VocoderBatcher stacking their same-shape HiFT calls (batch_flow)


def _install_gate(model: Any) -> _TokenGate | None:
    pipeline = getattr(model, "_pipeline", None)
    llm = getattr(pipeline, "llm", None)
    if llm is None or not hasattr(llm, "inference"):
        return None
    if isinstance(llm, _TokenGate):
        return llm
    gate = _TokenGate(llm)
    pipeline.llm = gate
    return gate


def _make_instance(
    model: Any, batch_size: int, torch_threads: int | None, name: str, batch_flow: bool = False
) -> _Instance:
    pipeline = getattr(model, "_pipeline", None)
    llm = getattr(pipeline, "llm", None)
    batcher = flow_batcher = vocoder_batcher = None
    if batch_size > 1 and llm is not None and not isinstance(llm, _TokenGate) and hasattr(llm, "prefill"):
        from cosyserve.engine.batching import BatchingLM

        batcher = pipeline.llm = BatchingLM(llm, batch_size, torch_threads=torch_threads, name=name)
    t2w = getattr(pipeline, "token2wav", None)
    if batch_flow and batch_size > 1 and hasattr(getattr(t2w, "flow", None), "draw_noise"):
        from cosyserve.engine.batching import FlowBatcher, VocoderBatcher

        flow_batcher = t2w.flow = FlowBatcher(t2w.flow, batch_size, name=f"{name} flow")
        if hasattr(getattr(t2w, "hift", None), "draw_source_noise"):
            vocoder_batcher = t2w.hift = VocoderBatcher(t2w.hift, batch_size, name=f"{name} vocoder")
    return _Instance(model, _install_gate(model), batcher, flow_batcher, vocoder_batcher)


async def shared(fut: concurrent.futures.Future[Any]) -> Any:
    """Await a future other callers share (a load, a release): cancelling this waiter leaves it running.

    ``asyncio.wrap_future`` alone would cancel the shared future when one waiting request is cancelled (a
    client that disconnects during a model load), and the loader thread would then fail to set its result.
    """
    return await asyncio.shield(asyncio.wrap_future(fut))


def _start(model: Any, r: SynthesisRequest) -> Iterator[np.ndarray]:
    # a full model (cosyserve.load) runs every mode; a minimal one (tests' fakes) only sft via synthesize()
    if callable(getattr(model, "synthesize_request", None)):
        fields = {name: getattr(r, name) for name in _PIPELINE_FIELDS}
        return model.synthesize_request(
            model.request(
                mode=r.mode,
                text=r.text,
                speaker=r.speaker,
                stream=r.stream,
                speed=r.speed,
                seed=r.seed,
                **fields,
            )
        )
    if r.mode != "sft":
        raise ClientError(f"model serves only sft mode; {r.mode!r} needs a full CosyVoice model")
    return model.synthesize(r.text, r.speaker, stream=r.stream, speed=r.speed, seed=r.seed)


def _worker_init(torch_threads: int | None) -> None:
    if torch_threads:
        import torch

        torch.set_num_threads(torch_threads)  # per-thread (OpenMP ICV): leaves other threads alone


class Engine:
    """Serves one model: load, admit, run, cancel, drain, release.

    Args:
        name: model name (logs, errors, metrics).
        loader: builds one model instance (blocking; runs in a loader thread). The model has
            ``synthesize(text, speaker, *, stream, speed, seed) -> Iterator[np.ndarray]``, ``sample_rate`` and
            (optionally) ``speakers``.
        instances: model instances, each with its own worker thread (``MODEL_POOL_SIZE``).
        batch_size: requests each instance serves at once (its workers), their LM steps batched (continuous
            batching); 1 serves one request at a time per instance.
        batch_flow: with ``batch_size`` > 1, also stack the workers' flow and vocoder calls of equal shapes
            (:class:`~cosyserve.engine.batching.FlowBatcher`, :class:`~cosyserve.engine.batching.VocoderBatcher`):
            audio then equals unbatched audio up to float rounding instead of bit for bit. Off by default.
        queue_limit: requests allowed to wait for a worker; one more fails at once with
            :class:`OverloadedError`.
        torch_threads: torch intra-op threads in each worker thread (None leaves torch's default).
        stats: where request counters go (the pool shares one per model).
        clock: monotonic seconds (tests inject a fake one).
        default_service_s: service-time guess for ``retry_after`` before any request has finished.
    """

    def __init__(
        self,
        name: str,
        loader: Callable[[], Any],
        *,
        instances: int = 1,
        batch_size: int = 1,
        batch_flow: bool = False,
        queue_limit: int = 16,
        torch_threads: int | None = 1,
        stats: ModelStats | None = None,
        clock: Callable[[], float] = time.monotonic,
        default_service_s: float = 1.0,
    ) -> None:
        if instances < 1:
            raise ValueError(f"instances must be >= 1, got {instances}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if queue_limit < 0:
            raise ValueError(f"queue_limit must be >= 0, got {queue_limit}")
        self.name = name
        self._loader = loader
        self.instances = instances
        self.batch_size = batch_size
        self.batch_flow = batch_flow
        self.slots = instances * batch_size  # requests served at once
        self.queue_limit = queue_limit
        self.torch_threads = torch_threads
        self.stats = stats or ModelStats(name)
        self.clock = clock
        self._lock = threading.Lock()
        self._idle_cond = threading.Condition(self._lock)
        self._state = EngineState.NEW
        self._seq = itertools.count()
        self.transitions: list[Transition] = []
        self._listeners: list[Listener] = []
        self._load_future: concurrent.futures.Future[Engine] | None = None
        self._release_future: concurrent.futures.Future[None] | None = None
        self._instances: list[_Instance] = []
        self._idle: queue.SimpleQueue[_Instance] = queue.SimpleQueue()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._jobs: set[_Job] = set()
        self._in_flight = 0
        self._active = 0
        self._default_service_s = default_service_s
        # wall seconds (engine clock) each recent request held its slot, start to end: what retry_after predicts from
        self._service_s: deque[float] = deque(maxlen=32)
        self.sample_rate: int | None = None
        self.speakers: list[str] = []
        # the model runs every mode (synthesize_request) and checks speakers itself
        self._full_pipeline = False
        self.resident_hint: Any = None  # the first instance, for the pool's byte accounting

    # -- state machine ---------------------------------------------------------------------------------------

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def cause(self) -> BaseException | None:
        """Why the engine FAILED (None otherwise)."""
        if self._state is EngineState.FAILED and self.transitions:
            return self.transitions[-1].cause
        return None

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(engine, transition)`` after every state change (outside the engine lock)."""
        self._listeners.append(listener)

    def _transition_locked(self, new: EngineState, cause: BaseException | None = None) -> Transition:
        old = self._state
        if new not in _ALLOWED[old]:
            raise EngineStateError(STATE_TRANSITION_ERROR.format(name=self.name, old=old.name, new=new.name))
        self._state = new
        tr = Transition(next(self._seq), old, new, time.time(), self.clock(), cause)
        self.transitions.append(tr)
        self._idle_cond.notify_all()
        return tr

    def _notify(self, tr: Transition) -> None:
        logger.info("engine %s: %s -> %s", self.name, tr.old.value, tr.new.value)
        for listener in list(self._listeners):
            try:
                listener(self, tr)
            except Exception:
                logger.exception("engine %s: state listener %r failed", self.name, listener)

    def transition(self, new: EngineState, cause: BaseException | None = None) -> Transition:
        """Move to ``new`` if the table allows it from the current state, else raise EngineStateError."""
        with self._lock:
            tr = self._transition_locked(new, cause)
        self._notify(tr)
        return tr

    # -- load ------------------------------------------------------------------------------------------------

    def start_load(self) -> concurrent.futures.Future[Engine]:
        """Start loading (NEW -> LOADING) or join the load already started; thread-safe.

        Returns:
            A future shared by every caller: the engine once READY, or :class:`EngineDeadError` (``__cause__``
            the loader's exception) once FAILED.
        Raises:
            EngineStateError: the engine was released before it was loaded.
        """
        with self._lock:
            if self._load_future is not None:
                return self._load_future
            tr = self._transition_locked(EngineState.LOADING)
            fut: concurrent.futures.Future[Engine] = concurrent.futures.Future()
            self._load_future = fut
        self._notify(tr)
        threading.Thread(target=self._load_main, name=f"cosyserve-load-{self.name}", daemon=True).start()
        return fut

    async def load(self) -> Engine:
        """Await the (shared) load; see :meth:`start_load`."""
        return await shared(self.start_load())

    def load_sync(self, timeout: float | None = None) -> Engine:
        return self.start_load().result(timeout)

    def _load_main(self) -> None:
        fut = self._load_future
        assert fut is not None
        error: BaseException | None = None
        tr: Transition | None = None
        try:
            if self.instances == 1:
                models = [self._loader()]
            else:
                with concurrent.futures.ThreadPoolExecutor(self.instances) as ex:
                    models = list(ex.map(lambda _: self._loader(), range(self.instances)))
            instances = [
                _make_instance(m, self.batch_size, self.torch_threads, self.name, self.batch_flow)
                for m in models
            ]
            executor = concurrent.futures.ThreadPoolExecutor(
                self.slots,
                thread_name_prefix=f"cosyserve-{self.name}",
                initializer=_worker_init,
                initargs=(self.torch_threads,),
            )
        except BaseException as e:  # noqa: BLE001 - reported through FAILED and the future
            error = e
        finally:
            with self._lock:
                if error is None:
                    self._instances = instances
                    for inst in instances:
                        for _ in range(self.batch_size):
                            self._idle.put(inst)
                    self._executor = executor
                    first = models[0]
                    self.sample_rate = int(getattr(first, "sample_rate", 0)) or None
                    self.speakers = list(getattr(first, "speakers", []) or [])
                    self._full_pipeline = callable(getattr(first, "synthesize_request", None))
                    self.resident_hint = first
                    tr = self._transition_locked(EngineState.READY)
                else:
                    tr = self._transition_locked(EngineState.FAILED, error)
            self._notify(tr)
            if error is None:
                fut.set_result(self)
            else:
                logger.error("engine %s: load failed: %r", self.name, error)
                dead = EngineDeadError(f"model {self.name!r} failed to load: {error}")
                dead.__cause__ = error
                fut.set_exception(dead)

    # -- requests --------------------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Requests admitted and not finished (queued + running)."""
        return self._in_flight

    @property
    def active(self) -> int:
        """Requests a worker is running now."""
        return self._active

    @property
    def queue_depth(self) -> int:
        return self._in_flight - self._active

    def retry_after(self, request_ids: Collection[str] = ()) -> float:
        """Seconds until a slot is likely free: the earliest expected end of a running request.

        A refused client needs one slot, and one ends when the first running request does: that is the time
        left of the running request closest to its end, each expected to take the median of recent service
        times. With ``request_ids``, the earliest expected end of those requests (a tenant's own, for its
        quota); one still queued is expected to start when the first slot frees. Bounded to
        :data:`RETRY_AFTER_BOUNDS_S`.
        """
        with self._lock:
            return self._retry_after_locked(request_ids)

    def idle_after(self) -> float:
        """Seconds until every request in flight is likely done (when the pool could evict this model)."""
        with self._lock:
            typical, running, queued = self._expected_locked()
            last = max((left for _, left in running), default=0.0)
            return _bounded(last + math.ceil(queued / self.slots) * typical)

    def _expected_locked(self) -> tuple[float, list[tuple[str, float]], int]:
        # (typical service seconds, (request id, expected seconds left) of each running request, queued count)
        typical = statistics.median(self._service_s) if self._service_s else self._default_service_s
        now = self.clock()
        running = [
            # a cancelled request ends at its next token
            (job.request.request_id, 0.0 if job.cancel_reason else max(0.0, typical - (now - job.started)))
            for job in self._jobs
            if job.started is not None
        ]
        return typical, running, max(0, self._in_flight - len(running))

    def _retry_after_locked(self, request_ids: Collection[str] = ()) -> float:
        typical, running, _ = self._expected_locked()
        first_free = min((left for _, left in running), default=0.0)  # none running: a slot is free now
        if not request_ids:
            return _bounded(first_free)
        mine = [left for rid, left in running if rid in request_ids]
        return _bounded(min(mine) if mine else first_free + typical)

    def _refuse_locked(self) -> CosyserveError:
        st = self._state
        if st in (EngineState.NEW, EngineState.LOADING):
            return NotReadyError(f"model {self.name!r} is {st.value}, not ready")
        if st is EngineState.DRAINING:
            return NotReadyError(f"model {self.name!r} is draining (shutting down or being evicted)")
        err = EngineDeadError(f"model {self.name!r} is {st.value}")
        err.__cause__ = self.cause
        return err

    def submit(
        self,
        request: SynthesisRequest,
        sink: Callable[[Any], None],
        on_done: Callable[[], None] | None = None,
    ) -> _Job:
        """Admit ``request`` (READY only, queue bound checked atomically) and schedule it on a worker.

        ``sink`` receives each float32 chunk, then one ``_End``. Prefer :meth:`synthesize` /
        :meth:`synthesize_sync`, which build the sink. ``on_done`` runs once when the request ends.
        Raises:
            ClientError, NotReadyError, EngineDeadError, OverloadedError: at once, nothing was queued.
        """
        request.verify()
        job = _Job(request, sink, self.clock)
        if on_done is not None:
            job.on_done.append(on_done)
        with self._lock:
            if self._state is not EngineState.READY:
                self.stats.record_reject("not_ready")
                raise self._refuse_locked()
            if not self._full_pipeline and self.speakers and request.speaker not in self.speakers:
                raise ClientError(
                    f"unknown speaker {request.speaker!r} for model {self.name!r}; known: "
                    + ", ".join(sorted(self.speakers))
                )
            waiting = max(0, self._in_flight - self.slots)
            if self._in_flight >= self.slots + self.queue_limit:
                self.stats.record_reject("overloaded")
                raise OverloadedError(
                    f"model {self.name!r}: {waiting} requests already waiting "
                    f"(queue limit {self.queue_limit})",
                    retry_after=self._retry_after_locked(),
                )
            self._in_flight += 1
            self._jobs.add(job)
            assert self._executor is not None, "READY without an executor"
            job.future = self._executor.submit(self._run, job)
        self.stats.record_admit()
        return job

    def cancel(self, job: _Job, reason: BaseException | None = None) -> None:
        """Stop ``job``: a queued one ends now, a running one at its next token or chunk."""
        job.cancel(reason or RequestCancelledError(f"request {job.request.request_id} cancelled"))
        fut = job.future
        if fut is not None and fut.cancel():
            self._finish(job, None, compute_s=0.0)

    def synthesize(self, request: SynthesisRequest, on_done: Callable[[], None] | None = None) -> AudioStream:
        """Admit ``request`` and return its audio as an async iterator of float32 chunks.

        Call from a coroutine (the stream belongs to the running loop). Admission errors raise here, at once;
        errors during synthesis raise from the iteration. Leaving the iteration early (``aclose``, client
        cancelled) stops the generation.
        """
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Any] = asyncio.Queue()

        def sink(item: Any) -> None:
            loop.call_soon_threadsafe(q.put_nowait, item)  # RuntimeError once the loop is closed

        job = self.submit(request, sink, on_done)
        return AudioStream(self, job, q)

    def synthesize_sync(
        self, request: SynthesisRequest, on_done: Callable[[], None] | None = None
    ) -> SyncAudioStream:
        """Blocking twin of :meth:`synthesize`: admission errors raise here, chunks come from the iterator;
        ``close()`` (or dropping it) cancels the generation."""
        q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        job = self.submit(request, q.put, on_done)
        return SyncAudioStream(self, job, q)

    def _emit(self, job: _Job, chunk: np.ndarray) -> None:
        if job.first_audio is None:
            job.first_audio = self.clock()
            self.stats.record_first_audio(job.first_audio - job.submitted)
        job.samples += int(chunk.shape[-1])
        try:
            job.sink(chunk)
        except RuntimeError:  # the consumer's event loop is closed: nobody listens any more
            job.cancel(RequestCancelledError("the consumer's event loop is closed"))

    def _run(self, job: _Job) -> None:
        # worker thread: runs one request to its end on one instance
        inst = self._idle.get()  # never waits: one worker per slot of an instance
        error: BaseException | None = None
        t0 = time.perf_counter()
        with self._lock:
            self._active += 1
            job.started = self.clock()
        try:
            job.check()
            r = job.request
            gen = _start(inst.model, r)
            if inst.gate is not None:
                inst.gate.check = job.check
            try:
                for chunk in gen:
                    self._emit(job, chunk)
                    job.check()
            finally:
                gen.close()  # here, in the worker: a generator stopped mid-way frees its caches now
        except _Stop:
            pass
        except ClientError as e:
            error = e
        except Exception as e:
            rid = job.request.request_id
            logger.exception("engine %s: request %s failed", self.name, rid)
            # the message reaches remote clients: never the exception's text, which may name server paths;
            # an error that knows what a client may read says so in public_message
            public = e.public_message if isinstance(e, CosyserveError) else None
            what = public or f"synthesis failed ({type(e).__name__})"
            error = InternalError(f"model {self.name!r}: {what} (details in the server log, request {rid})")
            error.__cause__ = e
        finally:
            if inst.gate is not None:
                inst.gate.check = None
            with self._lock:
                self._active -= 1
            self._idle.put(inst)
            self._finish(job, error, time.perf_counter() - t0)

    def _finish(self, job: _Job, error: BaseException | None, compute_s: float) -> None:
        with self._lock:
            if job.finished:
                return
            job.finished = True
            self._jobs.discard(job)
            self._in_flight -= 1
            if job.started is not None and error is None and job.cancel_reason is None:
                self._service_s.append(max(0.0, self.clock() - job.started))
            self._idle_cond.notify_all()
        reason = job.cancel_reason
        if error is not None:
            outcome = "client_error" if isinstance(error, ClientError) else "error"
        elif isinstance(reason, DeadlineExceededError):
            outcome = "deadline"
        elif reason is not None:
            outcome = "cancelled"
        else:
            outcome = "ok"
        rate = self.sample_rate or 1
        self.stats.record_finish(outcome, job.samples / rate, compute_s)
        try:
            job.sink(_End(error if error is not None else reason))
        except RuntimeError:
            logger.debug(
                "engine %s: request %s ended after its consumer's loop closed",
                self.name,
                job.request.request_id,
            )
        finally:
            for cb in job.on_done:
                try:
                    cb()
                except Exception:
                    logger.exception("engine %s: on_done callback failed", self.name)

    # -- drain and release -----------------------------------------------------------------------------------

    def try_begin_drain(self) -> bool:
        """READY with nothing in flight -> DRAINING, atomically (the pool's eviction); False otherwise."""
        with self._lock:
            if self._state is not EngineState.READY or self._in_flight:
                return False
            tr = self._transition_locked(EngineState.DRAINING)
        self._notify(tr)
        return True

    def start_release(self, timeout: float | None = 30.0) -> concurrent.futures.Future[None]:
        """Stop admitting (-> DRAINING), let in-flight requests finish within ``timeout`` seconds, cancel the
        rest, then drop the model instances (-> RELEASED). Shared by concurrent callers; idempotent.
        """
        with self._lock:
            if self._release_future is not None:
                return self._release_future
            fut: concurrent.futures.Future[None] = concurrent.futures.Future()
            self._release_future = fut
            tr = None
            if self._state is EngineState.NEW:
                tr = self._transition_locked(EngineState.RELEASED)
                fut.set_result(None)
        if tr is not None:
            self._notify(tr)
            return fut
        threading.Thread(
            target=self._release_main, args=(timeout,), name=f"cosyserve-release-{self.name}", daemon=True
        ).start()
        return fut

    async def release(self, timeout: float | None = 30.0) -> None:
        await shared(self.start_release(timeout))

    def release_sync(self, timeout: float | None = 30.0) -> None:
        self.start_release(timeout).result()

    def _release_main(self, timeout: float | None) -> None:
        fut = self._release_future
        assert fut is not None
        try:
            if self._load_future is not None:
                concurrent.futures.wait([self._load_future])
            tr = None
            with self._lock:
                if self._state is EngineState.READY:
                    tr = self._transition_locked(EngineState.DRAINING)
            if tr is not None:
                self._notify(tr)
            with self._lock:
                if self._state is EngineState.DRAINING:
                    end = None if timeout is None else time.monotonic() + timeout
                    while self._in_flight and (end is None or time.monotonic() < end):
                        self._idle_cond.wait(None if end is None else max(0.0, end - time.monotonic()))
                    leftovers = list(self._jobs)
            if self._state is EngineState.DRAINING:
                for job in leftovers:
                    logger.warning(
                        "engine %s: cancelling request %s at release", self.name, job.request.request_id
                    )
                    self.cancel(job, EngineDeadError(f"model {self.name!r} released while serving"))
                executor = self._executor
                if executor is not None:
                    executor.shutdown(wait=True)  # workers stop at their next token
                for inst in self._instances:
                    if inst.batcher is not None:
                        inst.batcher.close()
                with self._lock:
                    self._instances = []
                    self._idle = queue.SimpleQueue()
                    self._executor = None
                    self.resident_hint = None
                    tr = self._transition_locked(EngineState.RELEASED)
                self._notify(tr)
                inst = None  # the loop variable held the last instance
                # cosyserve.load froze what it built (cosyserve.gchold.release_gc): the model's reference cycles
                # are freed only by a collection that looks at frozen objects; without it the weights stay mapped
                collect_frozen()
            else:  # FAILED: nothing was kept
                with self._lock:
                    self._instances = []
                    self.resident_hint = None
        except BaseException as e:
            fut.set_exception(e)
        finally:
            if not fut.done():
                fut.set_result(None)

    def describe(self) -> dict[str, Any]:
        """State, load, queue and transition times for health and metrics."""
        with self._lock:
            return {
                "name": self.name,
                "state": self._state.value,
                "cause": repr(self.cause) if self.cause is not None else None,
                "instances": self.instances,
                "batch_size": self.batch_size,
                "batch_flow": self.batch_flow,
                "in_flight": self._in_flight,
                "active": self._active,
                "queue_depth": self.queue_depth,
                "queue_limit": self.queue_limit,
                "transitions": [(t.new.value, t.wall) for t in self.transitions],
            }


class AudioStream:
    """The audio of one admitted request: ``async for chunk in stream`` (float32 numpy arrays).

    Closing it early (``await stream.aclose()``, ``async with``, or the consuming task being cancelled)
    cancels the generation. ``request_id`` and ``sample_rate`` are for the caller's headers.
    """

    def __init__(self, engine: Engine, job: _Job, q: asyncio.Queue[Any]) -> None:
        self._engine = engine
        self._job = job
        self._q = q
        self._done = False
        self.request_id = job.request.request_id
        self.sample_rate = engine.sample_rate
        weakref.finalize(self, _cancel_if_running, engine, job)

    def __aiter__(self) -> AsyncIterator[np.ndarray]:
        return self

    async def __anext__(self) -> np.ndarray:
        if self._done:
            raise StopAsyncIteration
        job = self._job
        try:
            if not self._q.empty():
                item = self._q.get_nowait()
            elif job.request.deadline is not None:
                left = max(0.0, job.request.deadline - self._engine.clock())
                item = await asyncio.wait_for(self._q.get(), left)
            else:
                item = await self._q.get()
        except TimeoutError:
            self._done = True
            err = DeadlineExceededError(f"request {job.request.request_id}: deadline passed")
            self._engine.cancel(job, err)
            raise err from None
        except (asyncio.CancelledError, GeneratorExit):
            self._done = True
            self._engine.cancel(job, RequestCancelledError("client went away"))
            raise
        if isinstance(item, _End):
            self._done = True
            if item.error is not None:
                raise item.error
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._engine.cancel(self._job, RequestCancelledError("stream closed by the client"))

    async def __aenter__(self) -> AudioStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _cancel_if_running(engine: Engine, job: _Job) -> None:
    if not job.finished:
        engine.cancel(job, RequestCancelledError("stream dropped without being closed"))


class SyncAudioStream:
    """Blocking iterator over one admitted request's chunks; ``close()`` cancels it."""

    def __init__(self, engine: Engine, job: _Job, q: queue.SimpleQueue[Any]) -> None:
        self._engine = engine
        self._job = job
        self._q = q
        self._done = False
        self.request_id = job.request.request_id
        self.sample_rate = engine.sample_rate
        weakref.finalize(self, _cancel_if_running, engine, job)

    def __iter__(self) -> Iterator[np.ndarray]:
        return self

    def __next__(self) -> np.ndarray:
        if self._done:
            raise StopIteration
        job = self._job
        timeout = None
        if job.request.deadline is not None:
            timeout = max(0.0, job.request.deadline - self._engine.clock())
        try:
            item = self._q.get(timeout=timeout)
        except queue.Empty:
            self._done = True
            err = DeadlineExceededError(f"request {job.request.request_id}: deadline passed")
            self._engine.cancel(job, err)
            raise err from None
        except BaseException:
            self.close()
            raise
        if isinstance(item, _End):
            self._done = True
            if item.error is not None:
                raise item.error
            raise StopIteration
        return item

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._engine.cancel(self._job, RequestCancelledError("the caller stopped reading"))

    def __enter__(self) -> SyncAudioStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
