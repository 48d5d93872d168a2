"""The torch-free prompt features (cosyserve.frontend.features_np, for the lite runtime) against the torch ones
and the reference fixtures, and importable with torch unimportable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyserve.frontend import features as torch_features
from cosyserve.frontend import features_np
from cosyserve.frontend.features import MelSpectrogramConfig

SRC = str(Path(__file__).resolve().parents[1] / "src")


# the prompt mels of CosyVoice-300M (the function's defaults), CosyVoice2 (24 kHz, fmax 8000) and CosyVoice3 (fmax
# None: up to 12 kHz), and one with a window shorter than the FFT, centred (what the yaml's settings may say)
MELS = [
    None,
    MelSpectrogramConfig(
        n_fft=1920, num_mels=80, sampling_rate=24000, hop_size=480, win_size=1920, fmax=8000
    ),
    MelSpectrogramConfig(
        n_fft=1920, num_mels=80, sampling_rate=24000, hop_size=480, win_size=1920, fmax=None
    ),
    MelSpectrogramConfig(
        n_fft=1024, num_mels=80, sampling_rate=24000, hop_size=240, win_size=960, center=True
    ),
]


@pytest.mark.parametrize("n", [24000, 2 * 24000 + 123])
def test_numpy_features_equal_the_torch_ones(n: int) -> None:
    """The numpy STFT/mel path gives what the torch path gives (float32 rounding apart), for every family's prompt
    mel settings and whisper's log-mel: a lite runtime's prompt features feed the same flow and speech tokenizer.
    If this failed, zero-shot voices would sound different on the two runtimes."""
    x = (np.random.default_rng(n).standard_normal((1, n)) * 0.1).astype(np.float32)
    t = torch.from_numpy(x)
    pairs = [(torch_features.whisper_log_mel(t), features_np.whisper_log_mel(x))]
    for mel in MELS:
        if mel is None:
            pairs.append((torch_features.mel_spectrogram(t), features_np.mel_spectrogram(x)))
        else:  # the one settings object: a tensor in, torch's mel; an array in, numpy's
            pairs.append((mel(t), mel(x)))
    for a, b in pairs:
        assert isinstance(a, torch.Tensor) and isinstance(b, np.ndarray) and b.dtype == np.float32
        assert a.shape == b.shape
        assert np.abs(a.numpy() - b).max() < 1e-5


def test_numpy_features_import_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; import numpy as np; "
        "from cosyserve.frontend import features_np as f; "
        "print(f.whisper_log_mel(np.zeros((1, 16000), np.float32)).shape)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": SRC})
    assert r.returncode == 0 and "(1, 128, 100)" in r.stdout, r.stderr
