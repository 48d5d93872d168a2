"""The engine's states and the one table of transitions between them.

::

    NEW -> LOADING -> READY -> DRAINING -> RELEASED
              |         |         |
              +-> FAILED <--------+          (NEW -> RELEASED too: released before it was ever loaded)

Every transition is checked against :data:`ALLOWED`; an illegal one raises
:class:`~cosyserve.core.errors.EngineStateError` with :data:`STATE_TRANSITION_ERROR`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ALLOWED", "STATE_TRANSITION_ERROR", "EngineState", "Listener", "Transition"]


class EngineState(enum.Enum):
    NEW = "new"
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    RELEASED = "released"
    FAILED = "failed"


S = EngineState
ALLOWED: dict[EngineState, frozenset[EngineState]] = {
    S.NEW: frozenset({S.LOADING, S.RELEASED}),
    S.LOADING: frozenset({S.READY, S.FAILED}),
    S.READY: frozenset({S.DRAINING, S.FAILED}),
    S.DRAINING: frozenset({S.RELEASED, S.FAILED}),
    S.RELEASED: frozenset(),
    S.FAILED: frozenset(),
}
STATE_TRANSITION_ERROR = "engine {name!r}: illegal state transition {old} -> {new}"


@dataclass(frozen=True)
class Transition:
    """One state change: ``seq`` orders them, ``wall`` is ``time.time()``, ``at`` the engine clock."""

    seq: int
    old: EngineState
    new: EngineState
    wall: float
    at: float
    cause: BaseException | None = None


Listener = Callable[[Any, Transition], None]  # (engine, transition)
