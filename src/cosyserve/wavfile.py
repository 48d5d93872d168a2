"""Write audio files atomically (a failed or interrupted write leaves no partial file).

WAV (16-bit PCM) is written as the chunks come; FLAC, MP3, Opus and raw PCM are encoded when the last chunk is
in, by the server's encoders (:func:`cosyserve.server.encode.encode_all`).
"""

from __future__ import annotations

import os
import tempfile
import wave
from collections.abc import Iterable
from pathlib import Path

import numpy as np

__all__ = ["float_to_pcm16", "write_audio_atomic", "write_wav_atomic"]


def float_to_pcm16(audio: np.ndarray) -> bytes:
    """float audio in [-1, 1] -> little-endian int16 bytes (clipped, scaled by 32767)."""
    return (np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def write_wav_atomic(path: str | Path, chunks: Iterable[np.ndarray], sample_rate: int) -> float:
    """Write mono float chunks to ``path`` as 16-bit PCM WAV; returns the duration in seconds."""
    return write_audio_atomic(path, chunks, sample_rate, "wav")


def write_audio_atomic(
    path: str | Path, chunks: Iterable[np.ndarray], sample_rate: int, fmt: str = "wav"
) -> float:
    """Write mono float chunks to ``path`` in ``fmt``; returns the duration in seconds.

    The audio goes to a temporary file beside ``path`` that is renamed over it only after the last chunk, so
    an exception in the middle (a bad request, Ctrl-C) leaves no partial file behind. A failure to create,
    write or rename the file names ``path``, not the temporary file.

    Args:
        fmt: ``wav`` (16-bit PCM) or a format of :data:`cosyserve.server.encode.FORMATS` (flac, mp3, opus, pcm).
    """
    path = Path(path)
    from cosyserve.staging import file_mode

    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
    samples = 0
    try:
        os.fchmod(fd, file_mode())  # mkstemp makes it private; the audio file is an ordinary one
        with os.fdopen(fd, "wb") as f:
            if fmt == "wav":
                with wave.open(f, "wb") as w:
                    w.setnchannels(1)
                    w.setsampwidth(2)
                    w.setframerate(sample_rate)
                    for chunk in chunks:
                        w.writeframes(float_to_pcm16(np.asarray(chunk, dtype=np.float32).reshape(-1)))
                        samples += int(np.asarray(chunk).size)
            else:
                from cosyserve.server.encode import encode_all

                audio = [np.asarray(chunk, dtype=np.float32).reshape(-1) for chunk in chunks]
                samples = sum(a.size for a in audio)
                f.write(encode_all(audio, fmt, sample_rate))
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError) and tmp in (e.filename, e.filename2):
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    return samples / sample_rate
