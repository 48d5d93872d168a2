"""A lite stream's flow state in numpy (:class:`~cosyserve.models.flow_stream.FlowStream`'s, in the layout the lite
graphs take): per Euler step (and, for CosyVoice2, per encoder rate) a :class:`StepState` whose kept rows are a graph's
input as they are and whose next rows its output; :class:`LiteFlowStream` the whole, forked from a registered voice's
(read-only, copied by a fork's first call that keeps frames) and written to and read from a stored voice state as
named arrays. :class:`~cosyserve.runtime.lite.chunkflow.LiteChunkFlow` runs the graphs over it. No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["LiteFlowStream", "StepState", "empty_state"]


@dataclass
class StepState:
    """One Euler step's kept state (:class:`~cosyserve.models.flow_stream.StepCache`'s, in numpy): ``kv``
    (capacity, layers, 2, B, H, D) whose first ``kept`` rows (the stream's frames) are the kept frames' attention
    keys and values, frames first so that those rows are the graph's input as they are and the rows after them
    its output; each causal conv's last input frames before the kept boundary ``tails`` (B, C, kernel - 1)."""

    kv: np.ndarray
    tails: list[np.ndarray]
    kept: int = 0  # rows of kv that are kept frames
    lent: bool = False  # kv and tails are another stream's (a fork's, until its first call that keeps frames)

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` rows of keys and values, the kept ones where they were (grown by half again: they are
        copied once in a while, not at every call); lent rows are copied into a buffer of this step's own."""
        if rows > self.kv.shape[0] or (self.lent and rows > self.kept):
            grown = np.empty((max(rows, self.kv.shape[0] * 3 // 2), *self.kv.shape[1:]), self.kv.dtype)
            grown[: self.kept] = self.kv[: self.kept]
            self.kv, self.lent = grown, False

    def fork(self) -> StepState:
        return StepState(self.kv[: self.kept], list(self.tails), self.kept, lent=True)

    def nbytes(self) -> int:
        # a lent step holds nothing of its own (its arrays are counted where they were made)
        return 0 if self.lent else int(self.kv.nbytes) + sum(int(t.nbytes) for t in self.tails)


@dataclass
class LiteFlowStream:
    """A stream's flow state in numpy (:class:`~cosyserve.models.flow_stream.FlowStream`'s): ``frames`` mel frames
    are final (a multiple of ``granularity``), their mel in ``mel`` (1, 80, frames), per Euler step a
    :class:`StepState` and, for CosyVoice2, the encoder's at token rate and at mel rate (``encoder``)."""

    granularity: int
    n_timesteps: int
    steps: list[StepState]
    encoder: list[StepState] = field(default_factory=list)
    frames: int = 0
    mel: np.ndarray | None = None
    lent_mel: bool = False  # mel is the stream's it was forked from (until a call keeps frames)

    def kept_until(self, frames: int) -> int:
        """The frames final after a call that computes up to ``frames``: whole attention chunks only."""
        return frames // self.granularity * self.granularity if self.granularity else 0

    def fork(self) -> LiteFlowStream:
        """A stream that continues from this one without changing it (a registered voice's, for a request): its
        states read this one's kept rows until their first call that keeps frames copies them into a buffer of
        their own (a graph takes every kept row as one array), so the voice's arrays are never written."""
        return LiteFlowStream(
            self.granularity, self.n_timesteps, [s.fork() for s in self.steps], [s.fork() for s in self.encoder],
            frames=self.frames, mel=self.mel, lent_mel=self.mel is not None,
        )  # fmt: skip

    def freeze(self) -> None:
        """Make the kept arrays read-only, each state's buffer cut to its kept rows (a voice's state, which its
        requests fork: a write into it would change every later request's audio)."""
        for state in (*self.steps, *self.encoder):
            state.kv = state.kv[: state.kept]
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
                arrays[f"{prefix}{i}.kv"] = state.kv[: state.kept]
                arrays.update({f"{prefix}{i}.t{j}": tail for j, tail in enumerate(state.tails)})
        meta = {"frames": str(self.frames), "granularity": str(self.granularity), "arrays": "numpy"}
        return arrays, {**meta, "n_timesteps": str(self.n_timesteps), "encoder": str(len(self.encoder))}

    def nbytes(self) -> int:
        """Bytes this stream holds of its own (each state's buffer, the tails and the mel): a fork's arrays lent by
        its voice are counted there, until its first call that keeps frames copies them (then counted here)."""
        mel = 0 if self.mel is None or self.lent_mel else int(self.mel.nbytes)
        return sum(s.nbytes() for s in (*self.steps, *self.encoder)) + mel


def empty_state(kv_shape: tuple[int, ...], tails: list[tuple[int, ...]], batch: int) -> StepState:
    # no kept rows: keys and values (0, layers, 2, batch, heads, head_dim), zero tails (batch, channels, frames)
    kv = np.zeros((0, kv_shape[0], 2, batch, *kv_shape[1:]), np.float32)
    return StepState(kv, [np.zeros((batch, c, k), np.float32) for c, k in tails])
