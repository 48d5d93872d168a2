"""Every limit on a request, applied in one place: the constructor each entry point builds its requests with.

The HTTP routes (``/v1/audio/speech`` audio and SSE, the reference's ``/inference_*``), the WebSocket (its
``session.config`` and each utterance), the voices API (its names, transcripts and samples), the Python API and the
CLI turn what they received into a :class:`~cosyserve.core.request.SynthesisRequest` through :meth:`Limits.request`, and
the format and rate of its audio through :meth:`Limits.output`. A transport parses its protocol and maps its field
names; what a request may hold is decided here, once, from the settings (each limit declared once in
:mod:`cosyserve.core.settings`):

| limit | fields | setting |
|---|---|---|
| text to speak, and each streamed piece of it | ``text`` | ``max_text_chars`` |
| streamed text received and not yet read by the model | ``text`` (a :meth:`Limits.feed`) | ``max_buffered_text_chars`` |
| a voice sample's transcript | ``prompt_text`` | ``max_prompt_text_chars`` |
| a style instruction | ``instruct_text`` | ``max_instructions_chars`` |
| a voice name | ``speaker`` | ``max_voice_name_chars`` |
| a voice sample or recording: bytes, seconds | ``prompt_wav``, ``source_wav`` | ``max_upload_bytes``, ``max_prompt_seconds`` |
| tempo | ``speed`` | :data:`~cosyserve.core.request.SPEED_MIN` .. :data:`~cosyserve.core.request.SPEED_MAX` (OpenAI's) |
| audio format, sample rate | :class:`Output` | the transport's formats, the server's encoders; each codec's rates |

An error names its field as the caller spells it (``names`` maps the request's field names to the transport's:
``text`` -> ``input``), in its ``param`` and its message. Pure Python: the audio's length is read from its header
(``soundfile``, imported when a request carries audio).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from cosyserve.core.errors import AudioError, ClientError, PayloadTooLargeError, shown
from cosyserve.core.formats import format_error, rate_error
from cosyserve.core.request import SynthesisRequest, field_errors, is_text_iterable, speed_error
from cosyserve.core.textfeed import TextFeed

__all__ = ["Limits", "Output", "StreamedText"]

# request field -> the limit (a Limits attribute) on its length in characters
_CHARS = {
    "text": "text_chars",
    "prompt_text": "prompt_text_chars",
    "instruct_text": "instructions_chars",
    "speaker": "voice_chars",
}
# request field -> what its audio is, as messages name it
_AUDIO = {"prompt_wav": "prompt audio", "source_wav": "source audio"}


@dataclass(frozen=True)
class Output:
    """How a request's audio is delivered: ``format`` (a name of :data:`cosyserve.server.audiofile.FORMATS`, or ``raw``,
    the reference's int16 PCM), ``sample_rate`` (None: the model's own, as :func:`cosyserve.server.audiofile.codec_rate`
    says) and whether it is ``streamed`` as it is made (a format that cannot be streamed is sent whole anyway:
    :data:`cosyserve.server.audiofile.STREAMABLE`)."""

    format: str
    sample_rate: int | None = None
    streamed: bool = True


@dataclass(frozen=True)
class Limits:
    """The limits of every request (see the module docstring); the defaults are the settings' defaults.

    Args:
        text_chars: longest text, and longest piece of streamed text.
        buffered_text_chars: most streamed text an utterance holds received and not yet read by the model (one
            piece longer than that is taken alone).
        prompt_text_chars: longest transcript of a voice sample.
        instructions_chars: longest style instruction.
        voice_chars: longest voice name.
        upload_bytes: largest voice sample or recording, encoded.
        prompt_seconds: longest voice sample or recording, in seconds.
    """

    text_chars: int = 4096
    buffered_text_chars: int = 4096
    prompt_text_chars: int = 1024
    instructions_chars: int = 1024
    voice_chars: int = 256
    upload_bytes: int = 16 << 20
    prompt_seconds: float = 30.0

    @classmethod
    def from_settings(cls, settings: Any) -> Limits:
        """The limits a :class:`cosyserve.core.settings.Settings` sets."""
        s = settings
        return cls(
            text_chars=s.max_text_chars,
            buffered_text_chars=s.max_buffered_text_chars,
            prompt_text_chars=s.max_prompt_text_chars,
            instructions_chars=s.max_instructions_chars,
            voice_chars=s.max_voice_name_chars,
            upload_bytes=s.max_upload_bytes,
            prompt_seconds=s.max_prompt_seconds,
        )

    # -- the constructor ------------------------------------------------------------------------------------------

    def request(self, *, names: Mapping[str, str] | None = None, **fields: Any) -> SynthesisRequest:
        """The request ``fields`` (of :class:`~cosyserve.core.request.SynthesisRequest`) ask for, within every limit.

        Text given as pieces (an iterable that is not a string) is read as it arrives: each piece is checked when
        the runtime takes it (a :class:`StreamedText`, or a :meth:`feed` built here, which checks each piece as it
        is put).

        Args:
            names: request field -> the caller's name for it (its error messages and ``param``); default the
                field names.
            fields: the request's fields.
        Returns:
            The checked request (unresolved: its model resolves it once, see :class:`ResolvedRequest`).
        Raises:
            ClientError: a field over its limit (PayloadTooLargeError for bytes, AudioError for audio that is too
                long or not audio), or a request :meth:`SynthesisRequest.verify` refuses; ``param`` names the field.
        """
        self.check(names=names, **fields)
        n = _names(names)
        text = fields.get("text")
        if is_text_iterable(text) and not self._checks(text):
            fields["text"] = StreamedText(text, self.text_chars, n["text"])
        try:
            return SynthesisRequest(**fields)
        except ClientError as e:
            # the fields a mode takes: said in the caller's names
            present = _present(fields)
            plain = field_errors(fields.get("mode"), present)
            if not names or str(e) != "; ".join(msg for _, msg in plain):
                raise
            named = field_errors(fields.get("mode"), present, n)
            raise ClientError("; ".join(msg for _, msg in named), param=named[0][0]) from None

    def check(self, *, names: Mapping[str, str] | None = None, **fields: Any) -> None:
        """Check ``fields`` (request field names) against their limits: texts and names by length, audio by bytes
        and seconds, speed by range. What a route takes besides a request (the voices API's name, transcript and
        sample) is checked here too.

        Raises:
            ClientError: as :meth:`request`.
        """
        n = _names(names)
        for name, value in fields.items():
            limit = _CHARS.get(name)
            if limit is not None and isinstance(value, str):
                most = getattr(self, limit)
                if len(value) > most:
                    raise ClientError(
                        f"{n[name]} is {len(value)} characters; the limit is {most}", param=name
                    )
            elif name in _AUDIO and value is not None:
                self._check_audio(value, name, n[name])
        if "speed" in fields:
            bad = speed_error(fields["speed"])
            if bad is not None:
                raise ClientError(bad.replace("speed", n["speed"], 1), param="speed")

    def feed(self, *, deadline: float | None = None, on_take: Callable[[], None] | None = None) -> TextFeed:
        """A :class:`~cosyserve.core.textfeed.TextFeed` for an utterance's streamed text, within the limits: each piece
        at most ``text_chars`` (a longer one is refused as it is put, naming ``text``); the producer waits for room
        while :attr:`TextFeed.pending_chars` would pass ``buffered_text_chars``
        (:meth:`~cosyserve.core.textfeed.TextFeed.has_room`)."""
        return TextFeed(
            deadline=deadline,
            on_take=on_take,
            max_piece_chars=self.text_chars,
            max_pending_chars=self.buffered_text_chars,
        )

    def output(
        self,
        fmt: str,
        formats: Iterable[str],
        sample_rate: int | None = None,
        *,
        streamed: bool = True,
        names: Mapping[str, str] | None = None,
    ) -> Output:
        """The delivery a caller asks for: ``fmt`` one of the transport's ``formats`` that this server can encode,
        ``sample_rate`` a rate that format takes (the encoder resamples the model's audio to it) or None (the
        model's), ``streamed`` as it is made or whole.

        Raises:
            ClientError: naming ``response_format`` or ``sample_rate``.
        """
        n = _names(names)
        choices = tuple(formats)
        if fmt not in choices:
            raise ClientError(
                f"{n['response_format']} {shown(fmt)} is not supported; choose one of {', '.join(choices)}",
                param="response_format",
            )
        missing = format_error(fmt)
        if missing is not None:
            raise ClientError(f"{n['response_format']} {missing}", param="response_format")
        if sample_rate is not None:
            bad = rate_error(fmt, sample_rate)
            if bad is not None:
                raise ClientError(f"{n['sample_rate']} {bad}", param="sample_rate")
        return Output(fmt, sample_rate, streamed)

    # -- helpers --------------------------------------------------------------------------------------------------

    def _checks(self, text: object) -> bool:
        # a feed of these limits checks its pieces itself
        return (
            isinstance(text, TextFeed)
            and text.max_piece_chars is not None
            and text.max_piece_chars <= self.text_chars
        )

    def _check_audio(self, value: Any, field: str, name: str) -> None:
        # bytes, then seconds from the header: a sample over a limit is refused before anything decodes it. Audio
        # that is missing, empty or not audio at all is the frontend's to refuse, when the request runs (after the
        # checks only the model can make: a mode it cannot run is the clearer error)
        what = _AUDIO[field]
        if isinstance(value, bytes | bytearray | memoryview):
            size = len(value)
            source: Any = io.BytesIO(bytes(value))
        elif isinstance(value, str | os.PathLike) and os.path.isfile(value):
            size = os.path.getsize(value)
            source = os.fspath(value)
        else:
            return
        if size > self.upload_bytes:
            raise PayloadTooLargeError(
                f"{name}: the {what} is {size} bytes; the limit is {self.upload_bytes}", param=field
            )
        import soundfile

        try:
            info = soundfile.info(source)
        except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError):
            return
        seconds = info.frames / info.samplerate if info.samplerate > 0 else 0.0
        if seconds > self.prompt_seconds:
            raise AudioError(
                f"{name}: the {what} is {seconds:.2f} s long; it may be at most {self.prompt_seconds:g} s (trim it)",
                param=field,
            )


class StreamedText:
    """Text given as pieces, each checked as the runtime takes it: at most ``limit`` characters (else a
    :class:`ClientError` naming ``text``, which ends the request). ``chars`` counts what was taken."""

    def __init__(self, pieces: Iterable[str], limit: int, name: str = "text") -> None:
        self._pieces = iter(pieces)
        self.limit = limit
        self.name = name
        self.chars = 0

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        piece = next(self._pieces)
        if isinstance(piece, str) and len(piece) > self.limit:
            raise ClientError(
                f"a piece of {self.name} is {len(piece)} characters; the limit is {self.limit} a piece",
                param="text",
            )
        self.chars += len(piece) if isinstance(piece, str) else 0
        return piece

    def close(self) -> None:
        close = getattr(self._pieces, "close", None)
        if close is not None:
            close()


def _present(fields: Mapping[str, Any]) -> set[str]:
    # the content fields given (SynthesisRequest.present, before the request exists)
    out = {
        n
        for n in ("text", "speaker", "prompt_text", "instruct_text")
        if isinstance(fields.get(n), str) and fields[n].strip()
    }
    if is_text_iterable(fields.get("text")):
        out.add("text")
    return out | {n for n in _AUDIO if fields.get(n) is not None}


class _names(dict[str, str]):
    # the caller's name of each field (the field's own where it has none)
    def __init__(self, names: Mapping[str, str] | None) -> None:
        super().__init__(names or {})

    def __missing__(self, key: str) -> str:
        return key
