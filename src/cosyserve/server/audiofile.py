"""Audio files from float chunks: the one encoder every transport sends audio with (HTTP bodies, SSE deltas,
WebSocket frames and their WAV header) and the CLI writes with, and the atomic write of a whole file.

| format | media type | streamed | encoder |
|---|---|---|---|
| ``wav`` | audio/wav | yes: 16-bit PCM after a header with unknown sizes (0xFFFFFFFF), which players accept | ours |
| ``pcm`` | audio/pcm | yes: raw 16-bit signed little-endian mono at the model's rate (header ``X-Sample-Rate``) | ours |
| ``opus`` | audio/ogg | yes: Ogg/Opus pages, resampled to 48 kHz (Opus takes 8/12/16/24/48 kHz) | libsndfile |
| ``flac`` | audio/flac | no: encoded when synthesis ends | libsndfile |
| ``mp3`` | audio/mpeg | no: encoded when synthesis ends (LAME inside libsndfile >= 1.1) | libsndfile |

FLAC and MP3 are not streamed because libsndfile patches their headers at close (STREAMINFO, the LAME tag):
bytes sent before that stay wrong, and a streamed MP3 decodes to only part of its samples. ``raw`` is the
reference server's int16 PCM (``application/octet-stream``), as ``pcm``.

A response's audio goes through one :class:`Encoder`: ``header()``, ``encode(chunk)`` per chunk, ``finish()``.
A format in :data:`STREAMABLE` gives its bytes as the chunks come; another keeps the chunks and encodes them at
``finish()`` (:attr:`Encoder.streamed` tells the caller which, e.g. to run ``finish()`` off its event loop). Where
a later change extends it: a format is a row of :data:`MEDIA_TYPES` (and of :data:`STREAMABLE` when it is encoded
chunk by chunk, with its codec in :class:`Encoder`: ``_SF``'s libsndfile formats today); a rate other than the
model's is refused by :func:`check_rate`, naming ``sample_rate``, until a resampler in :class:`Encoder` gives it
(it resamples for Opus already).

Every 16-bit sample, whoever writes it (a response, ``cosyserve synth --out``, the samples handed to the FLAC
encoder), comes from :func:`to_int16`: one rule, so the same audio gives the same bytes everywhere.
"""

from __future__ import annotations

import io
import os
import struct
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from cosyserve.core.errors import ClientError

__all__ = [
    "FORMATS",
    "MEDIA_TYPES",
    "RAW",
    "STREAMABLE",
    "Encoder",
    "check_rate",
    "encode_all",
    "to_int16",
    "wav_header",
    "write_audio_atomic",
    "write_wav_atomic",
]

MEDIA_TYPES = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
}
FORMATS = tuple(MEDIA_TYPES)
STREAMABLE = ("wav", "pcm", "opus", "raw")
RAW = "raw"  # the reference endpoints' int16 PCM: pcm's bytes as application/octet-stream
_SF = {"flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS")}
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)


def to_int16(chunk: np.ndarray) -> bytes:
    """Float samples -> 16-bit PCM: ``x * 32768``, clipped to [-32768, 32767], truncated toward zero.

    Why this rule: it is the reference's (its server sends ``(x * 2**15).astype(int16)``), so for every sample
    the reference does not wrap our bytes are its bytes; and it inverts the decoder's ``int16 / 32768``
    (:func:`cosyserve.frontend.audio.load_wav`, libsndfile's float reading), so 16-bit audio read and written
    again comes back unchanged. Where the reference wraps a full-scale sample around (1.0 -> -32768), we clip:
    1.0 and above -> 32767, -1.0 and below -> -32768.

    Args:
        chunk: float samples, nominally in [-1, 1], any shape (flattened in C order).

    Returns:
        Little-endian int16 bytes, two per sample.
    """
    x = np.clip(np.asarray(chunk, dtype=np.float32) * 32768.0, -32768.0, 32767.0)
    return x.astype("<i2").tobytes()


def wav_header(sample_rate: int, data_bytes: int | None) -> bytes:
    """44-byte RIFF/WAVE header for mono 16-bit PCM; ``None`` = unknown length (streaming)."""
    data = 0xFFFFFFFF if data_bytes is None else data_bytes
    riff = 0xFFFFFFFF if data_bytes is None else 36 + data_bytes
    return (
        b"RIFF"
        + struct.pack("<I", riff)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", data)
    )


def _codec_rate(fmt: str, sample_rate: int) -> int:
    return 48000 if fmt == "opus" and sample_rate not in _OPUS_RATES else sample_rate


def _resample(chunk: np.ndarray, rate: int, out_rate: int) -> np.ndarray:
    if out_rate == rate:
        return chunk
    # linear interpolation is enough ahead of a lossy codec
    n_out = int(round(len(chunk) * out_rate / rate))
    if n_out == 0:
        return chunk[:0]
    pos = np.arange(n_out) * (rate / out_rate)
    return np.interp(pos, np.arange(len(chunk)), chunk).astype(np.float32)


class _Sink(io.RawIOBase):
    """A write-only file for libsndfile that hands out appended bytes as they come.

    Bytes already sent cannot change, so a seek back to patch them at close is dropped (Ogg does not need it).
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._sent = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        end = self._pos + len(data)
        if end > len(self._buf):
            self._buf.extend(b"\0" * (end - len(self._buf)))
        start = max(self._pos, self._sent)
        if start < end:
            self._buf[start:end] = data[start - self._pos :]
        self._pos = end
        return len(data)

    def read(self, n: int = -1) -> bytes:
        end = len(self._buf) if n is None or n < 0 else min(len(self._buf), self._pos + n)
        out = bytes(self._buf[self._pos : end])
        self._pos = end
        return out

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: len(self._buf)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def take(self) -> bytes:
        out = bytes(self._buf[self._sent :])
        self._sent = len(self._buf)
        return out


def check_rate(sample_rate: int, out_rate: int | None) -> None:
    """Refuse audio at ``out_rate`` from a model that speaks at ``sample_rate`` where they differ (no resampling).

    Raises:
        ClientError: naming ``sample_rate``.
    """
    if out_rate is not None and out_rate != sample_rate:
        raise ClientError(
            f"sample_rate {out_rate} is not the model's: it speaks at {sample_rate} Hz, and the server does not "
            "resample (leave sample_rate out, or resample on the client)",
            param="sample_rate",
        )


class Encoder:
    """Turns float32 chunks into the bytes of one response in ``fmt`` (see the module docstring).

    ``header()`` first, ``encode(chunk)`` per chunk, ``finish()`` last; each returns the bytes to send now (maybe
    empty). A format that is not :attr:`streamed` gives all its bytes at ``finish()``.

    Args:
        fmt: one of :data:`FORMATS`, or :data:`RAW`.
        sample_rate: the rate of the chunks (the model's).
        out_rate: the rate the caller asked for (None: ``sample_rate``).
    Raises:
        ClientError: ``out_rate`` is not ``sample_rate`` (naming ``sample_rate``; no resampling here).
        ValueError: an unknown format.
    """

    def __init__(self, fmt: str, sample_rate: int, out_rate: int | None = None) -> None:
        if fmt not in MEDIA_TYPES and fmt != RAW:
            raise ValueError(f"unknown audio format {fmt!r}; expected one of {', '.join(FORMATS)} or {RAW}")
        check_rate(sample_rate, out_rate)
        self.fmt = fmt
        self.sample_rate = sample_rate
        self.media_type = MEDIA_TYPES.get(fmt, "application/octet-stream")
        self.streamed = fmt in STREAMABLE
        self._chunks: list[np.ndarray] = []  # a whole format's audio, until finish()
        self._sf: Any = None
        self._sink: _Sink | None = None
        self._out_rate = sample_rate
        if self.streamed and fmt in _SF:
            import soundfile as sf

            self._out_rate = _codec_rate(fmt, sample_rate)
            self._sink = _Sink()
            kind, subtype = _SF[fmt]
            self._sf = sf.SoundFile(
                self._sink, mode="w", samplerate=self._out_rate, channels=1, format=kind, subtype=subtype
            )

    @property
    def out_rate(self) -> int:
        """The rate of the audio in the bytes it gives: the codec's (Opus), else the chunks'."""
        return self._out_rate

    def header(self) -> bytes:
        return wav_header(self.sample_rate, None) if self.fmt == "wav" else b""

    def _resample(self, chunk: np.ndarray) -> np.ndarray:
        return _resample(chunk, self.sample_rate, self._out_rate)

    def encode(self, chunk: np.ndarray) -> bytes:
        if not self.streamed:
            self._chunks.append(chunk)
            return b""
        if self._sf is None:
            return to_int16(chunk)
        assert self._sink is not None
        self._sf.write(np.clip(self._resample(np.asarray(chunk, dtype=np.float32)), -1.0, 1.0))
        return self._sink.take()

    def finish(self) -> bytes:
        """The last bytes: a codec's tail, or a whole format's file (CPU work: off an event loop)."""
        if not self.streamed:
            chunks, self._chunks = self._chunks, []
            return encode_all(chunks, self.fmt, self.sample_rate)
        if self._sf is None:
            return b""
        assert self._sink is not None
        self._sf.close()
        return self._sink.take()


def encode_all(chunks: list[np.ndarray], fmt: str, sample_rate: int) -> bytes:
    """A whole (non-streamed) file: exact sizes in the WAV header."""
    if fmt == "wav":
        pcm = b"".join(to_int16(c) for c in chunks)
        return wav_header(sample_rate, len(pcm)) + pcm
    if fmt in ("pcm", RAW):
        return b"".join(to_int16(c) for c in chunks)
    import soundfile as sf

    if fmt not in _SF:
        raise ValueError(f"unknown audio format {fmt!r}; expected one of {', '.join(FORMATS)}")
    audio = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
    out_rate = _codec_rate(fmt, sample_rate)
    buf = io.BytesIO()
    kind, subtype = _SF[fmt]
    samples: np.ndarray = np.clip(_resample(audio, sample_rate, out_rate), -1.0, 1.0)
    if fmt == "flac":  # lossless: the very int16 samples wav/pcm carry (libsndfile would round, not truncate)
        samples = np.frombuffer(to_int16(samples), dtype="<i2")
    sf.write(buf, samples, out_rate, format=kind, subtype=subtype)
    return buf.getvalue()


def write_wav_atomic(path: str | Path, chunks: Iterable[np.ndarray], sample_rate: int) -> float:
    """:func:`write_audio_atomic` in ``wav`` (16-bit PCM); returns the duration in seconds."""
    return write_audio_atomic(path, chunks, sample_rate, "wav")


def write_audio_atomic(
    path: str | Path, chunks: Iterable[np.ndarray], sample_rate: int, fmt: str = "wav"
) -> float:
    """Write mono float chunks to ``path`` in ``fmt``; returns the duration in seconds.

    The audio goes to a temporary file beside ``path`` that is renamed over it only after the last chunk, so
    an exception in the middle (a bad request, Ctrl-C) leaves no partial file behind. A failure to create,
    write or rename the file names ``path``, not the temporary file.

    Args:
        path: the file to write (replaced if it exists).
        chunks: mono float samples (see :func:`to_int16`).
        sample_rate: samples per second of ``chunks``.
        fmt: one of :data:`FORMATS`; ``wav`` and ``pcm`` are written as the chunks come, the others encoded
            when the last chunk is in.

    Returns:
        The duration written, in seconds.
    """
    path = Path(path)
    from cosyserve.system.staging import file_mode

    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
    samples = 0
    try:
        os.fchmod(fd, file_mode())  # mkstemp makes it private; the audio file is an ordinary one
        with os.fdopen(fd, "wb") as f:
            if fmt in ("wav", "pcm"):
                if fmt == "wav":
                    f.write(wav_header(sample_rate, 0))  # the sizes are written once the last chunk is in
                for chunk in chunks:
                    pcm = to_int16(chunk)
                    f.write(pcm)
                    samples += len(pcm) // 2
                if fmt == "wav":
                    f.seek(0)
                    f.write(wav_header(sample_rate, 2 * samples))
            else:
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
