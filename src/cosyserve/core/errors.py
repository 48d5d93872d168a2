"""Every error cosyserve raises on purpose, in one tree. Pure Python: any layer may import it.

::

    CosyserveError
    ├── ClientError (ValueError)        a request that cannot be served as given; ``param`` names the field
    │   ├── UnknownModelError           no such model (for this tenant)
    │   ├── UnknownVoiceError           no such speaker or registered voice (for this tenant)
    │   ├── ModeUnavailableError        the model cannot run the mode (files missing, not an -Instruct model)
    │   ├── AudioError                  prompt or source audio that cannot be used
    │   ├── RegistryError               a registered voice that cannot be stored, found or read
    │   ├── PayloadTooLargeError        a body or upload over its limit
    │   └── UnsupportedMediaTypeError   a body of the wrong content type
    ├── InputError (ValueError)         a file, setting or flag the operator gave cannot be used (names it)
    │   ├── SettingsError               an environment variable, flag or settings-file value
    │   ├── ModelDirError               an official model directory (missing or unreadable files)
    │   ├── ModelConfigError            its cosyvoice.yaml
    │   ├── BundleError                 a bundle (manifest, weights, ONNX files, checksums)
    │   ├── ConvertError                where a conversion may write
    │   └── HubError                    a hub id that cannot be downloaded
    ├── OverloadedError                 a bound is reached: retry after ``retry_after`` seconds
    │   ├── QuotaExceededError          the tenant's own quota (others are unaffected)
    │   └── MemoryBudgetError           the model does not fit and nothing can be evicted
    ├── NotReadyError                   the model is loading or draining
    ├── EngineDeadError                 the model failed to load or was released
    │   └── LoadFailedError             its last load failed: not tried again for ``retry_after`` seconds
    ├── DeadlineExceededError           the request's deadline passed
    ├── RequestCancelledError           the client went away or closed the stream
    └── InternalError                   a failure inside the model code (a bug); ``__cause__`` holds it

    EngineStateError (RuntimeError)     an illegal engine state transition: a bug in the caller

Which HTTP status each class gets is decided in one table, :data:`cosyserve.server.errors.STATUS`. Messages name
the bad value and what is expected; for a failure that is not the client's, :attr:`CosyserveError.public_message`
is what a server may show a client (an operator's file paths are not in it). A message that echoes a client's value
shows it with :func:`shown` (quoted, a long one cut), so that a 100,000-character name is not sent back whole.
"""

from __future__ import annotations

__all__ = [
    "AudioError",
    "BundleError",
    "ClientError",
    "ConvertError",
    "CosyserveError",
    "DeadlineExceededError",
    "EngineDeadError",
    "EngineStateError",
    "HubError",
    "InputError",
    "InternalError",
    "LoadFailedError",
    "MemoryBudgetError",
    "ModeUnavailableError",
    "ModelConfigError",
    "ModelDirError",
    "NotReadyError",
    "OverloadedError",
    "PayloadTooLargeError",
    "QuotaExceededError",
    "RegistryError",
    "RequestCancelledError",
    "SettingsError",
    "UnknownModelError",
    "UnknownVoiceError",
    "UnsupportedMediaTypeError",
    "cut",
    "shown",
]

# the longest part of a client's value a message or a log line repeats
SHOWN_CHARS = 80


def cut(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text``, or its first ``limit`` characters, an ellipsis and its length when it is longer (for log lines)."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``value`` as a message quotes it (``repr``), cut to ``limit`` characters with an ellipsis and its length:
    ``shown("a" * 100_000)`` is ``'aa…a…' (100000 characters)``, 80 a's between the quotes."""
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else f"{value[:limit] + '…'!r} ({len(value)} characters)"
    return cut(repr(value), limit)


class CosyserveError(Exception):
    """Base of every error cosyserve raises on purpose.

    Args:
        message: what is wrong, naming the value and what is expected.
        param: the request field at fault, as :class:`~cosyserve.core.request.SynthesisRequest` names it (``text``,
            ``speaker``, ``prompt_wav``, ...); a server maps it to its own field name.
        public: what a server may show a client of an error that is not the client's fault, when ``message``
            names things of the operator's (file paths): :attr:`public_message`.
        code: a machine-readable code for clients (default the class's ``code``).
    """

    code = "error"

    def __init__(
        self,
        message: str = "",
        *,
        param: str | None = None,
        public: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.param = param
        self._public = public
        if code is not None:
            self.code = code

    @property
    def public_message(self) -> str | None:
        """What a client may read of an operator-side failure (no paths); None when nothing was said."""
        return self._public


class ClientError(CosyserveError, ValueError):
    """The request cannot be served as given (empty text, unknown speaker, speed out of range, bad audio)."""

    code = "invalid_value"


class UnknownModelError(ClientError, LookupError):
    """No model of that name (for this tenant)."""

    code = "model_not_found"


class UnknownVoiceError(ClientError, LookupError):
    """No pre-defined speaker nor registered voice of that name (for this tenant)."""

    code = "voice_not_found"


class ModeUnavailableError(ClientError):
    """The model cannot run the requested mode (its ONNX files are missing, or it is not an -Instruct model)."""

    code = "mode_unavailable"


class AudioError(ClientError):
    """Prompt or source audio that cannot be decoded or used (too short, too long, silent, unreadable)."""

    code = "invalid_audio"


class RegistryError(ClientError):
    """A registered voice that cannot be stored, found or read (bad name, clash, damaged file)."""

    code = "invalid_voice"


class PayloadTooLargeError(ClientError):
    """A request body or upload over its limit."""

    code = "payload_too_large"


class UnsupportedMediaTypeError(ClientError):
    """A request body of a content type the route does not take."""

    code = "unsupported_media_type"


class InputError(CosyserveError, ValueError):
    """A file, setting or flag the operator gave cannot be used; the message names it and says what is expected."""

    code = "invalid_input"


class SettingsError(InputError):
    """An environment variable, flag or settings-file value cosyserve cannot use."""


class ModelDirError(InputError):
    """An official model directory with a missing or unreadable file."""


class ModelConfigError(InputError):
    """A model directory's cosyvoice.yaml that cannot be used (unknown tag, missing key, bad value)."""


class BundleError(InputError):
    """A bundle that cannot be used (manifest, weights, ONNX files, checksums); convert the model again."""


class ConvertError(InputError):
    """A conversion refused before writing anything (the output is the model, around it, or not a bundle)."""


class HubError(InputError):
    """A hub id that cannot be downloaded (the hub extra is missing, or the download failed)."""


class OverloadedError(CosyserveError):
    """Refused at once because a bound is reached; retry after ``retry_after`` seconds.

    Args:
        message: what is full.
        retry_after: estimated seconds until a slot frees (> 0).
    """

    code = "overloaded"

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = max(float(retry_after), 0.001)


class QuotaExceededError(OverloadedError):
    """A tenant's own quota (concurrent requests, models, memory) is full; other tenants are unaffected."""

    code = "quota_exceeded"


class MemoryBudgetError(OverloadedError):
    """Loading a model would exceed the memory budget and nothing can be evicted (all pinned or busy)."""

    code = "memory_budget"


class NotReadyError(CosyserveError):
    """The model is not READY (still loading, or draining for shutdown or eviction)."""

    code = "not_ready"


class EngineDeadError(CosyserveError):
    """The model failed to load, or was released; ``__cause__`` holds the failure where there is one."""

    code = "engine_dead"


class LoadFailedError(EngineDeadError):
    """The model's last load failed (``__cause__``); it is not loaded again for ``retry_after`` seconds.

    Args:
        message: the model and the cause.
        model: the model's name.
        retry_after: seconds until the next load may start (> 0).
    """

    code = "load_failed"

    def __init__(self, message: str, model: str, retry_after: float) -> None:
        super().__init__(message)
        self.model = model
        self.retry_after = max(float(retry_after), 0.001)


class DeadlineExceededError(CosyserveError):
    """The request's deadline passed; its generation was stopped."""

    code = "deadline_exceeded"


class RequestCancelledError(CosyserveError):
    """The request was cancelled (the client disconnected or closed the stream)."""

    code = "cancelled"


class InternalError(CosyserveError):
    """An unexpected failure inside the model code; ``__cause__`` holds the original exception."""

    code = "internal_error"


class EngineStateError(RuntimeError):
    """An illegal engine state transition (a programming error, not a request error)."""
