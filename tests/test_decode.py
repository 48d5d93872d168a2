"""The one decode loop (cosyserve.runtime.decode) and the one sampler (cosyserve.core.sampling), on tiny random LMs:
rows joining and leaving give each row its own tokens, streamed-text rows batch beside one-shot rows, ids read
back late give the tokens of ids read at once, and no step reads a tensor on the host."""

from __future__ import annotations

import ast
import inspect
import threading
from typing import Any

import numpy as np
import pytest
import torch

from cosyserve.core.sampling import Sampler, SamplingConfig, array_ops, row_key
from cosyserve.core.stop import Stopped
from cosyserve.models.llm import TransformerLM
from cosyserve.models.qwen2lm import Qwen2Config, Qwen2LM, Qwen2LMConfig
from cosyserve.runtime import decode, lm, readback, rows
from cosyserve.runtime.decode import DecodeLoop
from cosyserve.runtime.lm import OneShot, Streamed, one_shot
from cosyserve.runtime.oneoff import generate
from lm_util import join_and_leave, together


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    # tiny ops with 2 OpenMP threads on a 2-vCPU machine run many times slower than with 1; only speed changes
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _lm300() -> TransformerLM:
    from test_llm import _tiny_config

    torch.manual_seed(0)
    return TransformerLM(_tiny_config(2)).eval()


def _qwen() -> Qwen2LM:
    torch.manual_seed(1)
    qwen = Qwen2Config(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2,
        vocab_size=64,
    )  # fmt: skip
    return Qwen2LM(
        Qwen2LMConfig(llm_input_size=32, llm_output_size=32, speech_token_size=40, qwen=qwen)
    ).eval()


def _one_shot(lm: Any, seed: int, n_text: int = 4, **kw: Any) -> OneShot:
    g = torch.Generator().manual_seed(seed)
    n_vocab = lm.stack.embed_tokens.num_embeddings if isinstance(lm, Qwen2LM) else lm.cfg.text_token_size
    model_input = {"text": torch.randint(0, n_vocab, (1, n_text), generator=g, dtype=torch.int32)}
    if isinstance(lm, TransformerLM):
        model_input["llm_embedding"] = torch.randn(1, lm.cfg.spk_embed_dim, generator=g)
    with torch.inference_mode():
        return one_shot(lm, model_input, **kw)


def _streamed(seed: int, n_words: int = 12, piece: int = 2, speech: int = 0) -> Streamed:
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(0, 64, (n_words,), generator=g).tolist()
    prompt_speech = torch.randint(0, 40, (speech,), generator=g).tolist()
    return Streamed([words[i : i + piece] for i in range(0, n_words, piece)], [3, 4], prompt_speech)


def _fresh(spec: Any) -> Any:
    # a streamed row's text is consumed by a run: each run gets its own copy
    if isinstance(spec, Streamed):
        return Streamed(list(spec.text), spec.prompt_text, spec.prompt_speech, spec.max_len, spec.ratio)
    return spec


def _alone(lm: Any, spec: Any, key: int, lag: int = 0) -> list[int]:
    return list(generate(lm, _fresh(spec), key, lag=lag))


# -- the sampler ---------------------------------------------------------------------------------------------------


def test_sampler_nucleus_and_repetition_fallback() -> None:
    """Ids 0..2 make the nucleus (mass before id 3 is 0.9 >= 0.8); a pick seen in the window is redrawn from the
    rest, so id 3 becomes reachable. If this failed, the sampler would not be the reference's ras_sampling."""
    cfg = SamplingConfig(top_p=0.8, top_k=25, win_size=10, tau_r=0.1)
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    s = Sampler(cfg, 4, array_ops(logp))
    key = torch.tensor([row_key(5)])

    def picks(history: torch.Tensor) -> set[int]:
        return {int(s(logp, key, torch.tensor([i]), history)) for i in range(300)}

    assert picks(torch.full((1, 10), -1)) == {0, 1, 2}
    assert 3 in picks(torch.tensor([[0, 1, 2] + [-1] * 7]))


def test_sampler_draws_depend_on_key_and_index_only() -> None:
    """A row's draw is the same alone or among other rows, in numpy or in torch: the sampler is a function of (its
    key, its token index, its log-probabilities). If this failed, batching or the runtime would change tokens."""
    rng = np.random.default_rng(0)
    b, v = 6, 300
    logp = torch.log_softmax(torch.from_numpy(rng.standard_normal((b, v)).astype(np.float32)) * 3, -1)
    keys = torch.tensor([row_key(s, s % 2) for s in range(b)])
    index = torch.tensor([0, 5, 9, 2, 7, 100])
    history = torch.from_numpy(rng.integers(-1, v, (b, 10)))
    cfg = SamplingConfig()
    batch = Sampler(cfg, v, array_ops(logp))(logp, keys, index, history)
    for r in range(b):
        alone = Sampler(cfg, v, array_ops(logp))(
            logp[r : r + 1], keys[r : r + 1], index[r : r + 1], history[r : r + 1]
        )
        assert int(alone) == int(batch[r])
    ops = array_ops(logp.numpy())
    got = Sampler(cfg, v, ops)(logp.numpy(), keys.numpy(), index.numpy(), history.numpy())
    assert got.tolist() == batch.tolist(), "numpy and torch drew differently"
    assert len({row_key(s) for s in range(1000)}) == 1000 and row_key(1, 0) != row_key(1, 1)


# -- rows joining and leaving --------------------------------------------------------------------------------------


def test_rows_joining_and_leaving_mid_run_keep_each_rows_tokens() -> None:
    """Four requests on three rows: they join one after another while others decode, one waits for a free row, one
    consumer leaves early (its row is freed); each row's tokens are those it gets alone (same key). If this
    failed, a row's neighbours, its cache row or its join step would change its speech."""
    lm = _lm300()
    specs = [_one_shot(lm, s, n_text=t) for s, t in ((0, 4), (1, 2), (2, 5), (3, 3))]
    join_and_leave(lm, specs, [row_key(10 + i) for i in range(4)])


def test_more_consumers_than_rows_wait_for_a_free_row_and_step_it_themselves() -> None:
    """On the CPU the consumers step the loop in their own threads: three requests on one cache row each get their
    tokens alone, the later ones waiting for the row (not failing, not spinning on a step that cannot run). If this
    failed, a request arriving while the model's rows are taken would error or hang on a CPU server."""
    lm = _lm300()
    specs = [_one_shot(lm, s, n_text=t) for s, t in ((0, 3), (1, 2), (2, 4))]
    keys = [row_key(30 + i) for i in range(3)]
    want = [_alone(lm, sp, k) for sp, k in zip(specs, keys, strict=True)]
    loop = DecodeLoop(lm, 1, name="test")
    got = together(loop, specs, keys)
    loop.close()
    assert got == want
    assert loop._thread is None and loop.stats.prefills == 3 and loop.stats.peak_rows == 1


def test_streamed_text_rows_batch_beside_a_one_shot_row() -> None:
    """Two rows whose text arrives in pieces (one with prompt speech to interleave) decode in the same steps as a
    one-shot row, and each gets its tokens alone. If this failed, streamed text would still need a loop of its own
    (or fall back to one run per sentence) when requests share the model."""
    lm = _qwen()
    lm.llm_decoder.bias.data[lm.eos_token :] = -4.0  # rows run for a while: fills are forced, EOS comes late
    specs: list[Any] = [_streamed(0), _streamed(1, n_words=9, piece=3, speech=20), _one_shot(lm, 2)]
    keys = [row_key(20 + i) for i in range(3)]
    want = [_alone(lm, sp, k) for sp, k in zip(specs, keys, strict=True)]
    loop = DecodeLoop(lm, 3, name="test")
    got = together(loop, [_fresh(sp) for sp in specs], keys)
    loop.close()
    assert got == want
    assert all(len(w) > 10 for w in want)
    assert loop.stats.peak_rows >= 2, "streamed and one-shot rows never shared a step"


# -- a voice's prompt prefix ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("lm_name", ["300m", "qwen2"])
def test_a_kept_prompt_prefix_gives_the_tokens_of_a_whole_prefill(lm_name: str) -> None:
    """A one-shot row whose prompt prefix (sos, [speaker,] prompt text) another row left in the voice cache
    prefills only the rest (new text, task_id, prompt speech) from where the prefix ends, in any cache row: the
    same tokens for the same key as a whole prefill, and log-probabilities within float32 rounding, for new texts
    of other lengths. If this failed, a registered voice's requests would speak otherwise than its first (a position off, a cache
    row not restored). A 300M text encoder that is not causal gets no prefix (the new text would change it)."""
    import dataclasses

    from cosyserve.voices.voicestates import VoiceStates

    lm = _lm300() if lm_name == "300m" else _qwen()
    g = torch.Generator().manual_seed(3)
    n_vocab = lm.stack.embed_tokens.num_embeddings if isinstance(lm, Qwen2LM) else lm.cfg.text_token_size
    voice = {
        "prompt_text": torch.randint(0, n_vocab, (1, 7), generator=g, dtype=torch.int32),
        "llm_prompt_speech_token": torch.randint(0, 40, (1, 9), generator=g, dtype=torch.int32),
    }
    if isinstance(lm, TransformerLM):
        voice["llm_embedding"] = torch.randn(1, lm.cfg.spk_embed_dim, generator=g)
    texts = [torch.randint(0, n_vocab, (1, n), generator=g, dtype=torch.int32) for n in (3, 6)]
    store, loop = VoiceStates(1 << 30), DecodeLoop(lm, 1, threaded=False)

    def run(text: torch.Tensor, prefixes: Any, key: int) -> tuple[list[int], torch.Tensor]:
        with torch.inference_mode():
            row = one_shot(lm, {**voice, "text": text}, prefixes=prefixes)
        record: list[Any] = []
        return list(loop.generate(row, key, record=record)), torch.stack([lp for lp, _ in record])

    run(texts[0], store, row_key(9))  # keeps the prefix
    assert loop.stats.prefix_positions == 0 and len(store) == 1
    positions = 1 + int(lm_name == "300m") + 7  # sos, [speaker,] the prompt text
    for i, text in enumerate(texts):
        cached, whole = run(text, store, row_key(i)), run(text, None, row_key(i))
        assert cached[0] == whole[0] and len(cached[0]) > 0, (i, cached[0], whole[0])
        torch.testing.assert_close(cached[1], whole[1], rtol=0, atol=1e-4)
        assert loop.stats.prefix_positions == (i + 1) * positions, "the kept prefix was not used"
    # loaded into cache row 1 while another row holds row 0 (it was kept from row 0)
    loop2 = DecodeLoop(lm, 2, threaded=False)
    with torch.inference_mode():
        other = loop2.generate(one_shot(lm, {**voice, "text": texts[1]}), row_key(5))
        next(other)  # holds cache row 0
        spec = one_shot(lm, {**voice, "text": texts[0]}, prefixes=store)
    assert list(loop2.generate(spec, row_key(0))) == run(texts[0], None, row_key(0))[0]
    other.close()
    assert loop2.stats.prefix_positions == positions
    if isinstance(lm, TransformerLM):
        lm.text_encoder.cfg = dataclasses.replace(lm.text_encoder.cfg, static_chunk_size=0)
        assert lm.prefix_positions({**voice, "text": texts[0]}) == 0


# -- ids read back late ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lm_name", ["300m", "qwen2"])
def test_ids_read_late_give_the_tokens_of_ids_read_at_once(lm_name: str) -> None:
    """The device's way (ids read ``lag`` steps late, a stop seen late and the steps after it dropped, a fill seen
    late rolled back) run on the CPU gives the tokens of reading each id at once. If this failed, a GPU request's
    speech for a seed would differ from the CPU's beyond numerics."""
    lm = _lm300() if lm_name == "300m" else _qwen()
    rollbacks = stops = 0
    for bias in (0.0, 3.0):  # 3: stop ids (and fills) likely, so rows end or ask for text at various steps
        lm.llm_decoder.bias.data[lm.eos_token :] = bias
        specs: list[Any] = [_one_shot(lm, s, min_ratio=0.5) for s in range(2)]
        if lm_name == "qwen2":
            specs += [_streamed(5), _streamed(6, speech=16)]
        for spec in specs:
            for seed in range(2):
                want = _alone(lm, spec, row_key(seed))
                stops += len(want) < 80
                for lag in (1, 4, 1000):
                    loop = DecodeLoop(lm, 1, lag=lag, threaded=False)
                    assert list(loop.generate(_fresh(spec), row_key(seed))) == want, (bias, seed, lag)
                    rollbacks += loop.stats.rollbacks
                gen = DecodeLoop(lm, 1, lag=4, threaded=False).generate(_fresh(spec), row_key(seed))
                assert [t for _, t in zip(range(2), gen, strict=False)] == want[:2]
                gen.close()  # as a request's stop closes it
    assert stops >= 4, "the biased runs should end on stop ids before max_len"
    if lm_name == "qwen2":
        assert rollbacks > 0, "no fill was read late: the rollback went untested"


def test_the_cpu_reads_each_id_at_once_and_steps_on_demand() -> None:
    """On the CPU the loop reads ids at once and steps only while a consumer waits, in that consumer's thread (no
    loop thread: its OpenMP team would slow the request's own), so a lone request alternates with its own work
    (token2wav) as an unbatched one does; on a device it would run ahead in a thread of its own."""
    lm = _lm300()
    loop = DecodeLoop(lm, 2, name="test")
    assert loop.lag == 0 and not loop.threaded
    spec = _one_shot(lm, 0, n_text=6)
    gen = loop.generate(spec, row_key(1))
    got = [next(gen) for _ in range(3)]
    row = loop._active[0]
    threading.Event().wait(0.2)  # the consumer is busy: the loop must not decode ahead of it
    assert row.steps == row.taken == 3
    got += list(gen)
    assert loop._thread is None, "the CPU loop started a thread of its own"
    loop.close()
    assert got == _alone(lm, spec, row_key(1))


def test_a_consumer_goes_on_with_its_requests_share_of_the_cores_after_its_last_step() -> None:
    """The step that frees a lone request's row serves no row; its consumer's thread then runs that request's
    token2wav. If this failed, a lone one-shot request's whole token2wav ran on one of two cores (1.4x its wall
    time), as the step's share of no rows was applied and never put back."""
    from cosyserve.runtime.cores import CoreShare

    lm = _lm300()
    share, calls = CoreShare(2), []

    def before_step(serves: int) -> None:
        calls.append(serves)
        share.apply(serves)

    loop = DecodeLoop(lm, 2, before_step=before_step, name="test")
    share.enter()  # the request counted as running, as the torch runtime's share() does
    try:
        assert list(loop.generate(_one_shot(lm, 0, n_text=6, max_tokens=8), row_key(1)))
        assert 0 in calls, "no step served zero rows: this test no longer covers the row's freeing step"
        assert torch.get_num_threads() == 2, (
            f"after its last step the request runs on {torch.get_num_threads()}"
        )
    finally:
        share.leave()
        torch.set_num_threads(1)  # the module's setting
        loop.close()


_CONVERSIONS = (
    "__int__",
    "__index__",
    "__bool__",
    "__float__",
    "item",
    "tolist",
    "numpy",
    "cpu",
    "__array__",
)


def test_no_step_reads_a_tensor_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's steps (sampling, masks, stop checks, extends, the LM's step) read no tensor's value on the host:
    on a GPU each such read would wait for the device at every token. Ids come back through the loop's ring of
    host buffers (one numpy view, made with the loop) and are read as numpy."""
    lm = _qwen()
    lm.llm_decoder.bias.data[lm.eos_token :] = -1e4  # no stop id: every step runs
    specs = [_one_shot(lm, 0, min_ratio=20.0), _streamed(3)]
    loops = [DecodeLoop(lm, 1, lag=4, threaded=False) for _ in specs]  # made before the spy: the ring's view
    calls: list[str] = []
    for name in _CONVERSIONS:
        original = getattr(torch.Tensor, name)

        def spy(self: torch.Tensor, *a: Any, _name: str = name, _orig: Any = original, **k: Any) -> Any:
            calls.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    for loop, spec in zip(loops, specs, strict=True):
        out = list(loop.generate(spec, row_key(0)))
        assert len(out) >= 50
    assert calls == [], calls


def test_the_loop_reads_ids_in_one_place() -> None:
    """Code inspection of the one loop and its parts: host conversions (``item``, ``tolist``, ``numpy``, ``cpu``)
    appear only where the ring of read-back ids is made (its one numpy view) and read, and where a consumer turns
    its text into ids (``flat_ids``, in the consumer's thread). If this failed, someone added a per-step host read."""
    found = set()
    for module in (decode, readback, rows, lm):
        for fn in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(fn, ast.FunctionDef):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Attribute) and node.attr in ("item", "tolist", "numpy", "cpu"):
                        found.add(f"{module.__name__.rsplit('.', 1)[1]}.{fn.name}")
    assert found == {"readback.__init__", "readback._pop", "rows.flat_ids"}, found


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the same loop runs on the CPU above)"
)
def test_the_loop_on_cuda_never_synchronises() -> None:
    lm = _qwen().cuda()
    lm.llm_decoder.bias.data[lm.eos_token :] = -1e4
    spec = _one_shot(lm, 0, min_ratio=20.0)
    list(DecodeLoop(lm, 1, threaded=False).generate(spec, 0))  # warm: first-use allocations may sync
    loop = DecodeLoop(lm, 1, threaded=False)
    assert loop.lag > 0 and not loop.demand
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = list(loop.generate(spec, 0))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(out) == spec.max_len


def test_a_stopped_row_waiting_for_a_cache_row_is_never_prefilled() -> None:
    """A request stopped while it waits for a free row (its client left the queue) ends with Stopped at the next
    step, without a prefill; the row that holds the cache goes on."""
    lm = _qwen()
    loop = DecodeLoop(lm, 1, threaded=False)
    first = loop.generate(_one_shot(lm, 0), 1)
    next(first)  # holds the only cache row
    waiting = loop.generate(_one_shot(lm, 1), 2, should_stop=lambda: True)
    with pytest.raises(Stopped):
        next(waiting)
    assert loop.stats.prefills == 1, "the stopped row was prefilled"
    assert len(list(first)) > 0
