"""Audio encoders and the atomic file write (cosyserve.server.audiofile): the bytes the server sends and the CLI
writes."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cosyserve.core.errors import ClientError
from cosyserve.server.audiofile import (
    STREAMABLE,
    Encoder,
    codec_rate,
    encode_all,
    to_int16,
    wav_header,
    write_wav_atomic,
)
from server_util import decoded

RATE = 22050


def decoded_length(data: bytes) -> tuple[int, int]:
    samples, rate = decoded(data)
    return len(samples), rate


def tone(seconds: float = 1.0, rate: int = RATE) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


# -- encoders ----------------------------------------------------------------------------------------------


def test_int16_scaling_matches_the_reference_and_clips_instead_of_wrapping() -> None:
    x = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 1.5], dtype=np.float32)
    got = np.frombuffer(to_int16(x), dtype="<i2")
    # the reference sends (x * 2**15).astype(int16); 1.0 and 1.5 would wrap to negative there
    assert got.tolist() == [0, 16384, -16384, 32767, -32768, 32767]


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus", "aac"])
def test_whole_files_decode_to_the_same_duration(fmt: str) -> None:
    x = tone(1.0)
    data = encode_all([x[:10000], x[10000:]], fmt, RATE)
    n, rate = decoded_length(data)
    # mp3's LAME tag (written back at the end of a whole file) trims the codec's delay: the exact length; ADTS
    # has no place for it (aac decodes 1024 samples of priming more, and its last frame whole)
    most = {"wav": 0.01, "flac": 0.01, "mp3": 0.01, "opus": 0.01, "aac": 0.1}[fmt]
    assert 1.0 - 0.01 <= n / rate <= 1.0 + most, f"{fmt}: {n} samples at {rate} Hz"
    if fmt in ("wav", "flac"):  # lossless: the samples survive up to 16-bit rounding
        audio, _ = sf.read(io.BytesIO(data))
        assert rate == RATE and np.abs(audio - x).max() < 1e-4


@pytest.mark.parametrize("fmt", [f for f in STREAMABLE if f != "aac"] + ["aac"])
def test_streamed_formats_give_bytes_as_the_audio_comes_and_decode_whole(fmt: str) -> None:
    """If this fails, a streamed format holds its bytes back (a client's first byte waits for the end) or a
    streamed file decodes short: every chunk of ~0.18 s must give bytes (the last, 50 ms, may not), and the whole stream its full length
    (mp3 and aac streams carry their codec's delay, some 50-100 ms more, with no tag to trim it)."""
    if fmt == "aac":
        pytest.importorskip("av", reason="aac needs PyAV (the aac extra)")
    x = tone(1.5)
    enc = Encoder(fmt, RATE, 24000)
    assert enc.streamed
    head = enc.header()
    chunks = [enc.encode(x[i : i + 4000]) for i in range(0, len(x), 4000)]
    data = head + b"".join(chunks) + enc.finish()
    assert all(chunks[1:-1]), f"{fmt}: a chunk gave no bytes: {[len(c) for c in chunks]}"
    if fmt in ("pcm", "raw"):
        assert len(data) // 2 == 36000, "1.5 s at 24 kHz"
        return
    n, rate = decoded_length(data)
    assert rate in (24000, 48000) and 1.5 - 0.01 <= n / rate <= 1.5 + 0.11, f"{fmt}: {n} samples at {rate} Hz"
    if fmt == "wav":
        assert data[:4] == b"RIFF" and data[40:44] == b"\xff\xff\xff\xff", (
            "a streamed header's sizes are unknown"
        )


def test_resampling_is_chunk_by_chunk_without_seams_and_keeps_the_pitch() -> None:
    """If this fails, 22.05 kHz audio given at 24 kHz (the OpenAI routes' pcm) is not 24 kHz audio of the same
    sound: wrong length (plays fast or slow), a shifted pitch, or a click where two chunks meet."""
    x = tone(2.0)
    one = Encoder("pcm", RATE, 24000)
    whole = np.frombuffer(one.encode(x) + one.finish(), "<i2")
    enc = Encoder("pcm", RATE, 24000)
    pieces = [enc.encode(x[i : i + 1234]) for i in range(0, len(x), 1234)] + [enc.finish()]
    chunked = np.frombuffer(b"".join(pieces), "<i2")
    assert len(chunked) == len(whole) == 48000 and enc.samples == 48000
    assert np.abs(chunked.astype(int) - whole.astype(int)).max() <= 1, (
        "chunked resampling differs from one-shot"
    )
    spectrum = np.abs(np.fft.rfft(chunked[4000:-4000]))
    peak_hz = np.argmax(spectrum) * 24000 / len(chunked[4000:-4000])
    assert abs(peak_hz - 440) < 2, f"the tone moved to {peak_hz:.1f} Hz"


def test_each_codec_takes_its_own_rates_and_defaults_to_the_models_where_it_can() -> None:
    with pytest.raises(ClientError, match="44000 Hz is not a rate mp3 takes") as e:
        Encoder("mp3", RATE, 44000)
    assert e.value.param == "sample_rate"
    with pytest.raises(ClientError, match="between 1 and 384000"):
        Encoder("pcm", RATE, 0)
    assert Encoder("wav", RATE, 16000).out_rate == 16000
    assert (
        codec_rate("opus", RATE) == 24000
        and codec_rate("mp3", RATE) == RATE
        and codec_rate("pcm", 100) == 100
    )
    assert Encoder("opus", RATE).out_rate == 24000, "opus takes no 22.05 kHz: the next rate it takes"
    with pytest.raises(ValueError, match="unknown audio format"):
        Encoder("aiff", RATE)


def test_aac_without_pyav_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """If this fails, a server without PyAV answers aac with a traceback instead of saying what to install."""
    from cosyserve.core import formats

    monkeypatch.setattr(formats, "_has_pyav", lambda: False)
    with pytest.raises(ClientError, match=r"pip install 'cosyserve\[aac\]'") as e:
        Encoder("aac", RATE)
    assert e.value.param == "response_format"


def test_wav_header_sizes() -> None:
    h = wav_header(RATE, 100)
    assert (
        len(h) == 44 and int.from_bytes(h[4:8], "little") == 136 and int.from_bytes(h[40:44], "little") == 100
    )
    assert wav_header(RATE, None)[40:44] == b"\xff\xff\xff\xff"


@pytest.mark.parametrize("fmt", ["flac", "mp3", "wav"])
def test_a_whole_encoder_gives_its_file_at_the_end(fmt: str) -> None:
    """The one encoder serves whole files too (flac always; any format asked whole): nothing before finish(),
    then the file encode_all makes."""
    x = tone(0.5)
    enc = Encoder(fmt, RATE, whole=fmt != "flac")
    assert (
        not enc.streamed
        and enc.header() == b""
        and enc.encode(x[:4000]) == b""
        and enc.encode(x[4000:]) == b""
    )
    assert enc.finish() == encode_all([x[:4000], x[4000:]], fmt, RATE)


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
