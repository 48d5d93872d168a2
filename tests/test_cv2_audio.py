"""CosyVoice2's audio pieces on the tiny random-weight model: the 24 kHz vocoder's SineGen2 draws, the 24 kHz
prompt mel's frame rule and the prompt trimming to two mel frames per speech token."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import torch


@pytest.fixture(scope="module")
def pipeline(cv2_model_dir: Path) -> Any:
    from cosyserve.runtime import RuntimeOptions, load_runtime

    return load_runtime(cv2_model_dir, RuntimeOptions(warmup=False, text_tier="lazy")).pipeline


def test_sinegen2_takes_its_draws_from_the_caller_only(pipeline: Any) -> None:
    """Given draws, the 24 kHz vocoder is deterministic and leaves the global RNG alone; with a generator, the
    same seed gives the same audio. If this failed, seeded requests would not repeat, or a request would
    disturb every other user of torch's global RNG."""
    hift = pipeline.token2wav.hift
    assert hift.sinegen2 and hift.cfg.upsample_factor == 480
    T, H = 3, hift.cfg.nb_harmonics + 1
    L = T * 480
    mel = torch.randn(1, hift.cfg.in_channels, T)
    phase, noise = torch.rand(1, H), torch.randn(1, L, H)
    state = torch.get_rng_state()
    a = hift.inference(mel, None, sine_phase=phase, sine_noise=noise)
    b = hift.inference(mel, None, sine_phase=phase, sine_noise=noise)
    c = hift.inference(mel, None, generator=torch.Generator().manual_seed(1))
    d = hift.inference(mel, None, generator=torch.Generator().manual_seed(1))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a[0], b[0]) and torch.equal(c[0], d[0]) and a[0].shape == (1, L)
    with pytest.raises(ValueError, match="SineGen2"):
        hift.inference(mel, None, sine_phase=torch.rand(1, H, 1), sine_noise=noise)


@pytest.mark.parametrize("n", [480 * 4, 480 * 4 + 479, 480 * 5])
def test_the_24k_prompt_mel_has_a_frame_per_480_samples(n: int) -> None:
    from cosyserve.frontend.features import mel_spectrogram_24k

    assert mel_spectrogram_24k(torch.randn(1, n)).shape == (1, 80, n // 480)


def test_prompt_features_keep_two_mel_frames_per_token(pipeline: Any) -> None:
    """CosyVoice2's trimming (its family's prompt_mel_per_token 2, the reference's resample_rate 24000): n =
    min(frames // 2, tokens); feat keeps 2n frames and the tokens n, so the flow's prompt mel and prompt tokens line
    up. Without it the flow refuses the prompt."""
    t = np.arange(int(2.3 * 16000)) / 16000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), 16000, format="WAV")
    prompt = pipeline.extract_prompt(buf.getvalue(), "Hello there.")
    n = prompt["flow_prompt_speech_token"].shape[1]
    assert prompt["prompt_speech_feat"].shape == (1, 2 * n, 80) and n > 0
    assert int(prompt["prompt_speech_feat_len"]) == 2 * n and int(prompt["flow_prompt_speech_token_len"]) == n
