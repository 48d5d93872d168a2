"""One synthesis request, built by the CLI, the Python API and the server alike, and checked in one place.

A :class:`SynthesisRequest` names a mode and the fields that mode takes. Pure Python (no torch): the CLI checks
its flags with these rules before loading anything, and :meth:`SynthesisRequest.verify` checks every request
before it is queued; what only the model can tell (does the speaker exist, is the mode available) the runtime
checks when the request starts.

The modes, the fields each takes and needs, are :data:`cosyserve.core.modes.MODE_TABLE`'s (read here by
:func:`field_errors`).

``mode=None`` means ``zero_shot`` when ``speaker`` is a registered zero-shot voice, else ``sft`` (decided by the
runtime, which knows the voices). ``instruct`` is CosyVoice-300M-Instruct's (a speaker and a style instruction);
``instruct2`` is CosyVoice2's (``inference_instruct2``: the instruction and a voice to clone).

``text`` is one string, or an iterable of string pieces that is not a string (an LLM's output as it is generated,
such as a :class:`cosyserve.core.textfeed.TextFeed`): the runtime iterates it in its worker thread and speaks the text as
it arrives. An iterable cannot be checked for emptiness up front: the runtime refuses an utterance that ended with
nothing to speak.

Every entry point builds its requests with :meth:`cosyserve.core.limits.Limits.request`, which applies the server's
limits before it builds one. A request is resolved once, by the model that serves it (``Runtime.resolve``: its
mode decided, its voice found for its tenant): the result is a :class:`ResolvedRequest`, which the engine and the
runtime take as it is.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from cosyserve.core.errors import ClientError
from cosyserve.core.modes import FIELDS, MODE_TABLE, MODES, PROMPT_MODES, ROLES, VOICE_MODES, accepting

__all__ = [
    "MODES",
    "PROMPT_MODES",
    "VOICE_MODES",
    "ResolvedRequest",
    "SPEED_MAX",
    "SPEED_MIN",
    "AudioSource",
    "Mode",
    "SynthesisRequest",
    "field_errors",
    "is_text_iterable",
    "speed_error",
]

Mode = str  # a key of MODE_TABLE

# The tempo range every entry point accepts (OpenAI's). Speed stretches the whole utterance's mel in time before
# the vocoder (the reference's rule), which works for any factor > 0; the bounds keep requests sane.
SPEED_MIN = 0.25
SPEED_MAX = 4.0

AudioSource = str | Path | bytes | bytearray | memoryview  # a file's path, or the encoded file's bytes
Text = str | Iterable[str]  # one string, or its pieces as they arrive


def is_text_iterable(text: object) -> bool:
    """Whether ``text`` is text given as pieces: an iterable that is neither a string nor bytes-like."""
    return not isinstance(text, str | bytes | bytearray | memoryview) and hasattr(text, "__iter__")


@dataclass(frozen=True)
class SynthesisRequest:
    """One synthesis request (frozen; derive variants with :func:`dataclasses.replace`).

    Args:
        text: what to say (every mode but vc); split into sentence pieces unless ``normalize`` is False. Or an
            iterable of pieces that is not a str, read as they arrive (see the module docstring).
        speaker: a pre-defined speaker id, or a voice registered for ``tenant``; None in sft/instruct: the model's
            default voice.
        mode: a mode of :data:`~cosyserve.core.modes.MODE_TABLE`, or None (see the module docstring).
        prompt_text: the transcript of ``prompt_wav`` (zero_shot).
        prompt_wav: the voice to clone (zero_shot, cross_lingual, vc): a path or the encoded file's bytes.
        source_wav: the recording to convert (vc): a path or bytes.
        instruct_text: the style instruction (instruct, with an -Instruct model).
        stream: yield chunks as soon as ~2 s of speech tokens exist (True) or one chunk per piece (False).
        speed: tempo factor in [SPEED_MIN, SPEED_MAX]; only with ``stream=False`` (as in the reference).
        seed: seeds every random draw; the same seed gives the same audio. None draws a fresh seed.
        normalize: run the text frontend on text, prompt_text and instruct_text (the reference's
            ``text_frontend``); False speaks ``text`` as one piece.
        tenant: the namespace of registered voices, and the tenant whose quota the request counts against.
        deadline: ``time.monotonic()`` after which the request is stopped (:class:`DeadlineExceededError`);
            None for none.
        request_id: names the request in logs, metrics and headers.
    """

    text: Text = ""
    speaker: str | None = None
    mode: Mode | None = None
    prompt_text: str = ""
    prompt_wav: AudioSource | None = None
    source_wav: AudioSource | None = None
    instruct_text: str = ""
    stream: bool = False
    speed: float = 1.0
    seed: int | None = None
    normalize: bool = True
    tenant: str = "default"
    deadline: float | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])

    def __post_init__(self) -> None:
        self.verify()

    def present(self) -> set[str]:
        """Names of the content fields this request gives (non-blank strings, audio that is not None)."""
        out = {
            name
            for name in ("text", "speaker", "prompt_text", "instruct_text")
            if isinstance(getattr(self, name), str) and getattr(self, name).strip()
        }
        if is_text_iterable(self.text):  # its pieces are yet to come
            out.add("text")
        return out | {name for name in ("prompt_wav", "source_wav") if getattr(self, name) is not None}

    def verify(self) -> None:
        """Check everything that needs no model; raise :class:`ClientError` naming the first bad field.

        Runs when the request is built (``__post_init__``): a request that exists is a valid one, whoever built
        it (the CLI, the Python API, the server).
        """
        if self.mode is not None and self.mode not in MODES:
            raise ClientError(f"unknown mode {self.mode!r}; expected one of {', '.join(MODES)}", param="mode")
        if not isinstance(self.text, str) and not is_text_iterable(self.text):
            raise ClientError(
                f"text must be a string or an iterable of string pieces, got {type(self.text).__name__}",
                param="text",
            )
        for name in ("prompt_text", "instruct_text"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ClientError(f"{name} must be a string, got {type(value).__name__}", param=name)
        if self.speaker is not None and not isinstance(self.speaker, str):
            raise ClientError(f"speaker must be a string, got {type(self.speaker).__name__}", param="speaker")
        needs_text = self.mode is None or "text" in MODE_TABLE[self.mode].needs
        if needs_text and isinstance(self.text, str) and not self.text.strip():
            raise ClientError("text is empty: give at least one word to speak", param="text")
        errors = field_errors(self.mode, self.present())
        if errors:
            raise ClientError("; ".join(msg for _, msg in errors), param=errors[0][0])
        bad_speed = speed_error(self.speed)
        if bad_speed:
            raise ClientError(bad_speed, param="speed")
        if not isinstance(self.stream, bool):
            raise ClientError("stream must be true or false", param="stream")
        if self.stream and self.speed != 1.0:
            raise ClientError(
                f"speed {self.speed:g} needs the whole audio of a sentence at once (as in the reference): a streamed "
                "request (stream: true, stream_format: sse, the WebSocket, --stream) keeps speed 1.0",
                param="speed",
            )
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ClientError(f"seed must be an integer, got {self.seed!r}", param="seed")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ClientError(f"seed must be an integer in [0, 2**63), got {self.seed}", param="seed")

    def resolved_as(self, mode: Mode, speaker: str | None, instruct_text: str) -> ResolvedRequest:
        """This request as a model resolved it (``Runtime.resolve``): the mode it runs in, its speaker and its
        instruction as that model takes them."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return ResolvedRequest(
            **(values | {"mode": mode, "speaker": speaker, "instruct_text": instruct_text})
        )


@dataclass(frozen=True)
class ResolvedRequest(SynthesisRequest):
    """A request its model resolved (:meth:`SynthesisRequest.resolved_as`): its ``mode`` decided and its
    ``speaker`` found for its tenant, so the engine and the runtime take it as it is (they resolve only what is not
    one). Derive variants with :func:`dataclasses.replace` only in fields the resolution does not decide (text,
    request id, deadline, seed): a WebSocket session resolves its voice once and speaks each utterance with it."""


def speed_error(speed: object) -> str | None:
    """Why ``speed`` is not an accepted tempo factor (a finite number in [SPEED_MIN, SPEED_MAX]); None if it is."""
    if isinstance(speed, bool) or not isinstance(speed, int | float) or not math.isfinite(speed):
        return f"speed must be a number, got {speed!r}"
    if not SPEED_MIN <= speed <= SPEED_MAX:
        return f"speed must be between {SPEED_MIN} and {SPEED_MAX}, got {speed!r}"
    return None


def field_errors(
    mode: str | None, present: set[str], names: Mapping[str, str] | None = None
) -> list[tuple[str, str]]:
    """What is wrong with a request of ``mode`` that gives the fields in ``present``.

    Args:
        mode: one of :data:`MODES`, or None (sft or zero_shot, as the speaker decides: the fields both take).
        present: names of the given (non-empty) fields among text, speaker, prompt_wav, prompt_text,
            instruct_text, source_wav.
        names: how messages spell each field (the CLI passes its flags); default the field names.
    Returns:
        ``(field, message)`` per problem, the field the message is about first (empty when the combination is
        valid).
    """
    n = {f: f for f in FIELDS} | dict(names or {})
    if mode is None:  # sft or zero_shot with a registered voice: text and speaker only
        return [
            (f, f"{n[f]} needs a mode that takes it (it is for {' / '.join(accepting(f))})")
            for f in FIELDS
            if f in present and f not in ("text", "speaker")
        ] + ([] if "text" in present else [("text", f"{n['text']} is needed (what to say)")])
    if mode not in MODE_TABLE:
        return [("mode", f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")]
    spec = MODE_TABLE[mode]
    errors = [
        (f, f"{n[f]} is not used in {mode} mode (it is for {' / '.join(accepting(f))})")
        for f in FIELDS
        if f in present and f not in spec.takes
    ]
    errors += [(f, f"{mode} mode needs {n[f]} ({ROLES[f]})") for f in spec.needs if f not in present]
    if spec.voice == "clone":
        if "speaker" in present and "prompt_wav" in present:
            errors.append(
                (
                    "speaker",
                    f"{mode} mode takes {n['speaker']} (a registered voice) or {n['prompt_wav']}, not both",
                )
            )
        elif "speaker" in present and "prompt_text" in present:
            errors.append(
                (
                    "prompt_text",
                    f"{n['prompt_text']} comes with {n['prompt_wav']}; a registered voice holds its transcript",
                )
            )
        elif "speaker" not in present:
            if "prompt_wav" not in present:
                errors.append(
                    (
                        "prompt_wav",
                        f"{mode} mode needs {n['prompt_wav']} (the voice to clone) or {n['speaker']} (a registered voice)",
                    )
                )
            if spec.transcript and "prompt_text" not in present:
                errors.append(
                    (
                        "prompt_text",
                        f"{mode} mode needs {n['prompt_text']} (the transcript of {n['prompt_wav']}); "
                        "without one use cross_lingual mode",
                    )
                )
    return errors
