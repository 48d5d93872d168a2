"""The decode loop's one-off runs in the argument order the LM tests keep their inputs in: (text, text_len,
prompt_text, prompt_text_len, prompt_speech_token, prompt_speech_token_len, embedding); concurrent consumers of one
loop, and the rows-joining-and-leaving run every LM's loop is tested with."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from cosyserve.core.sampling import row_key
from cosyserve.runtime.decode import DecodeLoop
from cosyserve.runtime.lm import one_shot
from cosyserve.runtime.oneoff import generate, teacher_forced


def model_input(args: tuple) -> dict[str, Any]:
    text, _, prompt_text, _, prompt_speech, _, embedding = args
    return {
        "text": text,
        "prompt_text": prompt_text,
        "llm_prompt_speech_token": prompt_speech,
        "llm_embedding": embedding,
    }


def tf(lm: Any, args: tuple, teacher: Any) -> tuple[torch.Tensor, int, int]:
    """(logprobs (K, V), min_len, max_len) of ``teacher`` fed back."""
    row = one_shot(lm, model_input(args))
    tokens = [int(t) for t in torch.as_tensor(teacher).reshape(-1).tolist()]
    return teacher_forced(lm, row, tokens).logprobs, row.min_len, row.max_len


def sample(
    lm: Any,
    args: tuple,
    seed: int,
    *,
    min_token_text_ratio: float = 2.0,
    max_token_text_ratio: float = 20.0,
    max_tokens: int | None = None,
    lag: int | None = None,
) -> list[int]:
    """The tokens a one-shot row samples for ``seed``."""
    row = one_shot(
        lm,
        model_input(args),
        max_tokens=max_tokens,
        min_ratio=min_token_text_ratio,
        max_ratio=max_token_text_ratio,
    )
    return list(generate(lm, row, row_key(seed), lag=lag))


def in_threads(fns: list[Callable[[], Any]], timeout: float = 120.0) -> list[Any]:
    # each in a thread of one torch thread; a hang fails the test instead of hanging it
    out: list[Any] = [None] * len(fns)

    def main(i: int) -> None:
        torch.set_num_threads(1)
        try:
            out[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            out[i] = e

    threads = [threading.Thread(target=main, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a row never finished (not freed, or stalled)"
    for x in out:
        if isinstance(x, BaseException):
            raise x
    return out


def together(loop: DecodeLoop, specs: list[Any], keys: list[int]) -> list[list[int]]:
    # each row's whole run, every consumer in its own thread, all starting at once
    started = threading.Barrier(len(specs))

    def consume(i: int) -> Callable[[], list[int]]:
        def run() -> list[int]:
            started.wait(30)
            return list(loop.generate(specs[i], keys[i]))

        return run

    return in_threads([consume(i) for i in range(len(specs))])


def join_and_leave(lm: Any, specs: list[Any], keys: list[int]) -> DecodeLoop:
    """Four one-shot rows on a loop of three cache rows: row i joins once row i-1 has had 5 tokens, rows 0 and 1 stay
    until row 2 has joined (three rows decode together), row 3 waits for a free row, row 1's consumer leaves after
    7 tokens. Asserts each row's tokens are those it gets alone (same key); returns the closed loop."""
    want = [list(generate(lm, sp, k)) for sp, k in zip(specs, keys, strict=True)]
    assert len({len(w) for w in want}) > 1, "the rows should have different lengths"
    loop = DecodeLoop(lm, 3, name="test")
    joined = [threading.Event() for _ in specs]

    def consume(i: int) -> Callable[[], list[int]]:
        def run() -> list[int]:
            if i > 0:  # row i joins once row i-1 has had 5 tokens
                assert joined[i - 1].wait(60)
            out = []
            gen = loop.generate(specs[i], keys[i])
            for token in gen:
                out.append(token)
                if len(out) == 5:
                    joined[i].set()
                    if i < 2:  # rows 0 and 1 stay until row 2 has joined: three rows decode together
                        assert joined[2].wait(60)
                if i == 1 and len(out) == 7:
                    gen.close()  # its consumer leaves: the row is freed at the next step
                    break
            joined[i].set()
            return out

        return run

    got = in_threads([consume(i) for i in range(4)])
    loop.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(loop.generate(specs[0], keys[0]))
    assert got[1] == want[1][:7]
    assert [g for i, g in enumerate(got) if i != 1] == [w for i, w in enumerate(want) if i != 1]
    assert loop.stats.peak_rows == 3 and loop.stats.prefills == 4 and loop.active == 0
    assert loop.stats.rows_hist.get(3, 0) > 0, "the rows were not decoded together"
    return loop


def batch_run_ends_when_every_row_stopped(lm: Any) -> None:
    """A lite LM's batch graph runs once for every row of a step: ended early (ORT's terminate) only when every row's
    request stopped; a row that goes on gets its log-probabilities."""
    lm.reserve(2, 8)
    tokens, pos = np.array([1, 2]), np.array([0, 3])
    steps = lm.batch_steps
    assert not lm.decode(tokens, pos, 4, None, [lambda: True, lambda: True]).any()
    assert lm.batch_steps == steps, "a step of rows that all stopped ran to its end"
    assert lm.decode(tokens, pos, 4, None, [lambda: True, None]).any() and lm.batch_steps == steps + 1
