"""The public API end to end on a tiny random-weight model."""

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cosyserve
from cosyserve.core.errors import ClientError


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    return cosyserve.load(tiny_model_dir)


def test_load_exposes_speakers_and_rate(model) -> None:  # type: ignore[no-untyped-def]
    assert model.sample_rate == 22050
    assert "英文女" in model.speakers and model.speakers == sorted(model.speakers)


def test_seed_reproducible_and_seeds_differ(model) -> None:  # type: ignore[no-untyped-def]
    a = model.synthesize_all("Hello world.", "英文女", seed=7)
    b = model.synthesize_all("Hello world.", "英文女", seed=7)
    c = model.synthesize_all("Hello world.", "英文女", seed=8)
    assert a.dtype == np.float32 and a.ndim == 1 and a.size > 0
    assert np.array_equal(a, b), "same seed must give the same audio"
    assert a.shape != c.shape or not np.array_equal(a, c), "different seeds gave identical audio"
    assert np.abs(a).max() <= 0.99 + 1e-6  # the vocoder's audio_limit


def test_stream_yields_chunks_in_hop_sized_steps(tiny_model_dir: Path) -> None:
    # a ~10-token text allows up to 200 speech tokens: enough for at least one 120-token window
    model = cosyserve.load(tiny_model_dir, chunk_policy="reference", warmup=False)
    chunks = list(
        model.synthesize("This is a somewhat longer sentence to speak.", "英文男", stream=True, seed=1)
    )
    assert len(chunks) >= 2
    assert all(c.dtype == np.float32 and c.ndim == 1 for c in chunks)
    # reference window rules: 120 tokens -> int(120/50*22050/256) mel frames, 34 kept back for the fade,
    # 20 frames of vocoder context prepended from the second window on, 5120 samples held for the cross-fade
    frames = int(120 / 50 * 22050 / 256) - 34
    assert chunks[0].size == frames * 256 - 5120
    for c in chunks[1:-1]:
        assert c.size == (frames + 20) * 256 - 5120


def test_speed_changes_duration(model) -> None:  # type: ignore[no-untyped-def]
    base = model.synthesize_all("Hello world.", "英文女", seed=5)
    fast = model.synthesize_all("Hello world.", "英文女", seed=5, speed=2.0)
    assert fast.size == pytest.approx(base.size / 2, abs=256)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"text": "Hi.", "speaker": "nobody"}, "unknown speaker"),
        ({"text": "", "speaker": "英文女"}, "empty"),
        ({"text": "?!", "speaker": "英文女"}, "nothing to speak"),
        ({"text": "Hi.", "speaker": "英文女", "speed": 5.0}, "speed"),
        ({"text": "Hi.", "speaker": "英文女", "speed": 1.5, "stream": True}, "stream"),
    ],
)
def test_bad_requests(model, kwargs, needle) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ClientError, match=needle):
        list(model.synthesize(**kwargs))


def test_concurrent_calls_of_one_loaded_model_take_turns(tiny_model_dir: Path) -> None:
    """A model loaded with one slot keeps its LM's caches on the module: two threads calling it at once shared
    them and both got wrong audio, silently. They must take turns and each get the audio it gets alone."""
    import threading

    import numpy as np

    import cosyserve

    model = cosyserve.load(tiny_model_dir, warmup=False, batch_size=1)
    texts = ["Hello there, the first voice speaks.", "And this one is the second request."]
    alone = [model.synthesize_all(t, seed=i) for i, t in enumerate(texts)]
    together: list[Any] = [None, None]

    def run(i: int) -> None:
        together[i] = model.synthesize_all(texts[i], seed=i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for a, b in zip(alone, together, strict=True):
        assert b is not None and a.shape == b.shape and np.array_equal(a, b)
    model.close()
