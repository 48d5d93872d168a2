"""Continuous batching of the LM (cosyserve.engine.batching): batched outputs equal unbatched ones."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import cosyserve
from cosyserve.engine import batching
from cosyserve.engine.batching import BatchingLM
from cosyserve.engine.engine import Engine, SynthesisRequest
from cosyserve.models import llm as llm_module

# Batched decode multiplies a (B, C) matrix where the unbatched one multiplies (1, C), and attends over the
# batch's longest row with the extra keys masked: the same values up to float rounding.
LOGP_ATOL = 1e-4

TEXTS = (
    "one two three four five six seven",
    "hello",
    "a somewhat longer sentence to speak",
    "short text",
)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Any:
    return cosyserve.load(tiny_model_dir, warmup=False)


def _args(model: Any, text: str) -> tuple[torch.Tensor, ...]:
    p = model._pipeline
    ids = torch.tensor([p.tokenizer.encode(text)], dtype=torch.int32)
    empty, zero = torch.zeros(1, 0, dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    embedding = p.speakers[sorted(p.speakers)[0]]["embedding"]
    return ids, torch.tensor([ids.shape[1]], dtype=torch.int32), empty, zero, empty, zero, embedding


def _recording(monkeypatch: pytest.MonkeyPatch, module: Any) -> dict[int, list[torch.Tensor]]:
    # log-probabilities each sampling call sees, per generator (= per request)
    seen: dict[int, list[torch.Tensor]] = {}
    real = module.ras_sample

    def ras_sample(scores: torch.Tensor, history: torch.Tensor, cfg: Any, generator: Any) -> torch.Tensor:
        seen.setdefault(id(generator), []).append(scores.clone())
        return real(scores, history, cfg, generator)

    monkeypatch.setattr(module, "ras_sample", ras_sample)
    return seen


def _in_thread(fn: Callable[[], Any], timeout: float = 60.0) -> Any:
    # run fn in a thread so a bug that blocks forever fails the test instead of hanging it; one torch thread,
    # as the decode loop, so unbatched references use the same reductions
    box: dict[str, Any] = {}

    def main() -> None:
        torch.set_num_threads(1)
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e

    t = threading.Thread(target=main, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the batched LM never finished the request (a row was not freed?)"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_batched_equals_unbatched_with_staggered_joins(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    lm = model._pipeline.llm
    generators = [torch.Generator().manual_seed(10 + i) for i in range(len(TEXTS))]
    seen = _recording(monkeypatch, llm_module)
    ref = _in_thread(
        lambda: [
            list(lm.inference(*_args(model, t), generator=g)) for t, g in zip(TEXTS, generators, strict=True)
        ]
    )
    ref_logp = [torch.cat(seen[id(g)]) for g in generators]
    assert len({len(r) for r in ref}) > 1, "the texts should give different lengths"

    generators = [torch.Generator().manual_seed(10 + i) for i in range(len(TEXTS))]
    seen = _recording(monkeypatch, batching)
    # gather_s: a generous wait, so every consumer that is back for its next token is in the step (the
    # consumers here only collect tokens): rows stay together and joiners arrive mid-flight for sure
    b = BatchingLM(lm, 3, gather_s=1.0, torch_threads=1)
    out: list[list[int]] = [[] for _ in TEXTS]
    joined = [threading.Event() for _ in TEXTS]

    def consume(i: int) -> None:
        if i > 0:  # request i joins after request i-1 has had 7 tokens
            assert joined[i - 1].wait(30)
        for token in b.inference(*_args(model, TEXTS[i]), generator=generators[i]):
            out[i].append(token)
            if len(out[i]) == 7:
                joined[i].set()
        joined[i].set()

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(len(TEXTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    b.close()

    assert out == ref, "batched decoding changed a request's tokens"
    for i, g in enumerate(generators):
        torch.testing.assert_close(torch.cat(seen[id(g)]), ref_logp[i], atol=LOGP_ATOL, rtol=0)
    # 4 requests on 3 rows: one waited for a free row; the rows really were decoded together
    assert b.stats.peak_rows == 3
    assert b.stats.mean_batch > 1.5
    assert b.stats.tokens == sum(len(r) for r in ref)
    assert b.active == 0


def test_closing_the_consumer_frees_its_row(model: Any) -> None:
    lm = model._pipeline.llm
    b = BatchingLM(lm, 1, torch_threads=1)  # one row: the next request needs the freed one
    args = _args(model, TEXTS[0])
    ref = _in_thread(lambda: list(lm.inference(*args, generator=torch.Generator().manual_seed(5))))

    def scenario() -> list[int]:
        first = b.inference(*args, generator=torch.Generator().manual_seed(1))
        assert [next(first) for _ in range(3)]
        first.close()  # GeneratorExit inside: the row is freed at the loop's next step
        dropped: Iterator[int] = b.inference(*args, generator=torch.Generator().manual_seed(2))
        next(dropped)
        del dropped  # dropped without close(): its finalizer frees the row the same way
        return list(b.inference(*args, generator=torch.Generator().manual_seed(5)))

    assert _in_thread(scenario) == ref
    assert b.active == 0 and b.stats.prefills == 3
    b.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(b.inference(*args))


def test_cancelled_request_mid_batch_does_not_disturb_others(model: Any) -> None:
    lm = model._pipeline.llm
    args = [_args(model, t) for t in TEXTS[:2]]
    ref = _in_thread(lambda: list(lm.inference(*args[0], generator=torch.Generator().manual_seed(3))))
    b = BatchingLM(lm, 2, torch_threads=1)

    def scenario() -> list[int]:
        keep = b.inference(*args[0], generator=torch.Generator().manual_seed(3))
        got = [next(keep) for _ in range(4)]
        other = b.inference(*args[1], generator=torch.Generator().manual_seed(4))
        for _ in range(5):
            got.append(next(keep))
            next(other)
        other.close()
        return got + list(keep)

    assert _in_thread(scenario) == ref
    assert b.active == 0
    b.close()


def test_engine_batch_size_serves_concurrently_with_unbatched_audio(tiny_model_dir: Path) -> None:
    reqs = [
        SynthesisRequest(text=TEXTS[0], speaker="中文女", seed=1, stream=True),
        SynthesisRequest(text=TEXTS[2], speaker="英文男", seed=2),
        SynthesisRequest(text=TEXTS[3], speaker="中文女", seed=3, stream=True),
    ]
    # batched only: a long streaming request whose client leaves after its first chunk
    leaver = SynthesisRequest(text=" ".join(TEXTS), speaker="英文男", seed=4, stream=True)

    def first_chunk_then_close(stream: Any) -> np.ndarray:
        chunk = next(stream)
        stream.close()  # cancels: its worker stops at the next token, its LM row is freed
        return chunk

    def run(batch_size: int) -> tuple[list[np.ndarray], Any, dict[str, Any]]:
        e = Engine(
            "tiny",
            lambda: cosyserve.load(tiny_model_dir, warmup=False),
            batch_size=batch_size,
            torch_threads=1,
        )
        e.load_sync(60)
        streams = [e.synthesize_sync(r) for r in reqs]  # all admitted at once: none waits for a worker
        leaving = e.synthesize_sync(leaver) if batch_size > 1 else None
        batcher = e._instances[0].batcher
        with concurrent.futures.ThreadPoolExecutor(len(streams) + 1) as pool:
            futures = [pool.submit(lambda s: np.concatenate(list(s)), s) for s in streams]
            if leaving is not None:
                assert pool.submit(first_chunk_then_close, leaving).result(60).size > 0
            audio = [f.result(60) for f in futures]
        assert e.describe()["batch_size"] == batch_size
        e.release_sync(30)
        return audio, batcher, e.stats.snapshot()["outcomes"]

    single, none, _ = run(1)
    batched, batcher, outcomes = run(4)
    assert none is None, "batch_size=1 must keep the plain LM"
    assert batcher is not None and batcher.stats.prefills == len(reqs) + 1
    assert batcher.active == 0
    assert outcomes == {"ok": len(reqs), "cancelled": 1}
    for a, b in zip(batched, single, strict=True):
        np.testing.assert_array_equal(a, b)


def test_pool_config_reads_batch_size(tmp_path: Path) -> None:
    from cosyserve.engine.poolconfig import PoolConfigError, load_pool_config

    f = tmp_path / "pool.toml"
    f.write_text('[pool]\nbatch_size = 2\n[models.a]\npath = "a"\n[models.b]\npath = "b"\nbatch_size = 8\n')
    cfg = load_pool_config(f, env={})
    assert (cfg.models["a"].batch_size, cfg.models["b"].batch_size) == (2, 8)
    cfg = load_pool_config(f, env={"COSYSERVE_BATCH_SIZE": "4"})  # the environment wins over the file
    assert (cfg.models["a"].batch_size, cfg.models["b"].batch_size) == (4, 4)
    with pytest.raises(PoolConfigError, match="COSYSERVE_BATCH_SIZE"):
        load_pool_config(f, env={"COSYSERVE_BATCH_SIZE": "0"})


@torch.inference_mode()
def test_growing_the_cache_keeps_rows_being_decoded(model: Any) -> None:
    lm = model._pipeline.llm
    prompt = lm.embed_inputs(*_args(model, TEXTS[0]))
    t0 = prompt.size(1)
    tokens = torch.arange(12) + 7

    def run(grow_at: int | None) -> torch.Tensor:
        lm.llm.encoders[0].self_attn.kv_cache = None  # fresh caches: only just big enough for the prompt
        lm.setup_caches(2, t0 + (4 if grow_at is not None else 64))
        row = torch.tensor([1])
        out = [lm.prefill(prompt, rows=row)]
        for i, token in enumerate(tokens):
            if i == grow_at:
                lm.grow_caches(3, t0 + 64)  # more rows and positions while row 1 is mid-sequence
            out.append(lm.decode_one_token(token.reshape(1), torch.tensor([t0 + i]), t0 + i + 1, row))
        return torch.cat(out)

    grown, reference = run(grow_at=3), run(grow_at=None)
    assert lm.cache_shape() == (2, t0 + 64)
    # a regrown cache that lost row 1's keys or projected distances would change every later step
    torch.testing.assert_close(grown, reference, atol=1e-5, rtol=0)
