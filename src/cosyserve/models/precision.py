"""A component's numeric precision: its float dtype (:func:`cast_floating`) and weight-only int8 linear layers.

Float dtype: a module computes in its weights' dtype. What must stay float32 whatever the component's dtype is
named by the module class's ``FLOAT32_PARTS`` (the vocoder's f0 predictor and source module: pitch and phase) and
by :func:`keeps_float32`; converter and load-time cast follow the same rule.

Which dtype a component computes in is chosen at load (:func:`choose_precision`): the one it is stored in, except
that a bfloat16 or float16 component computes in float32 where that is faster on this CPU (:func:`half_is_fast`):
always on a CPU without instructions for the dtype (AVX512-BF16 / AMX-BF16, AVX512-FP16 / AMX-FP16, read from its
flags), where oneDNN emulates it (measured on a 2-core AVX2 EPYC: a bfloat16 bundle's first audio 13.6 s against
4.2 s in float32, its flow 8x and its vocoder up to 50x slower; issue 34); on a CPU with them, as timed at load on
the component's kind of work (a matrix product, a 1-D convolution), since having them is not being faster: on a
2-core Xeon with AVX512-BF16 but no AMX the full-size CosyVoice2 vocoder ran 1.9x slower in bfloat16, its flow
1.1x. A dtype asked for (``--flow-dtype`` ...) wins.

Int8: weight-only, per-output-channel symmetric scales, for the bandwidth-bound LLM decode.

A decode step of the LLM reads every weight once for one row of activations: it is bound by memory bandwidth, and
int8 weights read a quarter of fp32's bytes. :class:`Int8Linear` keeps the int8 weight and its float32 scales as
tensors that a bundle stores as they are (mapped, no prepacking at load). Its kernel, measured on a 2-core AVX2 CPU
(``bench/fast_paths.py --kernels``): ``aten._weight_int8pack_mm`` with bfloat16 activations for a few rows (2-3x
fp32 at decode shapes), dequantize-then-linear for more (prefill: int8pack is slower than fp32 there). The fbgemm
dynamic path (``torch.ao`` ``quantize_dynamic``) is faster still but deprecated, quantizes the activations too
(twice the error) and prepacks every weight at load (~25 ms per 1024x4096 matrix).

Which linears: :data:`LLM_QUANTIZED` names them (gpt-fast ``WeightOnlyInt8QuantHandler`` rewrites the tree the same
way, before the state dict is loaded).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

logger = logging.getLogger(__name__)

__all__ = [
    "DECODE_ROWS",
    "Precision",
    "choose_precision",
    "cpu_flags",
    "cpu_native",
    "half_is_fast",
    "cast_floating",
    "keeps_float32",
    "Int8Linear",
    "LLM_QUANTIZED",
    "quantize_llm",
    "quantize_per_channel",
    "quantized_linears",
    "use_int8_linears",
]

QUANT_METHODS = ("none", "int8")
# at most this many activation rows take the int8pack kernel (decode, batched decode); more rows are a prefill
DECODE_ROWS = 16
# the LLM's linears that are quantized: the speech-token transformer's (not its position projection, run once per
# position and read by dtype) and the speech head; the text encoder runs once per request and stays as stored
LLM_QUANTIZED = ("llm.", "llm_decoder")
_SKIP = ("linear_pos",)
# CPU flags (as /proc/cpuinfo names them) under which oneDNN runs a half dtype's kernels natively
NATIVE_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``), or an empty set where they cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def cpu_native(dtype: str, flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU computes ``dtype`` (``float32``, ``bfloat16``, ``float16``) natively: from its flags, or
    where they cannot be read, oneDNN's own probe."""
    if dtype not in NATIVE_FLAGS:
        return True
    flags = cpu_flags() if flags is None else flags
    if flags:
        return any(f in flags for f in NATIVE_FLAGS[dtype])
    probe = getattr(
        torch.ops.mkldnn,
        "_is_mkldnn_bf16_supported" if dtype == "bfloat16" else "_is_mkldnn_fp16_supported",
        None,
    )
    return bool(probe()) if probe is not None else False


# the work whose speed decides a component's dtype: matrix products (the LM; the flow's attention and feed-forward
# layers) and 1-D convolutions (the flow's U-Net and position convolutions; the vocoder)
PROBES = {"llm": ("linear",), "flow": ("linear", "conv"), "hift": ("conv",)}


def _probe(op: str, dtype: torch.dtype) -> Callable[[], object]:
    # one op at a component's typical size, ready to time
    g = torch.Generator().manual_seed(0)
    if op == "linear":
        x, w = torch.randn(64, 1024, generator=g).to(dtype), torch.randn(1024, 1024, generator=g).to(dtype)
        return lambda: F.linear(x, w)
    x, w = torch.randn(1, 128, 1200, generator=g).to(dtype), torch.randn(128, 128, 7, generator=g).to(dtype)
    return lambda: F.conv1d(x, w, padding=3)


def _timed(runs: list[Callable[[], object]], rounds: int = 5) -> list[float]:
    # the best time of each of ``runs``, timed in turn round by round (a busy neighbour spreads over all), after an
    # untimed call each (kernel set-up)
    import time

    best = [float("inf")] * len(runs)
    for r in range(rounds + 1):
        for i, run in enumerate(runs):
            t = time.perf_counter()
            run()
            if r:
                best[i] = min(best[i], time.perf_counter() - t)
    return best


def half_is_fast(dtype: str, component: str) -> bool:
    """Whether ``component`` (``llm``, ``flow``, ``hift``) computes at least 5% faster in ``dtype`` than in float32
    on this CPU: never without the dtype's instructions (:func:`cpu_native`), else timed once per process on its
    kind of work (:data:`PROBES`, ~50 ms; float32, the exact one, wins a tie)."""
    if dtype not in NATIVE_FLAGS:
        return True
    return cpu_native(dtype) and all(_timed_faster(dtype, op) for op in PROBES[component])


@functools.cache
def _timed_faster(dtype: str, op: str) -> bool:
    full, half = _timed([_probe(op, torch.float32), _probe(op, getattr(torch, dtype))])
    return half <= 0.95 * full


@dataclass(frozen=True)
class Precision:
    """A component's compute dtype as chosen at load, the dtype it is stored in, and why."""

    dtype: str
    stored: str
    why: str

    def __str__(self) -> str:
        return self.dtype if self.why == "as stored" else f"{self.dtype} ({self.why})"


def choose_precision(
    stored: dict[str, str],
    requested: dict[str, str | None],
    device_type: str = "cpu",
    fast: Callable[[str, str], bool] | None = None,
) -> dict[str, Precision]:
    """Each component's compute dtype (see the module docstring).

    Args:
        stored: component -> the dtype its weights are stored in.
        requested: component -> the dtype asked for (settings, flags), or None to choose.
        device_type: where it computes (``cpu``: as :func:`half_is_fast` finds; else as stored).
        fast: ``(dtype, component) -> bool``, default :func:`half_is_fast` (tests pass a fake CPU).
    Returns:
        component -> :class:`Precision`.
    """
    fast = fast or half_is_fast
    out = {}
    for name, have in stored.items():
        want = requested.get(name)
        if want is not None:
            out[name] = Precision(want, have, "as stored" if want == have else f"asked for; stored {have}")
        elif device_type == "cpu" and have != "float32" and not fast(have, name):
            why = (
                f"this CPU has no native {have}" if not cpu_native(have) else "timed slower here than float32"
            )
            out[name] = Precision("float32", have, f"stored {have}: {why}")
        else:
            out[name] = Precision(have, have, "as stored")
    return out


def keeps_float32(module_cls: type, key: str) -> bool:
    """Whether state-dict entry ``key`` of a ``module_cls`` stays float32 in any component dtype: an int8
    linear's ``scales``, or a tensor under one of the class's ``FLOAT32_PARTS``."""
    parts: tuple[str, ...] = getattr(module_cls, "FLOAT32_PARTS", ())
    return key.endswith(".scales") or any(key.startswith(f"{p}.") for p in parts)


@torch.no_grad()
def cast_floating(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast ``module``'s floating parameters and persistent buffers to ``dtype`` in place, except those
    :func:`keeps_float32` names; int8 tensors are left as they are. A tensor that changes dtype becomes a private
    copy (a mapped bundle's pages for it are no longer read). Returns ``module``."""
    cls = type(module)
    for prefix, sub in module.named_modules():
        for kind in ("_parameters", "_buffers"):
            table = getattr(sub, kind)
            for name, t in table.items():
                key = f"{prefix}.{name}" if prefix else name
                skip = kind == "_buffers" and name in sub._non_persistent_buffers_set
                if t is None or skip or not t.is_floating_point() or t.dtype == dtype:
                    continue
                if keeps_float32(cls, key):
                    continue
                new = t.to(dtype)
                table[name] = nn.Parameter(new, requires_grad=False) if kind == "_parameters" else new
    return module


def quantize_per_channel(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per output channel: ``weight ~= q * scales[:, None]``.

    Args:
        weight: (N, K) floating weight.
    Returns:
        (q (N, K) int8 in [-127, 127], scales (N,) float32); an all-zero row gets scale 1.
    """
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


class Int8Linear(nn.Module):
    """``y = x @ (weight * scales[:, None]).T + bias`` with an int8 ``weight`` (N, K), float32 ``scales`` (N,).

    The output has the input's dtype. Keys: ``weight``, ``scales`` and, with a bias, ``bias`` (in the component's
    float dtype), so a quantized bundle keeps the float model's names.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: object = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer(
            "weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device)
        )
        self.register_buffer("scales", torch.empty(out_features, dtype=torch.float32, device=device))
        self.bias: Tensor | None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        # the int8pack kernel takes scales in the activations' dtype (bfloat16); derived once per load
        self._scales_bf16: Tensor | None
        self.register_buffer("_scales_bf16", None, persistent=False)
        self.register_load_state_dict_post_hook(_derive_scales)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """Quantize ``linear`` (a private int8 copy of its weight; its bias is shared)."""
        q = cls(linear.in_features, linear.out_features, bias=False, device=linear.weight.device)
        q.weight, q.scales = quantize_per_channel(linear.weight)
        q.bias = linear.bias
        q._scales_bf16 = q.scales.to(torch.bfloat16)
        return q

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // self.in_features
        if rows <= DECODE_ROWS and self._scales_bf16 is not None:
            flat = x.reshape(rows, self.in_features).to(torch.bfloat16)
            y = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self._scales_bf16)  # (rows, N)
            y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


# the int8pack kernel reads the weight with aligned vector loads once it multiplies 4 or more rows: a weight
# mapped from a bundle at an address that is not a multiple of this crashes the process (SIGSEGV, seen at 24 mod
# 64 on a full-size bundle); safetensors aligns tensors only to their element size, so where the file puts them
# decides
INT8_ALIGN = 64
_misaligned_warned = False


def _derive_scales(module: nn.Module, incompatible: object) -> None:
    assert isinstance(module, Int8Linear)
    if module.scales.is_meta:
        return
    module._scales_bf16 = module.scales.to(torch.bfloat16)
    if module.weight.data_ptr() % INT8_ALIGN:
        global _misaligned_warned
        if not _misaligned_warned:
            _misaligned_warned = True
            logger.warning(
                "this bundle's int8 weights are not %d-byte aligned in the file: they are copied into private "
                "memory (the int8 kernel needs aligned rows); they cost RSS instead of shared mapped pages",
                INT8_ALIGN,
            )
        module.weight = module.weight.clone()  # torch's allocator aligns to 64 bytes


def quantized_linears(module: nn.Module, prefixes: tuple[str, ...] = LLM_QUANTIZED) -> Iterator[str]:
    """Names of the ``nn.Linear`` submodules of ``module`` that weight-only int8 quantization replaces: those
    under one of ``prefixes`` (a name equal to it, or starting with it when it ends in '.')."""
    for name, child in module.named_modules():
        if not isinstance(child, nn.Linear) or name.rsplit(".", 1)[-1] in _SKIP:
            continue
        if any(name.startswith(p) if p.endswith(".") else name == p for p in prefixes):
            yield name


def _replace(module: nn.Module, name: str, new: nn.Module) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, attr, new)


def use_int8_linears(module: nn.Module, prefixes: tuple[str, ...] = LLM_QUANTIZED) -> nn.Module:
    """Rewrite ``module``'s tree before a quantized state dict is loaded: each linear of
    :func:`quantized_linears` becomes an empty :class:`Int8Linear` on the same device (meta under
    :func:`cosyserve.bundle.construct.empty_modules`). Returns ``module``."""
    for name in list(quantized_linears(module, prefixes)):
        lin = module.get_submodule(name)
        assert isinstance(lin, nn.Linear)
        new = Int8Linear(lin.in_features, lin.out_features, lin.bias is not None, device=lin.weight.device)
        _replace(module, name, new)
    return module


@torch.no_grad()
def quantize_llm(module: nn.Module, prefixes: tuple[str, ...] = LLM_QUANTIZED) -> nn.Module:
    """Quantize a loaded float module in place: each linear of :func:`quantized_linears` is replaced by
    :meth:`Int8Linear.from_linear` (private int8 copies: a quarter of the fp32 bytes). Returns ``module``."""
    for name in list(quantized_linears(module, prefixes)):
        lin = module.get_submodule(name)
        assert isinstance(lin, nn.Linear)
        _replace(module, name, Int8Linear.from_linear(lin))
    return module
