"""The cyclic garbage collector during a start: held off while a start builds its objects, then frozen.

A start allocates a few hundred thousand long-lived objects (torch's modules, then ours); each one pushes the
collector towards a full pass over all of them, a good part of ``import torch`` and of module construction. So
a start holds the collector off, and when the last hold goes, freezes what the start built (``gc.freeze``:
never scanned again, which also keeps later passes short on the request path) and turns it back on.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collect_frozen", "gc_held", "hold_gc", "release_gc"]

_gc_lock = threading.Lock()
_gc_holds = 0
_gc_was_enabled = False


def hold_gc() -> None:
    """Pause the cyclic garbage collector until the matching :func:`release_gc` (holds nest)."""
    global _gc_holds, _gc_was_enabled
    with _gc_lock:
        if _gc_holds == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_holds += 1


def release_gc() -> None:
    """Drop one hold; the last one freezes the objects alive now and re-enables the collector if it was on.
    A release without a hold does nothing (the server releases on READY whether or not the CLI held)."""
    global _gc_holds
    with _gc_lock:
        if _gc_holds == 0:
            return
        _gc_holds -= 1
        if _gc_holds == 0:
            gc.freeze()
            if _gc_was_enabled:
                gc.enable()


@contextmanager
def gc_held() -> Iterator[None]:
    """:func:`hold_gc` for the ``with`` block, :func:`release_gc` after it."""
    hold_gc()
    try:
        yield
    finally:
        release_gc()


def collect_frozen() -> None:
    """Collect garbage among frozen objects (after a model is released): a frozen cycle is otherwise never
    freed. One full pass (long once torch is loaded: call it when a model goes, not per request), then the
    survivors are frozen again. Does nothing while a start holds the collector."""
    with _gc_lock:
        if gc.get_freeze_count() == 0 or _gc_holds:
            return
        gc.unfreeze()
        gc.collect()
        gc.freeze()
