"""Errors as HTTP responses, in the OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import math
import re

from starlette.responses import JSONResponse

from cosyserve.engine.errors import EngineError, OverloadedError

__all__ = ["HTTPError", "error_response", "from_engine_error", "without_paths"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class HTTPError(Exception):
    """A request the server refuses: status, message naming the field, and the field (``param``)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


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
            "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }
    return JSONResponse(body, status_code=status, headers=headers)


# an absolute path: "/" at the start or after a blank, quote, bracket or "=", then path characters
_ABS_PATH = re.compile(r"(?<![^\s'\"(\[=])/(?:[^\s/'\"()\[\]]+/)*([^\s/'\"()\[\]]+)")


def without_paths(message: str) -> str:
    """``message`` with each absolute filesystem path cut to its last part (``/srv/models/m has ...`` ->
    ``m has ...``): a remote client is never told where the server keeps its files."""
    return _ABS_PATH.sub(r"\1", message)


def from_engine_error(e: EngineError) -> HTTPError:
    """The engine's typed error as the response the server sends (status from the class, Retry-After)."""
    status = int(getattr(e, "status_code", 500))
    headers: dict[str, str] = {}
    if isinstance(e, OverloadedError):
        headers["Retry-After"] = str(max(1, math.ceil(e.retry_after)))
    code = type(e).__name__.removesuffix("Error").lower() or None
    if status == 499:  # nobody is listening; keep a sane status for logs
        status = 400
    return HTTPError(status, without_paths(str(e)), code=code, headers=headers)
