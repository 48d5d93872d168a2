"""A request within the limits never wedges a model: text is cut into bounded pieces, a piece's speech is capped,
a long one-shot piece goes through bounded windows, and every stage stops at its next bounded piece of work once
the request's stop signal says so (deadline, disconnect, shutdown), on both runtimes, over HTTP and through
SIGTERM (issue 25, item 1)."""

from __future__ import annotations

import random
import re
import signal
import string
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from cosyserve.core.request import SynthesisRequest
from cosyserve.core.stop import Stopped
from cosyserve.families.cosyvoice.streampolicy import StreamPolicy
from cosyserve.frontend.text import PIECE_MAX_N, bound_pieces, split_paragraph, text_normalize
from cosyserve.frontend.tokenizer import get_tokenizer
from cosyserve.runtime import PIECE_SECONDS_MAX, RuntimeOptions, load_runtime
from server_util import running_server, start_server

# the input: the documented maximum of letters, without punctuation
UNPUNCTUATED = "".join(random.Random(0).choice(string.ascii_lowercase) for _ in range(4096))


def _encode(text: str) -> list[int]:
    return get_tokenizer().encode(text)


# --- text: bounded pieces ---------------------------------------------------------------------------------------


def test_unpunctuated_text_is_cut_into_bounded_pieces() -> None:
    """4096 letters with no punctuation were one piece of 2634 tokens (one LM run to 52,680 speech tokens, one
    flow pass over 18 minutes of speech): every piece must now be at most PIECE_MAX_N tokens, and together they
    must say the whole text."""
    pieces = text_normalize(UNPUNCTUATED)
    assert isinstance(pieces, list) and len(pieces) > 1
    assert max(len(_encode(p)) for p in pieces) <= PIECE_MAX_N
    assert "".join(pieces) == UNPUNCTUATED + "."  # the reference's final punctuation, nothing lost or added


def test_long_text_is_cut_at_clauses_then_words_then_characters() -> None:
    clauses = "the quick brown fox jumps over the lazy dog, " * 60  # one sentence of many clauses
    pieces = bound_pieces([clauses], _encode)
    assert len(pieces) > 1 and all(len(_encode(p)) <= PIECE_MAX_N for p in pieces)
    assert all(p.endswith(", ") for p in pieces[:-1]), "a clause boundary was available: cut there"
    words = "word " * 1000  # no clause punctuation: cut between words
    pieces = bound_pieces([words], _encode)
    assert all(p.endswith(" ") for p in pieces[:-1]) and "".join(pieces) == words
    zh = "这是一个没有标点的很长的句子" * 40  # Chinese: measured in characters, cut between them
    pieces = bound_pieces([zh], _encode)
    assert max(len(p) for p in pieces) <= PIECE_MAX_N and "".join(pieces) == zh


def test_text_the_reference_splits_into_normal_pieces_is_split_the_same() -> None:
    """The bound must not change what the reference does with normal text: only pieces over PIECE_MAX_N are
    cut."""
    text = (
        "This is the first sentence of a paragraph. Here is another one, with a clause. "
        "A third sentence follows it; and a fourth! Is this a question? Yes, it is. " * 4
    )
    normalized = text_normalize(text, split=False)
    assert isinstance(normalized, str)
    assert text_normalize(text) == split_paragraph(normalized, _encode, "en", 80, 60, 20)


def test_markup_tags_are_never_cut() -> None:
    text = "<|endofprompt|>" + "[breath]" * 30 + "<|endofprompt|>" * 30
    pieces = bound_pieces([text], _encode, max_n=12)
    assert len(pieces) > 1 and "".join(pieces) == text
    for piece in pieces:
        assert re.fullmatch(r"(<\|endofprompt\|>|\[breath\])+", piece), piece


def test_unnormalized_text_is_bounded_too(tiny_model_dir: Path) -> None:
    """normalize=False spoke the whole text as one piece, whatever its length."""
    rt = load_runtime(tiny_model_dir, RuntimeOptions(warmup=False))
    try:
        prepared = rt.pipeline.prepare(SynthesisRequest(text=UNPUNCTUATED, normalize=False))
    finally:
        rt.close()
    assert len(prepared.pieces) > 1 and "".join(prepared.pieces) == UNPUNCTUATED
    assert all(x["text"].shape[1] <= PIECE_MAX_N for x in prepared.inputs)


# --- the LM: a piece's speech is capped ---------------------------------------------------------------------------


def test_the_lm_stops_at_max_tokens_whatever_the_text(tiny_model_dir: Path) -> None:
    """Random weights never draw EOS: a run goes to its limit. max_tokens must cap it below the reference's 20
    per text token (and below min_len too, which would otherwise mask EOS past the cap)."""
    rt = load_runtime(tiny_model_dir, RuntimeOptions(warmup=False))
    try:
        from cosyserve.runtime.lm import one_shot
        from cosyserve.runtime.oneoff import generate

        llm = rt.pipeline.llm
        text = torch.arange(1, 41, dtype=torch.int32)[None]  # 40 tokens: min 80, max 800
        row = one_shot(llm, {"text": text, "llm_embedding": torch.zeros(1, 192)}, max_tokens=30)
        assert (row.min_len, row.max_len) == (30, 30)
        assert len(list(generate(llm, row, 0))) == 30
        # the pipeline passes a cap of PIECE_SECONDS_MAX seconds of tokens
        assert rt.pipeline.max_piece_tokens == PIECE_SECONDS_MAX * 50
    finally:
        rt.close()


# --- one-shot synthesis of a long piece: bounded windows -----------------------------------------------------


def test_one_shot_of_a_long_piece_goes_through_bounded_windows() -> None:
    policy = StreamPolicy.named("reference")
    short = list(range(policy.one_pass_max_len))
    assert list(policy.windows(short, stream=False)) == [(short, True)], "the reference's one pass"
    long = list(range(policy.one_pass_max_len * 2 + 7))
    windows = list(policy.windows(long, stream=False))
    assert len(windows) > 2 and windows[-1][1] and not any(final for _, final in windows[:-1])
    assert max(len(w) for w, _ in windows) <= policy.token_max_hop_len + policy.token_overlap_len


@pytest.mark.parametrize("speed", [1.0, 2.0])
def test_windowed_one_shot_says_the_whole_piece(tiny_model_dir: Path, speed: float) -> None:
    """A piece over the one-pass bound must still give all its audio, at the asked speed, finite."""
    rt = load_runtime(tiny_model_dir, RuntimeOptions(warmup=False))
    try:
        t2w = rt.pipeline.token2wav
        n = t2w.policy.one_pass_max_len + 300
        tokens = [int(x) for x in torch.randint(0, 4000, (n,), generator=torch.Generator().manual_seed(0))]
        chunks = list(
            t2w(
                tokens, embedding=torch.zeros(1, 192), speed=speed, generator=torch.Generator().manual_seed(1)
            )
        )
    finally:
        rt.close()
    audio = torch.cat(chunks, dim=1)
    seconds = audio.shape[1] / rt.sample_rate
    assert len(chunks) > 2 and bool(torch.isfinite(audio).all())
    assert seconds == pytest.approx(n / 50 / speed, rel=0.02)


# --- stop checks inside the stages ---------------------------------------------------------------------------


class _StopAfter:
    """A stop signal that says True from its n-th question on, and counts the questions."""

    def __init__(self, n: int) -> None:
        self.n, self.asked = n, 0

    def __call__(self) -> bool:
        self.asked += 1
        return self.asked >= self.n


def test_flow_and_vocoder_stop_within_a_pass(tiny_model_dir: Path) -> None:
    """A flow pass asks between its Euler steps and its estimator's blocks, the vocoder between its stages: once
    the signal says stop, no more estimator block and no more vocoder stage may run."""
    rt = load_runtime(tiny_model_dir, RuntimeOptions(warmup=False))
    try:
        flow, hift = rt.pipeline.token2wav.flow, rt.pipeline.token2wav.hift
        estimator = flow.decoder.estimator
        calls = {"steps": 0}
        original = estimator.forward_packed

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls["steps"] += 1
            return original(*args, **kwargs)

        estimator.forward_packed = counted
        tok = torch.randint(0, 4000, (1, 200), dtype=torch.int32)
        empty, zero = torch.zeros(1, 0, dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
        stop = _StopAfter(5)
        with pytest.raises(Stopped):
            flow.inference(
                tok, torch.tensor([200], dtype=torch.int32), empty, zero, torch.zeros(1, 0, 80), zero,
                torch.zeros(1, 192), torch.zeros(1, 80, 0, 2), generator=torch.Generator().manual_seed(0),
                should_stop=stop,
            )  # fmt: skip
        assert stop.asked == 5, "nothing may ask again after the stop: the pass ends at once"
        assert calls["steps"] < flow.N_TIMESTEPS, "the Euler loop went on after the stop"
        stop = _StopAfter(2)
        with pytest.raises(Stopped):
            hift.inference(torch.zeros(1, 80, 400), None, generator=torch.Generator(), should_stop=stop)
        assert stop.asked == 2
    finally:
        rt.close()


def test_the_lm_prefill_and_steps_of_a_stopped_request_end_at_once(tiny_model_dir: Path) -> None:
    """The torch runtime hands the request's stop signal to the LM's decode loop: a stop that comes while the
    prompt is prefilled ends it before the next layer, with no decode step after; a stop that comes during a
    step ends the row without the next step (before: the prefill ran whole and the loop took one more step)."""
    rt = load_runtime(tiny_model_dir, RuntimeOptions(warmup=False))
    try:
        lm = rt.pipeline.llm
        layers: list[int] = []
        steps = {"n": 0}
        stop = threading.Event()
        hooks = [
            layer.register_forward_hook(lambda *a, i=i: layers.append(i))
            for i, layer in enumerate(lm.stack.encoders)
        ]
        assert len(hooks) > 1, "the test needs a stack of several layers"
        decode = lm.decode

        def counted(*args: Any, **kwargs: Any) -> Any:
            steps["n"] += 1
            if steps["n"] == 3:
                stop.set()  # the client leaves during the third step
            return decode(*args, **kwargs)

        lm.decode = counted
        try:
            hooks.append(lm.stack.encoders[0].register_forward_hook(lambda *a: stop.set()))
            assert list(rt.start(SynthesisRequest(text="hello there", seed=1), stop.is_set)) == []
            assert layers == [0] and steps["n"] == 0, (
                f"layers {layers}, {steps['n']} steps ran after the stop"
            )
            hooks.pop().remove()
            stop.clear()
            layers.clear()
            assert list(rt.start(SynthesisRequest(text="hello there", seed=1), stop.is_set)) == []
            assert steps["n"] == 3, f"{steps['n']} decode steps: the loop stepped on after the stop"
            assert rt.pipeline.decoder.active == 0, "the stopped row should have given its cache row back"
        finally:
            del lm.decode
            for h in hooks:
                h.remove()
    finally:
        rt.close()


def test_an_onnx_run_of_a_stopped_request_is_terminated(tiny_lite_bundle: Path) -> None:
    """One ORT run holds no Python code: the terminate watcher must end it (not let it run to its end)."""
    from cosyserve.runtime.lite import terminate

    rt = load_runtime(tiny_lite_bundle, RuntimeOptions(warmup=False), runtime="lite")
    try:
        session = rt.lite.session("hift_decode")
        mel = np.zeros((1, 80, 2000), np.float32)
        s_stft = np.zeros((1, 18, 2000 * 256 // 4 + 1), np.float32)
        assert terminate.run(session, {"mel": mel[:, :, :4], "s_stft": s_stft[:, :, :257]}, lambda: False)
        with pytest.raises(Stopped):
            terminate.run(session, {"mel": mel, "s_stft": s_stft}, lambda: True)
    finally:
        rt.close()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("runtime", ["torch", "lite"])
def test_a_request_of_unpunctuated_text_ends_at_its_stop(
    tiny_model_dir: Path, tiny_lite_bundle: Path, runtime: str, stream: bool
) -> None:
    """The issue's request, through the runtime: a stop must end it at the next bounded piece of work (here
    the signal flips after 30 questions; a wedged stage would never ask again)."""
    model = tiny_model_dir if runtime == "torch" else tiny_lite_bundle
    rt = load_runtime(model, RuntimeOptions(warmup=False), runtime=runtime)
    try:
        stop = _StopAfter(30)
        chunks = list(rt.start(SynthesisRequest(text=UNPUNCTUATED, stream=stream, seed=1), stop))
    finally:
        rt.close()
    assert stop.asked == 30, f"asked {stop.asked} times: work went on after the stop"
    assert sum(c.shape[0] for c in chunks) < 30 * rt.sample_rate


# --- over HTTP, and through SIGTERM ----------------------------------------------------------------------------


def _rss_peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _in_flight(c: httpx.Client) -> float:
    text = c.get("/metrics").text
    return sum(float(m) for m in re.findall(r"^cosyserve_in_flight_requests\{[^}]*\} (\S+)$", text, re.M))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the server's peak RSS from /proc")
def test_the_longest_request_over_http_ends_at_its_deadline_and_frees_the_model(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The issue's finding: 4096 unpunctuated letters, wav, not streamed, ran for 20 minutes past its 504 and
    took every later request with it. With a 3 s deadline the request must end (504), in-flight return to 0,
    the next request be served, and the server's memory stay bounded."""
    with running_server(tiny_model_dir, tmp_path, args=["--request-timeout", "3"]) as server:
        with server.client(timeout=120.0) as c:
            body = {
                "model": "tiny-Instruct",
                "input": UNPUNCTUATED,
                "voice": "英文女",
                "response_format": "wav",
                "stream": False,
            }
            r = c.post("/v1/audio/speech", json=body)
            assert r.status_code == 504, r.text[:300]
            end = time.monotonic() + 60
            while _in_flight(c) and time.monotonic() < end:
                time.sleep(0.1)
            assert _in_flight(c) == 0, "the request still holds the model"
            ok = c.post("/v1/audio/speech", json={**body, "input": "Hello there."})
            assert ok.status_code == 200 and ok.content[:4] == b"RIFF"
            peak = _rss_peak_mb(server.proc.pid)
    assert peak < 2000, f"peak RSS {peak:.0f} MB (it passed 12 GB before the fix)"


def test_sigterm_during_the_longest_request_exits_within_the_grace(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """SIGTERM took 6 min 43 s with such a request in flight (compose and Kubernetes kill at 40 s): the drain
    must end it at the grace and the process exit."""
    server = start_server(
        tiny_model_dir, tmp_path, args=["--request-timeout", "600", "--shutdown-grace", "2"]
    )
    try:
        body = {"model": "tiny-Instruct", "input": UNPUNCTUATED, "voice": "英文女", "stream": False}
        result: dict[str, Any] = {}

        def post() -> None:
            try:
                with server.client(timeout=120.0) as c:
                    result["status"] = c.post("/v1/audio/speech", json=body).status_code
            except httpx.HTTPError as e:
                result["error"] = e

        t = threading.Thread(target=post)
        t.start()
        with server.client() as c:  # the request is running
            end = time.monotonic() + 60
            while not _in_flight(c) and time.monotonic() < end:
                time.sleep(0.05)
            assert _in_flight(c) == 1
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(60)  # generous: a wedged request held it for minutes
        t.join(60)
    finally:
        server.stop(grace_s=5)
    assert code == 0, server.log()[-3000:]
    assert result.get("status") != 200, "the cut request must not look complete"
