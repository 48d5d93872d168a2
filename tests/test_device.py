"""The device setting and the device helpers, on the CPU (no GPU here or in CI): the setting's spelling and where
it is read from, the start check's one-line errors (CUDA made absent or present by patching torch), moving a mapped
module through the staging buffers (the CUDA path's code, run with the CPU as its target). The decode loop's device
behaviour (ids read back late, no host read per step) is tested in tests/test_decode.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from cosyserve.api import choose_runtime, load
from cosyserve.core.errors import SettingsError
from cosyserve.core.settings import Settings
from cosyserve.runtime import RuntimeOptions
from cosyserve.system.device import _move, check_device, resolve_device, synchronize, to_device

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    # tiny ops with 2 OpenMP threads on a 2-vCPU machine run many times slower than with 1; only speed changes
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# -- the setting ---------------------------------------------------------------------------------------------------


def test_device_setting_is_read_from_flag_variable_and_pool_file(tmp_path: Path) -> None:
    """If this fails, a spelling users write (CUDA, cuda:1) is refused or kept unnormalised, a bad one is not named
    with where it came from, or the setting does not reach the runtime's options."""
    assert Settings.load(env={}).device == "cpu"
    assert Settings.load(env={"COSYSERVE_DEVICE": " CUDA "}).device == "cuda"
    assert Settings.load(flags={"device": "cuda:01"}, env={"COSYSERVE_DEVICE": "cpu"}).device == "cuda:1"
    pool = tmp_path / "pool.toml"
    pool.write_text('[pool]\ndevice = "cuda:2"\n')
    s = Settings.load(env={}, file=pool)
    assert s.device == "cuda:2" and s.where("device").endswith("[pool] device")
    assert RuntimeOptions.from_settings(s).device == "cuda:2"
    for flags, env, where in (
        ({"device": "gpu"}, {}, "--device gpu"),
        ({}, {"COSYSERVE_DEVICE": "cuda:-1"}, "COSYSERVE_DEVICE='cuda:-1'"),
        ({}, {"COSYSERVE_DEVICE": "mps"}, "COSYSERVE_DEVICE='mps'"),
    ):
        with pytest.raises(SettingsError) as e:
            Settings.load(flags=flags, env=env)
        assert str(e.value).startswith(f"{where}: expected cpu, cuda or cuda:N"), e.value
    for bad in ("gpu", "CUDA", "cuda:01", 0, None):
        with pytest.raises(ValueError, match="device must be cpu, cuda or cuda:N"):
            RuntimeOptions(device=bad)  # type: ignore[arg-type]


def test_importing_the_settings_and_checking_cpu_never_imports_torch() -> None:
    """If this fails, reading the settings or the start check of the default device imports torch (seconds of start
    for the lite runtime, and an ImportError where torch is not installed)."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from cosyserve.core.settings import Settings\n"
        "from cosyserve.system.device import check_device\n"
        "check_device(Settings.load(env={}).device, 'torch'); check_device('cpu', 'lite')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(SRC)}
    )
    assert r.returncode == 0, r.stderr


# -- the start check -----------------------------------------------------------------------------------------------


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, *, built: bool, count: int = 0) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8" if built else None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    def no_init() -> bool:
        raise AssertionError(
            "the check initialised CUDA (cudaGetDeviceCount) instead of counting GPUs by NVML"
        )

    monkeypatch.setattr(torch.cuda, "is_available", no_init)


def test_cuda_on_a_machine_without_one_is_one_line_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """If this fails, `--device cuda` where torch cannot use a GPU gets past the start (to fail later, deep in a
    load), or its message does not say which flag or variable asked and what is missing."""
    flag = Settings.load(flags={"device": "cuda"}, env={})
    _fake_cuda(monkeypatch, built=False)
    with pytest.raises(SettingsError) as e:
        choose_runtime("demo", flag, "torch")
    message = str(e.value)
    assert message.startswith("--device cuda: this torch (") and "built without CUDA" in message
    assert "\n" not in message

    _fake_cuda(monkeypatch, built=True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    env = Settings.load(env={"COSYSERVE_DEVICE": "cuda:1"})
    with pytest.raises(
        SettingsError, match=r"^COSYSERVE_DEVICE='cuda:1': torch .* finds no GPU .*VISIBLE_DEVICES=''"
    ):
        choose_runtime("demo", env, "torch")

    _fake_cuda(monkeypatch, built=True, count=2)
    with pytest.raises(
        SettingsError, match=r"^device 'cuda:2': there is no GPU 2: 2 visible \(cuda:0 to cuda:1\)$"
    ):
        resolve_device("cuda:2")
    assert resolve_device("cuda") == torch.device("cuda", 0)  # indexed: equal to its tensors' device
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")
    choose_runtime("demo", env, "torch")  # a visible GPU 1: the start goes on


def test_cosyserve_load_checks_device_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """If this fails, cosyserve.load(device=...) starts loading a model on a device that does not exist, or its
    error does not name the argument."""
    import cosyserve.runtime

    def no_load(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model was loaded before the device was checked")

    monkeypatch.setattr(cosyserve.runtime, "load_runtime", no_load)
    _fake_cuda(monkeypatch, built=True)
    with pytest.raises(SettingsError, match=r"^cosyserve\.load\(device='cuda'\): torch .* finds no GPU"):
        load("demo", device="cuda", runtime="torch")
    with pytest.raises(
        SettingsError, match=r"^cosyserve\.load\(device='gpu'\): expected cpu, cuda or cuda:N"
    ):
        load("demo", device="gpu", runtime="torch")


def test_the_lite_runtime_refuses_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """If this fails, the lite runtime accepts `--device cuda` and silently computes on the CPU, or does not say
    whether ONNX Runtime's CUDA provider is there."""
    import onnxruntime

    s = Settings.load(flags={"device": "cuda"}, env={})
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(
        SettingsError, match=r"^--device cuda: the lite runtime computes on the CPU only .*not "
    ):
        choose_runtime("demo", s, "lite")
    monkeypatch.setattr(
        onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    with pytest.raises(
        SettingsError, match=r"CUDA provider is installed, but the lite runtime does not use it yet"
    ):
        check_device("cuda:0", "lite")
    check_device("cpu", "lite")


def test_cli_device_flag_without_cuda_is_one_line(tmp_path: Path) -> None:
    """If this fails, `cosyserve synth --device cuda` on a machine without CUDA does not stop in one line naming
    the flag (a traceback, or a load that starts anyway)."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "x.wav"
    r = subprocess.run(
        [sys.executable, "-m", "cosyserve", "synth", "--model", "demo", "--device", "cuda", "--text", "hi",
         "--out", str(out)],
        capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cosyserve synth: error: --device cuda: "), r.stderr
    assert not out.exists()


def test_synchronize_waits_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """If this fails, synchronize() does not wait for a CUDA device's queued work (timings and the end of a move
    would not be real), or touches CUDA for the CPU."""
    calls: list[Any] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    synchronize("cpu")
    assert calls == []
    synchronize(torch.device("cuda", 1))
    assert calls == [torch.device("cuda", 1)]


# -- moving a module -----------------------------------------------------------------------------------------------


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(300, 8)
        self.proj = nn.Linear(8, 300)
        self.proj.weight = self.embed.weight  # tied, as some heads are
        self.register_buffer("steps", torch.arange(5, dtype=torch.int64))
        self.register_buffer("window", torch.hann_window(7), persistent=False)
        self.norm = nn.LayerNorm(8)


def _mapped(tmp_path: Path) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    # a module built on the meta device and given views of a mapped safetensors file, as the bundle loader does
    from safetensors.torch import save_file

    from cosyserve.bundle.mmap_safetensors import MappedFile

    torch.manual_seed(0)
    sd = {k: v for k, v in _Tied().state_dict().items() if k != "proj.weight"}  # a tied tensor is stored once
    save_file(sd, str(tmp_path / "m.safetensors"))
    with torch.device("meta"):
        module = _Tied()
    mapped = MappedFile(tmp_path / "m.safetensors").state_dict()
    module.load_state_dict(mapped | {"proj.weight": mapped["embed.weight"]}, assign=True)
    module.proj.weight = module.embed.weight
    module.window = torch.hann_window(7)  # a derived buffer: computed, not stored
    return module, {k: v.clone() for k, v in sd.items()} | {"window": module.window.clone()}


def test_to_device_leaves_a_cpu_module_where_it_is(tmp_path: Path) -> None:
    """If this fails, "moving" to the CPU copies the mapped weights into private memory (the page-cache sharing
    between processes, and the start time, would be lost)."""
    module, _ = _mapped(tmp_path)
    before = {k: v.data_ptr() for k, v in module.state_dict().items()}
    assert to_device(module, "cpu") is module
    assert {k: v.data_ptr() for k, v in module.state_dict().items()} == before
    to_device(module, "cpu", torch.float16)
    assert module.embed.weight.dtype == torch.float16 and module.steps.dtype == torch.int64


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_staged_move_copies_every_tensor_in_pieces_through_two_buffers(tmp_path: Path, dtype: Any) -> None:
    """The CUDA path's copy code with the CPU as its target. If this fails, a tensor is lost, garbled at a piece
    boundary, cast when it is not floating-point, left sharing the source's memory, copied twice when tied, or the
    host staging grows with the model instead of staying two buffers."""
    module, want = _mapped(tmp_path)
    sources = {id(t) for t in [*module.parameters(), *module.buffers()]}
    stats = _move(module, torch.device("cpu"), dtype, staging_bytes=1000)  # embed.weight (9600 B) in pieces
    assert module.proj.weight is module.embed.weight
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        assert id(t) not in sources, f"{name} was not copied"
        expect = want[name]
        if dtype is not None and expect.is_floating_point():
            expect = expect.to(dtype)
        assert t.dtype == expect.dtype and torch.equal(t, expect), name
    assert isinstance(module.embed.weight, nn.Parameter) and not isinstance(module.steps, nn.Parameter)
    size = {
        k: v.numel() * (dtype.itemsize if dtype and v.is_floating_point() else v.element_size())
        for k, v in want.items()
    }
    per = 1000 // (dtype or torch.float32).itemsize * (dtype or torch.float32).itemsize  # bytes per piece
    # embed (tied with proj), proj.bias, norm weight and bias, steps, window; embed and proj.bias in pieces
    assert stats.tensors == len(want) == 6
    assert stats.copies == sum(-(-n // per) for n in size.values()) > len(want)
    assert stats.bytes == sum(size.values())
    assert stats.staging_bytes == 2000


def test_moving_a_module_that_was_never_loaded_is_refused() -> None:
    """If this fails, a module built on the meta device (weights never assigned) is "moved" and computes on
    uninitialised memory."""
    with torch.device("meta"):
        module = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"Linear\.weight is on the meta device"):
        _move(module, torch.device("cpu"), None, 1 << 20)


@pytest.mark.parametrize(("env", "expect"), [("3", 3), ("", None), ("0", None), ("two", None)])
def test_threads_follow_omp_num_threads_else_the_affinity(
    env: str, expect: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If this failed, the lite runtime (ONNX Runtime reads no OMP_NUM_THREADS) would compute with another
    thread count than torch under the same environment: one spinning thread per host core in a container given
    two, or on a CI worker told OMP_NUM_THREADS=1."""
    from cosyserve.system.cpus import default_threads, usable_cpus

    monkeypatch.setenv("OMP_NUM_THREADS", env)
    assert default_threads() == (expect if expect is not None else usable_cpus())
