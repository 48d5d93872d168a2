"""One model's serving engine: an explicit state machine, a bounded request queue, off-loop workers.

The states and their transitions are :mod:`cosyserve.engine.state`. Every transition happens under one lock and
is checked against its table; requests are admitted under the same lock and only in READY, so no request ever sees
a half-loaded or released model. Concurrency is a count of requests in flight inside READY, not a state.

The engine knows its model only as :class:`cosyserve.runtime.Runtime` instances (``instances`` of them, loaded by
the ``loader`` it is given). Model work runs on a bounded executor: one worker thread per slot of each instance
(``runtime.slots``, the requests it serves at at once). A request's audio chunks travel from the worker to the
request's own queue (:mod:`cosyserve.engine.streams`); nothing is polled. A cancelled request (client gone, stream
closed, deadline passed) stops at its next speech token (the runtime asks ``should_stop``), and its generator is
closed in the worker thread, which frees its state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from cosyserve.core.errors import (
    ClientError,
    CosyserveError,
    DeadlineExceededError,
    EngineDeadError,
    EngineStateError,
    InternalError,
    NotReadyError,
    OverloadedError,
    RequestCancelledError,
    UnknownVoiceError,
)
from cosyserve.core.request import ResolvedRequest, SynthesisRequest
from cosyserve.engine.job import BUFFER_SECONDS, Job, check_finite
from cosyserve.engine.servicetime import RETRY_AFTER_BOUNDS_S, ServiceTimes
from cosyserve.engine.state import ALLOWED, STATE_TRANSITION_ERROR, EngineState, Listener, Transition
from cosyserve.engine.stats import ModelStats
from cosyserve.engine.streams import AudioStream, End, SyncAudioStream, shared
from cosyserve.engine.voicemap import is_openai_voice, openai_voice_map
from cosyserve.system.gchold import collect_frozen

if TYPE_CHECKING:
    from cosyserve.runtime import Runtime

logger = logging.getLogger(__name__)

__all__ = ["BUFFER_SECONDS", "RETRY_AFTER_BOUNDS_S", "Engine", "Job", "check_finite"]


class Engine:
    """Serves one model: load, admit, run, cancel, drain, release.

    Args:
        name: model name (logs, errors, metrics).
        loader: loads one :class:`cosyserve.runtime.Runtime` (blocking; runs in a loader thread).
        instances: runtimes to load (``MODEL_POOL_SIZE``); each serves ``runtime.slots`` requests at once, from
            as many worker threads.
        queue_limit: requests allowed to wait for a worker; one more fails at once with
            :class:`OverloadedError`.
        stats: where request counters go (the pool shares one per model).
        clock: monotonic seconds (tests inject a fake one).
        default_service_s: service-time guess for ``retry_after`` before any request has finished.
        voices: the pool config's map of OpenAI voice names to this model's voices, over the default rule
            (:func:`cosyserve.engine.voicemap.openai_voice_map`).
        default_voice: the voice a request that names none speaks with (None: the model's first speaker).
    """

    def __init__(
        self,
        name: str,
        loader: Callable[[], Any],
        *,
        instances: int = 1,
        queue_limit: int = 16,
        stats: ModelStats | None = None,
        clock: Callable[[], float] = time.monotonic,
        default_service_s: float = 1.0,
        voices: Mapping[str, str] | None = None,
        default_voice: str | None = None,
    ) -> None:
        if instances < 1:
            raise ValueError(f"instances must be >= 1, got {instances}")
        if queue_limit < 0:
            raise ValueError(f"queue_limit must be >= 0, got {queue_limit}")
        self.name = name
        self._loader = loader
        self.instances = instances
        self.slots = instances  # requests served at once: each runtime's slots, known once loaded
        self.queue_limit = queue_limit
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
        self._instances: list[Runtime] = []  # the loaded runtimes
        self._idle: queue.SimpleQueue[Runtime] = queue.SimpleQueue()  # a runtime per free slot
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._jobs: set[Job] = set()
        self._in_flight = 0
        self._active = 0
        self._times = ServiceTimes(default_service_s)  # what retry_after predicts from
        self._voices = dict(voices or {})
        self._default_voice = default_voice
        self.sample_rate: int | None = None
        # the first runtime, READY: what it serves (voices, modes), its clock and memory
        self.runtime: Runtime | None = None

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
        if new not in ALLOWED[old]:
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
            slots = sum(int(m.slots) for m in models)
            for m in models:
                m.on_lm_step(self.stats.record_lm_step)  # the LM's steps, counted where the model's are
            executor = concurrent.futures.ThreadPoolExecutor(
                slots, thread_name_prefix=f"cosyserve-{self.name}"
            )
        except BaseException as e:  # noqa: BLE001 - reported through FAILED and the future
            error = e
        finally:
            with self._lock:
                if error is None:
                    self._instances = models
                    for runtime in models:
                        for _ in range(int(runtime.slots)):
                            self._idle.put(runtime)
                    self._executor = executor
                    self.slots = slots
                    self.runtime = models[0]
                    self.sample_rate = int(models[0].sample_rate)
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
        left of the running request closest to its end, each expected to take as long as its text's length says
        at the recent requests' seconds per character (a text of unknown length, streamed: the median of recent
        requests). With ``request_ids``, the earliest expected end of those requests (a tenant's own, for its
        quota); one still queued is expected to start when the first slot frees. Bounded to
        :data:`RETRY_AFTER_BOUNDS_S`.

        Why per character: requests are not alike. Expected from the median of recent requests whatever their
        length, a burst of one-sentence requests after a few long texts was told the long texts' time (Retry-After
        47 s where each took a second).
        """
        with self._lock:
            return self._times.retry_after(self._jobs, self.clock(), request_ids)

    def idle_after(self) -> float:
        """Seconds until every request in flight is likely done (when the pool could evict this model)."""
        with self._lock:
            return self._times.idle_after(self._jobs, self.clock(), self.slots)

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
        *,
        bounded: bool = False,
    ) -> Job:
        """Admit ``request`` (READY only, queue bound checked atomically) and schedule it on a worker.

        ``sink`` receives each float32 chunk, then one ``_End``. Prefer :meth:`synthesize` /
        :meth:`synthesize_sync`, which build the sink. ``on_done`` runs once when the request ends. ``bounded``:
        the consumer reports each chunk it takes (:meth:`Job.taken`) and the worker waits while it is more than
        :data:`BUFFER_SECONDS` of audio ahead.
        A request not yet resolved is resolved here (:meth:`resolve`: an unknown voice or a mode the model cannot
        run is refused before it takes a place in the queue); a :class:`~cosyserve.core.request.ResolvedRequest` is
        taken as it is, by the engine and by the runtime.
        Raises:
            ClientError, NotReadyError, EngineDeadError, OverloadedError: at once, nothing was queued.
        """
        if not isinstance(request, ResolvedRequest):
            request = self.resolve(request)
        job = Job(request, sink, self.clock)
        if bounded:  # the consumer reports what it takes (Job.taken): at most BUFFER_SECONDS of audio ahead
            job.buffer_limit = int(BUFFER_SECONDS * (self.sample_rate or 48000))
        if on_done is not None:
            job.on_done.append(on_done)
        with self._lock:
            if self._state is not EngineState.READY:
                self.stats.record_reject("not_ready")
                raise self._refuse_locked()
            waiting = max(0, self._in_flight - self.slots)
            if self._in_flight >= self.slots + self.queue_limit:
                self.stats.record_reject("overloaded")
                raise OverloadedError(
                    f"model {self.name!r}: {waiting} requests already waiting "
                    f"(queue limit {self.queue_limit})",
                    retry_after=self._times.retry_after(self._jobs, self.clock()),
                )
            self._in_flight += 1
            self._jobs.add(job)
            assert self._executor is not None, "READY without an executor"
            job.future = self._executor.submit(self._run, job)
        self.stats.record_admit()
        return job

    def openai_voices(self) -> dict[str, str | None]:
        """Each OpenAI voice name -> the voice it speaks with on this model (empty while not loaded)."""
        if self.runtime is None:
            return {}
        return openai_voice_map(self.runtime.speakers(), self._default_voice, self._voices)

    def resolve(self, request: SynthesisRequest) -> SynthesisRequest:
        """``request`` as the model runs it (``Runtime.resolve``: its mode decided, its voice found for its tenant),
        once: the result is taken as it is by :meth:`submit` and the runtime. An OpenAI voice name that is not a
        voice of the model's is the voice it maps to (:meth:`openai_voices`). A request is returned as it is while
        the engine has no runtime (not loaded).

        Raises:
            ClientError: what the model cannot serve (UnknownVoiceError, ModeUnavailableError), counted as a
                client error.
        """
        runtime = self.runtime
        if runtime is None:
            return request
        name = request.speaker
        alias = name is not None and is_openai_voice(name) and runtime.voice(name, request.tenant) is None
        if alias:
            request = dataclasses.replace(request, speaker=self.openai_voices()[name.lower()])
        try:
            return runtime.resolve(request)
        except ClientError as e:
            self.stats.record_reject("client_error")
            if alias and isinstance(e, UnknownVoiceError):
                raise UnknownVoiceError(
                    f"OpenAI voice {name!r} stands for {request.speaker!r} on model {self.name!r}: {e}",
                    param="speaker",
                ) from None
            raise

    def cancel(self, job: Job, reason: BaseException | None = None) -> None:
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

        job = self.submit(request, sink, on_done, bounded=True)
        return AudioStream(self, job, q)

    def synthesize_sync(
        self, request: SynthesisRequest, on_done: Callable[[], None] | None = None
    ) -> SyncAudioStream:
        """Blocking twin of :meth:`synthesize`: admission errors raise here, chunks come from the iterator;
        ``close()`` (or dropping it) cancels the generation."""
        q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        job = self.submit(request, q.put, on_done, bounded=True)
        return SyncAudioStream(self, job, q)

    def _emit(self, job: Job, chunk: np.ndarray) -> None:
        # Audio with NaN or infinite samples (a damaged checkpoint, an overflow in a half-precision cast) would be
        # encoded as silence or noise and answered as a success: it fails the request instead, before the chunk
        # leaves. One pass over a chunk costs microseconds next to the milliseconds that made it.
        check_finite(chunk)
        if job.first_audio is None:
            job.first_audio = self.clock()
            self.stats.record_first_audio(job.first_audio - job.submitted)
        job.samples += int(chunk.shape[-1])
        with job._room:
            job.pending += int(chunk.shape[-1])
        try:
            job.sink(chunk)
        except RuntimeError:  # the consumer's event loop is closed: nobody listens any more
            job.cancel(RequestCancelledError("the consumer's event loop is closed"))
        job.wait_for_room()

    def _run(self, job: Job) -> None:
        # worker thread: runs one request to its end on one runtime
        runtime = self._idle.get()  # never waits: one worker per slot of a runtime
        error: BaseException | None = None
        t0 = time.perf_counter()
        with self._lock:
            self._active += 1
            job.started = self.clock()
        try:
            if not job.should_stop():
                gen = runtime.start(job.request, job.should_stop)
                try:
                    for chunk in gen:
                        self._emit(job, chunk)
                        if job.should_stop():
                            break
                finally:
                    gen.close()  # here, in the worker: a generator stopped mid-way frees its caches now
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
            with self._lock:
                self._active -= 1
            self._idle.put(runtime)
            self._finish(job, error, time.perf_counter() - t0)

    def _finish(self, job: Job, error: BaseException | None, compute_s: float) -> None:
        with self._lock:
            if job.finished:
                return
            job.finished = True
            self._jobs.discard(job)
            self._in_flight -= 1
            if job.started is not None and error is None and job.cancel_reason is None:
                self._times.record(job.request, max(0.0, self.clock() - job.started))
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
            job.sink(End(error if error is not None else reason))
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
                for runtime in self._instances:
                    runtime.close()
                with self._lock:
                    self._instances = []
                    self._idle = queue.SimpleQueue()
                    self._executor = None
                    self.runtime = None
                    tr = self._transition_locked(EngineState.RELEASED)
                self._notify(tr)
                runtime = None  # the loop variable held the last runtime
                # cosyserve.load froze what it built (cosyserve.system.gchold.release_gc): the model's reference cycles
                # are freed only by a collection that looks at frozen objects; without it the weights stay mapped
                collect_frozen()
            else:  # FAILED: nothing was kept
                with self._lock:
                    self._instances = []
                    self.runtime = None
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
                "slots": self.slots,
                "in_flight": self._in_flight,
                "active": self._active,
                "queue_depth": self.queue_depth,
                "queue_limit": self.queue_limit,
                "transitions": [(t.new.value, t.wall) for t in self.transitions],
            }
