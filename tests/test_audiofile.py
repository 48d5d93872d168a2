"""Audio encoders and the atomic file write (cosyserve.server.audiofile): the bytes the server sends and the CLI
writes."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cosyserve.server.audiofile import STREAMABLE, Encoder, encode_all, to_int16, wav_header, write_wav_atomic

RATE = 22050


def tone(seconds: float = 1.0, rate: int = RATE) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


# -- encoders ----------------------------------------------------------------------------------------------


def test_int16_scaling_matches_the_reference_and_clips_instead_of_wrapping() -> None:
    x = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 1.5], dtype=np.float32)
    got = np.frombuffer(to_int16(x), dtype="<i2")
    # the reference sends (x * 2**15).astype(int16); 1.0 and 1.5 would wrap to negative there
    assert got.tolist() == [0, 16384, -16384, 32767, -32768, 32767]


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus"])
def test_whole_files_decode_to_the_same_duration(fmt: str) -> None:
    x = tone(1.0)
    data = encode_all([x[:10000], x[10000:]], fmt, RATE)
    audio, rate = sf.read(io.BytesIO(data))
    assert abs(len(audio) / rate - 1.0) < 0.06, f"{fmt}: {len(audio)} samples at {rate} Hz"
    if fmt in ("wav", "flac"):  # lossless: the samples survive up to 16-bit rounding
        assert rate == RATE and np.abs(audio - x).max() < 1e-4


@pytest.mark.parametrize("fmt", STREAMABLE)
def test_streamed_bytes_decode_like_the_whole_file(fmt: str) -> None:
    x = tone(1.5)
    enc = Encoder(fmt, RATE)
    parts = [enc.header()] + [enc.encode(x[i : i + 4000]) for i in range(0, len(x), 4000)] + [enc.finish()]
    data = b"".join(parts)
    if fmt in ("pcm", "raw"):
        assert np.array_equal(np.frombuffer(data, "<i2"), np.frombuffer(to_int16(x), "<i2"))
        return
    audio, rate = sf.read(io.BytesIO(data))
    assert abs(len(audio) / rate - 1.5) < 0.06, f"{fmt}: streamed file lost samples ({len(audio)} at {rate})"
    if fmt == "wav":
        assert data[:4] == b"RIFF" and np.abs(audio - x).max() < 1e-4


def test_wav_header_sizes() -> None:
    h = wav_header(RATE, 100)
    assert (
        len(h) == 44 and int.from_bytes(h[4:8], "little") == 136 and int.from_bytes(h[40:44], "little") == 100
    )
    assert wav_header(RATE, None)[40:44] == b"\xff\xff\xff\xff"


@pytest.mark.parametrize("fmt", ["flac", "mp3"])
def test_a_format_not_streamed_gives_its_whole_file_at_the_end(fmt: str) -> None:
    """The one encoder serves whole formats too: nothing before finish(), then the file encode_all makes."""
    x = tone(0.5)
    enc = Encoder(fmt, RATE)
    assert (
        not enc.streamed
        and enc.header() == b""
        and enc.encode(x[:4000]) == b""
        and enc.encode(x[4000:]) == b""
    )
    assert enc.finish() == encode_all([x[:4000], x[4000:]], fmt, RATE)


def test_a_rate_other_than_the_models_is_refused_naming_sample_rate() -> None:
    from cosyserve.core.errors import ClientError

    with pytest.raises(ClientError, match="does not resample") as e:
        Encoder("pcm", RATE, out_rate=RATE + 1)
    assert e.value.param == "sample_rate"
    assert Encoder("pcm", RATE, out_rate=RATE).encode(tone(0.01))  # the model's own rate is fine
    with pytest.raises(ValueError, match="unknown audio format"):
        Encoder("aiff", RATE)


def test_cli_and_server_write_the_same_samples_and_full_scale_clips_to_the_stated_values(
    tmp_path: Path,
) -> None:
    """If this fails, ``cosyserve synth --out x.wav`` and the server's WAV (whole or streamed) give different
    bytes for the same audio (two scales), or a full-scale sample no longer maps as :func:`to_int16` states."""
    x = np.concatenate(
        [tone(0.1), np.array([1.0, -1.0, 0.99999, -0.99999, 1.5, -1.5, 0.5, -0.5], np.float32)]
    )
    cli_wav = tmp_path / "cli.wav"
    write_wav_atomic(cli_wav, [x[:1000], x[1000:]], RATE)
    cli = cli_wav.read_bytes()
    whole = encode_all([x], "wav", RATE)
    enc = Encoder("wav", RATE)
    streamed = enc.header() + enc.encode(x[:1000]) + enc.encode(x[1000:]) + enc.finish()
    assert cli == whole, "the CLI's WAV file differs from the server's"
    assert cli[44:] == streamed[44:], "the CLI's samples differ from the server's streamed ones"
    tail = np.frombuffer(cli[-16:], "<i2").tolist()
    assert tail == [32767, -32768, 32767, -32767, 32767, -32768, 16384, -16384]


def test_int16_of_a_decoded_16_bit_file_is_the_file() -> None:
    """If this fails, reading a 16-bit file (int16 / 32768) and writing it again changes its samples."""
    pcm = np.array([-32768, -32767, -1, 0, 1, 12345, 32767], dtype="<i2")
    assert to_int16(pcm.astype(np.float32) / 32768.0) == pcm.tobytes()
