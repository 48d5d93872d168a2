"""An utterance's text as it arrives: an iterator of ``str`` pieces, fed by one thread and read by another.

The WebSocket route puts a client's text deltas (an LLM's output as it is generated) into a :class:`TextFeed` on
the event loop; the runtime iterates it in its worker thread, as the ``text`` of a
:class:`~cosyserve.core.request.SynthesisRequest`, and ``next()`` blocks until the next piece arrives. The iteration
ends once the producer calls :meth:`TextFeed.finish` (after the pieces put so far), at once when it calls
:meth:`TextFeed.abort` (a cancelled request, a client gone: the pieces not yet taken are dropped), or at the
feed's deadline, so a worker never waits on a producer that went away. The producer must end every feed it
starts, one way or the other; it cancels a request before it aborts its feed, so that a runtime whose text ends
finds ``should_stop()`` true and does not take the cut text for a finished utterance. Pure Python (no numpy, no
torch): runtimes import it too.

A feed built by :meth:`cosyserve.core.limits.Limits.feed` holds the limits of streamed text: a piece longer than
``max_piece_chars`` is refused as it is put (a :class:`~cosyserve.core.errors.ClientError` naming ``text``), and a
producer asks :meth:`TextFeed.has_room` before it puts more, so that the text put and not yet taken stays within
``max_pending_chars`` (a producer that waits is woken by ``on_take``).

Example::

    feed = TextFeed()
    stream = engine.synthesize(SynthesisRequest(text=feed, stream=True))  # the runtime reads it as it comes
    feed.put("Hello, ")
    feed.put("world.")
    feed.finish()
    async for chunk in stream: ...
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

from cosyserve.core.errors import ClientError

__all__ = ["TextFeed"]


class TextFeed:
    """A thread-safe, queue-backed iterator of text pieces (see the module docstring).

    Args:
        deadline: ``clock()`` time after which the iteration ends whatever the producer does (the request's
            deadline); None for none.
        on_take: called in the reading thread after each piece it takes (a producer that waits for room, see
            :attr:`pending_chars`, is woken by it); it must not block.
        clock: monotonic seconds, the clock of ``deadline``.
        max_piece_chars: the longest piece :meth:`put` takes (None: any).
        max_pending_chars: what :meth:`has_room` keeps the text put and not yet taken within (None: no bound).
    """

    def __init__(
        self,
        *,
        deadline: float | None = None,
        on_take: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_piece_chars: int | None = None,
        max_pending_chars: int | None = None,
    ) -> None:
        self.max_piece_chars = max_piece_chars
        self.max_pending_chars = max_pending_chars
        self._cond = threading.Condition()
        self._pieces: deque[str] = deque()
        self._finished = False
        self._aborted = False
        self._deadline = deadline
        self._on_take = on_take
        self._clock = clock
        self.chars = 0  # characters put
        self.pending_chars = 0  # characters put and not yet taken

    def put(self, text: str) -> None:
        """Add ``text`` to the utterance (an empty string adds nothing).

        Raises:
            TypeError: ``text`` is not a str.
            ClientError: ``text`` is longer than ``max_piece_chars`` (nothing is added).
            RuntimeError: the feed was finished or aborted.
        """
        if not isinstance(text, str):
            raise TypeError(f"a text piece must be a str, got {type(text).__name__}")
        most = self.max_piece_chars
        if most is not None and len(text) > most:
            raise ClientError(
                f"a piece of text is {len(text)} characters; the limit is {most} a piece", param="text"
            )
        with self._cond:
            if self._finished or self._aborted:
                raise RuntimeError("the text feed is closed: no piece can be added after finish() or abort()")
            if not text:
                return
            self._pieces.append(text)
            self.chars += len(text)
            self.pending_chars += len(text)
            self._cond.notify()

    def finish(self) -> None:
        """The utterance is complete: the iteration ends after the pieces already put (idempotent)."""
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def abort(self) -> None:
        """End the iteration now, dropping the pieces not yet taken (idempotent; also after :meth:`finish`)."""
        with self._cond:
            self._aborted = True
            self._pieces.clear()
            self.pending_chars = 0
            self._cond.notify_all()

    def has_room(self, chars: int) -> bool:
        """Whether a piece of ``chars`` characters may be put now within ``max_pending_chars``: always when
        nothing is pending (a piece longer than the bound goes alone)."""
        most = self.max_pending_chars
        return most is None or self.pending_chars == 0 or self.pending_chars + chars <= most

    @property
    def closed(self) -> bool:
        """Whether the producer ended the feed (finished or aborted)."""
        return self._finished or self._aborted

    @property
    def aborted(self) -> bool:
        return self._aborted

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        with self._cond:
            while not self._pieces and not self._finished and not self._aborted:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - self._clock()
                if left <= 0:
                    self._aborted = True  # the request is stopped at its deadline: nothing more is read
                    break
                self._cond.wait(left)
            if self._aborted or not self._pieces:
                raise StopIteration
            piece = self._pieces.popleft()
            self.pending_chars -= len(piece)
        if self._on_take is not None:
            self._on_take()
        return piece

    def __repr__(self) -> str:
        state = "aborted" if self._aborted else "finished" if self._finished else "open"
        return f"TextFeed({state}, {self.chars} chars, {self.pending_chars} pending)"
