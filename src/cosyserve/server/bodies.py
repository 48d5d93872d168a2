"""Request bodies that stall: a read timeout for every HTTP request body, and a cap on bodies arriving at once.

uvicorn times out neither a body that stops half way nor one that trickles: a client that sends ten bytes of a
body and then nothing held its socket (and a task) for as long as it liked, and forty such clients forty sockets.
:class:`BodyTimeout` wraps every HTTP request's ``receive`` (so every route's body, however it is read: JSON,
multipart, urlencoded):

- each read of the body waits at most ``body_timeout_s`` (``COSYSERVE_BODY_TIMEOUT``) for its next bytes, and the
  whole body arrives within ``request_timeout_s``; past either, the request is answered 408 (``body_timeout``)
  and its connection closed;
- at most ``max_pending_bodies`` (``COSYSERVE_MAX_PENDING_BODIES``) requests may be part way through their body
  at once (a body that arrives in one read is never counted); one more is answered 503 with ``Retry-After`` at
  once, and its connection closed, so that stalled clients hold a bounded number of sockets, each for a bounded
  time.

Once a request's body is complete, its ``receive`` is the server's own again (a route waiting for the client's
disconnect waits as long as the response takes).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cosyserve.core.errors import OverloadedError
from cosyserve.server.errors import BodyTimeoutError

__all__ = ["BodyTimeout"]


class BodyTimeout:
    """ASGI middleware: see the module docstring.

    Args:
        app: the app it wraps.
        state: the server's state: its settings (``body_timeout_s``, ``request_timeout_s``,
            ``max_pending_bodies``), and ``pending_bodies``, the requests part way through their body now, which
            this keeps.
    """

    def __init__(self, app: ASGIApp, state: Any) -> None:
        self.app = app
        self.state = state
        self.timeout_s = float(state.config.body_timeout_s)
        self.total_s = float(state.config.request_timeout_s)
        self.max_pending = int(state.config.max_pending_bodies)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        done = False  # the body is complete (or the client gone): receive() is the server's again
        counted = False  # counted in state.pending_bodies
        refused = False  # answered for its body: the connection closes after the answer
        deadline = time.monotonic() + self.total_s

        def uncount() -> None:
            nonlocal counted
            if counted:
                counted = False
                self.state.pending_bodies -= 1

        async def timed_receive() -> Message:
            nonlocal done, counted, refused
            if done:
                return await receive()
            left = deadline - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), max(min(self.timeout_s, left), 0.0))
            except TimeoutError:
                done, refused = True, True
                uncount()
                if left > self.timeout_s:
                    msg = f"nothing of it arrived for {self.timeout_s:g} s (COSYSERVE_BODY_TIMEOUT)"
                else:
                    msg = f"it took longer than {self.total_s:g} s to arrive (COSYSERVE_REQUEST_TIMEOUT)"
                raise BodyTimeoutError(f"the request body stalled: {msg}") from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                done = True
                uncount()
            elif not counted:  # part of a body arrived, the rest is to come
                if self.state.pending_bodies >= self.max_pending:
                    done, refused = True, True
                    raise OverloadedError(
                        f"{self.state.pending_bodies} requests are sending their bodies already "
                        "(COSYSERVE_MAX_PENDING_BODIES): try again in a moment",
                        retry_after=1.0,
                    )
                counted = True
                self.state.pending_bodies += 1
            return message

        async def closing_send(message: Message) -> None:
            if refused and message["type"] == "http.response.start":
                # the rest of the body may still come: the connection cannot carry another request
                headers: list[Any] = [h for h in message.get("headers", []) if h[0].lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, timed_receive, closing_send)
        finally:
            uncount()
