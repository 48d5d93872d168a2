"""A lite stream's flow state in numpy (:class:`~cosyserve.models.flow_stream.FlowStream`'s, in the layout the lite
graphs take): per Euler step (and, for CosyVoice2, per encoder rate) a :class:`StepState` whose kept rows are a graph's
input as they are and whose next rows its output; :class:`LiteFlowStream` the whole, forked from a registered voice's
(read-only, never copied: the graphs take a voice's rows as an input of their own, read before the stream's) and
written to and read from a stored voice state as named arrays. :class:`~cosyserve.runtime.lite.chunkflow.LiteChunkFlow`
runs the graphs over it. No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cosyserve.models.flow_window import dropped

__all__ = ["LiteFlowStream", "StepState", "empty_state"]


@dataclass
class StepState:
    """One Euler step's kept state (:class:`~cosyserve.models.flow_stream.StepCache`'s, in numpy): the ``kept``
    frames' attention keys and values, each row (layers, 2, B, H, D): first the ``voice`` rows (a registered
    voice's, read-only: a fork reads them where they are, never copied; None for a stream of its own), then this
    stream's own, the first rows of its buffer ``kv`` (capacity, layers, 2, B, H, D: frames first, so that those
    rows are the graph's input as they are and the rows after them its output); each causal conv's last input
    frames before the kept boundary ``tails`` (B, C, kernel - 1)."""

    kv: np.ndarray
    tails: list[np.ndarray]
    kept: int = 0  # kept frames: the voice's rows, then this stream's own
    voice: np.ndarray | None = None  # the voice's kept rows, read before kv's (a fork's)
    lent: bool = False  # the tails are the voice's (a fork's, until its first call that keeps frames)

    @property
    def own(self) -> int:
        """Rows of ``kv`` that are kept frames (after the voice's)."""
        return self.kept - (0 if self.voice is None else self.voice.shape[0])

    def rows(self) -> np.ndarray:
        """Every kept row as one array (a view where they are one already)."""
        own = self.kv if self.kv.shape[0] == self.own else self.kv[: self.own]
        return (
            own
            if self.voice is None
            else self.voice
            if not own.shape[0]
            else np.concatenate([self.voice, own])
        )

    def reserve(self, rows: int, share: bool = True) -> None:
        """Room in ``kv`` for ``rows`` rows after the kept ones, which stay where they were (grown by half again:
        they are copied once in a while, not at every call). ``share`` False (a graph that takes every kept row as
        one array: an estimator converted before a voice's rows were an input of their own): the voice's rows are
        copied into this step's own buffer first."""
        lent = 0 if share or self.voice is None else self.voice.shape[0]
        own, need = self.own, (self.kept if lent else self.own) + rows
        if lent or need > self.kv.shape[0]:
            grown = np.empty((max(need, self.kv.shape[0] * 3 // 2), *self.kv.shape[1:]), self.kv.dtype)
            if lent:
                grown[:lent] = self.voice
            grown[lent : lent + own] = self.kv[:own]
            self.kv = grown
            if lent:
                self.voice = None

    def keep(self, commit: int, tails: list[np.ndarray]) -> None:
        """A call's first ``commit`` frames are kept (their rows written after the kept ones), with the convs'
        ``tails`` at the new boundary (a call that keeps nothing moves none)."""
        if commit:
            self.kept += commit
            self.tails, self.lent = tails, False

    def drop(self, first: int, n: int) -> None:
        """Forget kept rows ``first .. first + n - 1`` (this stream's own, after the voice's: a bounded stream's
        oldest generated frames); the rows after them move up in the buffer."""
        lent = 0 if self.voice is None else self.voice.shape[0]
        if first < lent:
            raise ValueError(f"a stream drops rows of its own, not its voice's ({lent}); asked from {first}")
        a, own = first - lent, self.own
        self.kv[a : own - n] = self.kv[a + n : own]  # numpy copies overlapping rows as if through a buffer
        self.kept -= n

    def spans(self, granularity: int) -> list[int]:
        """The kept rows as a torch stream's segments (:class:`~cosyserve.models.flow_stream.StepCache`): the
        voice's as one, then one per attention chunk (a call keeps whole chunks)."""
        lent = 0 if self.voice is None else self.voice.shape[0]
        return [lent] * bool(lent) + [granularity] * (self.own // granularity)

    def fork(self) -> StepState:
        # the fork reads this step's kept rows as its voice's, and keeps its own in a buffer of its own (none yet)
        rows = self.rows()
        return StepState(rows[:0].copy(), list(self.tails), self.kept, voice=rows, lent=True)

    def nbytes(self) -> int:
        # what this step holds of its own: its buffer and, once its own, its tails (a voice's are counted there)
        return int(self.kv.nbytes) + (0 if self.lent else sum(int(t.nbytes) for t in self.tails))


@dataclass
class LiteFlowStream:
    """A stream's flow state in numpy (:class:`~cosyserve.models.flow_stream.FlowStream`'s): ``frames`` mel frames
    are final (a multiple of ``granularity``), their mel in ``mel`` (1, 80, frames), per Euler step a
    :class:`StepState` and, for CosyVoice2, the encoder's at token rate and at mel rate (``encoder``).

    ``context`` bounds the generated frames the estimator attends to and ``prompt`` is the frames never dropped, as
    the torch stream's (0: every frame; :meth:`trim`, by the rule both share: :mod:`cosyserve.models.flow_window`)."""

    granularity: int
    n_timesteps: int
    steps: list[StepState]
    encoder: list[StepState] = field(default_factory=list)
    frames: int = 0
    mel: np.ndarray | None = None
    lent_mel: bool = False  # mel is the stream's it was forked from (until a call keeps frames)
    context: int = 0
    prompt: int = 0

    def kept_until(self, frames: int) -> int:
        """The frames final after a call that computes up to ``frames``: whole attention chunks only."""
        return frames // self.granularity * self.granularity if self.granularity else 0

    def trim(self) -> None:
        """A bounded stream's kept generated frames cut to the most recent ``context`` or more, whole attention
        chunks, the oldest first, by the torch stream's rule (:func:`~cosyserve.models.flow_window.dropped`); the
        prompt's frames (the voice's among them) stay. The encoder's state is not trimmed (nor the torch one's)."""
        if not self.context or not self.steps:
            return
        spans = self.steps[0].spans(self.granularity)  # every step keeps the same rows
        first, n = dropped(spans, self.prompt, self.context)
        if n:
            for state in self.steps:
                state.drop(sum(spans[:first]), sum(spans[first : first + n]))

    def fork(self) -> LiteFlowStream:
        """A stream that continues from this one without changing it (a registered voice's, for a request): its
        states read this one's kept rows where they are (the graphs' ``kv*_voice`` inputs) and keep their own
        after them in buffers of their own, so the voice's arrays are never written nor copied (but for an older
        bundle's graphs, :meth:`StepState.reserve`)."""
        return LiteFlowStream(
            self.granularity, self.n_timesteps, [s.fork() for s in self.steps], [s.fork() for s in self.encoder],
            frames=self.frames, mel=self.mel, lent_mel=self.mel is not None, context=self.context,
            prompt=self.prompt,
        )  # fmt: skip

    def freeze(self) -> None:
        """Make the kept arrays read-only, each state's buffer cut to its kept rows (a voice's state, which its
        requests fork: a write into it would change every later request's audio)."""
        for state in (*self.steps, *self.encoder):
            state.kv, state.voice = state.rows(), None
            for a in (state.kv, *state.tails):
                a.flags.writeable = False
        if self.mel is not None:
            self.mel.flags.writeable = False

    def to_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """The kept state as named arrays and string metadata (what :mod:`cosyserve.voices.voicestates` stores;
        :meth:`LiteChunkFlow.stream_from_arrays` reads it back)."""
        arrays = {} if self.mel is None else {"mel": self.mel}
        for prefix, states in (("s", self.steps), ("e", self.encoder)):
            for i, state in enumerate(states):
                arrays[f"{prefix}{i}.kv"] = state.rows()
                arrays.update({f"{prefix}{i}.t{j}": tail for j, tail in enumerate(state.tails)})
        meta = {"frames": str(self.frames), "granularity": str(self.granularity), "arrays": "numpy"}
        return arrays, {**meta, "n_timesteps": str(self.n_timesteps), "encoder": str(len(self.encoder))}

    def nbytes(self) -> int:
        """Bytes this stream holds of its own (each state's buffer, the tails and the mel): a fork's arrays lent by
        its voice (its kept rows, and its tails and mel until a call keeps frames) are counted there."""
        mel = 0 if self.mel is None or self.lent_mel else int(self.mel.nbytes)
        return sum(s.nbytes() for s in (*self.steps, *self.encoder)) + mel


def empty_state(kv_shape: tuple[int, ...], tails: list[tuple[int, ...]], batch: int) -> StepState:
    # no kept rows: keys and values (0, layers, 2, batch, heads, head_dim), zero tails (batch, channels, frames)
    kv = np.zeros((0, kv_shape[0], 2, batch, *kv_shape[1:]), np.float32)
    return StepState(kv, [np.zeros((batch, c, k), np.float32) for c, k in tails])
