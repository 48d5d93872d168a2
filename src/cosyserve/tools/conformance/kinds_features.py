"""Conformance kinds for the audio input path: `mel`, `fbank`, `whisper_logmel`, `resample`."""

from __future__ import annotations

from typing import Any

import torch

from cosyserve.frontend.audio import load_wav
from cosyserve.frontend.features import mel_spectrogram, speaker_fbank, whisper_log_mel


def run_mel(ctx: Any, inputs: dict) -> dict:
    return {"mel": mel_spectrogram(inputs["speech"].float())}


def run_fbank(ctx: Any, inputs: dict) -> dict:
    return {"fbank": speaker_fbank(inputs["speech"].float())}


def run_whisper_logmel(ctx: Any, inputs: dict) -> dict:
    return {"logmel": whisper_log_mel(inputs["speech"].float(), n_mels=128)}


def run_resample(ctx: Any, inputs: dict) -> dict:
    speech: torch.Tensor = load_wav(ctx.set_dir / inputs["wav"], int(inputs["target_sr"]))
    return {"speech": speech}


KINDS = {
    "mel": run_mel,
    "fbank": run_fbank,
    "whisper_logmel": run_whisper_logmel,
    "resample": run_resample,
}
