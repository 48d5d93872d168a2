"""Write 16-bit PCM WAV files atomically (a failed or interrupted write leaves no partial file)."""

from __future__ import annotations

import os
import tempfile
import wave
from collections.abc import Iterable
from pathlib import Path

import numpy as np

__all__ = ["float_to_pcm16", "write_wav_atomic"]


def float_to_pcm16(audio: np.ndarray) -> bytes:
    """float audio in [-1, 1] -> little-endian int16 bytes (clipped, scaled by 32767)."""
    return (np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def write_wav_atomic(path: str | Path, chunks: Iterable[np.ndarray], sample_rate: int) -> float:
    """Write mono float chunks to ``path`` as 16-bit PCM; returns the duration in seconds.

    The audio goes to a temporary file beside ``path`` that is renamed over it only after the last chunk, so
    an exception in the middle (a bad request, Ctrl-C) leaves no partial WAV behind.
    """
    path = Path(path)
    from cosyserve.staging import file_mode

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    samples = 0
    try:
        os.fchmod(fd, file_mode())  # mkstemp makes it private; the WAV is an ordinary file
        with os.fdopen(fd, "wb") as f, wave.open(f, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(sample_rate)
            for chunk in chunks:
                w.writeframes(float_to_pcm16(np.asarray(chunk, dtype=np.float32).reshape(-1)))
                samples += int(np.asarray(chunk).size)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return samples / sample_rate
