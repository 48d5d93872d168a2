"""Streaming chunk policies: the reference's rule (what conformance checks) and the low-latency one (the default
of the server and the Python API), their hops, their first chunk, and the settings that choose them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import cosyserve
from cosyserve.core.errors import SettingsError
from cosyserve.core.settings import Settings
from cosyserve.families.cosyvoice.token2wav import StreamPolicy, Token2Wav
from cosyserve.runtime import RuntimeOptions


def hops(policy: StreamPolicy, n: int) -> list[int]:
    out, hop = [], policy.first_hop
    for _ in range(n):
        out.append(hop)
        hop = policy.next_hop(hop)
    return out


def test_reference_policy_keeps_the_reference_rule() -> None:
    # conformance's token2wav cases build Token2Wav without a policy: they must get the reference's 2 s hops
    assert StreamPolicy() == StreamPolicy.named("reference", 25)
    assert hops(StreamPolicy(), 4) == [100, 100, 100, 100]


def test_low_latency_hops_start_short_and_double_to_the_longest() -> None:
    assert hops(StreamPolicy.named("low-latency", 25), 6) == [25, 50, 100, 200, 200, 200]
    assert hops(StreamPolicy.named("low-latency", 15), 6) == [15, 30, 60, 120, 200, 200]


def test_a_first_hop_too_short_for_the_vocoder_cache_is_refused() -> None:
    # 11 + 20 tokens -> 53 mel frames; 34 are held for the fade, leaving 19 < the vocoder's 20-frame cache
    with pytest.raises(ValueError, match="first_hop_len must be >= 12"):
        StreamPolicy.named("low-latency", 11)
    assert StreamPolicy().min_first_hop == 12
    with pytest.raises(ValueError, match="unknown chunk policy 'fast'"):
        StreamPolicy.named("fast", 25)


class _Counting:
    """Speech tokens that record how many were consumed, and a flow that records what each call saw."""

    def __init__(self, flow: Any) -> None:
        self.flow = flow
        self.consumed = 0
        self.calls: list[int] = []

    def tokens(self, n: int) -> Iterator[int]:
        g = torch.Generator().manual_seed(3)
        for t in torch.randint(0, 100, (n,), generator=g).tolist():
            self.consumed += 1
            yield t

    def __getattr__(self, name: str) -> Any:
        return getattr(self.flow, name)

    def inference(self, token: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(token.shape[1])
        return self.flow.inference(token, *args, **kwargs)


@pytest.fixture(scope="module")
def modules(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    m = cosyserve.load(tiny_model_dir, warmup=False, text_tier="lazy")
    t2w = m.runtime.pipeline.token2wav
    emb = m.runtime.pipeline.speakers[m.speakers[0]]["embedding"]
    return t2w.flow, t2w.hift, emb


@pytest.mark.parametrize("first_hop", [12, 21, 25])
def test_low_latency_first_chunk_needs_only_first_hop_plus_overlap_tokens(modules, first_hop: int) -> None:  # type: ignore[no-untyped-def]
    flow, hift, emb = modules
    counting = _Counting(flow)
    policy = StreamPolicy.named("low-latency", first_hop)
    t2w = Token2Wav(counting, hift, policy)
    stream = t2w(counting.tokens(150), embedding=emb, stream=True, generator=torch.Generator().manual_seed(0))
    first = next(stream)
    # the first audio must not wait for more tokens than its window: with the reference rule it waited for 120
    assert counting.consumed == first_hop + policy.token_overlap_len
    assert counting.calls == [first_hop + policy.token_overlap_len]
    assert first.shape[1] == (policy.mel_frames(first_hop + 20) - 34) * 256 - 5120
    rest = list(stream)
    # windows: each hop + 20 overlap tokens, the hops doubling; the rest in one finalizing call
    want, left, hop = [], 150, first_hop
    while left >= hop + 20:
        want.append(hop + 20)
        left -= hop
        hop = policy.next_hop(hop)
    assert counting.calls == [*want, left]
    assert len(rest) == len(want)


def test_streamed_length_matches_the_windows(modules) -> None:  # type: ignore[no-untyped-def]
    # every chunk but the first carries the previous window's held-back 20 vocoder frames; the finalizing call
    # holds nothing back: the streamed total is the sum of the windows' emitted frames
    flow, hift, emb = modules
    policy = StreamPolicy.named("low-latency", 21)
    chunks = list(
        Token2Wav(flow, hift, policy)(range(250), embedding=emb, stream=True, generator=torch.Generator())
    )
    windows = [41, 62, 104, 103]  # hops 21, 42, 84; then 103 < 168 + 20 tokens left: the finalizing call
    frames = sum(policy.mel_frames(w) - 34 for w in windows[:-1]) + policy.mel_frames(windows[-1])
    assert sum(c.shape[1] for c in chunks) == frames * 256


def test_api_and_server_default_to_low_latency(tiny_model_dir: Path) -> None:
    settings = Settings.load(env={})
    assert settings.chunk_policy == "low-latency"
    options = RuntimeOptions.from_settings(settings)
    assert (options.chunk_policy, options.first_hop) == ("low-latency", settings.first_hop_tokens)
    m = cosyserve.load(tiny_model_dir, warmup=False, text_tier="lazy", settings=settings)
    assert m.runtime.pipeline.token2wav.policy.first_hop == settings.first_hop_tokens  # type: ignore[attr-defined]
    r = cosyserve.load(
        tiny_model_dir, warmup=False, text_tier="lazy", chunk_policy="reference", first_hop_tokens=30
    )
    assert r.runtime.pipeline.token2wav.policy == StreamPolicy()  # type: ignore[attr-defined]


def test_low_latency_stream_starts_sooner_through_the_api(tiny_model_dir: Path) -> None:
    text = "This is a somewhat longer sentence to speak."
    ll = cosyserve.load(tiny_model_dir, warmup=False, text_tier="lazy", first_hop_tokens=21)
    ref = cosyserve.load(tiny_model_dir, warmup=False, text_tier="lazy", chunk_policy="reference")
    a = list(ll.synthesize(text, "英文男", stream=True, seed=1))
    b = list(ref.synthesize(text, "英文男", stream=True, seed=1))
    # same tokens (same seed); the first low-latency chunk is the 41-token window's audio
    assert a[0].size == (int(41 / 50 * 22050 / 256) - 34) * 256 - 5120 < b[0].size
    assert len(a) > len(b)
    assert all(c.dtype == np.float32 and c.ndim == 1 for c in a)


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        (
            {"COSYSERVE_CHUNK_POLICY": "fast"},
            "COSYSERVE_CHUNK_POLICY='fast': expected one of reference, low-latency",
        ),
        ({"COSYSERVE_FIRST_HOP_TOKENS": "5"}, "COSYSERVE_FIRST_HOP_TOKENS='5': must be between 12 and 200"),
        ({"COSYSERVE_FIRST_HOP_TOKENS": "x"}, "COSYSERVE_FIRST_HOP_TOKENS='x': expected an integer"),
    ],
)
def test_bad_chunk_settings_name_the_variable(env: dict[str, str], needle: str) -> None:
    with pytest.raises(SettingsError, match=needle):
        Settings.load(env=env)


def test_runtime_options_check_the_chunk_fields() -> None:
    with pytest.raises(ValueError, match="chunk_policy must be one of reference, low-latency"):
        RuntimeOptions(chunk_policy="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="first_hop must be an integer between 12 and 200"):
        RuntimeOptions(first_hop=500)
