"""The device a model computes on: the ``device`` setting checked once at start, and a mapped model moved onto it.

The setting names ``cpu``, ``cuda`` or ``cuda:N`` (its spelling is checked where settings are read:
:class:`cosyserve.core.casts.Device`). :func:`check_device` runs once at start, before any model loads
(:func:`cosyserve.api.choose_runtime`): a CUDA device on a machine or a torch build without CUDA, or any device but
the CPU for the lite runtime, is one line naming the flag or variable that asked for it and what was found.
Nothing here initialises CUDA at import; torch is imported only when a device other than the CPU is asked for.

:func:`to_device` is what a loader calls once a module is built over the bundle's mapped weights: it copies them to
the device tensor by tensor through one pinned staging buffer pair (never a host copy of the whole model), with
non-blocking copies and one synchronisation at the end; on the CPU it leaves the mapped tensors where they are.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cosyserve.core.casts import Device
from cosyserve.core.errors import SettingsError

if TYPE_CHECKING:
    import torch
    from torch import nn

logger = logging.getLogger(__name__)

__all__ = [
    "MoveStats",
    "STAGING_BYTES",
    "check_device",
    "device_given",
    "resolve_device",
    "synchronize",
    "to_device",
]

# the pinned staging buffers' size (two of them): large enough that a copy's fixed cost is small against its
# bytes (~12 us per copy at ~20 GB/s is 0.1% of 256 MB), small enough to pin in a few milliseconds
STAGING_BYTES = 64 << 20

# what a CPU-only torch lacks, and how to add it (docs/deploy.md: GPU)
CUDA_TORCH_INSTALL = "pip install torch --index-url https://download.pytorch.org/whl/cu128"


def device_given(settings: Any) -> str:
    """The ``device`` setting as it was given, for messages: ``--device cuda``, ``COSYSERVE_DEVICE='cuda'``,
    ``pool.toml: [pool] device = 'cuda'``, ``cosyserve.load(device='cuda')``."""
    kind, label = settings.origins.get("device", ("default", ""))
    value = settings.device
    if kind == "flag":
        return f"{label} {value}"
    if kind == "env":
        return f"{label}={value!r}"
    if kind == "file":
        return f"{label} = {value!r}"
    if kind == "override":
        return f"{label}(device={value!r})"
    return f"device {value!r}"


def check_device(name: str, runtime: str, where: str | None = None) -> None:
    """Check, once at start, that ``runtime`` can compute on device ``name`` here.

    Cheap: nothing is imported for ``cpu``; for CUDA it asks torch how many GPUs are visible, which reads NVML and
    does not initialise CUDA.

    Args:
        name: the device setting (``cpu``, ``cuda`` or ``cuda:N``).
        runtime: ``torch`` or ``lite``.
        where: how the setting was given, to start the message (:func:`device_given`; default ``device 'NAME'``).
    Raises:
        SettingsError: one line: the setting as given and what was found (no CUDA in this torch build, no GPU
            visible, no GPU of that index), or that the lite runtime computes on the CPU only.
    """
    name, where = _named(name, where)
    if name == "cpu":
        return
    if runtime == "lite":
        raise SettingsError(f"{where}: {_lite_problem()}")
    resolve_device(name, where)


def _named(name: str, where: str | None) -> tuple[str, str]:
    # (the name as the setting spells it, how messages start)
    where = where or f"device {name!r}"
    try:
        return Device()(name), where
    except ValueError as e:
        raise SettingsError(f"{where}: {e}") from None


def _lite_problem() -> str:
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        return (
            "the lite runtime computes on the CPU only: ONNX Runtime's CUDA provider is installed, but the lite "
            "runtime does not use it yet; use --runtime torch for a GPU, or --device cpu"
        )
    return (
        "the lite runtime computes on the CPU only (ONNX Runtime's CUDA provider, onnxruntime-gpu, is not "
        "installed either); use --runtime torch for a GPU, or --device cpu"
    )


def resolve_device(name: str, where: str | None = None) -> torch.device:
    """The torch device ``name`` names, checked against this machine.

    Args:
        name: ``cpu``, ``cuda`` (the first GPU: ``cuda:0``) or ``cuda:N``.
        where: how the setting was given, to start the message (default ``device 'NAME'``).
    Returns:
        ``torch.device("cpu")`` or ``torch.device("cuda", N)`` (always with its index, so that it compares equal
        to the device of the tensors on it).
    Raises:
        SettingsError: a name that is not a device, a torch build without CUDA, no GPU visible
            (``torch.cuda.device_count()`` 0), or an index past the GPUs visible; one line each.
    """
    import torch

    name, where = _named(name, where)
    if name == "cpu":
        return torch.device("cpu")
    index = int(name.partition(":")[2] or 0)
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        raise SettingsError(
            f"{where}: this torch ({torch.__version__}) is built without CUDA; install a CUDA build "
            f"({CUDA_TORCH_INSTALL}) or use device cpu"
        )
    # NVML first (torch falls back to the CUDA runtime where NVML fails): no CUDA context, milliseconds, and a
    # process that forks after the check leaves its children free to use CUDA
    count = torch.cuda.device_count()
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = "" if visible is None else f", CUDA_VISIBLE_DEVICES={visible!r}"
        raise SettingsError(
            f"{where}: torch {torch.__version__} finds no GPU (torch.cuda.device_count() is 0{hint}); check "
            "the driver (nvidia-smi) and the container's GPU access (docker --gpus, the nvidia.com/gpu resource), "
            "or use device cpu"
        )
    if index >= count:
        raise SettingsError(f"{where}: there is no GPU {index}: {count} visible (cuda:0 to cuda:{count - 1})")
    return torch.device("cuda", index)


def module_device(module: Any) -> torch.device:
    """Where ``module`` computes: its first parameter's device (the CPU for one without parameters)."""
    import torch

    params = getattr(module, "parameters", None)
    first = next(params(), None) if params is not None else None
    return first.device if first is not None else torch.device("cpu")


def factory_device(device: torch.device | str) -> Any:
    """A context in which tensors made without a device (a module's dummy warm-up inputs) are made on ``device``
    (``torch.device`` as a context); on the CPU, where they already are, an empty context (the device context
    routes every torch call through a Python mode, a cost for nothing there)."""
    import contextlib

    import torch

    device = torch.device(device)
    return contextlib.nullcontext() if device.type == "cpu" else device


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (a no-op on the CPU, whose work is done when it returns)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class MoveStats:
    """What :func:`to_device` moved: ``tensors`` distinct tensors (tied ones once), ``bytes`` on the device,
    ``copies`` host-to-device copies (a tensor larger than a staging buffer takes several), ``staging_bytes`` of
    host staging allocated in all, ``seconds`` including the final synchronisation."""

    tensors: int
    bytes: int
    copies: int
    staging_bytes: int
    seconds: float


def to_device(
    module: nn.Module,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    *,
    staging_bytes: int = STAGING_BYTES,
) -> nn.Module:
    """Move ``module``'s parameters and buffers onto ``device`` (in place, as ``module.to`` does), casting its
    floating-point ones to ``dtype`` if given, without a host copy of the whole model.

    Each tensor is read from where it lies (the bundle's mapped file) into one of two pinned staging buffers of
    ``staging_bytes`` (in pieces when it is larger), cast there if asked, and copied to the device without
    blocking; a buffer is refilled once its previous copy is done, so reading the file overlaps the transfers.
    Host memory in use is the two buffers, whatever the model's size. Tied tensors stay tied. One synchronisation
    at the end: the module is ready to use when this returns.

    On the CPU it is a no-op (the mapped tensors stay mapped) unless ``dtype`` asks for a cast (``module.to``).
    Tensors held as plain attributes (not parameters or buffers) are not moved, as ``module.to`` does not move them.

    Args:
        module: a module whose tensors are all materialised (none on the meta device).
        device: the target (see :func:`resolve_device`).
        dtype: cast floating-point parameters and buffers to it (None: keep each tensor's dtype).
        staging_bytes: the size of each of the two staging buffers.
    Returns:
        ``module``.
    Raises:
        ValueError: a tensor still on the meta device (the module was not loaded).
    """
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return module if dtype is None else module.to(dtype)
    stats = _move(module, device, dtype, staging_bytes)
    logger.info(
        "moved %d tensors (%.1f MB) to %s in %.0f ms (%.1f GB/s; %d copies through %.0f MB of pinned staging)",
        stats.tensors,
        stats.bytes / 1e6,
        device,
        stats.seconds * 1e3,
        stats.bytes / max(stats.seconds, 1e-9) / 1e9,
        stats.copies,
        stats.staging_bytes / 1e6,
    )
    return module


def _move(
    module: nn.Module, device: torch.device, dtype: torch.dtype | None, staging_bytes: int
) -> MoveStats:
    # The copy path of to_device, for any device: on the CPU (tests) the staging is not pinned and every copy is
    # synchronous, on CUDA the same code overlaps them.
    import torch
    from torch import nn

    t0 = time.perf_counter()
    slots = [
        (owner, kind, name, t)
        for owner in module.modules()
        for kind, table in (("param", owner._parameters), ("buffer", owner._buffers))
        for name, t in table.items()
        if t is not None
    ]
    for owner, _, name, t in slots:
        if t.is_meta:
            raise ValueError(f"{type(owner).__name__}.{name} is on the meta device: load the weights first")

    def target(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    largest = max((t.numel() * target(t).itemsize for *_, t in slots), default=0)
    stager = _Stager(device, min(staging_bytes, largest))
    moved: dict[int, torch.Tensor] = {}  # id(source) -> its copy: a tensor tied in two places is copied once
    params: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for owner, kind, name, t in slots:
            key = id(t)
            if key not in moved:
                moved[key] = stager.copy(t.detach(), target(t))
            if kind == "param":
                if key not in params:
                    params[key] = nn.Parameter(moved[key], requires_grad=t.requires_grad)
                owner._parameters[name] = params[key]
            else:
                owner._buffers[name] = moved[key]
        synchronize(device)
    return MoveStats(
        tensors=len(moved),
        bytes=sum(t.numel() * t.element_size() for t in moved.values()),
        copies=stager.copies,
        staging_bytes=stager.allocated,
        seconds=time.perf_counter() - t0,
    )


class _Stager:
    """Two host buffers that tensors pass through on their way to the device, used in turn: a buffer is refilled
    only once the copy out of it is done (its event), so the host reads one piece while the previous one moves."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device = device
        self.capacity = max(capacity, 1)
        self.pin = device.type == "cuda"
        self.buffers: list[torch.Tensor] = []
        self.events: list[Any] = [None, None]
        self.turn = 0
        self.copies = 0
        self.allocated = 0

    def _buffer(self) -> torch.Tensor:
        import torch

        i = self.turn
        self.turn = 1 - i
        if len(self.buffers) <= i:
            self.buffers.append(torch.empty(self.capacity, dtype=torch.uint8, pin_memory=self.pin))
            self.allocated += self.capacity
        elif self.events[i] is not None:
            self.events[i].synchronize()  # the copy out of this buffer is done: it may be refilled
        return self.buffers[i]

    def _sent(self) -> None:
        import torch

        self.copies += 1
        if self.pin:
            event = torch.cuda.Event()
            event.record()
            self.events[1 - self.turn] = event

    def copy(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        import torch

        out = torch.empty(src.shape, dtype=dtype, device=self.device)
        n = src.numel()
        if n == 0:
            return out
        # a non-contiguous source (rare: the bundle's tensors are contiguous) costs one host copy of that tensor
        flat = src.reshape(-1) if src.is_contiguous() else src.contiguous().reshape(-1)
        dst = out.view(-1)
        per = max(1, self.capacity // dtype.itemsize)  # elements per piece
        for a in range(0, n, per):
            b = min(n, a + per)
            stage = self._buffer()[: (b - a) * dtype.itemsize].view(dtype)
            stage.copy_(flat[a:b])  # reads the mapped pages; casts if dtype differs
            dst[a:b].copy_(stage, non_blocking=True)
            self._sent()
        return out
