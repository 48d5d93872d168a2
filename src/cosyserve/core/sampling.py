"""The one speech-token sampler of both runtimes, written once over an array namespace (numpy or torch).

Repetition-aware sampling, the reference's ``ras_sampling``: a nucleus draw (the ``top_k`` most likely ids, cut
where the probability mass before an id reaches ``top_p``); if the pick occurs in the row's last ``win_size``
tokens at least ``ceil(win_size * tau_r)`` times, a draw from the whole distribution without it.

Both draws race ``p / Exp(1)`` (``argmax`` of it draws id ``i`` with probability ``p_i / sum(p)``: no multinomial,
no host sync). The Exp(1) variates are not taken from a random generator but computed: a counter-based hash of
(the row's key, the row's token index, the draw, the vocabulary id) turned into a uniform and then ``-log(u)``. So a
row's tokens are a function of its key and its log-probabilities alone: the same whether it runs alone or in any
batch, with the ids read back at once or steps late, on numpy (the lite runtime) or torch (CPU or GPU). A row's key
comes from the request's seed and the number of its text piece (:func:`row_key`).

The hash keeps 32-bit values in int64 arrays and multiplies them by constants below 2**31 only, so no product
overflows: numpy and torch compute the same bits. Probabilities are float64 in both.

Nothing here imports torch or numpy at module level (``import cosyserve`` stays light, the lite runtime
torch-free): :func:`array_ops` picks the namespace of an array.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["ArrayOps", "PromptRuleError", "Sampler", "SamplingConfig", "StopRules", "array_ops", "row_key"]

_M = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_TWO32 = float(2**32)
_END = object()


@dataclass(frozen=True)
class SamplingConfig:
    """Repetition-aware sampling (reference ``ras_sampling``): nucleus (top_p, top_k); if the pick occurred in the
    last ``win_size`` generated tokens at least ``win_size * tau_r`` times, draw again from the full distribution
    without it."""

    TARGET: ClassVar[str] = "cosyvoice.utils.common.ras_sampling"

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 1:
            raise ValueError(f"sampling top_k={self.top_k} must be >= 1")
        if self.win_size < 0 or self.tau_r < 0:
            raise ValueError(f"sampling win_size={self.win_size} and tau_r={self.tau_r} must be >= 0")

    @property
    def repeats(self) -> int:
        """The count of the pick in the window that triggers the fallback draw (``>= win_size * tau_r`` for an
        integer count)."""
        return math.ceil(self.win_size * self.tau_r)


@dataclass(frozen=True)
class StopRules:
    """An LM's special ids, as the decode loop applies them.

    Attributes:
        vocab: the width of its log-probabilities.
        eos_token: every id from it up ends an utterance; before ``min_len`` this id alone is masked (the
            reference's rule: for CosyVoice3 it is ``sos``, and the real EOS stays drawable).
        eos: the real end of speech (what a streamed-text run's last phase may pick).
        fill: the token that asks for more text (streamed text, the reference's bistream); None: the LM takes no
            streamed text.
        mix_ratio: (text, speech) tokens interleaved while text arrives.
        sos, task_id: the special ids (as the LM's ``embed`` reads them) that open a streamed-text row's input and
            follow its text.
        marker: the text id every prompt must hold, after whose first occurrence a streamed-text row's prompt
            text splits (CosyVoice3's ``<|endofprompt|>``); None: no such rule.
    """

    vocab: int
    eos_token: int
    eos: int
    fill: int | None = None
    mix_ratio: tuple[int, int] = (5, 15)
    sos: int = 0
    task_id: int = 1
    marker: int | None = None

    def require_marker(self, ids: list[int]) -> None:
        """Raise :class:`PromptRuleError` when a one-shot prompt's prompt text + text ``ids`` lack the marker (the
        reference asserts it)."""
        if self.marker is not None and self.marker not in ids:
            raise PromptRuleError(
                "CosyVoice3 needs <|endofprompt|> in the prompt text or the text, e.g. a prompt text (or text) "
                "starting with 'You are a helpful assistant.<|endofprompt|>'"
            )

    def prompt_head(self, prompt_ids: list[int]) -> int:
        """How many prompt text ids start a streamed-text row's input with sos: up to the marker, which is then
        required (no marker rule: none)."""
        if self.marker is None:
            return 0
        if self.marker not in prompt_ids:
            raise PromptRuleError(
                "CosyVoice3 streaming text input needs <|endofprompt|> in the prompt text, e.g. "
                "'You are a helpful assistant.<|endofprompt|>' before the prompt's transcript"
            )
        return prompt_ids.index(self.marker) + 1


class PromptRuleError(ValueError):
    """A prompt lacks the marker its LM needs (CosyVoice3: ``<|endofprompt|>``)."""


def _mix(x: Any) -> Any:
    # a 32-bit avalanche (x in [0, 2**32) as int64 or a Python int); multipliers < 2**31, so no int64 overflow
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M
    return x ^ (x >> 16)


def row_key(seed: int, stream: int = 0) -> int:
    """The sampler key of a request's ``stream``-th LM run (its text piece) for ``seed`` (any int >= 0)."""
    h = _mix((seed & _M) ^ _GOLDEN)
    h = _mix(h ^ ((seed >> 32) & _M))
    h = _mix(h ^ ((seed >> 64) & _M))
    return int(_mix(h ^ (stream & _M)))


class ArrayOps:
    """The few array operations the sampler and the decode loop need, for numpy (``xp`` numpy) or torch (on
    ``device``). Ints are int64, floats float64 unless named."""

    def __init__(self, xp: Any, device: Any = None) -> None:
        self.xp = xp
        self.torch = xp.__name__ == "torch"
        self.device = device
        # a read is free where the ids live in host memory: the loop reads them at once there
        self.host = not self.torch or device is None or getattr(device, "type", "cpu") == "cpu"

    def no_grad(self) -> Any:
        """A context in which the arrays need no autograd (torch's inference mode)."""
        if self.torch:
            return self.xp.inference_mode()
        import contextlib

        return contextlib.nullcontext()

    def each_without_grad(self, steps: Iterator[Any]) -> Iterator[Any]:
        """The items of generator ``steps``, each step of it run in :meth:`no_grad` (as a generator decorated with
        torch's inference mode is): the consumer's code between steps runs outside it. Closing this closes
        ``steps``."""
        try:
            while True:
                with self.no_grad():
                    item = next(steps, _END)
                if item is _END:
                    return
                yield item
        finally:
            steps.close()  # type: ignore[attr-defined]

    def zeros(self, shape: tuple[int, ...], dtype: str) -> Any:
        """Zeros of ``dtype`` (a name both namespaces know: ``int32``, ``float32``) where the arrays live."""
        if self.torch:
            return self.xp.zeros(shape, dtype=getattr(self.xp, dtype), device=self.device)
        return self.xp.zeros(shape, dtype=dtype)

    def ints(self, values: Any) -> Any:
        """Host ints as an array where the rows live; to a device through pinned memory, without waiting for it
        (a plain copy from pageable memory would synchronise the stream)."""
        if not self.torch:
            return self.xp.asarray(values, dtype=self.xp.int64)
        host = self.xp.tensor(values, dtype=self.xp.int64)
        if self.host:
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def asarray(self, values: Any, dtype: str) -> Any:
        """Host values (nested lists of numbers) as an array of ``dtype`` (``int32``, ``float32`` ...) on the host
        (a request's inputs are made there: the pipeline moves them to the device once)."""
        if self.torch:
            return self.xp.tensor(values, dtype=getattr(self.xp, dtype))
        return self.xp.asarray(values, dtype=dtype)

    def from_host(self, a: Any) -> Any:
        """A numpy array as this namespace's array on the host, without a copy (torch shares its memory)."""
        return self.xp.from_numpy(a) if self.torch else a

    def to_host(self, x: Any) -> Any:
        """An array as a numpy array in host memory (one device-to-host copy for a device tensor)."""
        return x.detach().cpu().numpy() if self.torch else x

    def generator(self, seed: int) -> Any:
        """A random generator seeded with ``seed`` (torch's on the device, or numpy's): the flow's and vocoder's
        draws of a request."""
        if self.torch:
            g = self.xp.Generator(device=self.device if self.device is not None else "cpu")
            g.manual_seed(seed)
            return g
        import numpy

        return numpy.random.default_rng(seed)

    def full(self, shape: tuple[int, ...], value: int) -> Any:
        if self.torch:
            return self.xp.full(shape, value, dtype=self.xp.int64, device=self.device)
        return self.xp.full(shape, value, dtype=self.xp.int64)

    def arange(self, n: int) -> Any:
        return self.xp.arange(n, device=self.device) if self.torch else self.xp.arange(n, dtype=self.xp.int64)

    def f64(self, x: Any) -> Any:
        return x.double() if self.torch else x.astype(self.xp.float64)

    def sort_desc(self, x: Any) -> tuple[Any, Any]:
        # stable: equal values keep their id order in both namespaces
        if self.torch:
            return self.xp.sort(x, dim=-1, descending=True, stable=True)
        idx = self.xp.argsort(-x, axis=-1, kind="stable")
        return self.xp.take_along_axis(x, idx, -1), idx

    def take(self, x: Any, idx: Any) -> Any:
        return x.gather(-1, idx) if self.torch else self.xp.take_along_axis(x, idx, -1)

    def cumsum(self, x: Any) -> Any:
        return x.cumsum(-1) if self.torch else self.xp.cumsum(x, -1)

    def argmax(self, x: Any) -> Any:
        return x.argmax(-1) if self.torch else x.argmax(-1).astype(self.xp.int64)

    def amax(self, x: Any) -> Any:
        return x.amax(-1, keepdim=True) if self.torch else x.max(-1, keepdims=True)

    def total(self, x: Any) -> Any:
        return x.sum(-1, keepdim=True) if self.torch else x.sum(-1, keepdims=True)

    def count(self, x: Any) -> Any:
        return x.sum(-1) if self.torch else x.sum(-1).astype(self.xp.int64)

    def cat(self, xs: list[Any], dim: int = 0) -> Any:
        return self.xp.cat(xs, dim) if self.torch else self.xp.concatenate(xs, dim)

    def clone(self, x: Any) -> Any:
        return x.clone() if self.torch else x.copy()


def array_ops(x: Any) -> ArrayOps:
    """The :class:`ArrayOps` of array ``x`` (a numpy array or a torch tensor, on its device)."""
    if type(x).__module__.startswith("torch"):
        import torch

        return ArrayOps(torch, x.device)
    import numpy

    return ArrayOps(numpy)


class Sampler:
    """Repetition-aware sampling of a batch of rows, each its own key and token index (see the module docstring).

    Args:
        cfg: the sampling options.
        vocab: the width of the log-probabilities.
        ops: the namespace (and device) the rows live in.
    """

    def __init__(self, cfg: SamplingConfig, vocab: int, ops: ArrayOps) -> None:
        self.cfg = cfg
        self.ops = ops
        self.k = min(cfg.top_k, vocab)
        self._vocab_hash = _mix((ops.arange(vocab) * _GOLDEN + 0x6A09E667) & _M)  # (V,)

    def _exp(self, keys: Any, index: Any, draw: int, ids: Any) -> Any:
        # Exp(1) variates of the vocabulary ids ``ids`` ((B, N) or (1, N)) for each row's key and token index (B,)
        s = _mix(keys ^ _mix((index * 2 + draw) & _M))  # (B,)
        h = _mix(s[:, None] ^ self._vocab_hash[ids])  # (B, N)
        u = (self.ops.f64(h) + 0.5) / _TWO32  # in (0, 1)
        return -self.ops.xp.log(u)

    def _softmax(self, scores: Any) -> Any:
        xp = self.ops.xp
        e = xp.exp(scores - self.ops.amax(scores))
        return e / self.ops.total(e)

    def __call__(self, scores: Any, keys: Any, index: Any, history: Any) -> Any:
        """Draw one id per row.

        Args:
            scores: (B, V) log-probabilities, masked entries -inf (never drawn).
            keys: (B,) int64 row keys (:func:`row_key`).
            index: (B,) int64 each row's token index (its draws for this token).
            history: (B, W) int64 the row's last W tokens in any order, -1 for none (W = win_size, may be 0).
        Returns:
            (B,) int64 ids.
        """
        ops, xp, cfg = self.ops, self.ops.xp, self.cfg
        scores = ops.f64(scores)
        probs = self._softmax(scores)
        sorted_p, sorted_idx = ops.sort_desc(probs)
        head_p, head_idx = sorted_p[:, : self.k], sorted_idx[:, : self.k]
        # candidate i is kept while the mass before it is < top_p
        before = ops.cumsum(head_p) - head_p
        race = xp.where(before < cfg.top_p, head_p / self._exp(keys, index, 0, head_idx), -1.0)
        top = ops.take(head_idx, ops.argmax(race)[:, None])  # (B, 1)
        all_ids = ops.arange(scores.shape[1])[None]  # (1, V)
        fallback_p = self._softmax(xp.where(all_ids == top, -math.inf, scores))
        race = xp.where(fallback_p > 0, fallback_p / self._exp(keys, index, 1, all_ids), -1.0)
        fallback = ops.argmax(race)  # (B,)
        top = top[:, 0]
        repeats = ops.count(history == top[:, None])
        return xp.where(repeats >= cfg.repeats, fallback, top)
