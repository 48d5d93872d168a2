"""The engine's typed errors; the HTTP server maps each class to one status code.

| class | meaning | suggested status |
|---|---|---|
| :class:`ClientError` | the request cannot be served as given (bad text, speaker, option) | 400 |
| :class:`UnknownModelError` | no such model (or not visible to this tenant) | 404 |
| :class:`OverloadedError` | queue or quota full: retry after ``retry_after`` seconds | 429 / 503 + Retry-After |
| :class:`NotReadyError` | the engine is loading or draining | 503 |
| :class:`EngineDeadError` | the engine failed or was released | 503 |
| :class:`DeadlineExceededError` | the request's deadline passed before it finished | 504 |
| :class:`RequestCancelledError` | the client went away or closed the stream | 499 (nothing to send) |
| :class:`InternalError` | a bug or an unexpected failure inside the model code | 500 |

:class:`EngineStateError` is not a request error: it reports an illegal state transition, i.e. a bug in the
caller (the engine's own transitions are checked against one table).
"""

from __future__ import annotations

__all__ = [
    "ClientError",
    "DeadlineExceededError",
    "EngineDeadError",
    "EngineError",
    "EngineStateError",
    "InternalError",
    "MemoryBudgetError",
    "NotReadyError",
    "OverloadedError",
    "QuotaExceededError",
    "RequestCancelledError",
    "UnknownModelError",
]


class EngineError(Exception):
    """Base of every error a synthesis request can end with."""

    status_code = 500


class ClientError(EngineError, ValueError):
    """The request is invalid (empty text, unknown speaker, speed out of range, unsupported mode).

    Args:
        message: what is wrong and how to fix it.
        param: the request field at fault, as :class:`~cosyserve.engine.engine.SynthesisRequest` names it
            (``text``, ``prompt_wav``, ``instruct_text``, ...); a server maps it to its own field name.
    """

    status_code = 400

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnknownModelError(ClientError, LookupError):
    """No model of that name (for this tenant)."""

    status_code = 404


class OverloadedError(EngineError):
    """Refused at once because a bound is reached; the client should retry after ``retry_after`` seconds.

    Args:
        message: what is full.
        retry_after: estimated seconds until a slot frees (> 0).
    """

    status_code = 503

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = max(float(retry_after), 0.001)


class QuotaExceededError(OverloadedError):
    """A tenant's own quota (concurrent requests, models, memory) is full; other tenants are unaffected."""

    status_code = 429


class MemoryBudgetError(OverloadedError):
    """Loading a model would exceed the memory budget and nothing can be evicted (all pinned or busy)."""

    status_code = 503


class NotReadyError(EngineError):
    """The engine is not READY (still loading, or draining for shutdown/eviction)."""

    status_code = 503


class EngineDeadError(EngineError):
    """The engine failed to load, or was released; ``__cause__`` holds the failure where there is one."""

    status_code = 503


class DeadlineExceededError(EngineError):
    """The request's deadline passed; its generation was stopped."""

    status_code = 504


class RequestCancelledError(EngineError):
    """The request was cancelled (client disconnected or closed the stream)."""

    status_code = 499


class InternalError(EngineError):
    """An unexpected failure inside the model code; ``__cause__`` holds the original exception."""

    status_code = 500


class EngineStateError(RuntimeError):
    """An illegal engine state transition (a programming error, not a request error)."""
