"""The LM decode step's matrix products on CPU: ``x·Wᵀ`` (torch's ``F.linear``) or ``W·xᵀ``, whichever this CPU's
BLAS runs faster for so few rows, timed on the first decode steps.

A decode step multiplies one activation row per request by every weight of the LM: the step is bound by reading
the weights from memory, and how fast BLAS streams them depends on the layout it is asked for. Measured with torch
2.13's MKL on a 2-core AMD EPYC (Zen 4), the full-size Qwen2 LM's 24 layers of linears (1.4 GB, float32): a 1-row
step 92 ms as ``x·Wᵀ`` (MKL's gemv) against 52 ms as ``W·xᵀ`` with the row repeated to two columns; 2 rows 180
against 53, 4 rows 158 against 68, 8 rows 146 against 143; the whole decode step 100 ms against 62 (1 row) and
175 against 80 (4 rows). Cache-hot, the order reverses (a 1024x1024 product: gemv 75 us, ``W·xᵀ`` 159), so no
small probe tells which wins on the weights as they are read in a step, and it differs by CPU, BLAS and row count.

So it is timed where it runs (``auto``): for each weight shape and row count up to :data:`ROWS`, the first calls
(after each module's first, which may fault its pages in) alternate the two layouts, each timed; once each has
:data:`SAMPLES` times, the faster by median is kept for that shape and row count for the rest of the process
(``W·xᵀ`` must be 10% faster to displace ``F.linear``). A row count is decided within its first one or two steps,
the speech head (one call per step) within :data:`SAMPLES` steps. The two layouts round differently (float32, a few
ulps), so ``linear`` or ``transposed`` pins one where runs must repeat exactly.

``packed`` (opt-in) gives each linear a copy of its weight in oneDNN's blocked layout at load and multiplies every
row count with it, prefills included: on the same EPYC the 24 layers' linears took 56 ms for 1 row, 64 for 2 and 8,
88 for 16 (against 61, 63, 165 and more in the better of the two layouts above) and a 64-row prefill 281 against
394. It costs a private copy of the LM's linear weights (1.4 GB for the Qwen2 LMs; the mapped originals go unread)
and the packing at load (~1.7 s on 2 cores); on a 2-core Xeon an earlier session measured oneDNN's blocked weights
slower for one row (0.73 against 0.63 ms per matrix), so it is not chosen for you.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

logger = logging.getLogger(__name__)

__all__ = ["GEMM_MODES", "ROWS", "SAMPLES", "DecodeLinear", "decisions", "forget", "use_decode_linears"]

GEMM_MODES = ("auto", "linear", "transposed", "packed")
# at most this many activation rows are decode rows (one per request of a batch); more are a prefill: F.linear
ROWS = 16
# timed calls of each layout before a shape and row count is decided
SAMPLES = 12
# W·xᵀ must take at most this fraction of F.linear's median to be kept
MARGIN = 0.9
# the row-count hint the blocked layout is made for (it serves every count; the figures above are with 8)
PACK_ROWS = 8


class _Choice:
    __slots__ = ("calls", "times", "way")

    def __init__(self) -> None:
        self.calls = 0
        self.times: dict[str, list[float]] = {"linear": [], "transposed": []}
        self.way: str | None = None


# (out_features, in_features, rows) -> what was timed and chosen, for the whole process: it is the CPU's and BLAS's
# answer, the same for every model with that shape
_choices: dict[tuple[int, int, int], _Choice] = {}
_lock = threading.Lock()
# the order the two layouts are timed in, repeated (ABBA: neither always runs first)
_ORDER = ("linear", "transposed", "transposed", "linear")


def _transposed(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    # x: (M, K) -> (M, N) as (W·xᵀ)ᵀ; one row is repeated to two columns (BLAS's gemv path is the one avoided) and
    # the columns must be contiguous rows of x (a transposed x would be a different, slower kernel)
    m = x.size(0)
    cols = (x.expand(2, -1) if m == 1 else x).contiguous()  # (M', K)
    if bias is None:
        y = torch.mm(weight, cols.t())  # (N, M')
    else:
        y = torch.addmm(bias.unsqueeze(1), weight, cols.t())
    return y.t()[:m].contiguous()


def _record(key: tuple[int, int, int], choice: _Choice, way: str, seconds: float) -> None:
    with _lock:
        if choice.way is not None:
            return
        choice.times[way].append(seconds)
        lin, tra = choice.times["linear"], choice.times["transposed"]
        if len(lin) < SAMPLES or len(tra) < SAMPLES:
            return
        a, b = statistics.median(lin), statistics.median(tra)
        choice.way = "transposed" if b <= MARGIN * a else "linear"
    logger.debug(
        "decode GEMM %dx%d, %d rows: %s (median x·Wᵀ %.3f ms, W·xᵀ %.3f ms)",
        key[0],
        key[1],
        key[2],
        choice.way,
        a * 1e3,
        b * 1e3,
    )


class DecodeLinear(nn.Linear):
    """An ``nn.Linear`` (the same parameters, keys and type) whose products of at most :data:`ROWS` float32 rows on
    CPU take the layout ``mode`` names: ``auto`` (timed, see the module docstring), ``linear`` or ``transposed``;
    ``packed`` multiplies every float32 CPU input with :attr:`packed` once :meth:`pack` has made it."""

    mode: str
    packed: (
        Tensor | None
    )  # the weight in oneDNN's blocked layout (mode packed, made by pack(); not a state key)
    _warm: bool  # a first call may fault the weights in: never timed

    def __init__(self, linear: nn.Linear, mode: str = "auto") -> None:
        # a new module over ``linear``'s parameters (the runtime converts its own in place: :meth:`wrap`)
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._become(mode)

    @classmethod
    def wrap(cls, linear: nn.Linear, mode: str) -> DecodeLinear:
        """``linear`` itself made a :class:`DecodeLinear` with ``mode`` (its class changed in place: no new module,
        ~1 us instead of ~80 for a new one, 169 of them in a CosyVoice2 LM)."""
        if not isinstance(linear, DecodeLinear):
            linear.__class__ = cls
        assert isinstance(linear, DecodeLinear)
        linear._become(mode)
        return linear

    def _become(self, mode: str) -> None:
        if mode not in GEMM_MODES:
            raise ValueError(f"decode GEMM mode must be one of {', '.join(GEMM_MODES)}, got {mode!r}")
        # plain attributes, set directly (nn.Module's setattr is slower); a packed copy is kept across mode changes
        self.__dict__.setdefault("packed", None)
        self.__dict__.setdefault("_warm", False)
        self.__dict__["mode"] = mode

    @torch.no_grad()
    def pack(self) -> None:
        """Make :attr:`packed` (a private copy the weight's size) from the float32 CPU weight."""
        if not torch.backends.mkldnn.is_available():
            raise RuntimeError(
                "llm_gemm=packed needs torch built with oneDNN (mkldnn), which this torch is not"
            )
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().float(), PACK_ROWS)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // self.in_features
        w = self.weight
        warm, self._warm = self._warm, True
        native = x.dtype == torch.float32 and w.dtype == torch.float32 and x.device.type == "cpu"
        if native and self.mode == "packed" and self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        if self.mode in ("linear", "packed") or rows > ROWS or not native:
            return F.linear(x, w, self.bias)
        flat = x.reshape(rows, self.in_features)
        way, timed = self.mode, None
        if way == "auto":
            key = (self.out_features, self.in_features, rows)
            choice = _choices.get(key) or _choices.setdefault(key, _Choice())
            way = choice.way
            if way is None:
                way = _ORDER[choice.calls % len(_ORDER)]
                choice.calls += 1
                if warm:
                    timed = key, choice
        start = time.perf_counter()
        y = F.linear(flat, w, self.bias) if way == "linear" else _transposed(flat, w, self.bias)
        if timed is not None:
            _record(*timed, way, time.perf_counter() - start)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode}"


def use_decode_linears(llm: nn.Module, mode: str) -> int:
    """Make each float linear of the LM ``llm`` that a decode step runs (those int8 quantization would replace:
    :func:`cosyserve.models.precision.quantized_linears`) a :class:`DecodeLinear` with ``mode``, in place, the
    parameters shared; ``packed``: each float32 one packed (see the module docstring). Returns how many."""
    from cosyserve.models.precision import quantized_linears

    n = 0
    modules = dict(llm.named_modules())
    for name in list(quantized_linears(llm)):
        lin = modules[name]
        if type(lin) is nn.Linear or isinstance(lin, DecodeLinear):
            new = DecodeLinear.wrap(lin, mode)
            if mode == "packed" and new.weight.dtype == torch.float32 and new.weight.device.type == "cpu":
                new.pack()
            n += 1
    return n


def decisions() -> dict[tuple[int, int, int], str]:
    """(out_features, in_features, rows) -> the layout kept, for each shape and row count decided so far."""
    with _lock:
        return {k: c.way for k, c in _choices.items() if c.way is not None}


def forget() -> None:
    """Drop every timing and decision (tests)."""
    with _lock:
        _choices.clear()
