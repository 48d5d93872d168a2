"""Conformance kinds for CosyVoice2's vocoder and features: ``hift_inference``, ``mel``, ``whisper_logmel``,
``resample`` (KINDS-cosyvoice2.md)."""

from __future__ import annotations

from typing import Any


def hift2(ctx: Any) -> Any:
    """The set's 24 kHz HiFT (from the model dir, or from its bundle with --via-bundle), loaded once."""
    return ctx.hift()


def run_hift_inference(ctx: Any, inputs: dict) -> dict:
    # draws recorded: sine_rand_ini [1, 9], sine_noise [1, L, 9], source_noise (unused by any output)
    speech, source = hift2(ctx).inference(
        inputs["speech_feat"],
        inputs["cache_source"],
        sine_phase=inputs["sine_rand_ini"],
        sine_noise=inputs["sine_noise"],
    )
    return {"speech": speech, "source": source}


def run_mel(ctx: Any, inputs: dict) -> dict:
    from cosyserve.frontend.features import mel_spectrogram_24k

    return {"mel": mel_spectrogram_24k(inputs["speech"].float())}


def _shared(kind: str) -> Any:
    # whisper_logmel and resample mean the same as for CosyVoice-300M sets (128 mels; load_wav to the target)
    from cosyserve.conformance.kinds_features import KINDS as FEATURES

    return FEATURES[kind]


KINDS = {
    "hift_inference": run_hift_inference,
    "mel": run_mel,
    "whisper_logmel": lambda ctx, inputs: _shared("whisper_logmel")(ctx, inputs),
    "resample": lambda ctx, inputs: _shared("resample")(ctx, inputs),
}
