"""The back-off of a model whose load failed: it is not loaded again until its wait ends (:data:`LOAD_BACKOFF_S`,
doubled after each further failure), and requests in between get the failure at once
(:class:`~cosyserve.core.errors.LoadFailedError`, with the wait); a change of its files on disk ends the wait early.

:class:`LoadFailures` keeps each model's last failed load; the pool asks it under its lock (it locks nothing itself).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

from cosyserve.core.errors import EngineDeadError, LoadFailedError

logger = logging.getLogger("cosyserve.engine.pool")

__all__ = ["LOAD_BACKOFF_S", "LoadFailure", "LoadFailures", "files_stamp"]

# Back-off after a failed load: the first wait, doubled after each further failure, up to the last. A load that
# failed (a damaged or missing file) fails again the same way; loading it per request would spend a core (and, for
# a large bundle, its checksum reads) on every request.
LOAD_BACKOFF_S = (1.0, 60.0)


@dataclass
class LoadFailure:
    """A model's last failed load: why, how many failed in a row, and when the next may start (pool clock)."""

    cause: BaseException
    failures: int
    retry_at: float
    stamp: tuple[tuple[str, int, int], ...] | None  # its files when it failed (see files_stamp)
    checked_at: float  # when the stamp was last compared with the disk

    def error(self, model: str, now: float) -> LoadFailedError:
        wait = max(self.retry_at - now, 0.001)
        times = f" ({self.failures} times in a row)" if self.failures > 1 else ""
        err = LoadFailedError(
            f"model {model!r} failed to load{times}: {self.cause}; "
            f"it is tried again in {math.ceil(wait)} s at the earliest",
            model=model,
            retry_after=wait,
        )
        err.__cause__ = self.cause
        return err


def files_stamp(path: str | None) -> tuple[tuple[str, int, int], ...] | None:
    """(name, size, mtime) of a model's path and its top-level entries: a few stat calls, enough to see a bundle
    converted again or a file replaced; None when it is not a local path (a hub id, a test fake)."""
    if path is None or not os.path.exists(path):
        return None
    try:
        st = os.stat(path)
        items = [("", st.st_size, st.st_mtime_ns)]
        if os.path.isdir(path):
            with os.scandir(path) as it:
                for e in it:
                    est = e.stat()
                    items.append((e.name, est.st_size, est.st_mtime_ns))
    except OSError:
        return ()
    return tuple(sorted(items))


class LoadFailures:
    """Each model's last load, while it failed (a load that succeeds clears it)."""

    def __init__(self) -> None:
        self._by_model: dict[str, LoadFailure] = {}

    def get(self, model: str) -> LoadFailure | None:
        return self._by_model.get(model)

    def models(self) -> set[str]:
        return set(self._by_model)

    def clear(self, model: str) -> None:
        self._by_model.pop(model, None)

    def record(self, model: str, path: str | None, error: BaseException, now: float) -> LoadFailedError:
        """A load of ``model`` (its files at ``path``) failed with ``error``: its back-off starts (or doubles).

        Returns:
            The error to answer the load's waiters and the requests of the back-off with.
        """
        # the engine wraps the loader's exception; the failure keeps the loader's own
        cause = (
            error.__cause__ if isinstance(error, EngineDeadError) and error.__cause__ is not None else error
        )
        previous = self._by_model.get(model)
        failures = previous.failures + 1 if previous is not None else 1
        first, most = LOAD_BACKOFF_S
        failure = LoadFailure(
            cause,
            failures,
            retry_at=now + min(most, first * 2 ** min(failures - 1, 16)),
            stamp=files_stamp(path),
            checked_at=now,
        )
        self._by_model[model] = failure
        return failure.error(model, now)

    def refusal(self, model: str, path: str | None, now: float) -> LoadFailedError | None:
        """The failure to answer with while the model's back-off runs; None when a load may start."""
        failure = self._by_model.get(model)
        if failure is None or now >= failure.retry_at:
            return None
        if failure.stamp is not None and now - failure.checked_at >= LOAD_BACKOFF_S[0]:
            failure.checked_at = now  # at most one look at the disk a second, whatever the request rate
            if files_stamp(path) != failure.stamp:
                logger.info("pool: %s: its files changed since its load failed: loading it again now", model)
                return None
        return failure.error(model, now)
