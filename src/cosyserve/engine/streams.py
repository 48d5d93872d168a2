"""How a request's audio reaches its caller: an async stream for the server, a blocking one for threads.

The engine's worker puts each chunk, then one :class:`End`, into the request's own queue (``asyncio.Queue``
through ``loop.call_soon_threadsafe``, or a ``queue.SimpleQueue``); nothing is polled. Taking a chunk tells the
job (:meth:`~cosyserve.engine.engine.Job.taken`): a worker more than ``BUFFER_SECONDS`` of audio ahead of its
consumer waits for it. Leaving a stream early
(``aclose``/``close``, the consuming task cancelled, the stream dropped) cancels the request in the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import weakref
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from cosyserve.core.errors import DeadlineExceededError, RequestCancelledError

if TYPE_CHECKING:
    from cosyserve.engine.engine import Engine, Job

__all__ = ["AudioStream", "End", "SyncAudioStream", "shared"]


@dataclass(frozen=True)
class End:
    """The last item of a request's queue: ``error`` is why it ended early (None: it completed)."""

    error: BaseException | None = None


async def shared(fut: concurrent.futures.Future[Any]) -> Any:
    """Await a future other callers share (a load, a release): cancelling this waiter leaves it running.

    ``asyncio.wrap_future`` alone would cancel the shared future when one waiting request is cancelled (a
    client that disconnects during a model load), and the loader thread would then fail to set its result.
    """
    return await asyncio.shield(asyncio.wrap_future(fut))


class _StreamBase:
    """What both streams hold: the engine, the job, the resolved request and the cancel-on-drop finaliser."""

    def __init__(self, engine: Engine, job: Job) -> None:
        self._engine = engine
        self._job = job
        self._done = False
        self.request = job.request  # as the runtime resolved it (mode, speaker)
        self.request_id = job.request.request_id
        self.sample_rate = engine.sample_rate
        # cancels the request if the stream is dropped unfinished; detached once it is done (see _finish)
        self._finalizer = weakref.finalize(self, _cancel_if_running, engine, job)

    def _finish(self) -> None:
        # the stream is done: its request ended or was cancelled. Detach the finaliser, whose registry would
        # otherwise keep the job (and whatever it reaches: a client's session, its text feed) alive for good
        self._done = True
        self._finalizer.detach()


class AudioStream(_StreamBase):
    """The audio of one admitted request: ``async for chunk in stream`` (float32 numpy arrays).

    Closing it early (``await stream.aclose()``, ``async with``, or the consuming task being cancelled)
    cancels the generation. ``request_id`` and ``sample_rate`` are for the caller's headers.
    """

    def __init__(self, engine: Engine, job: Job, q: asyncio.Queue[Any]) -> None:
        super().__init__(engine, job)
        self._q = q

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
            self._finish()
            err = DeadlineExceededError(f"request {job.request.request_id}: deadline passed")
            self._engine.cancel(job, err)
            raise err from None
        except (asyncio.CancelledError, GeneratorExit):
            self._finish()
            self._engine.cancel(job, RequestCancelledError("client went away"))
            raise
        if isinstance(item, End):
            self._finish()
            if item.error is not None:
                raise item.error
            raise StopAsyncIteration
        job.taken(int(item.shape[-1]))
        return item

    async def aclose(self) -> None:
        if not self._done:
            self._finish()
            self._engine.cancel(self._job, RequestCancelledError("stream closed by the client"))

    async def __aenter__(self) -> AudioStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _cancel_if_running(engine: Engine, job: Job) -> None:
    if not job.finished:
        engine.cancel(job, RequestCancelledError("stream dropped without being closed"))


class SyncAudioStream(_StreamBase):
    """Blocking iterator over one admitted request's chunks; ``close()`` cancels it."""

    def __init__(self, engine: Engine, job: Job, q: queue.SimpleQueue[Any]) -> None:
        super().__init__(engine, job)
        self._q = q

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
            self._finish()
            err = DeadlineExceededError(f"request {job.request.request_id}: deadline passed")
            self._engine.cancel(job, err)
            raise err from None
        except BaseException:
            self.close()
            raise
        if isinstance(item, End):
            self._finish()
            if item.error is not None:
                raise item.error
            raise StopIteration
        job.taken(int(item.shape[-1]))
        return item

    def close(self) -> None:
        if not self._done:
            self._finish()
            self._engine.cancel(self._job, RequestCancelledError("the caller stopped reading"))

    def __enter__(self) -> SyncAudioStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
