"""One synthesis request from HTTP to audio bytes, shared by the OpenAI and the reference routes.

The response starts only once the first audio chunk exists (or the request failed): a request that cannot be
served gets a proper JSON error with its status code instead of a 200 with a truncated body. After that,
chunks are encoded and sent as they come. A client that disconnects cancels the generation in the engine:
before the response starts (a non-streamed request, or a streamed one waiting for its first chunk) through a
watch on the connection's ``http.disconnect``, after it through starlette cancelling the streaming task; the
engine stream's ``aclose`` stops the model at its next token. A started stream that ends short (deadline,
engine error, model released at shutdown) raises :class:`StreamCut`: the connection closes without the final
chunk, so the client sees a truncated body instead of audio that merely looks complete.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Mapping
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from cosyserve.audiofile import MEDIA_TYPES, STREAMABLE, Encoder, encode_all, to_int16
from cosyserve.errors import (
    ClientError,
    CosyserveError,
    DeadlineExceededError,
    EngineDeadError,
    NotReadyError,
    RequestCancelledError,
    cut,
)
from cosyserve.request import SynthesisRequest
from cosyserve.server.errors import error_object, status_of
from cosyserve.server.schemas import MAX_NAME_CHARS

logger = logging.getLogger("cosyserve.access")

__all__ = [
    "Record",
    "StreamCut",
    "new_request_id",
    "submit",
    "synthesis_request",
    "synthesize_response",
    "usage",
]


class StreamCut(BaseException):
    """A started response that must end without its terminating chunk, so the client sees it was cut.

    A BaseException, as :class:`asyncio.CancelledError` is: no ``except Exception`` on the way out (starlette's
    error middleware, an app's catch-all 500 handler) may turn it into an error response or log it again; it
    reaches uvicorn, which closes the connection (:mod:`cosyserve.server.run` keeps uvicorn from logging it as
    a crash: the request's own WARNING line already said why).
    """


def _cut_outcome(e: CosyserveError) -> str:
    """The access log's and the metrics' outcome of a stream that ended short (the engine's outcome names)."""
    if isinstance(e, DeadlineExceededError):
        return "deadline"
    if isinstance(e, EngineDeadError):
        return "released"  # the model was released while serving: shutdown grace over, or the pool let it go
    if isinstance(e, RequestCancelledError):
        return "cancelled"
    return "error"


_T = TypeVar("_T")

# an event stream must reach the client as it is written: no proxy buffering, no cache
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _sse(event: dict[str, Any]) -> bytes:
    """One Server-Sent Event: its ``type`` as the event name, the object as JSON data."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


def _sse_delta(data: bytes, fmt: str) -> bytes:
    return _sse(
        {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii"), "format": fmt}
    )


def new_request_id(request: Request) -> str:
    given = request.headers.get("x-request-id", "")
    if given and len(given) <= 64 and given.replace("-", "").replace("_", "").isalnum():
        return given
    return uuid.uuid4().hex[:16]


class Record:
    """What one request did, for the access log line and the metrics (filled as it goes)."""

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
        self.sample_rate = 0

    def failed(self, e: BaseException) -> None:
        """The request ended before its response started: an engine error (its status) or a cancel (499)."""
        if isinstance(e, CosyserveError):
            self.status, self.outcome = status_of(e), e.code
        else:
            self.status, self.outcome = 499, "cancelled"
        self.done()

    def done(self) -> None:
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
    """Characters of a request's text: a string's length, a text feed's count so far (None: not known)."""
    return len(text) if isinstance(text, str) else getattr(text, "chars", None)


def usage(rec: Record) -> dict[str, Any]:
    """What a request spoke, as the SSE and WebSocket ``usage`` objects state it."""
    rate = rec.sample_rate
    return {
        "input_characters": text_chars(rec.req.text),
        "audio_samples": rec.samples,
        "audio_seconds": round(rec.samples / rate, 3) if rate else 0.0,
        "sample_rate": rate,
    }


async def submit(state: Any, model: str, req: SynthesisRequest, tenant: str | None) -> Any:
    """Admit ``req`` on ``model`` through the pool: the tenant's quota, the model's load, the engine's queue.

    Returns:
        The request's :class:`~cosyserve.engine.streams.AudioStream`.
    Raises:
        NotReadyError: the server is draining. Otherwise what the pool and engine refuse with.
    """
    if state.draining:
        raise NotReadyError("the server is shutting down")
    # the pool counts a tenant's requests against its quota; an API key's tenant that the pool config does not
    # list has no quota
    known = tenant if tenant is not None and tenant in state.pool.tenants else None
    return await state.pool.submit(model, req, tenant=known)


async def _until_disconnect(request: Request) -> None:
    # the body has been read: the next ASGI message is http.disconnect, sent when the client goes away
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, _T]) -> _T | None:
    """``work``'s result, or None once the client disconnects first (``work`` is cancelled then).

    Starlette stops a streaming response whose client goes away, but not a handler still working out its
    response: without this, a non-streamed request ran to its end for nobody, holding a worker.
    """
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))  # its own clean-up stops the generation
    return None if task.cancelled() else task.result()


async def _start(
    state: Any, model: str, req: SynthesisRequest, tenant: str | None, rec: Record, whole: bool
) -> tuple[Any, list[Any]]:
    """Submit ``req``; wait for its first chunk, or with ``whole`` for all of them (closed on failure)."""
    stream = await submit(state, model, req, tenant)
    rec.req = stream.request  # as the model resolved it: the voice and mode that speak
    chunks: list[Any] = []
    try:
        async for c in stream:
            if rec.ttfa_s is None:
                rec.ttfa_s = time.perf_counter() - rec.t0
            chunks.append(c)
            rec.samples += len(c)
            if not whole:
                break
    except BaseException:
        await stream.aclose()
        raise
    return stream, chunks


async def synthesize_response(
    state: Any,
    request: Request,
    *,
    route: str,
    model: str,
    req: SynthesisRequest,
    fmt: str,
    sse: bool = False,
    params: Mapping[str, str] | None = None,
) -> Response:
    """Run ``req`` on ``model`` and answer with its audio in ``fmt`` (``raw`` = the reference's int16 PCM).

    ``req.stream`` decides both how the engine cuts the audio and whether the response is streamed
    (formats that cannot be streamed are sent whole). Engine errors before the first chunk raise (the app maps
    them to JSON errors); after it, they end the stream early and are logged. A client that disconnects
    before the response starts stops the generation (logged as ``client_gone``, status 499).

    With ``sse``, the response is OpenAI's Server-Sent Events (``stream_format: "sse"``): one
    ``speech.audio.delta`` event per piece of encoded audio (``audio``: its bytes in base64; a format that cannot
    be streamed comes whole in one), then ``speech.audio.done`` with the ``usage``, or ``speech.audio.error``
    (``error``: the OpenAI error object, ``params`` naming the route's fields) when it ended early.
    """
    rec = Record(state, route, model, req, fmt)
    if state.draining:
        rec.status, rec.outcome = 503, "draining"
        rec.done()
        raise NotReadyError("the server is shutting down")
    whole = fmt != "raw" and (not req.stream or fmt not in STREAMABLE)
    tenant = state.tenant_of(request)
    try:
        started = await _unless_disconnected(request, _start(state, model, req, tenant, rec, whole))
    except BaseException as e:
        rec.failed(e)
        raise
    if started is None:  # nobody to answer
        rec.status, rec.outcome = 499, "client_gone"
        rec.done()
        return Response(status_code=499)
    stream, chunks = started
    if rec.ttfa_s is None:  # no audio at all
        rec.ttfa_s = time.perf_counter() - rec.t0
    rec.sample_rate = int(stream.sample_rate or 0)
    rate = rec.sample_rate
    headers = {"X-Request-Id": req.request_id, "X-Sample-Rate": str(rate), "X-Model": model}
    if state.demo:
        headers["X-Cosyserve-Demo"] = "random weights: noise, not speech"

    if whole:
        data = await asyncio.to_thread(encode_all, chunks, fmt, rate)
        if not sse:
            rec.bytes = len(data)
            rec.done()
            return Response(data, media_type=MEDIA_TYPES[fmt], headers=headers)
        # a format that cannot be streamed goes whole, in one delta
        events = _sse_delta(data, fmt) + _sse({"type": "speech.audio.done", "usage": usage(rec)})
        rec.bytes = len(events)
        rec.done()
        return Response(events, media_type="text/event-stream", headers=headers | _SSE_HEADERS)

    first = chunks[0] if chunks else None
    enc = Encoder(fmt, rate) if fmt != "raw" else None

    def encode(chunk: Any) -> bytes:
        return enc.encode(chunk) if enc is not None else to_int16(chunk)

    async def audio() -> AsyncIterator[bytes]:
        head = enc.header() if enc is not None else b""
        data = head + (encode(first) if first is not None else b"")
        if data:
            yield data
        async for c in stream:
            rec.samples += len(c)
            data = encode(c)
            if data:
                yield data
        if enc is not None:
            tail = enc.finish()
            if tail:
                yield tail

    async def body() -> AsyncIterator[bytes]:
        cut: CosyserveError | None = None
        try:
            async for data in audio():
                out = _sse_delta(data, fmt) if sse else data
                rec.bytes += len(out)
                yield out
            if sse:
                done = _sse({"type": "speech.audio.done", "usage": usage(rec)})
                rec.bytes += len(done)
                yield done
        except CosyserveError as e:  # headers are out: an SSE event says so, an audio stream can only be cut
            rec.outcome = _cut_outcome(e)
            cut = e
        except (asyncio.CancelledError, GeneratorExit):
            rec.outcome = "client_gone"
            await stream.aclose()
            raise
        except Exception:
            rec.outcome = "error"  # a bug: uvicorn logs its traceback and closes the connection
            raise
        finally:
            await stream.aclose()
            if not sse or cut is None:
                rec.done()
        if cut is not None and sse:
            logger.warning(
                "request %s: stream ended early after %d bytes (%s: %s); the last event says so",
                req.request_id,
                rec.bytes,
                rec.outcome,
                cut,
            )
            failed = _sse({"type": "speech.audio.error", "error": error_object(cut, params)})
            rec.bytes += len(failed)
            rec.done()
            yield failed
        elif cut is not None:
            logger.warning(
                "request %s: stream cut after %d bytes (%s: %s); closing the connection without the final chunk",
                req.request_id,
                rec.bytes,
                rec.outcome,
                cut,
            )
            raise StreamCut(req.request_id)

    if sse:
        return StreamingResponse(body(), media_type="text/event-stream", headers=headers | _SSE_HEADERS)
    media = MEDIA_TYPES.get(fmt, "application/octet-stream")
    return StreamingResponse(body(), media_type=media, headers=headers)


def synthesis_request(state: Any, request: Request, **fields: Any) -> SynthesisRequest:
    """The request an HTTP route asks for: ``fields`` of :class:`SynthesisRequest`, with the server's deadline,
    the caller's request id (``X-Request-Id``) and tenant, and the server's limits on text and name length (those
    the OpenAPI document states).

    Raises:
        ClientError: a text or a voice name over its limit, or a request :meth:`SynthesisRequest.verify` refuses.
    """
    limit = state.config.max_text_chars
    for name in ("text", "prompt_text", "instruct_text"):
        value = fields.get(name)
        if isinstance(value, str) and len(value) > limit:
            raise ClientError(f"{name} is {len(value)} characters; the limit is {limit}", param=name)
    speaker = fields.get("speaker")
    most = min(MAX_NAME_CHARS, limit)
    if isinstance(speaker, str) and len(speaker) > most:
        raise ClientError(
            f"the voice name is {len(speaker)} characters; a speaker or registered voice has at most {most}",
            param="speaker",
        )
    return SynthesisRequest(
        deadline=time.monotonic() + state.config.request_timeout_s,
        request_id=new_request_id(request),
        tenant=state.tenant_of(request) or "default",
        **fields,
    )
