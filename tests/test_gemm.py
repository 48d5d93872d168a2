"""The LM decode step's two product layouts (cosyserve.models.gemm): the same products either way, the choice
between them made from timings as the module says, and the torch runtime's LM decoding through them."""

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cosyserve.core.errors import SettingsError
from cosyserve.models import gemm
from cosyserve.models.gemm import ROWS, SAMPLES, DecodeLinear, use_decode_linears


@pytest.fixture(autouse=True)
def _fresh_choices() -> Iterator[None]:
    gemm.forget()
    yield
    gemm.forget()


def _linear(n: int, k: int, bias: bool) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(k, n, bias=bias)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, ROWS, ROWS + 1, 40])
def test_both_layouts_give_torchs_linear(rows: int, bias: bool) -> None:
    # a wrong transpose, a dropped bias, a row of padding left in, or a (B, T, C) input flattened the wrong way
    # would all differ from F.linear by far more than float32 rounding
    lin = _linear(48, 32, bias)
    x = torch.randn(rows, 1, 32)
    want = F.linear(x, lin.weight, lin.bias)
    for mode in ("transposed", "linear", "auto", "packed"):
        mod = DecodeLinear(lin, mode)
        if mode == "packed":
            mod.pack()
        got = mod(x)
        assert got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # activations laid out column by column (a transposed view: the kernel must still get rows of x)
    xt = torch.randn(32, rows).t()
    torch.testing.assert_close(DecodeLinear(lin, "transposed")(xt), F.linear(xt, lin.weight, lin.bias))


def test_the_module_keeps_the_linears_parameters_and_keys() -> None:
    lin = _linear(8, 4, True)
    wrapped = DecodeLinear(lin, "transposed")
    assert isinstance(wrapped, nn.Linear)
    assert wrapped.weight is lin.weight and wrapped.bias is lin.bias
    assert list(wrapped.state_dict()) == list(lin.state_dict())
    # the runtime's way: the module itself becomes one (no new module, the same object wherever it is held)
    other = _linear(8, 4, False)
    keys = list(other.state_dict())
    same = DecodeLinear.wrap(other, "transposed")
    assert same is other and isinstance(other, DecodeLinear) and other.mode == "transposed"
    assert list(other.state_dict()) == keys and other.packed is None
    x = torch.randn(2, 4)
    torch.testing.assert_close(other(x), F.linear(x, other.weight))
    with pytest.raises(ValueError, match="decode GEMM mode must be one of"):
        DecodeLinear.wrap(other, "fastest")
    assert wrapped.packed is None and "packed" not in wrapped.state_dict()
    wrapped.pack()
    assert wrapped.packed is not None and list(wrapped.state_dict()) == list(lin.state_dict())
    with pytest.raises(ValueError, match="decode GEMM mode must be one of auto, linear, transposed, packed"):
        DecodeLinear(lin, "fast")


def _count_transposed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = gemm._transposed

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.size(0))
        return real(x, w, b)

    monkeypatch.setattr(gemm, "_transposed", spy)
    return calls


def test_only_few_float32_cpu_rows_take_the_transposed_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_transposed(monkeypatch)
    lin = DecodeLinear(_linear(16, 8, True), "transposed")
    lin(torch.randn(ROWS + 1, 8))  # a prefill
    lin.to(torch.bfloat16)(torch.randn(2, 8, dtype=torch.bfloat16))  # a half dtype: its own kernels
    assert calls == []
    lin.float()(torch.randn(3, 8))
    assert calls == [3]
    DecodeLinear(_linear(16, 8, True), "linear")(torch.randn(3, 8))
    assert calls == [3]


def _feed(
    choice_key: tuple[int, int, int], linear_s: float, transposed_s: float, packed_s: float | None = None
) -> str | None:
    choice = gemm._choices.setdefault(choice_key, gemm._Choice(packed_s is not None))
    for _ in range(SAMPLES):
        gemm._record(choice_key, choice, "linear", linear_s)
        gemm._record(choice_key, choice, "transposed", transposed_s)
        if packed_s is not None:
            assert choice.way is None  # not decided before every candidate has its samples
            gemm._record(choice_key, choice, "packed", packed_s)
    return choice.way


def test_the_faster_layout_is_kept_and_the_default_wins_within_the_margin() -> None:
    assert _feed((8, 8, 1), 1.0, 0.5) == "transposed"
    assert _feed((8, 8, 2), 1.0, 0.95) == "linear"  # within 10%: F.linear stays
    assert _feed((8, 8, 3), 0.5, 1.0) == "linear"
    assert gemm.decisions() == {(8, 8, 1): "transposed", (8, 8, 2): "linear", (8, 8, 3): "linear"}
    # one shape and row count: another shape or row count is timed on its own
    assert (8, 8, 4) not in gemm.decisions()


def test_the_packed_layout_is_kept_where_it_beats_the_better_plain_one_by_the_margin() -> None:
    """If this fails, auto keeps the packed copies where they save less than 10% (or loses them where they save
    more), or compares them against the slower plain layout."""
    assert _feed((8, 8, 1), 1.0, 0.5, 0.46) == "transposed"  # 8% under the better plain one: not enough
    assert gemm._choices[(8, 8, 1)].plain == "transposed"
    assert _feed((8, 8, 2), 1.0, 0.5, 0.4) == "packed"
    assert gemm._choices[(8, 8, 2)].plain == "transposed"  # what a module without a copy runs
    assert _feed((8, 8, 4), 0.5, 1.0, 0.6) == "linear"


def test_a_module_with_a_packed_copy_times_three_layouts_and_one_without_falls_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """If this fails, auto never times the packed layout of a module that has its copy, or a module of the same
    shape without one (another model's) fails or runs a layout not timed for it once packed is kept."""
    calls: list[str] = []
    blocked, transposed = gemm._blocked, gemm._transposed
    monkeypatch.setattr(gemm, "_blocked", lambda *a: calls.append("packed") or blocked(*a))
    monkeypatch.setattr(gemm, "_transposed", lambda *a: calls.append("transposed") or transposed(*a))
    lin = DecodeLinear(_linear(16, 8, True), "auto")
    lin.pack()
    x = torch.randn(2, 8)
    ref = F.linear(x, lin.weight, lin.bias)
    for _ in range(3 * SAMPLES + 1):
        torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-5)
    choice = gemm._choices[(16, 8, 2)]
    assert {w: len(t) for w, t in choice.times.items()} == {
        "linear": SAMPLES,
        "transposed": SAMPLES,
        "packed": SAMPLES,
    }
    assert calls.count("packed") == calls.count("transposed") == SAMPLES
    # the decision forced to packed: the module with a copy runs it, one without runs the better plain layout
    choice.way, choice.plain = "packed", "transposed"
    calls.clear()
    other = DecodeLinear(_linear(16, 8, True), "auto")
    torch.testing.assert_close(other(x), F.linear(x, other.weight, other.bias), rtol=1e-5, atol=1e-5)
    lin(x)
    assert calls == ["transposed", "packed"]


def _four_linears() -> list[DecodeLinear]:
    return [DecodeLinear(_linear(16, 8, i % 2 == 0), "auto") for i in range(4)]


def test_autopack_packs_on_the_first_batched_step_then_times_every_layout_again() -> None:
    """If this fails, auto packs for lone requests (memory for nothing), never packs for batches, or keeps
    decisions taken without the packed layout."""
    linears = _four_linears()
    pack = gemm.AutoPack(linears, free=lambda: 1 << 40)
    assert pack.bytes == 4 * 16 * 8 * 4
    _feed((16, 8, 1), 1.0, 0.5)
    pack.rows(1)  # a lone request's step
    assert pack.state == "idle" and pack.thread is None
    pack.rows(2)
    pack.join(30)
    assert pack.state == "packed" and all(m.packed is not None for m in linears)
    assert gemm.decisions() == {}  # timed again, the packed layout among the candidates
    pack.rows(3)  # once
    assert pack.state == "packed"
    x = torch.randn(2, 8)
    for m in linears:
        torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
    pack.close()
    assert all(m.packed is None for m in linears) and pack.linears == []


def test_autopack_drops_copies_that_no_decided_batched_shape_kept() -> None:
    """If this fails, auto keeps copies the size of the LM's linears on a CPU where the packed layout loses (or
    drops them where it won, or leaves a shape still being timed with a layout it can no longer run)."""
    linears = _four_linears()
    pack = gemm.AutoPack(linears, free=lambda: 1 << 40)
    pack.rows(2)
    pack.join(30)
    assert pack.state == "packed"
    _feed((16, 8, 2), 1.0, 0.5, 0.6)  # decided: transposed
    gemm._choices[(16, 8, 3)] = gemm._Choice(True)  # undecided, packed among its layouts
    for _ in range(gemm.JUDGE_AFTER - 1):
        pack.rows(2)
    assert pack.state == "packed"
    pack.rows(1)  # a lone step does not count
    pack.rows(4)
    assert pack.state == "dropped" and all(m.packed is None for m in linears)
    assert gemm.decisions() == {(16, 8, 2): "transposed"} and (16, 8, 3) not in gemm._choices
    # where a decided batched shape kept them, they stay
    gemm.forget()
    linears = _four_linears()
    pack = gemm.AutoPack(linears, free=lambda: 1 << 40)
    pack.rows(2)
    pack.join(30)
    _feed((16, 8, 2), 1.0, 0.5, 0.6)
    _feed((16, 8, 4), 1.0, 0.5, 0.3)
    for _ in range(gemm.JUDGE_AFTER + 5):
        pack.rows(8)
    assert pack.state == "packed" and all(m.packed is not None for m in linears)


def test_closing_during_the_packing_stops_it_and_keeps_no_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """If this fails, a model closed (evicted, reloaded) while its LM is being packed keeps packing in the
    background, or leaves copies on its modules."""
    import threading

    started, release = threading.Event(), threading.Event()
    real = DecodeLinear.blocked

    def slow(self: DecodeLinear) -> torch.Tensor:
        started.set()
        release.wait(10)
        return real(self)

    monkeypatch.setattr(DecodeLinear, "blocked", slow)
    linears = _four_linears()
    pack = gemm.AutoPack(linears, free=lambda: 1 << 40)
    pack.rows(2)
    assert started.wait(10) and pack.state == "packing"
    threading.Timer(0.2, release.set).start()
    pack.close()  # waits for the module being packed, then stops
    assert pack.state == "closed" and not pack.thread.is_alive()
    assert all(m.packed is None for m in linears)


def test_autopack_leaves_the_lm_unpacked_without_twice_the_copies_free(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """If this fails, auto makes the copies on a machine that cannot hold them twice over."""
    linears = _four_linears()
    pack = gemm.AutoPack(linears, name="m", free=lambda: 2 * 16 * 8 * 4 * 4 - 1)
    with caplog.at_level("INFO", logger="cosyserve.models.gemm"):
        pack.rows(8)
        pack.join(30)
    assert pack.state == "refused" and all(m.packed is None for m in linears)
    assert "m: the LM's decode linears stay unpacked" in caplog.text


def test_a_batched_torch_runtime_packs_its_lm_once_requests_share_a_step(cv2_model_dir: Path) -> None:
    """If this fails, the runtime's llm_gemm=auto never makes the packed copies its concurrent requests would
    decode with (or makes them for a lone request), or keeps them after close."""
    import threading

    import cosyserve

    m = cosyserve.load(cv2_model_dir, warmup=False, batch_size=2)
    pack = m.runtime.autopack
    assert pack is not None and pack.linears
    m.synthesize_all("Hello there.", m.speakers[0] if m.speakers else None, seed=1)
    assert pack.state == "idle"  # a lone request: one row per step
    rows: list[int] = []
    m.runtime.on_lm_step(rows.append)
    gate = threading.Barrier(2)

    def one(seed: int) -> None:
        gate.wait()
        m.synthesize_all("Hello there, how are you today?", m.speakers[0] if m.speakers else None, seed=seed)

    threads = [threading.Thread(target=one, args=(s,)) for s in (2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert max(rows) == 2
    pack.join(60)
    # packed, and on a tiny model's small matrices maybe already dropped again (the plain layouts won there)
    assert pack.state in ("packed", "dropped"), pack.state
    assert all((lin.packed is not None) == (pack.state == "packed") for lin in pack.linears)
    linears = list(pack.linears)
    m.close()
    assert all(lin.packed is None for lin in linears)
    # pinned layouts and lone-request models make none
    assert (
        cosyserve.load(cv2_model_dir, warmup=False, batch_size=2, llm_gemm="linear").runtime.autopack is None
    )
    assert cosyserve.load(cv2_model_dir, warmup=False, batch_size=1).runtime.autopack is None


def test_auto_times_both_layouts_then_keeps_one(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_transposed(monkeypatch)
    lin = DecodeLinear(_linear(16, 8, False), "auto")
    x = torch.randn(2, 8)
    lin(x)  # the module's first call: run, never timed (it may fault the weights in)
    assert gemm._choices[(16, 8, 2)].times == {"linear": [], "transposed": []}
    for _ in range(2 * SAMPLES):
        lin(x)
    choice = gemm._choices[(16, 8, 2)]
    assert [len(t) for t in choice.times.values()] == [SAMPLES, SAMPLES]
    assert choice.way in ("linear", "transposed")
    # the untimed first call ran F.linear, the timed ones each layout SAMPLES times; once decided, only the kept
    # layout runs
    assert len(calls) == SAMPLES
    for _ in range(10):
        lin(x)
    assert len(calls) == SAMPLES + (10 if choice.way == "transposed" else 0)


def test_the_torch_runtime_decodes_through_the_chosen_layout(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cosyserve

    monkeypatch.setenv("COSYSERVE_LLM_GEMM", "transposed")
    calls = _count_transposed(monkeypatch)
    m = cosyserve.load(tiny_model_dir, warmup=False)
    llm = m.runtime.pipeline.llm
    decode = {n for n, mod in llm.named_modules() if isinstance(mod, DecodeLinear)}
    # the speech LM's linears and its head; not the text encoder (run once per request) nor the position
    # projections (once per position)
    assert "llm_decoder" in decode and any(n.startswith("llm.") for n in decode)
    assert not any(n.startswith("text_encoder") or n.endswith("linear_pos") for n in decode)
    audio = m.synthesize_all("Hello there.", m.speakers[0], seed=3)
    assert audio.size and calls.count(1) > 10  # a lone request's decode steps: one row each
    # pinned to torch's linear (an option beats the environment), no product takes the other layout
    m2 = cosyserve.load(tiny_model_dir, warmup=False, llm_gemm="linear")
    n = len(calls)
    assert m2.synthesize_all("Hello there.", m2.speakers[0], seed=3).size
    assert len(calls) == n
    monkeypatch.setenv("COSYSERVE_LLM_GEMM", "fastest")
    with pytest.raises(SettingsError, match=r"COSYSERVE_LLM_GEMM='fastest': expected one of auto, linear"):
        cosyserve.load(tiny_model_dir)


def test_an_int8_lm_keeps_its_int8_linears(tiny_model_dir: Path) -> None:
    import cosyserve
    from cosyserve.models.precision import Int8Linear

    m = cosyserve.load(tiny_model_dir, warmup=False, llm_quantize="int8")
    llm = m.runtime.pipeline.llm
    assert isinstance(llm.llm_decoder, Int8Linear)
    assert not any(isinstance(mod, DecodeLinear) for mod in llm.modules())
    assert use_decode_linears(llm, "auto") == 0


def test_decode_gemm_bench_dry_run_prints_every_figure(tmp_path: Path, cv2_model_dir: Path) -> None:
    """If this fails, bench/decode_gemm.py (the figures behind models/gemm.py's choice) no longer runs end to end."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "figures.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root / "src")}
    cmd = [sys.executable, str(root / "bench" / "decode_gemm.py"), "--dry-run", "--model", str(cv2_model_dir)]
    r = subprocess.run(
        [*cmd, "--rows", "1,3", "--requests", "1", "--packed", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert set(figures["rows"]) == {"1", "3"}
    for row in figures["rows"].values():
        assert row["linear_ms"] > 0 and row["transposed_ms"] > 0 and row["packed_ms"] > 0
    assert "ratio" in r.stdout and figures["cpu"]
    assert figures["requests"]["auto"]["first"] > 0 and figures["requests"]["packed"]["rtf"] > 0


def test_packed_lm_multiplies_with_its_packed_copies(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cosyserve

    used: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise

    def spy(x: torch.Tensor, *rest: object) -> torch.Tensor:
        used.append(x.numel())
        return real(x, *rest)

    m = cosyserve.load(tiny_model_dir, warmup=False, llm_gemm="packed")
    assert "gemm_pack" in m.clock.durations
    decode = [mod for mod in m.runtime.pipeline.llm.modules() if isinstance(mod, DecodeLinear)]
    assert decode and all(mod.packed is not None for mod in decode)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    assert m.synthesize_all("Hello there.", m.speakers[0], seed=3).size
    assert len(used) > 10 * len(decode)  # the prefill and every decode step, each linear


def test_decode_gemm_bench_dry_run_on_the_lite_runtime(tmp_path: Path, cv3_lite_bundle: Path) -> None:
    """If this fails, bench/decode_gemm.py --runtime lite (the lite batch graph unpacked vs prepacked) no longer
    runs end to end."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "figures.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root / "src")}
    cmd = [sys.executable, str(root / "bench" / "decode_gemm.py"), "--dry-run", "--runtime", "lite"]
    r = subprocess.run(
        [*cmd, "--model", str(cv3_lite_bundle), "--rows", "1,2", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"1", "2"} and all(v["unpacked_ms"] > 0 and v["packed_ms"] > 0 for v in rows.values())


def test_a_pool_model_sets_its_own_decode_products(tmp_path: Path) -> None:
    """A model of the pool file sets llm_gemm in its `load` table, checked there like every load setting: else a
    packed (or pinned) model would need the whole server's setting, or a bad value would surface at its load."""
    from cosyserve.core.settings import Settings
    from cosyserve.engine.poolfile import load_pool_config
    from cosyserve.runtime import RuntimeOptions

    pool = tmp_path / "pool.toml"
    pool.write_text("[models.a]\npath='x'\nload={llm_gemm='fastest'}\n")
    with pytest.raises(SettingsError, match=r"\[models.a\] load.llm_gemm = 'fastest': expected one of auto"):
        load_pool_config(Settings.load(env={}, file=pool))
    pool.write_text("[models.a]\npath='x'\nload={llm_gemm='packed'}\n")
    options = load_pool_config(Settings.load(env={}, file=pool)).models["a"].load_options
    assert RuntimeOptions(**options).llm_gemm == "packed"
