"""One synthesis through the server, whatever its transport: the request built by the one constructor, run through
the pool, recorded, its audio encoded by the one encoder.

Every transport (the HTTP routes in :mod:`cosyserve.server.responses`, the WebSocket in
:mod:`cosyserve.server.transports.ws`) does the same three things here and keeps only its protocol:

1. :func:`order`: what the caller asked for, through :meth:`cosyserve.core.limits.Limits.request` (every limit, the
   caller's tenant from its API key and its ``X-Request-Id``: :func:`caller`, the server's deadline), the model it
   names (visible to its tenant) and the format and rate of its audio (:meth:`cosyserve.core.limits.Limits.output`).
2. :class:`Synthesis`: the request admitted through the pool (the tenant's quota, the model's load, the engine's
   queue), its first audio awaited, then its audio as encoded bytes (:class:`cosyserve.server.audiofile.Encoder`), and
   one :class:`Record` of it (the access log line, the metrics), whatever ends it: done, refused, cut short
   (deadline, engine error, model released at shutdown), or the client gone.
3. The transport frames the bytes (a body, SSE deltas, WebSocket frames) and says how it ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import HTTPConnection

from cosyserve.core.errors import (
    CosyserveError,
    DeadlineExceededError,
    EngineDeadError,
    NotReadyError,
    RequestCancelledError,
    cut,
)
from cosyserve.core.limits import Output
from cosyserve.core.request import SynthesisRequest
from cosyserve.server.audiofile import Encoder
from cosyserve.server.errors import status_of

logger = logging.getLogger("cosyserve.access")

__all__ = ["Order", "Record", "Synthesis", "caller", "new_request_id", "order", "text_chars", "usage"]


def new_request_id(conn: HTTPConnection) -> str:
    """The caller's ``X-Request-Id`` when it is a sane id (at most 64 letters, digits, ``-`` and ``_``), else a new
    one."""
    given = conn.headers.get("x-request-id", "")
    if given and len(given) <= 64 and given.replace("-", "").replace("_", "").isalnum():
        return given
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True)
class Order:
    """A transport's request, checked: the model that speaks it, the request, how its audio is delivered, and the
    caller's tenant (its API key's; None without keys)."""

    model: str
    request: SynthesisRequest
    output: Output
    tenant: str | None


def caller(state: Any, conn: HTTPConnection) -> dict[str, Any]:
    """What :func:`order` takes of an HTTP or WebSocket caller: the tenant of its API key (None without keys) and
    its request id (``X-Request-Id``)."""
    return {"tenant": state.tenant_of(conn), "request_id": new_request_id(conn)}


def order(
    state: Any,
    *,
    tenant: str | None,
    request_id: str | None = None,
    params: Mapping[str, str],
    model: str | None = None,
    model_param: str = "model",
    fmt: str,
    formats: Iterable[str],
    sample_rate: int | None = None,
    streamed: bool = True,
    **fields: Any,
) -> Order:
    """What a caller of ``tenant`` asks for (``fields`` of :class:`~cosyserve.core.request.SynthesisRequest`), within the
    server's limits, on ``model`` (a name the tenant may use; None: the default model), with its audio in ``fmt``
    (one of ``formats``) at ``sample_rate`` (None: the model's), ``streamed`` as it is made or sent whole; the
    server's deadline from now. A transport that is
    not HTTP (a later Wyoming server) names its caller's tenant and request id itself; HTTP's and the WebSocket's
    come from :func:`caller`.

    Args:
        tenant: the caller's tenant (its API key's; None: the server has no keys).
        request_id: the id of the request in logs and headers (None: a new one).
        params: request field -> the transport's name for it (errors name it so).
        model_param: the transport's name of the model field (``model``, the reference routes' ``X-Model``).
    Raises:
        ClientError: a field over a limit or a request that cannot be served as given (UnknownModelError for a
            model the tenant may not use), ``param`` naming the field.
    """
    name = state.resolve_model(model, tenant, param=model_param)
    limits = state.limits
    req = limits.request(
        names=params,
        tenant=tenant or "default",
        request_id=request_id or uuid.uuid4().hex[:16],
        deadline=time.monotonic() + state.config.request_timeout_s,
        **fields,
    )
    return Order(name, req, limits.output(fmt, formats, sample_rate, streamed=streamed, names=params), tenant)


class Record:
    """What one request did, for the access log line and the metrics (filled as it goes; :meth:`done` once)."""

    def __init__(self, state: Any, route: str, model: str, req: SynthesisRequest, fmt: str) -> None:
        self.state = state
        self.route = route
        self.model = model
        self.req = req
        self.fmt = fmt
        self.t0 = time.perf_counter()
        self.ttfa_s: float | None = None
        self.samples = 0
        self.bytes = 0
        self.status = 200
        self.outcome = "ok"
        self.sample_rate = 0  # the model's
        self.out_rate = 0  # the audio's as delivered (the encoder's)
        self.out_samples = 0  # samples delivered, at out_rate
        self._done = False

    def failed(self, e: BaseException) -> None:
        """The request ended before its audio started: an engine error (its status), or the client gone (499)."""
        if isinstance(e, CosyserveError):
            self.status, self.outcome = status_of(e), e.code
        else:
            self.status, self.outcome = 499, "client_gone"
        self.done()

    def cut(self, e: BaseException) -> None:
        """The request ended after its audio started: how, as the access log and the metrics name it (the status
        stays the one the response started with)."""
        if isinstance(e, DeadlineExceededError):
            self.outcome = "deadline"
        elif isinstance(e, EngineDeadError):
            self.outcome = "released"  # the model was released while serving: shutdown grace over, or evicted
        elif isinstance(e, RequestCancelledError):
            self.outcome = "cancelled"
        elif isinstance(e, asyncio.CancelledError | GeneratorExit):
            self.outcome = "client_gone"
        else:
            self.outcome = "error"

    def done(self) -> None:
        if self._done:
            return
        self._done = True
        total = time.perf_counter() - self.t0
        audio_s = self.samples / self.sample_rate if self.sample_rate else 0.0
        self.state.metrics.observe_request(
            self.route, self.model, self.status, self.outcome, self.ttfa_s, total, audio_s
        )
        logger.info(
            json.dumps(
                {
                    "event": "request",
                    "id": self.req.request_id,
                    "route": self.route,
                    "model": self.model,
                    "mode": self.req.mode,
                    "voice": None if self.req.speaker is None else cut(self.req.speaker),
                    "format": self.fmt,
                    "stream": self.req.stream,
                    "chars": text_chars(self.req.text),
                    "status": self.status,
                    "outcome": self.outcome,
                    "ttfa_ms": None if self.ttfa_s is None else round(self.ttfa_s * 1e3, 1),
                    "total_ms": round(total * 1e3, 1),
                    "audio_s": round(audio_s, 3),
                    "bytes": self.bytes,
                },
                ensure_ascii=False,
            )
        )


def text_chars(text: Any) -> int | None:
    """Characters of a request's text: a string's length, a streamed text's count so far (None: not known)."""
    return len(text) if isinstance(text, str) else getattr(text, "chars", None)


def usage(rec: Record) -> dict[str, Any]:
    """What a request spoke, as the SSE and WebSocket ``usage`` objects state it: its audio as delivered (at the
    rate the caller got)."""
    rate = rec.out_rate
    return {
        "input_characters": text_chars(rec.req.text),
        "audio_samples": rec.out_samples,
        "audio_seconds": round(rec.out_samples / rate, 3) if rate else 0.0,
        "sample_rate": rate,
    }


class Synthesis:
    """One request on its way from the pool to a transport (see the module docstring).

    :meth:`start` admits it and waits for its first audio; :meth:`audio` (or :meth:`whole`) gives its encoded
    bytes; :meth:`aclose` ends it (always call it). ``rec`` is its :class:`Record`: a transport adds the bytes it
    sends (its framing included), and says how a started request ended (:meth:`Record.cut`).

    Args:
        state: the server's state (its pool, metrics, drain flag).
        route: the route that serves it (logs, metrics).
        order: what was asked (:func:`order`).
    """

    def __init__(self, state: Any, route: str, order: Order) -> None:
        self.state = state
        self.order = order
        self.rec = Record(state, route, order.model, order.request, order.output.format)
        self.stream: Any = None
        self.encoder: Encoder | None = None
        self._chunks: list[Any] = []  # taken by start(), not yet encoded

    @property
    def request(self) -> SynthesisRequest:
        """The request as its model resolved it (the voice and mode that speak) once it started."""
        return self.rec.req

    @property
    def sample_rate(self) -> int:
        return self.rec.sample_rate

    async def start(self, whole: bool = False) -> None:
        """Admit the request and wait for its first chunk (with ``whole``, for all of them); its encoder is made
        then (a whole one with ``whole``).

        Raises:
            NotReadyError: the server is draining. Otherwise what the pool, the engine or the encoder refuse with
            (all recorded: the request is over).
        """
        rec = self.rec
        if self.state.draining:
            rec.status, rec.outcome = 503, "draining"
            rec.done()
            raise NotReadyError("the server is shutting down")
        try:
            pool, tenant = self.state.pool, self.order.tenant
            # an API key's tenant that the pool config does not list has no quota
            self.stream = await pool.submit(
                self.order.model, self.order.request, tenant=tenant if tenant in pool.tenants else None
            )
            rec.req = self.stream.request  # as the model resolved it
            rec.sample_rate = int(self.stream.sample_rate or 0)
            out = self.order.output
            self.encoder = Encoder(out.format, rec.sample_rate, out.sample_rate, whole=whole)
            rec.out_rate = self.encoder.out_rate
            async for chunk in self.stream:
                self._chunks.append(self._took(chunk))
                if not whole:
                    break
            if rec.ttfa_s is None:  # no audio at all
                rec.ttfa_s = time.perf_counter() - rec.t0
        except BaseException as e:
            await self.aclose()
            rec.failed(e)
            raise

    def _took(self, chunk: Any) -> Any:
        # a chunk taken from the engine: the first audio's time, the samples
        rec = self.rec
        if rec.ttfa_s is None:
            rec.ttfa_s = time.perf_counter() - rec.t0
        rec.samples += len(chunk)
        return chunk

    async def whole(self) -> bytes:
        """The audio of a request started with ``whole``, as one file (exact sizes in its header), encoded off the
        event loop."""
        enc = self.encoder
        assert enc is not None and not enc.streamed, "start(whole=True) first"
        chunks, self._chunks = self._chunks, []

        def encode() -> bytes:
            for chunk in chunks:
                enc.encode(chunk)
            return enc.finish()

        data = await asyncio.to_thread(encode)
        self.rec.out_samples = enc.samples
        return data

    async def audio(self) -> AsyncIterator[bytes]:
        """The encoded bytes as they come: the header (on its own), each chunk's bytes, the encoder's last bytes.
        A codec's work (mp3, opus, aac; a whole format's file) runs off the event loop, 16-bit PCM on it.

        Raises:
            CosyserveError: the request ended short (deadline, engine error, model released); recorded with
                :meth:`Record.cut`, as is a client gone (``CancelledError``, ``GeneratorExit``).
        """
        enc = self.encoder
        assert enc is not None and self.stream is not None, "start() first"

        async def run(work: Any, *args: Any) -> bytes:
            data: bytes = work(*args) if enc.inline else await asyncio.to_thread(work, *args)
            self.rec.out_samples = enc.samples
            return data

        try:
            head = enc.header()
            if head:
                yield head
            for chunk in self._chunks:  # what start() took
                data = await run(enc.encode, chunk)
                if data:
                    yield data
            self._chunks = []
            async for chunk in self.stream:
                data = await run(enc.encode, self._took(chunk))
                if data:
                    yield data
            tail = await run(enc.finish)
            if tail:
                yield tail
        except BaseException as e:
            self.rec.cut(e)
            raise

    async def deliver(
        self,
        send: Callable[[bytes], Awaitable[None]],
        *,
        start: Callable[[], Awaitable[None]] | None = None,
        gone: tuple[type[BaseException], ...] = (),
    ) -> CosyserveError | None:
        """Hand a started request's audio to a transport that frames each piece itself (the WebSocket, Wyoming):
        ``start()`` (its opening message), then each piece of :meth:`audio` through ``send`` (counted in
        :attr:`rec`); the request is closed and its record done whatever ends it.

        Returns:
            None when all of it was sent, else the error that cut it short (recorded): the transport says so its
            way.
        Raises:
            What ``start`` or ``send`` raise when the client is gone (``gone``, or the task cancelled), recorded as
            ``client_gone`` (499), and anything unexpected (recorded as an error, 500).
        """
        rec = self.rec
        try:
            if start is not None:
                await start()
            async with contextlib.aclosing(self.audio()) as audio:
                async for data in audio:
                    rec.bytes += len(data)
                    await send(data)
        except CosyserveError as e:  # cut short (recorded by audio())
            rec.status = status_of(e)
            return e
        except (asyncio.CancelledError, *gone):
            rec.status, rec.outcome = 499, "client_gone"
            raise
        except BaseException:
            rec.status, rec.outcome = 500, "error"
            raise
        finally:
            await self.aclose()
            rec.done()
        return None

    async def aclose(self) -> None:
        """Stop the request's generation if it still runs (idempotent)."""
        if self.stream is not None:
            await self.stream.aclose()
