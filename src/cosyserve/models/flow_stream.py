"""What a streamed flow keeps between chunks, so that a chunk computes its own frames only.

CosyVoice2's and CosyVoice3's flows stream with static chunk attention: frame ``i`` attends to frame ``j`` only
when ``j < (i // c + 1) * c`` (``c`` = 50 frames), every convolution is causal, and the ODE starts from a fixed
noise indexed by frame. So once a call has computed every frame of an attention chunk, nothing later changes that
chunk's frames: at every Euler step their keys and values, and the inputs of every causal convolution, are final.
A :class:`FlowStream` keeps them, per Euler step, and the next call computes only the frames after the last
complete chunk (the frames of a chunk still incomplete are computed again: the smallest exact recomputation).

Layout, per Euler step (a :class:`StepCache`): for each causal convolution in the order the estimator runs them,
its input's last ``kernel - 1`` frames before the kept boundary; for each attention layer, its keys and values
of every kept frame, as a list of segments (one per call that added frames), never written to: a request forked
from a registered voice (:meth:`FlowStream.fork`) shares the voice's segments and appends its own (a call's
attention concatenates them for one fused kernel, :func:`attend`). Both CFG rows (conditioned and not) are kept,
batch first. The object is separate from the modules, so several streams' states step as one batch
(:class:`StepRows`: one estimator call per Euler step over every stream's rows, each at its own offset).

Memory: per kept frame, 2 (CFG rows) x Euler steps x every attention layer's keys and values, in the flow's
dtype: ~4.6 MB for a full-size CosyVoice2 flow in float32, ~3.6 MB for CosyVoice3 (50 frames a second).

A bounded stream (``context`` > 0 frames, the ``flow_context_seconds`` setting; opt-in, no longer the reference's
result) keeps each call's committed frames as one segment per attention chunk and, after each call
(:meth:`FlowStream.trim`), drops the oldest segments of generated speech while the ones after them still hold
``context`` frames: the estimator then attends to the prompt's frames (never dropped, to the end of the chunk the
prompt ends in), the most recent ``context`` to ``context + chunk`` generated frames and the call's own, so a
call's cost and the state's memory stop growing with the utterance. Conv tails, the encoder's caches (CosyVoice2's
conformer: ~1.4 MB per second of speech in float32, ~0.6% of the estimator's) and rotary positions (absolute,
from ``start``) are unaffected. Bounded streams stack as any (:class:`StepRows`: each row attends to what its own
stream keeps, whatever its context, right-aligned and masked), a bounded stream's last call included.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from cosyserve.models.flow_window import dropped

__all__ = ["FlowStream", "StepCache", "StepRows", "StepState", "attend", "joined"]


@dataclass
class StepCache:
    """One Euler step's (or the encoder's) state of a stream; see the module docstring.

    ``start`` is the number of frames already kept (a multiple of the attention chunk) and ``commit`` how many of
    the current call's frames become final (set by :meth:`begin` before each call's forward).
    """

    tails: list[Tensor] = field(default_factory=list)
    keys: list[list[Tensor]] = field(default_factory=list)
    values: list[list[Tensor]] = field(default_factory=list)
    start: int = 0
    commit: int = 0
    split: int = 0
    _conv: int = 0
    _attn: int = 0

    def begin(self, start: int, commit: int, split: int = 0) -> None:
        """A call over frames ``start ..`` of which the first ``commit`` are final, kept as segments of ``split``
        frames each (0: one segment); slots are taken in order."""
        self.start, self.commit, self.split, self._conv, self._attn = start, commit, split, 0, 0

    def left(self, x: Tensor, n: int) -> Tensor:
        """``x`` (B, C, T) with ``n`` frames of left context prepended: the kept frames before it (zeros at the
        start of the stream), as a causal convolution's zero padding would give over the whole sequence. Keeps
        the ``n`` frames before the new boundary for the next call."""
        padded = torch.cat([self.tail(x, x.shape[0], n).to(x.dtype), x], dim=2)
        self.keep_tail(padded, n)
        return padded

    def tail(self, x: Tensor, rows: int, n: int) -> Tensor:
        """The next causal convolution's kept input tail (rows, C, n), zeros at the stream's start (``x``: the
        call's input, for its width and device)."""
        i = self._conv
        if i == len(self.tails):
            self.tails.append(x.new_zeros(rows, x.shape[1], n))
        return self.tails[i]

    def keep_tail(self, padded: Tensor, n: int) -> None:
        """Keep the ``n`` frames of ``padded`` (this stream's rows: its tail, then the call's frames) before the
        new boundary for the next call; moves to the next convolution."""
        i = self._conv
        self._conv += 1
        if self.commit:
            self.tails[i] = padded[:, :, self.commit : self.commit + n].clone()

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """The next attention layer's output for the call's queries, keys and values (B, H, n, D): over the kept
        frames' keys and values (seen whole) and the call's own (``mask``: (n, n) bool, True = attend)."""
        return attend(q, *self.segments(k, v, dim=2), mask)

    def segments(self, k: Tensor, v: Tensor, dim: int) -> tuple[list[Tensor], list[Tensor]]:
        """The next attention layer's keys and values: the kept segments followed by ``k``, ``v`` (the call's
        frames along ``dim``); the committed frames of ``k``, ``v`` are kept as a new segment."""
        i = self._attn
        self._attn += 1
        if i == len(self.keys):
            self.keys.append([])
            self.values.append([])
        ks, vs = self.keys[i], self.values[i]
        if self.commit:
            # new lists: a fork shares the old ones (see FlowStream.fork)
            self.keys[i] = ks + self._kept(k, dim)
            self.values[i] = vs + self._kept(v, dim)
        return [*ks, k], [*vs, v]

    def _kept(self, x: Tensor, dim: int) -> list[Tensor]:
        if not self.split:
            return [x.narrow(dim, 0, self.commit).contiguous()]
        # clones: a segment dropped later frees its own bytes, not a view's share of the call's tensor
        return [t.clone() for t in x.narrow(dim, 0, self.commit).split(self.split, dim)]

    def drop(self, first: int, n: int) -> None:
        """Forget segments ``first .. first + n - 1`` of every attention layer (new lists: a fork shares the old)."""
        self.keys = [seg[:first] + seg[first + n :] for seg in self.keys]
        self.values = [seg[:first] + seg[first + n :] for seg in self.values]

    def extend(self, k: Tensor, v: Tensor, dim: int) -> tuple[Tensor, Tensor]:
        """:meth:`segments` as one tensor each (for small layers: the CosyVoice2 encoder's)."""
        ks, vs = self.segments(k, v, dim)
        return torch.cat(ks, dim=dim), torch.cat(vs, dim=dim)

    def fork(self) -> StepCache:
        return StepCache(list(self.tails), list(self.keys), list(self.values), self.start, 0)

    def tensors(self) -> list[Tensor]:
        return [*self.tails, *(t for seg in self.keys for t in seg), *(t for seg in self.values for t in seg)]


class StepRows:
    """Several streams' :class:`StepCache` of one Euler step, for one estimator call over all their rows: the
    CFM's layout, every stream's conditioned row first (stream order), then every unconditioned row, so stream
    ``j``'s two rows are ``x[j::B]``. Each stream has its own start (``start``: per row, the rotary positions), its
    convolutions' tails and its attention over its own kept frames; the calls must add the same frames.
    """

    def __init__(self, caches: list[StepCache]) -> None:
        self.caches = caches
        starts = [c.start for c in caches]
        self.start = torch.tensor(starts + starts)  # (2B,) each row's first frame
        # what every attention layer of the step shares: the left pads and the mask (see attend)
        self._pads: dict[tuple[int, int, int], Tensor] = {}
        self._seen: tuple[tuple[int, int, bool], Tensor] | None = None

    def left(self, x: Tensor, n: int) -> Tensor:
        """:meth:`StepCache.left` of every stream's rows of ``x`` (2B, C, T)."""
        b = len(self.caches)
        rows = x.shape[0] // b
        tails = torch.stack([c.tail(x, rows, n) for c in self.caches], dim=1).flatten(0, 1)  # (2B, C, n)
        padded = torch.cat([tails.to(x.dtype), x], dim=2)
        for j, c in enumerate(self.caches):
            c.keep_tail(padded[j::b], n)
        return padded

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """:meth:`StepCache.attend` of every stream's rows (q, k, v: (2B, H, n, D)) as one attention: each row's
        kept keys and values right-aligned before the call's own, the rows that keep fewer frames padded on the
        left with zeros and masked there (``mask``: the estimators' chunk mask of n frames, or None)."""
        b = len(self.caches)
        kept = [c.segments(k[j::b], v[j::b], dim=2) for j, c in enumerate(self.caches)]
        lengths = [sum(s.shape[2] for s in ks[:-1]) for ks, _ in kept]
        longest = max(lengths)
        if longest == 0:  # no stream keeps a frame yet
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        # per stream (2, H, longest + n, D), stacked to the rows' order (2, B, ...) -> (2B, H, longest + n, D)
        keys = torch.stack(
            [self._row(ks, longest - m) for (ks, _), m in zip(kept, lengths, strict=True)], dim=1
        )
        values = torch.stack(
            [self._row(vs, longest - m) for (_, vs), m in zip(kept, lengths, strict=True)], dim=1
        )
        seen = self._mask(lengths, k.shape[2], mask, q.device)
        return F.scaled_dot_product_attention(q, keys.flatten(0, 1), values.flatten(0, 1), attn_mask=seen)

    def _row(self, segments: list[Tensor], pad: int) -> Tensor:
        # one stream's kept segments and the call's own after `pad` zero frames
        if not pad:
            return torch.cat(segments, dim=2)
        last = segments[-1]
        key = (pad, last.shape[1], last.shape[3])
        zeros = self._pads.get(key)
        if zeros is None:
            zeros = self._pads[key] = last.new_zeros(last.shape[0], last.shape[1], pad, last.shape[3])
        return torch.cat([zeros, *segments], dim=2)

    def _mask(self, lengths: list[int], n: int, mask: Tensor | None, device: torch.device) -> Tensor:
        # (2B, 1, n, longest + n), True = attend: each row's kept frames and, by `mask`, the call's own; the same
        # for every attention layer of the step (their kept frames and chunk masks are)
        longest = max(lengths)
        key = (n, longest, mask is None)
        if self._seen is None or self._seen[0] != key:
            b = len(lengths)
            seen = torch.zeros(2 * b, 1, n, longest + n, dtype=torch.bool, device=device)
            seen[..., longest:] = True if mask is None else mask
            for j, length in enumerate(lengths):
                seen[j::b, :, :, longest - length : longest] = True
            self._seen = (key, seen)
        return self._seen[1]


# what an estimator's call takes: one stream's step, or several streams' rows
StepState = StepCache | StepRows


@dataclass
class FlowStream:
    """A stream's flow state: ``frames`` mel frames are final (a multiple of :attr:`granularity`), their mel in
    ``mel`` (1, 80, frames), and per Euler step a :class:`StepCache`; ``encoder`` holds the caches of a flow
    encoder that has attention of its own (CosyVoice2's: token rate, then mel rate).

    ``context`` bounds the generated frames the estimator attends to (0: every frame, the reference's result; see
    the module docstring) and ``prompt`` is the frames never dropped (the prompt's, set by the flow's calls).

    A state is only ever continued with the same prompt, speaker embedding and steps.
    """

    granularity: int
    n_timesteps: int
    steps: list[StepCache]
    encoder: list[StepCache] = field(default_factory=list)
    frames: int = 0
    mel: Tensor | None = None
    context: int = 0
    prompt: int = 0

    @classmethod
    def empty(cls, granularity: int, n_timesteps: int, encoder_caches: int = 0) -> FlowStream:
        return cls(
            granularity,
            n_timesteps,
            [StepCache() for _ in range(n_timesteps)],
            [StepCache() for _ in range(encoder_caches)],
        )

    def fork(self) -> FlowStream:
        """A state that continues from this one without changing it (a registered voice's, for a request)."""
        return FlowStream(
            self.granularity,
            self.n_timesteps,
            [s.fork() for s in self.steps],
            [s.fork() for s in self.encoder],
            self.frames,
            self.mel,
            self.context,
            self.prompt,
        )

    def kept_until(self, frames: int) -> int:
        """The frames final after a call that computes up to ``frames``: whole attention chunks only."""
        return frames // self.granularity * self.granularity

    @property
    def split(self) -> int:
        """Frames per kept segment: one attention chunk when bounded (the unit :meth:`trim` drops), else a call's."""
        return self.granularity if self.context else 0

    def trim(self) -> None:
        """A bounded stream's kept generated frames cut to the most recent ``context`` or more (whole segments,
        the oldest first; :func:`~cosyserve.models.flow_window.dropped`, the lite stream's rule too)."""
        if not self.context or not self.steps or not self.steps[0].keys:
            return
        spans = [t.shape[2] for t in self.steps[0].keys[0]]  # frames of each kept segment (every layer alike)
        first, n = dropped(spans, self.prompt, self.context)
        if n:
            for cache in self.steps:
                cache.drop(first, n)

    def tensors(self) -> list[Tensor]:
        out = [t for s in (*self.steps, *self.encoder) for t in s.tensors()]
        return out if self.mel is None else [*out, self.mel]

    def to_arrays(self) -> tuple[dict[str, Tensor], dict[str, str]]:
        """The kept state as named tensors (each layer's segments as one) and string metadata: what a stored voice
        state holds (:mod:`cosyserve.voices.voicestates`); :meth:`from_arrays` reads it back."""
        tensors: dict[str, Tensor] = {"mel": self.mel.contiguous()} if self.mel is not None else {}
        for prefix, caches in (("s", self.steps), ("e", self.encoder)):
            for i, cache in enumerate(caches):
                for j, tail in enumerate(cache.tails):
                    tensors[f"{prefix}{i}.t{j}"] = tail.contiguous()
                for j, (ks, vs) in enumerate(zip(cache.keys, cache.values, strict=True)):
                    dim = (
                        2 if prefix == "s" else 1
                    )  # (B, H, T, D) in the estimator, (B, T, H, D) in the encoder
                    tensors[f"{prefix}{i}.k{j}"] = torch.cat(ks, dim=dim)
                    tensors[f"{prefix}{i}.v{j}"] = torch.cat(vs, dim=dim)
        meta = {"frames": str(self.frames), "granularity": str(self.granularity)}
        return tensors, {**meta, "n_timesteps": str(self.n_timesteps), "encoder": str(len(self.encoder))}

    @classmethod
    def from_arrays(cls, tensors: dict[str, Tensor], meta: dict[str, str]) -> FlowStream:
        """The state :meth:`to_arrays` gave."""
        state = cls.empty(int(meta["granularity"]), int(meta["n_timesteps"]), int(meta["encoder"]))
        state.frames = int(meta["frames"])
        state.mel = tensors.get("mel")
        for prefix, caches in (("s", state.steps), ("e", state.encoder)):
            for i, cache in enumerate(caches):
                j = 0
                while f"{prefix}{i}.t{j}" in tensors:
                    cache.tails.append(tensors[f"{prefix}{i}.t{j}"])
                    j += 1
                j = 0
                while f"{prefix}{i}.k{j}" in tensors:
                    cache.keys.append([tensors[f"{prefix}{i}.k{j}"]])
                    cache.values.append([tensors[f"{prefix}{i}.v{j}"]])
                    j += 1
        return state

    def nbytes(self) -> int:
        """Bytes held (shared segments of a fork counted in full)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


def attend(q: Tensor, keys: list[Tensor], values: list[Tensor], mask: Tensor | None) -> Tensor:
    """Scaled dot-product attention of ``q`` (B, H, n, D) over keys/values given as segments along dim 2, the
    last one the queries' own frames, which ``mask`` (n, n_last) bool (True = attend) restricts; the earlier
    segments are seen whole.

    The segments are concatenated for one fused attention: copying the keys and values (2 x T x D per head) moves
    less memory than the scores a segment-wise attention makes (n x T per head) once a call adds more than 2 x D
    frames, and the fused kernel is faster besides (measured at CosyVoice2's 8 x 64 heads, 200 new of 1500 frames:
    15 ms against 25 ms; equal at 50 new frames)."""
    return F.scaled_dot_product_attention(q, *joined(keys, values, mask))


def joined(
    keys: list[Tensor], values: list[Tensor], mask: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """:func:`attend`'s keys and values as one (B, H, T, D) each and its mask over all T (the earlier segments
    seen whole): what one attention call takes."""
    if len(keys) == 1:
        return keys[0], values[0], mask
    k, v = torch.cat(keys, dim=2), torch.cat(values, dim=2)
    if mask is not None:
        mask = torch.cat([mask.new_ones(mask.shape[0], k.shape[2] - mask.shape[1]), mask], dim=1)
    return k, v, mask
