"""The audio formats a request may name, as facts (pure Python): each format's media type, which can be streamed,
the rates each codec takes, and why this server cannot give a format or a rate. A request's delivery is checked
with these (:meth:`cosyserve.core.limits.Limits.output`) before any audio is made; the encoders themselves are
:mod:`cosyserve.server.audiofile`'s."""

from __future__ import annotations

import functools
import importlib.util

from cosyserve.core.errors import shown

__all__ = [
    "FORMATS",
    "MAX_SAMPLE_RATE",
    "MEDIA_TYPES",
    "OPENAI_SAMPLE_RATE",
    "RATES",
    "RAW",
    "STREAMABLE",
    "codec_rate",
    "format_error",
    "rate_error",
]

MEDIA_TYPES = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
}
FORMATS = tuple(MEDIA_TYPES)
STREAMABLE = ("wav", "pcm", "mp3", "opus", "aac", "raw")
RAW = "raw"  # the reference endpoints' int16 PCM: pcm's bytes as application/octet-stream
OPENAI_SAMPLE_RATE = 24000  # OpenAI's rate for every format; pcm clients (Pipecat, LiveKit) assume it
MAX_SAMPLE_RATE = 384_000
# the rates a codec takes (a format not listed: any positive rate up to MAX_SAMPLE_RATE)
RATES = {
    "mp3": (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000),
    "opus": (8000, 12000, 16000, 24000, 48000),
    "aac": (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000),
}


@functools.cache
def _has_pyav() -> bool:
    return importlib.util.find_spec("av") is not None


def format_error(fmt: str) -> str | None:
    """Why this server cannot encode ``fmt`` (one of :data:`FORMATS`), naming the install that fixes it; None if
    it can."""
    if fmt == "aac" and not _has_pyav():
        return (
            "aac needs PyAV, which this server does not have installed (about 100 MB, so it is an extra): its "
            "operator can add it with pip install 'cosyserve[aac]'; mp3, opus, wav, flac and pcm need nothing more"
        )
    return None


def rate_error(fmt: str, rate: object) -> str | None:
    """Why audio in ``fmt`` cannot be given at ``rate`` samples per second (``rate`` as the caller gave it, any
    JSON value); None if it can."""
    if isinstance(rate, bool) or not isinstance(rate, int) or not 0 < rate <= MAX_SAMPLE_RATE:
        return (
            f"must be a whole number of samples per second between 1 and {MAX_SAMPLE_RATE}, got {shown(rate)}"
        )
    rates = RATES.get(fmt)
    if rates is not None and rate not in rates:
        return f"{rate} Hz is not a rate {fmt} takes; choose one of {', '.join(map(str, rates))}"
    return None


def codec_rate(fmt: str, sample_rate: int) -> int:
    """The rate ``fmt`` is encoded at when nobody asks for one: ``sample_rate`` (the model's), or where the codec
    does not take it the next rate it does (the highest it takes, above those)."""
    rates = RATES.get(fmt)
    if rates is None or sample_rate in rates:
        return sample_rate
    return next((r for r in rates if r >= sample_rate), rates[-1])
