"""The lite runtime's Qwen LM (CosyVoice2 and CosyVoice3): its step graph exported and checked against the torch
module, driven by the one decode loop on numpy.

If these fail: the lite LM's tokens are not the torch runtime's for a seed (one-shot or streamed text), the export
check lets a wrong graph through, the int8 graph's distance is not recorded, a stop does not reach a running
ONNX Runtime step, the shared token2wav needs torch to run the lite graphs, or the lite runtime serves these
families otherwise than the torch runtime (the same pipeline, tokens and, for CosyVoice3, audio), or lets a request
that needs new prompt audio analysed crash instead of refusing it.
"""

from __future__ import annotations

import copy
import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cosyserve.core.errors import ConvertError
from cosyserve.core.stop import Stopped

ENDOFPROMPT = 151646


@pytest.fixture(scope="module")
def qwen_bundles(cv2_lite_bundle: Path, cv3_lite_bundle: Path) -> dict:
    """family -> a bundle of the tiny model converted with --runtime lite (CosyVoice3's with the int8 LM too)."""
    return {"cosyvoice2": cv2_lite_bundle, "cosyvoice3": cv3_lite_bundle}


def _lms(bundle: Path, int8: bool = False) -> tuple[Any, Any]:
    """(torch LM, lite LM) over the same bundle."""
    from cosyserve.bundle.loader import LoadOptions, open_bundle
    from cosyserve.runtime.lite.lm import lite_lm
    from cosyserve.runtime.lite.models import LiteBundle

    torch_lm = open_bundle(bundle).load(LoadOptions(strategy="lazy", verify="none")).modules["llm"]
    lb = LiteBundle(bundle, verify="full", threads=1, int8=int8)
    return torch_lm, lite_lm(lb, lb.tables())


def _inputs(text: list[int], prompt_text: list[int], prompt_speech: list[int]) -> dict[str, dict]:
    t = {
        "text": torch.tensor([text], dtype=torch.int32),
        "prompt_text": torch.tensor([prompt_text], dtype=torch.int32),
        "llm_prompt_speech_token": torch.tensor([prompt_speech], dtype=torch.int32),
    }
    return {"torch": t, "lite": {k: v.numpy() for k, v in t.items()}}


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_lite_and_torch_give_equal_tokens_for_a_seed(qwen_bundles: dict, family: str) -> None:
    """One sampler and one decode loop over two LMs whose log-probabilities differ by float rounding: the same
    seed gives the same speech tokens, one-shot and with the text streamed in one id at a time (fills forced and
    sampled, the prompt speech interleaved 5:15). A difference means the lite LM's prompt, embeddings, positions,
    caches or stop rules are not the torch LM's."""
    from cosyserve.core.sampling import row_key
    from cosyserve.runtime.lm import Streamed, one_shot
    from cosyserve.runtime.oneoff import generate

    torch_lm, lite_lm = _lms(qwen_bundles[family])
    assert lite_lm.rules == torch_lm.rules and lite_lm.sampling == torch_lm.sampling
    marker = [ENDOFPROMPT] if family == "cosyvoice3" else []
    inputs = _inputs(marker + [5, 6, 7, 8, 9, 10], [11, 12], [3, 4, 5, 6])
    lengths = []
    for seed in (1, 2):
        runs = [list(generate(lm, one_shot(lm, inputs[name]), row_key(seed))) for name, lm in
                (("torch", torch_lm), ("lite", lite_lm))]  # fmt: skip
        assert runs[1] == runs[0], seed
        lengths.append(len(runs[0]))

    def spec() -> Streamed:
        text = ([t] for t in [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15])
        return Streamed(text, marker + [11, 12], list(range(30, 50)), max_len=120)

    runs = [list(generate(lm, spec(), row_key(3))) for lm in (torch_lm, lite_lm)]
    assert runs[1] == runs[0]
    lengths.append(len(runs[0]))
    assert min(lengths) >= 3 and max(lengths) >= 20, lengths  # the runs decoded something to compare
    # a kept prompt prefix (sos, the prompt text: runtime.lm.Prefix) on the lite LM's caches: the same tokens
    from cosyserve.runtime.decode import DecodeLoop
    from cosyserve.voices.voicestates import VoiceStates

    want = list(generate(torch_lm, one_shot(torch_lm, inputs["torch"]), row_key(2)))
    store, loop = VoiceStates(1 << 30), DecodeLoop(lite_lm, 1, threaded=False)
    for _ in range(2):  # the first keeps the prefix, the second starts from it
        assert list(loop.generate(one_shot(lite_lm, inputs["lite"], prefixes=store), row_key(2))) == want
    assert loop.stats.prefix_positions == 1 + 2, "the second run did not start from the kept prefix"


def test_cosyvoice3_prompt_rule_holds_on_lite(qwen_bundles: dict) -> None:
    """CosyVoice3's <|endofprompt|> rule is the lite LM's too (from the manifest's stop rules): a prompt without
    it is refused with the torch LM's error, and a streamed-text prompt splits after it."""
    from cosyserve.core.sampling import PromptRuleError

    _, lite_lm = _lms(qwen_bundles["cosyvoice3"])
    with pytest.raises(PromptRuleError, match="endofprompt"):
        lite_lm.prompt(_inputs([5, 6, 7], [11], [])["lite"])
    assert lite_lm.rules.prompt_head([9, ENDOFPROMPT, 11]) == 2
    _, cv2_lm = _lms(qwen_bundles["cosyvoice2"])
    assert cv2_lm.rules.marker is None and cv2_lm.rules.prompt_head([9, 11]) == 0


def test_manifest_records_the_check_and_the_int8_delta(qwen_bundles: dict) -> None:
    """The LM's graph is listed with its measured distance from the torch module; the int8 graph's quality delta
    (max |dlogp|, KL, top-1 agreement on the check inputs) is recorded at conversion, and llm_quantize=int8
    serves that graph: close to the float one, not equal to it."""
    from cosyserve.runtime.lm import one_shot
    from cosyserve.runtime.oneoff import teacher_forced

    bundle = qwen_bundles["cosyvoice3"]
    m = json.loads((bundle / "lite" / "manifest.json").read_text())
    assert m["parts"] == ["llm", "flow", "hift"] and "llm_step" in m["graphs"]
    assert 0 <= m["checked"]["llm_step"] < 1e-5
    assert set(m["int8"]) == {"max_abs_logp", "mean_kl", "top1_agree"} and m["int8"]["top1_agree"] > 0.5
    assert m["config"]["llm"]["rules"]["marker"] == ENDOFPROMPT
    for name in ("llm_step.onnx", "llm_step.onnx.data", "llm_step.int8.onnx.data", "tables.safetensors"):
        assert m["files"][name]["bytes"] == (bundle / "lite" / name).stat().st_size
    inputs = _inputs([ENDOFPROMPT, 5, 6, 7, 8], [], [])["lite"]
    (_, f32), (_, q8) = _lms(bundle), _lms(bundle, int8=True)
    teach = [1, 2, 3, 4]
    a = teacher_forced(f32, one_shot(f32, inputs), teach).logprobs
    b = teacher_forced(q8, one_shot(q8, inputs), teach).logprobs
    assert not np.array_equal(a, b)  # another graph ran ...
    np.testing.assert_allclose(a, b, atol=0.5)  # ... computing nearly the same thing


def _spy_lm_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    import threading

    from cosyserve.runtime.lite.lm import StepLM

    calls: list[tuple[str, str]] = []
    for name in ("_run_step", "_run_batch"):
        real = getattr(StepLM, name)

        def spy(*a, _r=real, _n=name, **k):  # type: ignore[no-untyped-def]
            calls.append((_n, threading.current_thread().name))
            return _r(*a, **k)

        monkeypatch.setattr(StepLM, name, spy)
    return calls


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_ready_maps_the_lm_step_weights_in_without_a_call(
    qwen_bundles: dict, quantize: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before READY the LM step graph's weights, which ONNX Runtime maps, are mapped in (MADV_POPULATE_READ) and
    the graph is not run. If this fails, a first request faults them in itself (~90 ms at full size fp32), or
    READY waits for a call that saves it nothing more (~70 ms: ORT's first call of a shape costs no more than a
    later one)."""
    from cosyserve.runtime import RuntimeOptions, load_runtime
    from cosyserve.system import pagecache

    calls = _spy_lm_calls(monkeypatch)
    populated: list[tuple[str, int]] = []
    real = pagecache.populate_mapped

    def spy(path: Path) -> int:
        populated.append((Path(path).name, real(path)))
        return populated[-1][1]

    monkeypatch.setattr(pagecache, "populate_mapped", spy)
    options = RuntimeOptions(text_tier="lazy", llm_quantize=quantize)
    rt = load_runtime(qwen_bundles["cosyvoice3"], options, runtime="lite")
    try:
        data = rt.lite.weights_file("llm_step")
        assert [name for name, _ in populated] == [data.name], populated
        assert populated[0][1] > 0, "ONNX Runtime's mappings of the weights were not found"
        rt.join_background()  # the int8 graph's prepacked form replaces the quick one (and its mappings) here
        assert calls == [], calls
        if quantize == "none":  # the float step graph keeps its mapped weights: every page of them mapped in
            mapped = sum(b - a for a, b in pagecache.mapped_ranges(data))
            assert pagecache.rss_of_files([data]) == mapped == populated[0][1]
    finally:
        rt.close()


def test_ready_runs_one_lm_call_where_the_kernel_cannot_map_the_weights_in(
    qwen_bundles: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where MADV_POPULATE_READ is refused (Linux before 5.14) the weights are faulted in by one call of the
    graph before READY (a one-position prefill and sampling, no decode step). If this fails, such a machine's
    first request pays the faults, or its start fails."""
    from cosyserve.runtime import RuntimeOptions, load_runtime
    from cosyserve.system import pagecache

    def refused(path: object) -> int:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(pagecache, "populate_mapped", refused)
    calls = _spy_lm_calls(monkeypatch)
    rt = load_runtime(qwen_bundles["cosyvoice3"], RuntimeOptions(text_tier="lazy"), runtime="lite")
    try:
        assert calls == [("_run_step", "MainThread")], calls
    finally:
        rt.close()


def test_int8_step_graph_opens_quick_before_ready_and_prepacked_after(qwen_bundles: dict) -> None:
    """READY waits for the int8 step graph's quick form (no prepacking: 0.05 s instead of 0.36 at full size); the
    after-READY thread swaps its prepacked form in between requests, after what a first request needs (the text
    tier). If this failed, READY would wait for the prepacking again, a first request would stall behind it (its
    open holds the GIL), or the int8 steps would stay 2.3x slower for the process's life."""
    import cosyserve

    model = cosyserve.load(qwen_bundles["cosyvoice3"], runtime="lite", llm_quantize="int8", threads=1)
    runtime = model.runtime
    assert runtime.quick == ["llm_step"]
    quick = runtime.lite.sessions["llm_step"]
    runtime.join_background()
    assert runtime.lite.sessions["llm_step"] is not quick, "the int8 step graph was never upgraded"
    starts = runtime.clock.starts
    assert runtime.clock.points["ready"] <= starts["text_tier"] <= starts["upgrades"], starts
    speakers = model.speakers
    assert len(model.synthesize_all("Hello there.", speaker=speakers[0], seed=1)) > 0


def test_flow_and_vocoder_sessions_open_quick_and_upgrade_between_requests(
    qwen_bundles: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ORT holds the GIL while a session opens, so the flow's and vocoder's serving forms (2.3 s for the full-size
    estimator) would stall every request that runs meanwhile: they open quick after READY and are replaced only
    when no request is in flight. If this failed, a first request arriving at READY would wait for the serving
    forms' opens (its first audio ~2 s later), or the quick forms (~1.4x slower runs) would serve for good."""
    import cosyserve
    from cosyserve.runtime import lite as lite_runtime
    from cosyserve.runtime.pipeline import Pipeline

    monkeypatch.setattr(lite_runtime, "UPGRADE_WAIT_S", 600.0)  # no forced upgrade while this test looks
    # the after-READY thread held before its upgrades until a request is in flight (else, with the text tier
    # cached by an earlier test in this process, it may reach them before the request starts)
    in_flight = threading.Event()
    after_ready = Pipeline.after_ready
    monkeypatch.setattr(
        Pipeline, "after_ready", lambda self: [*after_ready(self), ("held", lambda: in_flight.wait(60))]
    )
    model = cosyserve.load(qwen_bundles["cosyvoice3"], runtime="lite", threads=1)
    runtime = model.runtime
    names = [n for n in runtime.lite.graphs if not n.startswith("llm_")]
    for _ in range(600):  # the quick forms are open once the after-READY thread timed that step
        if "sessions_token2wav" in runtime.clock.durations:
            break
        threading.Event().wait(0.05)
    chunks = model.synthesize("Hello there.", speaker=model.speakers[0], seed=1, stream=True)
    next(chunks)  # a request in flight
    in_flight.set()
    quick = {n: runtime.lite.sessions[n] for n in names}
    runtime.join_background(0.5)
    assert runtime.background.is_alive(), "the after-READY thread ended with a request in flight"
    assert {n: runtime.lite.sessions[n] for n in names} == quick, "a session was replaced during a request"
    chunks.close()
    runtime.join_background(60)
    assert not runtime.background.is_alive()
    assert all(runtime.lite.sessions[n] is not quick[n] for n in names), "a quick session was never upgraded"
    assert runtime.in_flight.running == 0
    assert len(model.synthesize_all("Hello there.", speaker=model.speakers[0], seed=1)) > 0


def test_the_upgrades_wait_for_an_idle_moment_by_one_deadline_for_all_graphs(
    qwen_bundles: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The quick sessions' upgrades wait for no request in flight at most UPGRADE_WAIT_S in all, not per graph. If
    this fails, under steady traffic the last of the five flow and vocoder graphs was upgraded 5 x 20 s after the
    text tier (a long first request's successor ran on the quick forms too)."""
    import cosyserve
    from cosyserve.runtime import lite as lite_runtime
    from cosyserve.runtime.cores import Running

    waits: list[tuple[float, bool]] = []  # (timeout, whether no request was in flight by then)
    real = Running.wait_idle
    monkeypatch.setattr(Running, "wait_idle", lambda self, t: waits.append((t, r := real(self, t))) or r)
    monkeypatch.setattr(lite_runtime, "UPGRADE_WAIT_S", 0.5)
    model = cosyserve.load(qwen_bundles["cosyvoice3"], runtime="lite", threads=1)
    chunks = model.synthesize("Hello there.", speaker=model.speakers[0], seed=1, stream=True)
    next(chunks)  # a request in flight until every upgrade is done
    model.runtime.join_background(60)
    chunks.close()
    timed_out = [t for t, idle in waits if not idle]
    assert timed_out and sum(timed_out) <= 0.5 * 1.01, waits


def test_an_upgrade_opens_the_serving_form_once_the_quick_ones_run_in_flight_returns(
    qwen_bundles: dict,
) -> None:
    """A quick session's run in flight keeps its mapped weights resident; the serving form's open reads every
    weight to prepack it. If this fails, the two are held at once whenever a request is in flight at the upgrade
    (full-size CosyVoice3: a 4.9 GB peak instead of 3.5)."""
    from cosyserve.runtime.lite.models import LiteBundle

    lite = LiteBundle(qwen_bundles["cosyvoice3"], verify="none", threads=1)
    assert lite.open_quick("flow_estimator")
    order: list[str] = []
    release = threading.Event()

    class Blocking:  # the quick session, its one run held in flight until released
        def run(self, *args: Any) -> list[Any]:
            release.wait(60)
            order.append("run returned")
            return []

    lite.sessions["flow_estimator"].session = Blocking()
    real_open = lite._open
    lite._open = lambda name, quick: order.append("serving form opened") or real_open(name, quick)  # type: ignore[method-assign]
    quick = lite.session("flow_estimator")
    run = threading.Thread(target=quick.run, args=(None, {}))
    run.start()
    for _ in range(6000):  # the run in flight before the upgrade starts
        if quick.runs.running:
            break
        threading.Event().wait(0.01)
    upgrade = threading.Thread(target=lite.upgrade, args=("flow_estimator",))
    upgrade.start()
    upgrade.join(0.5)  # time to open the serving form, had it not waited
    release.set()
    run.join(60)
    upgrade.join(60)
    assert order == ["run returned", "serving form opened"], order
    assert not hasattr(lite.sessions["flow_estimator"], "runs"), "the serving form is not the quick one"


def test_the_export_check_refuses_a_graph_that_differs_from_the_module(qwen_bundles: dict) -> None:
    """The check runs the model's own cached attention on the graph's inputs: a graph exported from other weights
    (here the module with one weight changed after export) is refused, the unchanged module is accepted."""
    from cosyserve.bundle.lite import qwen_cache_names
    from cosyserve.bundle.lite.export import _check
    from cosyserve.bundle.lite.export_qwen import references

    bundle = qwen_bundles["cosyvoice2"]
    torch_lm, _ = _lms(bundle)
    torch_lm = torch_lm.float()
    a = torch_lm.stack.layers[0].self_attn
    names = qwen_cache_names(len(torch_lm.stack.layers), a.n_kv)
    inputs = ["x"] + [p for p, _ in names]
    c = torch_lm.cfg.llm_input_size
    cases = [(torch.randn(1, 3, c), *[torch.randn(7, a.head_dim) for _ in names])]
    graph = bundle / "lite" / "llm_step.onnx"
    assert _check("llm_step", graph, references(torch_lm)[0], cases, inputs, 1e-4) < 1e-4
    wrong = copy.deepcopy(torch_lm)
    with torch.no_grad():
        wrong.stack.layers[1].mlp.down_proj.weight.mul_(1.5)
    with pytest.raises(ConvertError, match="differs from the torch module"):
        _check("llm_step", graph, references(wrong)[0], cases, inputs, 1e-4)


def test_a_stop_ends_a_running_onnx_runtime_step(qwen_bundles: dict) -> None:
    """One ORT run of the step graph holds no Python code: the row's stop signal must reach it through ORT's
    terminate (the watcher thread asks it while the run goes on), not wait for the run's end. The prefill here
    runs for hundreds of milliseconds; the signal says stop only when the watcher asks."""
    _, lm = _lms(qwen_bundles["cosyvoice3"])
    n = 1000
    lm.reserve(1, n + 1)
    x = np.random.default_rng(0).standard_normal((1, n, lm.text_embedding.shape[1])).astype(np.float32)
    lm.extend(x[:, :8], 0, 0)  # the session is open: what follows is one run
    askers: list[str] = []

    def stop() -> bool:
        askers.append(threading.current_thread().name)
        return threading.current_thread().name == "cosyserve-ort-terminate"

    with pytest.raises(Stopped):
        lm.extend(x, 0, 0, stop)
    assert "cosyserve-ort-terminate" in askers, askers


def test_a_stopped_row_ends_and_its_neighbour_goes_on(qwen_bundles: dict) -> None:
    """Two rows share the decode loop's steps; one request stops mid-run: its consumer gets Stopped (the loop ends
    its row after the batch step it shares), the other row's tokens are the ones it gets alone."""
    from cosyserve.runtime.decode import DecodeLoop
    from cosyserve.runtime.lm import OneShot, one_shot
    from cosyserve.runtime.oneoff import generate

    _, lm = _lms(qwen_bundles["cosyvoice3"])
    inputs = _inputs([ENDOFPROMPT, 5, 6, 7, 8, 9], [], [])["lite"]
    row = one_shot(lm, inputs)
    row = OneShot(row.prompt, 60, 60)  # up to 60 tokens each (CosyVoice3's real EOS may come earlier)
    alone = list(generate(lm, row, 7))
    loop = DecodeLoop(lm, 2, name="test")
    try:
        stopped = threading.Event()
        got: dict[str, Any] = {}

        def first() -> None:
            tokens = []
            try:
                for t in loop.generate(row, 3, should_stop=stopped.is_set):
                    tokens.append(t)
                    if len(tokens) == 5:
                        stopped.set()
                got["first"] = tokens
            except Stopped:
                got["first"] = Stopped

        thread = threading.Thread(target=first)
        thread.start()
        got["second"] = list(loop.generate(row, 7, should_stop=lambda: False))
        thread.join(30)
    finally:
        loop.close()
    assert got["first"] is Stopped, got["first"]
    assert got["second"] == alone and len(alone) >= 10


def test_lite_rows_share_batch_steps_and_keep_their_tokens(qwen_bundles: dict) -> None:
    """Lite rows share decode steps through the batch graph (one run per step, each row at its own position, the
    cache rows of rows that do not step fed padding; its session opened by the first step of two rows): rows joining and leaving mid-run, and streamed-text rows
    beside a one-shot one (fills and rollbacks), get the tokens each gets alone (the step graph). If this failed,
    the batch graph's mask, positions or cache writes would change a row's speech with its neighbours; if no batch
    step ran, lite rows would still step one after another."""
    from cosyserve.core.sampling import row_key
    from cosyserve.runtime.decode import DecodeLoop
    from cosyserve.runtime.lm import OneShot, Streamed, one_shot
    from cosyserve.runtime.oneoff import generate
    from lm_util import batch_run_ends_when_every_row_stopped, join_and_leave, together

    _, lm = _lms(qwen_bundles["cosyvoice3"])  # CosyVoice2's graphs are the same code
    assert lm.batch_graph == "llm_batch"
    marker = [ENDOFPROMPT]
    specs = []
    for i, n in enumerate((20, 12, 25, 15)):  # prompts of different lengths: the rows' positions differ
        row = one_shot(
            lm, _inputs(marker + list(range(5, 7 + 2 * i)), [11, 12][: i % 3], [3, 4, 5][:i])["lite"]
        )
        specs.append(OneShot(row.prompt, n, n))
    join_and_leave(lm, specs, [row_key(40 + i) for i in range(4)])
    assert lm.batch_steps > 0, "no step ran the batch graph"

    def streamed(seed: int, speech: int) -> Streamed:
        text = ([t] for t in range(5 + seed, 17 + seed))
        return Streamed(text, marker + [11, 12], list(range(30, 30 + speech)), max_len=60)

    makers = [lambda: streamed(0, 0), lambda: streamed(1, 20), lambda: specs[2]]
    keys = [row_key(50 + i) for i in range(3)]
    want = [list(generate(lm, make(), k)) for make, k in zip(makers, keys, strict=True)]
    steps = lm.batch_steps
    loop = DecodeLoop(lm, 3, name="test")
    got = together(loop, [make() for make in makers], keys)
    loop.close()
    assert got == want and all(len(w) > 10 for w in want)
    assert lm.batch_steps > steps, "streamed-text rows never shared a batch step"
    batch_run_ends_when_every_row_stopped(lm)


def test_convert_lite_exports_every_part_of_both_families(qwen_bundles: dict) -> None:
    """`convert --runtime lite` writes CosyVoice2's and CosyVoice3's LM, flow and vocoder graphs, each checked
    against its torch module at conversion (the manifest records how far), the flow variants' weights stored once."""
    from cosyserve.bundle.lite.export import CHECK_ATOL

    for bundle in qwen_bundles.values():
        manifest = json.loads((bundle / "lite" / "manifest.json").read_text())
        assert manifest["parts"] == ["llm", "flow", "hift"]
        graphs = {"llm_step", "llm_batch", "flow_mu", "flow_mu_stream", "flow_estimator"}
        assert graphs | {"hift_f0", "hift_decode"} == set(manifest["checked"]), manifest["checked"]
        assert max(manifest["checked"].values()) <= CHECK_ATOL
        # the four flow graphs read one data file (what the streaming and whole variants share, stored once)
        assert "flow.onnx.data" in manifest["files"] and "flow_estimator.onnx.data" not in manifest["files"]
        # the LM's batch graph reads the step graph's weights from its data file (stored and mapped once)
        own = manifest["files"].get("llm_batch.onnx.data", {"bytes": 0})["bytes"]
        assert own < 0.05 * manifest["files"]["llm_step.onnx.data"]["bytes"], own


def test_the_flow_estimators_attention_is_one_fused_op_per_layer(qwen_bundles: dict) -> None:
    """Each estimator attention is ONNX Runtime's fused MultiHeadAttention: if not, the attention is traced op by
    op again (a Where over the mask and the NaN guard's IsNaN per layer), and the full-size CosyVoice3 estimator
    at zero-shot lengths is ~1.35x the torch flow's time instead of ~1.0x (bench/lite.py --zero-shot)."""
    import onnx

    for family, bundle in qwen_bundles.items():
        graph = onnx.load(str(bundle / "lite" / "flow_estimator.onnx"), load_external_data=False).graph
        ops = [n.op_type for n in graph.node]
        assert ops.count("MultiHeadAttention") >= 2 and "IsNaN" not in ops and "Softmax" not in ops, (
            family,
            ops,
        )


# -- served: the lite runtime over the shared pipeline, beside the torch runtime on the same bundle ------------------


@pytest.fixture(scope="module")
def served(qwen_bundles: dict, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(family, runtime) -> that runtime serving the family's tiny bundle; one registry folder for all, where a
    voice ``kept`` is registered (by the torch runtime, from a recording: the lite one analyses no CosyVoice2/3
    prompt audio yet)."""
    import soundfile as sf

    from cosyserve.runtime import RuntimeOptions, load_runtime

    tmp = tmp_path_factory.mktemp("served")
    wav = tmp / "prompt.wav"
    t = np.arange(24000) / 16000
    sf.write(
        wav, (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(np.float32), 16000
    )
    options = RuntimeOptions(warmup=False, threads=1, flow_steps=2, registry_dir=str(tmp / "voices"))
    out = {}
    for family, bundle in qwen_bundles.items():
        for name in ("torch", "lite"):
            out[family, name] = load_runtime(bundle, options, runtime=name)
        out[family, "torch"].add_voice("kept", wav, "A short prompt.")
    yield out
    for runtime in out.values():
        runtime.close()


def _speak(runtime: Any, **fields: Any) -> list[np.ndarray]:
    from cosyserve.core.request import SynthesisRequest

    fields = {"text": "Hi there.", "seed": 5, **fields}
    return list(runtime.start(SynthesisRequest(**fields), lambda: False))


SERVED_CASES = [
    {"speaker": "中文女"},
    {"speaker": "中文女", "stream": True},
    {"speaker": "kept"},  # zero_shot with a registered voice
    {"speaker": "kept", "mode": "instruct2", "instruct_text": "Speak slowly.", "stream": True},
]


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_lite_serves_what_the_torch_runtime_serves(served: Any, family: str) -> None:
    """The lite runtime serves CosyVoice2/3 through the shared pipeline, decode loop and family token2wav: for a
    seed, every mode without new prompt audio (sft, zero_shot and instruct2 with a registered voice, one-shot and
    streamed) gives chunks of the torch runtime's lengths (the same speech tokens and chunk schedule); CosyVoice3,
    which draws no noise (its fixed noise replayed in numpy), the same audio. A difference: the lite pipeline's
    inputs, tokens or noise are not the torch one's."""
    lite = type(served[family, "lite"].pipeline)
    assert lite.__module__ == "cosyserve.runtime.pipeline", lite  # the one pipeline, not a copy
    # CosyVoice2's audio differs by its vocoder's draws (numpy's): its tokens are checked in fewer cases
    for fields in SERVED_CASES if family == "cosyvoice3" else SERVED_CASES[1::2]:
        got, want = _speak(served[family, "lite"], **fields), _speak(served[family, "torch"], **fields)
        assert [len(c) for c in got] == [len(c) for c in want] and len(got) >= 1, fields
        if fields == {"speaker": "中文女", "stream": True}:
            assert len(got) >= 2, [len(c) for c in got]  # it streamed
        if family == "cosyvoice3":
            diff = max(float(np.abs(a - b).max()) for a, b in zip(got, want, strict=True))
            assert diff < 1e-3, (fields, diff)


def test_a_voice_registered_on_lite_has_its_flow_state_computed_once(
    served: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registering a voice on the lite runtime computes its flow state (in the background, as on torch: the shared
    pipeline's registration hook), and a streamed request of that voice forks it instead of computing its prompt's
    frames again. If this fails, lite requests of a registered voice pay for its sample at every first chunk."""
    import soundfile as sf

    from cosyserve.runtime.lite.chunkflow import LiteChunkFlow

    runtime = served["cosyvoice3", "lite"]
    pipeline = runtime.pipeline
    assert pipeline.token2wav.keeps_voices and pipeline.voice_states is not None
    prefills: list[int] = []
    prefill = LiteChunkFlow.prefill

    def counted(self: Any, stream: Any, prompt_token: Any, *args: Any) -> Any:
        prefills.append(prompt_token.shape[1])
        return prefill(self, stream, prompt_token, *args)

    monkeypatch.setattr(LiteChunkFlow, "prefill", counted)
    wav = tmp_path / "voice.wav"
    t = np.arange(32000) / 16000  # 2 s: its prompt's tokens fill a whole attention chunk of frames
    sf.write(
        wav, (0.3 * np.sin(2 * np.pi * 160 * t) * (1 + np.sin(2 * np.pi * 2 * t))).astype(np.float32), 16000
    )
    before = pipeline.voice_states.nbytes
    runtime.add_voice("lite-kept", wav, "A short prompt.")
    pipeline.voice_states.wait()
    assert len(prefills) == 1 and pipeline.voice_states.nbytes > before, "registration computed no flow state"
    chunks = _speak(runtime, speaker="lite-kept", stream=True)
    assert len(chunks) >= 1 and len(prefills) == 1, "the request computed its voice's prompt frames again"


def test_lite_streamed_text_runs_the_bistream_rows(served: Any) -> None:
    """Text given as pieces (the WebSocket's) feeds the lite LM as it arrives (CosyVoice3's bistream rules), the
    same tokens as the torch runtime's."""

    def pieces() -> Any:
        yield from ("Hi ", "there, ", "you.")

    got = _speak(served["cosyvoice3", "lite"], speaker="中文女", stream=True, text=pieces())
    want = _speak(served["cosyvoice3", "torch"], speaker="中文女", stream=True, text=pieces())
    assert [len(c) for c in got] == [len(c) for c in want] and len(got) >= 2


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_lite_analyses_prompt_audio_as_torch_does(served: Any, family: str) -> None:
    """A CosyVoice2/3 lite runtime analyses a new prompt recording with the numpy frontend: its zero-shot entry
    (prompt mel with the yaml's settings, trimmed to 2 frames a token; speech tokens; speaker embedding) is the torch
    runtime's, and vc from recordings speaks as long as on torch. If this fails, cloning a voice without torch gives
    another voice than with it."""
    import io

    import soundfile as sf

    from cosyserve.core.request import SynthesisRequest

    lite, torch_rt = served[family, "lite"], served[family, "torch"]
    t = np.arange(40000) / 22050
    buf = io.BytesIO()
    sf.write(
        buf,
        (0.3 * np.sin(2 * np.pi * 180 * t) * (1 + np.sin(2 * np.pi * 2 * t))).astype(np.float32),
        22050,
        format="WAV",
    )
    wav = buf.getvalue()
    got = lite.pipeline.extract_prompt(wav, "A prompt.")
    want = torch_rt.pipeline.extract_prompt(wav, "A prompt.")
    assert set(got) == set(want)
    for key, value in want.items():
        np.testing.assert_allclose(np.asarray(got[key]), value.numpy(), atol=1e-3, rtol=1e-3, err_msg=key)
    request = SynthesisRequest(mode="vc", source_wav=wav, prompt_wav=wav, seed=1)
    a = np.concatenate(list(lite.start(request, lambda: False)))
    b = np.concatenate(list(torch_rt.start(request, lambda: False)))
    assert a.shape == b.shape and a.size > 0


def test_a_stop_ends_a_running_lite_request(served: Any) -> None:
    """The request's stop signal reaches the lite decode loop and token2wav: asked to stop after its first chunk,
    a streamed request yields nothing more (the loop ends its row)."""
    from cosyserve.core.request import SynthesisRequest

    stop = threading.Event()
    runtime = served["cosyvoice3", "lite"]
    chunks = runtime.start(
        SynthesisRequest(text="Hello there. How are you? " * 4, speaker="中文女", seed=2, stream=True),
        stop.is_set,
    )
    first = next(chunks)
    stop.set()
    assert len(first) > 0 and list(chunks) == []


TORCH_FREE_TOKEN2WAV = """
import importlib.abc, itertools, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is blocked in this test: {name} was imported")
sys.meta_path.insert(0, Block())
import numpy as np
from pathlib import Path
from cosyserve.families.cosyvoice3.token2wav import Token2Wav3
from cosyserve.runtime.lite.chunkflow import LiteCausalVocoder, LiteChunkFlow
from cosyserve.runtime.lite.models import LiteBundle
lb = LiteBundle(Path(sys.argv[1]), verify="none", threads=1)
tables = lb.tables()
t2w = Token2Wav3(LiteChunkFlow(lb, tables), LiteCausalVocoder(lb, tables))
rng = np.random.default_rng(0)
noise = {"rand_ini": rng.random((1, 9), dtype=np.float32), "sine_waves": rng.random((1, 60000, 9), dtype=np.float32)}
emb = np.ones((1, 192), np.float32)
chunks = list(t2w(list(range(10, 70)), embedding=emb, stream=True, draws=itertools.repeat(noise)))
whole = list(t2w(list(range(10, 70)), embedding=emb, draws=itertools.repeat(noise)))
print(len(chunks), sum(c.shape[1] for c in chunks), whole[0].shape[1])
"""


def test_cosyvoice3_token2wav_runs_on_the_lite_graphs_without_torch(cv3_lite_bundle: Path) -> None:
    """The family's own token2wav (one code for both runtimes) streams a tiny CosyVoice3 bundle's lite graphs in
    a process where torch cannot be imported: several chunks, as many samples as the one-shot call. If this
    fails, the shared token2wav (or what it imports) needs torch, or the lite flow and vocoder lost its shapes."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(
        [sys.executable, "-c", TORCH_FREE_TOKEN2WAV, str(cv3_lite_bundle)],
        capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    n_chunks, streamed, whole = (int(x) for x in r.stdout.split())
    assert n_chunks >= 2 and streamed == whole == 60 * 2 * 480, r.stdout


def test_a_stop_ends_a_running_lite_flow(served: Any) -> None:
    """A flow call on the lite graphs (its Euler steps over the estimator graph) ends once its stop signal says so,
    between steps or inside an ONNX Runtime run, instead of running to its end: a stopped request's flow does not
    hold the cores."""
    flow = served["cosyvoice3", "lite"].pipeline.token2wav.flow
    asked: list[int] = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 2

    with pytest.raises(Stopped):
        flow.inference(
            np.arange(10, 70)[None], np.zeros((1, 0), np.int64), np.zeros((1, 0, 80), np.float32),
            np.ones((1, 192), np.float32), streaming=False, finalize=True, n_timesteps=10, should_stop=stop,
        )  # fmt: skip
    # asked during the call's work (a check at its end alone says False and would let it return)
    assert len(asked) >= 3, len(asked)


def test_auto_prepacks_the_batch_graph_between_requests_once_steps_batch(qwen_bundles: dict) -> None:
    """llm_gemm=auto on the lite runtime: a lone request's steps leave the batch graph as it is; the first step of
    two rows starts its prepacking, done once no request is in flight (its open holds the GIL). If this failed,
    auto would never give batches the prepacked graph (2x cheaper 2-8-row steps at full size), or would stall
    running streams for its open, or pay its memory for lone requests."""
    import gc
    import time
    import weakref

    import cosyserve
    from cosyserve.bundle.lite import BATCH_STEP

    model = cosyserve.load(qwen_bundles["cosyvoice3"], runtime="lite", batch_size=2, threads=1)
    rt = model.runtime
    rt.join_background()
    speaker = model.speakers[0] if model.speakers else None
    model.synthesize_all("Hello there.", speaker, seed=1)
    assert rt.batch_pack is None and not rt.lite.prepack_batch  # one row per step
    unpacked = weakref.ref(rt.lite.session(BATCH_STEP))
    lm = rt.llm  # a batched step on the unpacked graph: its IO binding is made on that session
    lm.reserve(2, 16)
    tokens, pos, rows = np.array([1, 2]), np.array([0, 0]), np.array([0, 1])
    before = lm.decode(tokens, pos, 1, rows)
    before_step = rt.pipeline.decoder.before_step
    rt.in_flight.enter()  # a request in flight (the decode loop calls before_step within one)
    before_step(2)  # the loop's first step of two rows
    assert rt.batch_pack is not None
    time.sleep(1.5)
    assert not rt.lite.prepack_batch and rt.lite.session(BATCH_STEP) is unpacked()  # not while it runs
    rt.in_flight.leave()
    rt.batch_pack.join(60)
    assert rt.lite.prepack_batch
    packed = rt.lite.session(BATCH_STEP)
    try:
        assert packed.get_session_options().get_session_config_entry("session.disable_prepacking") != "1"
    except RuntimeError:  # not set: ORT prepacks
        pass
    # the same step on the prepacked graph: the same log-probabilities (a binding kept from the replaced session
    # would run a freed one: a segfault)
    np.testing.assert_allclose(lm.decode(tokens, pos, 1, rows), before, rtol=1e-4, atol=1e-4)
    gc.collect()
    assert unpacked() is None  # replaced, its bindings dropped, and let go of (its memory returns)
    before_step(2)  # once
    assert rt.lite.session(BATCH_STEP) is packed
    assert model.synthesize_all("Hello there.", speaker, seed=1).size  # served on it
    model.close()
    # pinned layouts make no such thread
    pinned = cosyserve.load(qwen_bundles["cosyvoice3"], runtime="lite", batch_size=2, llm_gemm="linear")
    assert pinned.runtime.pipeline.decoder.before_step is None
    pinned.close()


def test_packed_prepacks_the_batch_graph_only(qwen_bundles: dict) -> None:
    """llm_gemm=packed on the lite runtime prepacks the LM's batch graph (MLAS, several rows per step), after READY,
    not its step graph (READY waits for that one: it opens unpacked). If this failed, the setting would do nothing
    on the lite runtime, READY would wait for a prepacking, or a first batched step would stall for it."""
    import cosyserve
    from cosyserve.bundle.lite import BATCH_STEP

    def prepacked(session: Any) -> bool:
        try:
            entry = session.get_session_options().get_session_config_entry("session.disable_prepacking")
        except RuntimeError:  # not set: ORT prepacks
            return True
        return entry != "1"

    for gemm, want in (("packed", True), ("auto", False)):
        model = cosyserve.load(qwen_bundles["cosyvoice3"], runtime="lite", llm_gemm=gemm, threads=1)
        lite = model.runtime.lite
        assert lite.prepack_batch is want
        model.runtime.join_background()
        # packed: opened after READY between requests (its open holds the GIL ~1.2 s at full size), not by a
        # first batched step; unpacked: opened by that step (milliseconds)
        assert (BATCH_STEP in lite.sessions) is want, gemm
        opened = lite.session(BATCH_STEP)
        assert not prepacked(lite.session("llm_step")), gemm
        assert prepacked(opened) is want, gemm
        lite.upgrade(BATCH_STEP)  # a later upgrade keeps a serving form as it is
        assert lite.session(BATCH_STEP) is opened
        model.close()
