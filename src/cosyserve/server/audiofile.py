"""Audio files from float chunks: the one encoder every transport sends audio with (HTTP bodies, SSE deltas,
WebSocket frames and their WAV header) and the CLI writes with, and the atomic write of a whole file.

| format | media type | streamed (bytes as the audio is made) | rates | codec |
|---|---|---|---|---|
| ``pcm`` | audio/pcm | yes: raw 16-bit signed little-endian mono (header ``X-Sample-Rate``) | any | ours |
| ``wav`` | audio/wav | yes: 16-bit PCM after a header with unknown sizes (0xFFFFFFFF), which players accept | any | ours |
| ``mp3`` | audio/mpeg | yes: constant-bitrate frames as they fill (~64 kbit/s at 24 kHz, ~128 at 44.1/48) | MPEG's | LAME in libsndfile |
| ``opus`` | audio/ogg | yes: Ogg/Opus pages as they fill (one per 100 ms of audio) | 8, 12, 16, 24, 48 kHz | libopus in libsndfile |
| ``aac`` | audio/aac | yes: ADTS frames as they fill (64 kbit/s) | AAC's | FFmpeg's, through PyAV (the ``aac`` extra) |
| ``flac`` | audio/flac | no: encoded when the audio ends | any | libsndfile |

Why each is so: a whole file gets its exact sizes written back at the end (the WAV sizes, MP3's LAME tag, FLAC's
STREAMINFO); bytes already sent cannot change, so a streamed file keeps what it said first. For WAV that is the
unknown-size header; MP3 is constant-bitrate so that a decoder that estimates its length from the bitrate (there
is no LAME tag before the end) gets it right, and its first frame is the tag's place, a silent frame; a streamed
FLAC without its STREAMINFO totals does not decode in libsndfile, so FLAC stays whole. ``raw`` is the reference
server's int16 PCM (``application/octet-stream``), as ``pcm``.

Rates: the chunks come at the model's rate; a caller may ask for another (``out_rate``, checked by
:func:`rate_error`: any positive rate up to 384 kHz for pcm, wav and flac, the codec's own for mp3, opus and aac),
and the encoder resamples chunk by chunk with soxr's streaming resampler (no seam between chunks). Without one,
the model's rate, or for a codec that does not take it the next rate it does (:func:`codec_rate`). The OpenAI
routes ask for :data:`OPENAI_SAMPLE_RATE` (24 kHz, OpenAI's own) unless the request names another.

A response's audio goes through one :class:`Encoder`: ``header()``, ``encode(chunk)`` per chunk, ``finish()``. A
streamed encoder gives its bytes as the chunks come; a whole one (``whole=True``, or a format not in
:data:`STREAMABLE`) gives them all at ``finish()``. Where a later change extends it: a format is a row of
:data:`MEDIA_TYPES`, of :data:`STREAMABLE` when it can be sent as it is made, of :data:`RATES` when its codec
takes only some rates, and a codec class in :data:`_CODECS`.

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
from cosyserve.core.formats import (
    FORMATS,
    MAX_SAMPLE_RATE,
    MEDIA_TYPES,
    OPENAI_SAMPLE_RATE,
    RATES,
    RAW,
    STREAMABLE,
    codec_rate,
    format_error,
    rate_error,
)

__all__ = [
    "FORMATS",
    "MAX_SAMPLE_RATE",
    "MEDIA_TYPES",
    "OPENAI_SAMPLE_RATE",
    "RATES",
    "RAW",
    "STREAMABLE",
    "Encoder",
    "codec_rate",
    "encode_all",
    "format_error",
    "rate_error",
    "to_int16",
    "wav_header",
    "write_audio_atomic",
    "write_wav_atomic",
]

# libsndfile's formats: (major format, subtype, SoundFile options)
_SF = {
    "flac": ("FLAC", "PCM_16", {}),
    # constant bitrate: level 0.6 is 64 kbit/s at MPEG-2 rates (<= 24 kHz), 128 kbit/s at MPEG-1's
    "mp3": ("MP3", "MPEG_LAYER_III", {"bitrate_mode": "CONSTANT", "compression_level": 0.6}),
    "opus": ("OGG", "OPUS", {}),
}
_AAC_BITRATE = 64000
# libsndfile >= 1.2 (sndfile.h): the longest an Ogg page holds audio back, 1 s by default
_SFC_SET_OGG_PAGE_LATENCY_MS = 0x1302
_OGG_PAGE_MS = 100.0


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


class _Sink(io.RawIOBase):
    """A write-only file for an encoder that hands out appended bytes as they come (:meth:`take`).

    Bytes already taken cannot change, so a seek back to patch them at close is dropped for those (a streamed
    file keeps what it said first); bytes not taken yet are patched as any file's (a whole file, taken once at the
    end, gets its sizes and tags written back).
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


class _Pcm:
    """Raw 16-bit samples (``pcm``, ``raw``)."""

    def __init__(self, sink: _Sink, rate: int, fmt: str) -> None:
        self.sink = sink
        self.rate = rate

    def write(self, x: np.ndarray) -> None:
        self.sink.write(to_int16(x))

    def close(self) -> None:
        pass


class _Wav(_Pcm):
    """A header with unknown sizes, then 16-bit samples; the sizes written back at close (kept where the header
    was sent already: a streamed file)."""

    def __init__(self, sink: _Sink, rate: int, fmt: str) -> None:
        super().__init__(sink, rate, fmt)
        self.bytes = 0
        sink.write(wav_header(rate, None))

    def write(self, x: np.ndarray) -> None:
        data = to_int16(x)
        self.bytes += len(data)
        self.sink.write(data)

    def close(self) -> None:
        self.sink.seek(0)
        self.sink.write(wav_header(self.rate, self.bytes))
        self.sink.seek(0, 2)


class _Sndfile:
    """libsndfile's codecs (see :data:`_SF`)."""

    def __init__(self, sink: _Sink, rate: int, fmt: str) -> None:
        import soundfile as sf

        kind, subtype, options = _SF[fmt]
        self.lossless = fmt == "flac"
        self.sf = sf.SoundFile(
            sink, mode="w", samplerate=rate, channels=1, format=kind, subtype=subtype, **options
        )
        if fmt == "opus":  # a page every 100 ms of audio, not every second (an older libsndfile keeps 1 s)
            latency = sf._ffi.new("double*", _OGG_PAGE_MS)
            sf._snd.sf_command(self.sf._file, _SFC_SET_OGG_PAGE_LATENCY_MS, latency, sf._ffi.sizeof("double"))

    def write(self, x: np.ndarray) -> None:
        if self.lossless:  # the very int16 samples wav/pcm carry (libsndfile would round, not truncate)
            self.sf.write(np.frombuffer(to_int16(x), dtype="<i2"))
        else:
            self.sf.write(np.clip(x, -1.0, 1.0))

    def close(self) -> None:
        self.sf.close()


class _Aac:
    """FFmpeg's AAC encoder in ADTS frames, through PyAV (imported here: the ``aac`` extra)."""

    def __init__(self, sink: _Sink, rate: int, fmt: str) -> None:
        import av

        # each packet written through at once, not held in FFmpeg's I/O buffer
        self.out = av.open(sink, mode="w", format="adts", options={"flush_packets": "1"})
        self.stream = self.out.add_stream("aac", rate=rate, layout="mono")
        self.stream.codec_context.bit_rate = _AAC_BITRATE
        self.rate = rate
        self.pts = 0

    def write(self, x: np.ndarray) -> None:
        import av

        frame = av.AudioFrame.from_ndarray(np.clip(x, -1.0, 1.0).reshape(1, -1), format="fltp", layout="mono")
        frame.sample_rate, frame.pts = self.rate, self.pts
        self.pts += x.size
        self._mux(frame)

    def _mux(self, frame: Any) -> None:
        for packet in self.stream.encode(frame):
            self.out.mux(packet)

    def close(self) -> None:
        self._mux(None)  # the encoder's last frames
        self.out.close()


_CODECS: dict[str, type[Any]] = {
    "pcm": _Pcm,
    RAW: _Pcm,
    "wav": _Wav,
    "flac": _Sndfile,
    "mp3": _Sndfile,
    "opus": _Sndfile,
    "aac": _Aac,
}


class _Resampler:
    """soxr's streaming resampler: chunk by chunk, the filter's state kept between chunks (no seam); it holds a
    few milliseconds back until :meth:`flush`."""

    def __init__(self, rate: int, out_rate: int) -> None:
        import soxr

        self.stream = soxr.ResampleStream(rate, out_rate, 1, dtype="float32", quality="HQ")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(self.stream.resample_chunk(x), dtype=np.float32).reshape(-1)

    def flush(self) -> np.ndarray:
        return np.asarray(
            self.stream.resample_chunk(np.zeros(0, np.float32), last=True), dtype=np.float32
        ).reshape(-1)


class Encoder:
    """Turns float32 chunks at the model's rate into the bytes of one response in ``fmt`` at ``out_rate`` (see the
    module docstring).

    ``header()`` first, ``encode(chunk)`` per chunk, ``finish()`` last; each returns the bytes to send now (maybe
    empty). A whole encoder (:attr:`streamed` false) gives every byte at ``finish()``. :attr:`inline`: cheap enough
    to run on an event loop (no codec but 16-bit PCM); a caller runs the others in a thread.

    Args:
        fmt: one of :data:`FORMATS`, or :data:`RAW`.
        sample_rate: the rate of the chunks (the model's).
        out_rate: the rate the caller asked for (None: :func:`codec_rate`, the model's where the codec takes it).
        whole: give the whole file at ``finish()`` (exact sizes in its header) even where ``fmt`` can stream.
    Raises:
        ClientError: ``out_rate`` is not one ``fmt`` takes (naming ``sample_rate``), or ``fmt`` needs a library the
            server lacks (naming ``response_format``).
        ValueError: an unknown format.
    """

    def __init__(
        self, fmt: str, sample_rate: int, out_rate: int | None = None, *, whole: bool = False
    ) -> None:
        if fmt not in _CODECS:
            raise ValueError(f"unknown audio format {fmt!r}; expected one of {', '.join(FORMATS)} or {RAW}")
        rate = codec_rate(fmt, sample_rate) if out_rate is None else out_rate
        bad = rate_error(fmt, rate)
        if bad is not None:
            raise ClientError(f"sample_rate {bad}", param="sample_rate")
        missing = format_error(fmt)
        if missing is not None:
            raise ClientError(f"response_format {missing}", param="response_format")
        self.fmt = fmt
        self.sample_rate = sample_rate
        self.out_rate = rate
        self.media_type = MEDIA_TYPES.get(fmt, "application/octet-stream")
        self.streamed = not whole and fmt in STREAMABLE
        self.inline = fmt in ("pcm", "wav", RAW)
        self.samples = 0  # samples encoded, at out_rate
        self._resample = _Resampler(sample_rate, rate) if rate != sample_rate else None
        self._sink = _Sink()
        self._codec = _CODECS[fmt](self._sink, rate, fmt)

    def header(self) -> bytes:
        """What the format says before any audio (a WAV header, Ogg's first pages), on its own (a WebSocket frame)."""
        return self._sink.take() if self.streamed else b""

    def encode(self, chunk: np.ndarray) -> bytes:
        x = np.asarray(chunk, dtype=np.float32).reshape(-1)
        if self._resample is not None:
            x = self._resample(x)
        self._write(x)
        return self._sink.take() if self.streamed else b""

    def finish(self) -> bytes:
        """The last bytes: the resampler's and the codec's tail, or a whole file."""
        if self._resample is not None:
            self._write(self._resample.flush())
        self._codec.close()
        return self._sink.take()

    def _write(self, x: np.ndarray) -> None:
        if x.size:
            self.samples += x.size
            self._codec.write(x)


def encode_all(
    chunks: Iterable[np.ndarray], fmt: str, sample_rate: int, out_rate: int | None = None
) -> bytes:
    """A whole file of ``chunks`` (exact sizes in its header), as :class:`Encoder` with ``whole=True`` makes it."""
    enc = Encoder(fmt, sample_rate, out_rate, whole=True)
    for chunk in chunks:
        enc.encode(chunk)
    return enc.finish()


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
