"""Errors as HTTP responses, in the OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import ast
import logging
import math
import re
from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cosyserve.core.errors import (
    SHOWN_CHARS,
    ClientError,
    CosyserveError,
    DeadlineExceededError,
    EngineDeadError,
    LoadFailedError,
    NotReadyError,
    OverloadedError,
    PayloadTooLargeError,
    QuotaExceededError,
    RequestCancelledError,
    UnknownModelError,
    UnknownVoiceError,
    UnsupportedMediaTypeError,
    shown,
)

__all__ = [
    "STATUS",
    "BodyTimeoutError",
    "LastResortMiddleware",
    "VoiceNotFoundError",
    "client_message",
    "cosyserve_error_response",
    "error_object",
    "error_response",
    "public_cause",
    "retry_after",
    "status_of",
    "without_paths",
]

logger = logging.getLogger("cosyserve.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class BodyTimeoutError(ClientError):
    """A request body that stalled: nothing of it arrived for the body timeout (408; the connection is closed)."""

    code = "body_timeout"


class VoiceNotFoundError(UnknownVoiceError):
    """The voice a route names as its resource (``DELETE /v1/audio/voices/{name}``) is not registered: 404, where
    a request that names an unknown voice to speak with is a 400 (as OpenAI answers an invalid voice)."""


# the HTTP status of each error class (cosyserve.core.errors); a class not listed takes its nearest listed base's
STATUS: dict[type[CosyserveError], int] = {
    CosyserveError: 500,
    ClientError: 400,
    BodyTimeoutError: 408,
    UnknownModelError: 404,
    VoiceNotFoundError: 404,
    PayloadTooLargeError: 413,
    UnsupportedMediaTypeError: 415,
    OverloadedError: 503,
    QuotaExceededError: 429,
    NotReadyError: 503,
    EngineDeadError: 503,
    DeadlineExceededError: 504,
    RequestCancelledError: 499,  # nobody is listening; what the access log and metrics say
}


def status_of(e: BaseException) -> int:
    """The HTTP status of ``e`` by :data:`STATUS` (500 for anything that is not a :class:`CosyserveError`)."""
    for cls in type(e).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": _error_type(status),
            "param": param,
            "code": code,
        }
    }
    return JSONResponse(body, status_code=status, headers=headers)


# an absolute path: "/" at the start or after a blank, quote, bracket or "=", then path characters
_ABS_PATH = r"(?<![^\s'\"(\[=])/(?:[^\s/'\"()\[\]]+/)*(?P<last>[^\s/'\"()\[\]]+)"
# a value quoted as repr() quotes it (not an apostrophe inside a word)
_QUOTED = r"""(?<!\w)(?P<quoted>'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")"""
_PATHS = re.compile(_ABS_PATH)
_PATHS_OUTSIDE_QUOTES = re.compile(f"{_QUOTED}|{_ABS_PATH}")


def without_paths(message: str) -> str:
    """``message`` with each absolute filesystem path cut to its last part (``/srv/models/m has ...`` ->
    ``m has ...``): a remote client is never told where the server keeps its files."""
    return _PATHS.sub(r"\g<last>", message)


def _client_value(m: re.Match[str]) -> str:
    # a client's own value, quoted by the message: as given (a path too), cut when long
    quoted = m.group("quoted")
    if quoted is None:
        return m.group("last")
    try:
        value = ast.literal_eval(quoted)  # a string literal only (the pattern admits nothing else)
    except (ValueError, SyntaxError):
        return quoted
    if not isinstance(value, str) or (len(value) == SHOWN_CHARS + 1 and value.endswith("…")):
        return quoted  # cut by shown() already, its length said after it: once is enough
    return shown(value)


def client_message(e: CosyserveError) -> str:
    """What a remote client is told of ``e``.

    A client error's message names the client's values, quoted: they are shown as given (``unknown model
    '/etc/passwd'`` stays so), a long one cut (:func:`cosyserve.core.errors.shown`), while an absolute path outside
    quotes (a model dir of the server's) is cut to its last part. Any other error: its public message, else its
    message with every absolute path cut to its last part.
    """
    if isinstance(e, ClientError):
        return _PATHS_OUTSIDE_QUOTES.sub(_client_value, str(e))
    if e.public_message:
        return e.public_message
    return without_paths(str(e))


def public_cause(e: BaseException) -> str:
    """A failure (a model's load, the start-up) as an open route may show it: no server path in it."""
    if isinstance(e, CosyserveError):
        return client_message(e)
    return without_paths(f"{type(e).__name__}: {e}")


def _error_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def retry_after(e: CosyserveError) -> int | None:
    """Whole seconds a client should wait before it sends ``e``'s request again (None: retrying will not help)."""
    if isinstance(e, OverloadedError | LoadFailedError):
        return max(1, math.ceil(e.retry_after))
    if isinstance(e, NotReadyError):
        return 1  # loading, or draining for shutdown: another replica or a moment later
    return None


def error_object(e: CosyserveError, params: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``e`` as the OpenAI error object (``message``, ``type``, ``param``, ``code``), as every transport states it.

    ``params`` maps request field names (``text``, ``instruct_text``, ...) to the route's own (``input``,
    ``instructions``) for the error's ``param``; a field without an entry keeps its name.
    """
    param = e.param
    if param is not None and params:
        param = params.get(param, param)
    return {"message": client_message(e), "type": _error_type(status_of(e)), "param": param, "code": e.code}


def cosyserve_error_response(e: CosyserveError, params: Mapping[str, str] | None = None) -> JSONResponse:
    """``e`` as the response the server sends: status by :data:`STATUS`, the OpenAI error shape
    (:func:`error_object`), Retry-After."""
    status = status_of(e)
    wait = retry_after(e)
    headers = {"Retry-After": str(wait)} if wait is not None else {}
    if status == 499:  # nobody is listening; a sane status for whoever logs the response
        status = 400
    return JSONResponse({"error": error_object(e, params)}, status_code=status, headers=headers)


class LastResortMiddleware:
    """Any exception a route did not expect becomes an OpenAI-shaped 500, counted in the error metrics.

    The body says only that the server failed (no message, path or traceback of the server's); the traceback
    goes to the log once, here (the exception is not re-raised, so the ASGI server does not log it again).
    An exception after the response started is re-raised: only the server can abort that connection.
    Pure ASGI, innermost of the app's middleware, so CORS headers still reach a browser's page.
    """

    def __init__(self, app: ASGIApp, metrics: Any) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            if started:
                raise
            route = getattr(scope.get("route"), "path", "unmatched")  # bounded labels, as the other errors
            logger.exception("%s %s failed unexpectedly", scope.get("method"), route)
            self.metrics.observe_error(route, 500, "internal_error")
            resp = error_response(
                500,
                "internal server error: the request failed unexpectedly (details are in the server log)",
                code="internal_error",
            )
            await resp(scope, receive, send)
