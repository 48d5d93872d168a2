"""The HTTP answer of a synthesis (the OpenAI and the reference routes): an audio body, or Server-Sent Events.

The response starts only once the first audio chunk exists (or the request failed): a request that cannot be
served gets a proper JSON error with its status code instead of a 200 with a truncated body. After that,
chunks are encoded and sent as they come (chunked transfer encoding), unless the audio goes whole: asked so
(``Output.streamed`` false: ``stream: false``), a format that cannot be streamed (flac), or an HTTP/1.0 client,
which has no chunked encoding (the whole body then, with its Content-Length, as HTTP/1.0 allows). A client that disconnects cancels the generation in the engine:
before the response starts (a non-streamed request, or a streamed one waiting for its first chunk) through a
watch on the connection's ``http.disconnect``, after it through starlette cancelling the streaming task; the
engine stream's ``aclose`` stops the model at its next token. A started stream that ends short (deadline,
engine error, model released at shutdown) raises :class:`StreamCut`: the connection closes without the final
chunk, so the client sees a truncated body instead of audio that merely looks complete.

The request, its run and its encoding are every transport's (:mod:`cosyserve.server.synth`); this module frames
them as HTTP.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Coroutine, Mapping
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from cosyserve.core.errors import CosyserveError
from cosyserve.server.audiofile import STREAMABLE
from cosyserve.server.errors import error_object
from cosyserve.server.synth import Order, Synthesis, usage

logger = logging.getLogger("cosyserve.access")

__all__ = ["StreamCut", "synthesize_response"]


class StreamCut(BaseException):
    """A started response that must end without its terminating chunk, so the client sees it was cut.

    A BaseException, as :class:`asyncio.CancelledError` is: no ``except Exception`` on the way out (starlette's
    error middleware, an app's catch-all 500 handler) may turn it into an error response or log it again; it
    reaches uvicorn, which closes the connection (:mod:`cosyserve.server.run` keeps uvicorn from logging it as
    a crash: the request's own WARNING line already said why).
    """


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


async def _until_disconnect(request: Request) -> None:
    # the body has been read: the next ASGI message is http.disconnect, sent when the client goes away
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, _T]) -> tuple[bool, _T | None]:
    """``(True, work's result)``, or ``(False, None)`` once the client disconnects first (``work`` is cancelled
    then).

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
    return (False, None) if task.cancelled() else (True, task.result())


async def synthesize_response(
    state: Any,
    request: Request,
    *,
    route: str,
    order: Order,
    sse: bool = False,
    params: Mapping[str, str] | None = None,
) -> Response:
    """Run ``order`` and answer with its audio (``raw``: the reference's int16 PCM).

    ``order.output.streamed`` decides whether the response is streamed (formats that cannot be streamed, and every
    answer to an HTTP/1.0 client, are sent whole, with a Content-Length); ``order.request.stream`` how the engine
    cuts the audio. Engine errors before the first chunk raise (the app maps them to JSON errors); after it, they end the stream early and are logged. A client
    that disconnects before the response starts stops the generation (logged as ``client_gone``, status 499).

    With ``sse``, the response is OpenAI's Server-Sent Events (``stream_format: "sse"``): one
    ``speech.audio.delta`` event per piece of encoded audio (``audio``: its bytes in base64; a format that cannot
    be streamed comes whole in one, as does every event for an HTTP/1.0 client), then ``speech.audio.done`` with the ``usage``, or ``speech.audio.error``
    (``error``: the OpenAI error object, ``params`` naming the route's fields) when it ended early.
    """
    fmt = order.output.format
    run = Synthesis(state, route, order)
    whole = not order.output.streamed or fmt not in STREAMABLE or request.scope.get("http_version") == "1.0"
    started, _ = await _unless_disconnected(request, run.start(whole))
    rec = run.rec
    if not started:  # nobody to answer (recorded as client_gone, 499)
        return Response(status_code=499)
    assert run.encoder is not None
    headers = {
        "X-Request-Id": order.request.request_id,
        "X-Sample-Rate": str(run.encoder.out_rate),
        "X-Model": order.model,
    }
    if state.demo:
        headers["X-Cosyserve-Demo"] = "random weights: noise, not speech"

    if whole:
        try:
            data = await run.whole()
        finally:
            await run.aclose()
        body = (
            _sse_delta(data, fmt) + _sse({"type": "speech.audio.done", "usage": usage(rec)}) if sse else data
        )
        rec.bytes = len(body)
        rec.done()
        if sse:  # a format that cannot be streamed goes whole, in one delta
            return Response(body, media_type="text/event-stream", headers=headers | _SSE_HEADERS)
        return Response(body, media_type=run.encoder.media_type, headers=headers)

    async def body() -> AsyncIterator[bytes]:
        cut: CosyserveError | None = None
        try:
            # closed here whatever ends the body (a client gone cancels it at a yield): run.audio records how
            async with contextlib.aclosing(run.audio()) as audio:
                async for data in audio:
                    out = _sse_delta(data, fmt) if sse else data
                    rec.bytes += len(out)
                    yield out
            if sse:
                done = _sse({"type": "speech.audio.done", "usage": usage(rec)})
                rec.bytes += len(done)
                yield done
        except CosyserveError as e:  # headers are out: an SSE event says so, an audio stream can only be cut
            cut = e
        finally:
            await run.aclose()
            if cut is None:
                rec.done()
        if cut is None:
            return
        if sse:
            logger.warning(
                "request %s: stream ended early after %d bytes (%s: %s); the last event says so",
                order.request.request_id,
                rec.bytes,
                rec.outcome,
                cut,
            )
            failed = _sse({"type": "speech.audio.error", "error": error_object(cut, params)})
            rec.bytes += len(failed)
            rec.done()
            yield failed
            return
        logger.warning(
            "request %s: stream cut after %d bytes (%s: %s); closing the connection without the final chunk",
            order.request.request_id,
            rec.bytes,
            rec.outcome,
            cut,
        )
        rec.done()
        raise StreamCut(order.request.request_id)

    if sse:
        return StreamingResponse(body(), media_type="text/event-stream", headers=headers | _SSE_HEADERS)
    return StreamingResponse(body(), media_type=run.encoder.media_type, headers=headers)
