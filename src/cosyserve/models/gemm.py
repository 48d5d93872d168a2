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

oneDNN's blocked layout is a third way, faster still for batches: on the same EPYC the 24 layers' linears took 56 ms
for 1 row, 64 for 2 and 8, 88 for 16 (against 61, 63, 165 and more in the better of the two layouts above) and a
64-row prefill 281 against 394. It needs a private copy of the LM's linear weights in that layout (1.4 GB for the
Qwen2 LMs) and ~1.7 s to make it; on a 2-core Xeon an earlier session measured oneDNN's blocked weights slower for
one row (0.73 against 0.63 ms per matrix). So ``auto`` makes the copy only where batches are served and memory
allows (:class:`AutoPack`): the first time a decode step serves :data:`PACK_AT` rows or more, a thread of its own
packs every decode linear of that LM (one thread, the steps go on meanwhile) if the memory the process may use has
twice the copy free; then every shape and row count is timed again with the packed layout as a third candidate,
kept where it is 10% faster than the better of the other two. A server that never sees concurrent requests never
pays the copy. ``packed`` makes the copy at load and multiplies every row count with it, prefills included.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

logger = logging.getLogger(__name__)

__all__ = [
    "GEMM_MODES",
    "PACK_AT",
    "ROWS",
    "SAMPLES",
    "AutoPack",
    "DecodeLinear",
    "decisions",
    "forget",
    "use_decode_linears",
]

GEMM_MODES = ("auto", "linear", "transposed", "packed")
# at most this many activation rows are decode rows (one per request of a batch); more are a prefill: F.linear
ROWS = 16
# timed calls of each layout before a shape and row count is decided
SAMPLES = 12
# W·xᵀ must take at most this fraction of F.linear's median to be kept, and packed of the better of those two
MARGIN = 0.9
# the row-count hint the blocked layout is made for (it serves every count; the figures above are with 8)
PACK_ROWS = 8
# auto: the first decode step of at least this many rows packs the LM's decode linears (AutoPack)
PACK_AT = 2
# auto: this many batched steps after the packing, copies that no decided shape and row count kept are dropped
JUDGE_AFTER = 32


class _Choice:
    __slots__ = ("calls", "order", "plain", "times", "way")

    def __init__(self, packed: bool) -> None:
        self.calls = 0
        # the order the layouts are timed in, repeated (ABBA: none always runs first)
        self.order = _ORDER_PACKED if packed else _ORDER
        self.times: dict[str, list[float]] = {way: [] for way in self.order}
        self.way: str | None = None  # the layout kept
        # the better of linear and transposed (what a module without a packed copy runs where packed is kept)
        self.plain: str | None = None


# (out_features, in_features, rows) -> what was timed and chosen, for the whole process: it is the CPU's and BLAS's
# answer, the same for every model with that shape
_choices: dict[tuple[int, int, int], _Choice] = {}
_lock = threading.Lock()
# the orders the layouts are timed in, repeated (ABBA: none always runs first)
_ORDER = ("linear", "transposed", "transposed", "linear")
_ORDER_PACKED = ("linear", "transposed", "packed", "packed", "transposed", "linear")


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


def _blocked(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def _record(key: tuple[int, int, int], choice: _Choice, way: str, seconds: float) -> None:
    with _lock:
        if choice.way is not None:
            return
        choice.times[way].append(seconds)
        if any(len(t) < SAMPLES for t in choice.times.values()):
            return
        med = {w: statistics.median(t) for w, t in choice.times.items()}
        choice.plain = "transposed" if med["transposed"] <= MARGIN * med["linear"] else "linear"
        packed = "packed" in med and med["packed"] <= MARGIN * med[choice.plain]
        choice.way = "packed" if packed else choice.plain
    logger.debug(
        "decode GEMM %dx%d, %d rows: %s (medians: %s)",
        key[0],
        key[1],
        key[2],
        choice.way,
        ", ".join(f"{w} {t * 1e3:.3f} ms" for w, t in med.items()),
    )


class DecodeLinear(nn.Linear):
    """An ``nn.Linear`` (the same parameters, keys and type) whose products of at most :data:`ROWS` float32 rows on
    CPU take the layout ``mode`` names: ``auto`` (timed, see the module docstring), ``linear`` or ``transposed``;
    ``packed`` multiplies every float32 CPU input with :attr:`packed` once :meth:`pack` has made it."""

    mode: str
    # the weight in oneDNN's blocked layout (made by pack() or AutoPack; not a state key)
    packed: Tensor | None
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

    def pack(self) -> None:
        """Make :attr:`packed` (a private copy the weight's size) from the float32 CPU weight."""
        if not can_pack():
            raise RuntimeError(
                "llm_gemm=packed needs torch built with oneDNN (mkldnn), which this torch is not"
            )
        self.packed = self.blocked()

    @torch.no_grad()
    def blocked(self) -> Tensor:
        """A copy of the float32 CPU weight in oneDNN's blocked layout (what :attr:`packed` holds)."""
        return torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().float(), PACK_ROWS)

    @property
    def packable(self) -> bool:
        w = self.weight
        return w.dtype == torch.float32 and w.device.type == "cpu"

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // self.in_features
        w, packed = self.weight, self.packed
        warm, self._warm = self._warm, True
        native = x.dtype == torch.float32 and w.dtype == torch.float32 and x.device.type == "cpu"
        if native and self.mode == "packed" and packed is not None:
            return _blocked(x, packed, self.bias)
        if self.mode in ("linear", "packed") or rows > ROWS or not native:
            return F.linear(x, w, self.bias)
        flat = x.reshape(rows, self.in_features)
        way, timed = self.mode, None
        if way == "auto":
            key = (self.out_features, self.in_features, rows)
            choice = _choices.get(key) or _choices.setdefault(key, _Choice(packed is not None))
            way = choice.way
            if way is None:
                way = choice.order[choice.calls % len(choice.order)]
                choice.calls += 1
                if warm:
                    timed = key, choice
            # another model's module of this shape has a copy, this one not: the better plain layout, untimed
            if way == "packed" and packed is None:
                way, timed = choice.plain or "linear", None
        start = time.perf_counter()
        if way == "packed":
            y = _blocked(flat, packed, self.bias)
        elif way == "linear":
            y = F.linear(flat, w, self.bias)
        else:
            y = _transposed(flat, w, self.bias)
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
            if mode == "packed" and new.packable:
                new.pack()
            n += 1
    return n


def can_pack() -> bool:
    """Whether this torch has oneDNN, whose blocked layout ``packed`` is."""
    return bool(torch.backends.mkldnn.is_available())


class AutoPack:
    """``auto``'s packed layout for one LM: its decode linears' blocked copies, made the first time a step serves
    :data:`PACK_AT` rows or more (:meth:`rows`, which the runtime's decode loop calls before each step), in a thread
    of its own, where the memory the process may use has twice the copies' size free; then every shape and row
    count is timed again with the packed layout among the candidates (see the module docstring).

    Args:
        linears: the LM's :class:`DecodeLinear` modules (mode ``auto``); those not float32 on CPU are left alone.
        name: the model, for the log.
        free: bytes the process may still take (default: :func:`cosyserve.system.pagecache.memory_free`).
    """

    def __init__(
        self, linears: list[DecodeLinear], name: str = "lm", free: Callable[[], int] | None = None
    ) -> None:
        self.linears = [m for m in linears if m.packable]
        self.bytes = sum(m.weight.numel() * m.weight.element_size() for m in self.linears)
        self.name = name
        from cosyserve.system.pagecache import memory_free

        self._free = free or memory_free
        self.state = "idle"  # idle -> packing -> packed (-> dropped) | refused | failed; close(): closed
        self.thread: threading.Thread | None = None
        self._closed = False
        self._steps = 0  # batched steps since the packing

    def rows(self, n: int) -> None:
        """A decode step is about to serve ``n`` rows: the first with :data:`PACK_AT` or more starts the packing;
        :data:`JUDGE_AFTER` such steps after it, copies that nothing decided kept are dropped."""
        if n < PACK_AT:
            return
        if self.state == "idle" and self.linears and can_pack():
            self.state = "packing"
            self.thread = threading.Thread(target=self._run, name=f"{self.name} gemm pack", daemon=True)
            self.thread.start()
        elif self.state == "packed":
            self._steps += 1
            if self._steps == JUDGE_AFTER:
                self._judge()

    def _judge(self) -> None:
        # the copies stay if any decided shape and row count of this LM kept them, or none is decided yet
        shapes = {(m.out_features, m.in_features) for m in self.linears}
        kept = [way for (o, i, rows), way in decisions().items() if (o, i) in shapes and rows >= PACK_AT]
        if not kept or "packed" in kept:
            return
        for m in self.linears:
            m.packed = None
        with _lock:  # shapes still being timed with the packed layout among theirs start again without it
            for key in [k for k, c in _choices.items() if c.way is None]:
                del _choices[key]
        self.state = "dropped"
        logger.info(
            "%s: the packed layout lost to the plain ones at every batched shape decided (%d): its %.2f GB of "
            "copies are dropped",
            self.name,
            len(kept),
            self.bytes / 1e9,
        )

    def _run(self) -> None:
        free = self._free()
        if free < 2 * self.bytes:
            self.state = "refused"
            logger.info(
                "%s: the LM's decode linears stay unpacked: their blocked copies need %.2f GB and the process may "
                "take %.2f GB more (twice the copies' size wanted)",
                self.name,
                self.bytes / 1e9,
                free / 1e9,
            )
            return
        torch.set_num_threads(1)  # this thread's own pool: the steps keep the cores
        start = time.perf_counter()
        try:
            copies = []
            for m in self.linears:
                if self._closed:
                    self.state = "closed"
                    return
                copies.append(m.blocked())
        except Exception:  # a torch without the op at run time: the two plain layouts serve
            self.state = "failed"
            logger.warning(
                "%s: packing the LM's decode linears failed; they stay unpacked", self.name, exc_info=True
            )
            return
        for m, c in zip(self.linears, copies, strict=True):
            m.packed = c
        forget()  # every shape and row count timed again, packed among the candidates
        self.state = "packed"
        logger.info(
            "%s: packed the LM's %d decode linears for batched steps (%.2f GB, %.1f s); their layouts are timed again",
            self.name,
            len(self.linears),
            self.bytes / 1e9,
            time.perf_counter() - start,
        )

    def join(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def close(self) -> None:
        """Stop a packing under way (its copies dropped) and let go of the made ones."""
        self._closed = True
        self.join()
        for m in self.linears:
            m.packed = None
        self.linears = []
        self.state = "closed"


def decisions() -> dict[tuple[int, int, int], str]:
    """(out_features, in_features, rows) -> the layout kept, for each shape and row count decided so far."""
    with _lock:
        return {k: c.way for k, c in _choices.items() if c.way is not None}


def forget() -> None:
    """Drop every timing and decision (tests)."""
    with _lock:
        _choices.clear()
