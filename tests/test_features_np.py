"""The torch-free prompt features (cosyserve.frontend.features_np, for the lite runtime) against the torch ones
and the reference fixtures, and importable with torch unimportable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyserve.frontend import features as torch_features
from cosyserve.frontend import features_np

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.mark.parametrize("n", [24000, 2 * 24000 + 123])
def test_numpy_features_equal_the_torch_ones(n: int) -> None:
    """The numpy STFT/mel path gives what the torch path gives (float32 rounding apart): a lite runtime's prompt
    features feed the same flow and speech tokenizer. If this failed, zero-shot voices would sound different
    on the two runtimes."""
    x = (np.random.default_rng(n).standard_normal((1, n)) * 0.1).astype(np.float32)
    t = torch.from_numpy(x)
    pairs = [
        (torch_features.mel_spectrogram(t), features_np.mel_spectrogram(x)),
        (torch_features.mel_spectrogram_24k(t), features_np.mel_spectrogram_24k(x)),
        (torch_features.whisper_log_mel(t), features_np.whisper_log_mel(x)),
    ]
    for a, b in pairs:
        assert a.shape == b.shape and b.dtype == np.float32
        assert np.abs(a.numpy() - b).max() < 1e-5


def test_numpy_features_pass_the_cosyvoice2_fixtures(cv2_set_dir: Path) -> None:
    """The recorded mel and whisper_logmel cases, within their tolerances."""
    from safetensors.numpy import load_file

    tensors = load_file(str(cv2_set_dir / "tensors.safetensors"))
    cases = json.loads((cv2_set_dir / "cases.json").read_text())["cases"]
    fns = {"mel": features_np.mel_spectrogram_24k, "whisper_logmel": features_np.whisper_log_mel}
    checked = 0
    for case in cases:
        if case["kind"] in fns:
            got = fns[case["kind"]](tensors[case["inputs"]["speech"]["tensor"]])
            (out,) = case["outputs"].values()
            exp = tensors[out["tensor"]]
            assert np.all(np.abs(got - exp) <= case["atol"] + case["rtol"] * np.abs(exp)), case["name"]
            checked += 1
    assert checked == 2


def test_numpy_features_import_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; import numpy as np; "
        "from cosyserve.frontend import features_np as f; "
        "print(f.whisper_log_mel(np.zeros((1, 16000), np.float32)).shape)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": SRC})
    assert r.returncode == 0 and "(1, 128, 100)" in r.stdout, r.stderr
