"""CosyVoice2's streaming token2wav rules (cosyserve.families.cosyvoice2.token2wav) with stand-in flow and
vocoder models.

The stand-ins record every call, so the tests check the reference's chunk schedule itself: the first hop of
25 + prompt pad tokens, 3 lookahead tokens, the flow re-run on all tokens from the start, doubling hops up to
100, a final full-attention call, and every request starting afresh at the first hop (the reference carries
the doubled hop into its next request). Exact audio is the conformance fixtures' job (token2wav_* kinds).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cosyserve.families.cosyvoice2.token2wav import StreamPolicy2, Token2Wav2


class FakeFlow:
    """Mel frames = 2 per token (prompt included, lookahead excluded unless finalizing); records its calls."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def inference(
        self,
        token,
        prompt_token,
        prompt_feat,
        embedding,
        *,
        streaming,
        finalize,
        n_timesteps=None,
        should_stop=None,
    ):  # type: ignore[no-untyped-def]
        n = token.shape[1] if finalize else token.shape[1] - 3
        self.calls.append({"tokens": token.shape[1], "streaming": streaming, "finalize": finalize})
        return torch.arange(2 * n, dtype=torch.float32).repeat(1, 80, 1)


class FakeHift:
    def __init__(self) -> None:
        self.frames: list[int] = []

    def inference(self, mel, cache_source, generator=None, **draws):  # type: ignore[no-untyped-def]
        self.frames.append(mel.shape[2])
        n = mel.shape[2] * 480
        return torch.ones(1, n), torch.zeros(1, 1, n)


def run(
    tokens: int, prompt: int = 0, stream: bool = True, policy: StreamPolicy2 | None = None
) -> tuple[Any, ...]:
    flow, hift = FakeFlow(), FakeHift()
    t2w = Token2Wav2(flow, hift, policy)
    chunks = list(
        t2w(
            iter(range(tokens)),
            embedding=torch.zeros(1, 192),
            prompt_token=torch.zeros(1, prompt, dtype=torch.int32),
            prompt_feat=torch.zeros(1, 2 * prompt, 80),
            stream=stream,
        )
    )
    return flow.calls, hift.frames, chunks


def test_stream_schedule_follows_the_reference_hops() -> None:
    """No prompt: calls on 28, 78, 178 tokens (hops 25, 50, 100, each + 3 lookahead), then the rest with full
    attention. A wrong hop or lookahead moves every chunk boundary against the reference's."""
    calls, frames, chunks = run(300)
    assert [c["tokens"] for c in calls] == [28, 78, 178, 278, 300]
    assert [c["streaming"] for c in calls] == [True, True, True, True, False]
    assert [c["finalize"] for c in calls] == [False, False, False, False, True]
    # the vocoder sees the new frames plus the 8 cached ones (none before the first call)
    assert frames == [50, 8 + 100, 8 + 200, 8 + 200, 8 + 2 * 300 - 2 * 275]
    # every chunk but the last holds back 3840 samples for the cross-fade
    assert [c.shape[1] for c in chunks[:-1]] == [50 * 480 - 3840] + [(f * 480) - 3840 for f in frames[1:-1]]


def test_prompt_pad_tops_the_first_hop_up_to_a_whole_chunk() -> None:
    """A 30-token prompt pads the first hop by 20 (to 50 prompt+hop tokens: two 25-token attention chunks)."""
    calls, _, _ = run(120, prompt=30)
    assert [c["tokens"] for c in calls][:2] == [25 + 20 + 3, 45 + 50 + 3]


def test_low_latency_hops_end_on_whole_attention_chunks() -> None:
    """After a short first hop the hops end on 25-token chunks (from the padded prompt): the flow keeps whole
    chunks only, so a hop ending mid-chunk would compute up to 24 tokens' frames twice. A 21-token first hop
    after a 30-token prompt (pad 20): ends at 21, 50, 100, 200 tokens past the padded prompt, not 21, 63, 147."""
    calls, _, _ = run(260, prompt=30, policy=StreamPolicy2.named("low-latency", 21))
    ends = [c["tokens"] - 3 - 20 for c in calls[:-1]]
    assert ends == [21, 50, 100, 200], ends


def test_every_request_starts_at_the_first_hop() -> None:
    """The reference doubles its hop on the model object, so its second streaming request starts at 50 or 100
    tokens; here the second request's schedule equals the first's."""
    flow, hift = FakeFlow(), FakeHift()
    t2w = Token2Wav2(flow, hift)
    for _ in range(2):
        list(t2w(iter(range(200)), embedding=torch.zeros(1, 192), stream=True))
    schedule = [c["tokens"] for c in flow.calls]
    half = len(schedule) // 2
    assert schedule[:half] == schedule[half:] == [28, 78, 178, 200]


def test_the_stream_state_is_made_when_its_first_call_is_due() -> None:
    """A stream's flow state (its voice's fork, or the prompt's frames computed now) is made when its first call
    is due, after the LM's first hop, not at its first token: a first request after READY decodes its first hop
    while the flow's session opens (lite), and a request that speaks nothing makes none. If this failed, the first
    request would wait for the flow before its LM's second token."""
    t2w = Token2Wav2(FakeFlow(), FakeHift())
    drawn: list[int] = []
    made: list[int] = []

    def tokens(n: int) -> Any:
        for i in range(n):
            drawn.append(i)
            yield i

    real = t2w.new_stream

    def spy(*args: Any, **kwargs: Any) -> Any:
        made.append(len(drawn))
        return real(*args, **kwargs)

    t2w.new_stream = spy  # type: ignore[method-assign]
    for n, expected in ((100, [28]), (10, [10]), (0, [])):  # first hop 25 + 3 lookahead; a short one; none
        drawn.clear()
        made.clear()
        list(t2w(tokens(n), embedding=torch.zeros(1, 192), stream=True))
        assert made == expected, (n, made)


def test_one_shot_is_one_full_attention_call() -> None:
    calls, frames, chunks = run(60, stream=False)
    assert calls == [{"tokens": 60, "streaming": False, "finalize": True}]
    assert len(chunks) == 1 and chunks[0].shape[1] == 120 * 480


def test_low_latency_policy_starts_with_a_shorter_hop() -> None:
    """A 10-token first hop, then hops that end on whole 25-token chunks (25, 50)."""
    calls, _, _ = run(100, policy=StreamPolicy2.named("low-latency", 10))
    assert [c["tokens"] for c in calls][:3] == [13, 28, 53]


@pytest.mark.parametrize("hop", [0, 3, 101])
def test_a_first_hop_that_cannot_fill_the_vocoder_cache_is_refused(hop: int) -> None:
    with pytest.raises(ValueError, match="first_hop_len"):
        StreamPolicy2(first_hop_len=hop)


@pytest.mark.parametrize("stream", [True, False])
def test_each_step_runs_without_autograd_and_leaves_the_mode_to_its_caller(stream: bool) -> None:
    """The flow and the vocoder compute in inference mode; the token source (the LM) and the code that consumes a
    chunk run in their own mode. If this fails, either autograd records every flow step (memory and time), or
    the mode leaks across a yield into the caller's code (its tensors become inference tensors it cannot train
    or update in place outside the mode)."""
    modes: dict[str, list[bool]] = {"flow": [], "tokens": [], "caller": []}
    flow, hift = FakeFlow(), FakeHift()
    inference = flow.inference

    def recorded(*args: Any, **kwargs: Any) -> Any:
        modes["flow"].append(torch.is_inference_mode_enabled())
        return inference(*args, **kwargs)

    flow.inference = recorded  # type: ignore[method-assign]

    def tokens() -> Any:
        for t in range(120):
            modes["tokens"].append(torch.is_inference_mode_enabled())
            yield t

    for chunk in Token2Wav2(flow, hift)(tokens(), embedding=torch.zeros(1, 192), stream=stream):
        modes["caller"].append(torch.is_inference_mode_enabled())
        assert chunk.is_inference(), "a chunk computed with autograd on"
    assert modes["flow"] and all(modes["flow"]), modes["flow"]
    assert not any(modes["tokens"]) and not any(modes["caller"]), modes
    assert len(modes["caller"]) == (3 if stream else 1), modes["caller"]
