"""OpenAI's voice names on a model's own voices, and what a voice's name says of its language.

Clients built for OpenAI offer its voice names (alloy, nova, echo, ...); a model has its own speakers. Each model
maps every OpenAI name to one of them, so that a client's voice picker still picks different voices
(:func:`openai_voice_map`), by this documented default rule:

- ``alloy`` (OpenAI's default) is the model's default voice: ``--default-voice``, else its first speaker;
- OpenAI's female voices (nova, shimmer, coral, sage, marin, in that order) go round the model's speakers whose
  name says female (``女``), its male ones (echo, onyx, ash, fable, ballad, verse, cedar) round those whose name
  says male (``男``), English speakers (``英文``) first: on CosyVoice-300M-SFT nova is 英文女 and echo 英文男;
- a model whose speakers' names say neither (or have none of one kind) has that group go round all its speakers
  but the default one, so that alloy and the others differ wherever the model has two or more;
- a model with one speaker: every name is that speaker; none: every name is the default voice (the request then
  needs a registered voice, as before).

The pool config overrides any of them per model (``[models.NAME] voices = { nova = "my-voice" }``; a registered
voice's name is fine); the voices list (``GET /v1/audio/voices``) shows the map as ``aliases``. A model's own
voice of one of these names (none of CosyVoice's) is that voice, never mapped; registering one is refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

__all__ = ["OPENAI_VOICES", "is_openai_voice", "language_of", "openai_voice_map"]

# OpenAI's voice names (its speech API's `voice` enum), alloy first: its default
OPENAI_VOICES = (
    "alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse", "marin", "cedar",
)  # fmt: skip
_FEMALE = ("nova", "shimmer", "coral", "sage", "marin")
_MALE = ("echo", "onyx", "ash", "fable", "ballad", "verse", "cedar")
# what the start of a pre-defined speaker's name says of its language (CosyVoice-300M-SFT's speakers)
_LANGUAGES = {"中文": "zh", "英文": "en", "日语": "ja", "粤语": "yue", "韩语": "ko"}


def is_openai_voice(name: str) -> bool:
    """``name`` is one of OpenAI's voice names (any case)."""
    return name.lower() in OPENAI_VOICES


def language_of(name: str) -> str | None:
    """The language a voice's name states (``中文女`` -> ``zh``), as a BCP 47 tag; None where it states none."""
    return next((tag for prefix, tag in _LANGUAGES.items() if name.startswith(prefix)), None)


def _round(names: Iterable[str], voices: Sequence[str], out: dict[str, str | None]) -> None:
    for i, name in enumerate(names):
        out[name] = voices[i % len(voices)] if voices else None


def openai_voice_map(
    speakers: Sequence[str], default: str | None, overrides: Mapping[str, str] | None = None
) -> dict[str, str | None]:
    """Each OpenAI voice name -> the voice it speaks with on a model (see the module docstring).

    Args:
        speakers: the model's pre-defined speakers, sorted (``Runtime.speakers()``).
        default: the model's default voice (None: its first speaker).
        overrides: the pool config's map for this model (OpenAI name -> voice), over the default rule.
    Returns:
        Every name of :data:`OPENAI_VOICES` -> a voice name (None only where the model has no speaker and no
        default: the request then speaks with the default voice, which it must have).
    """
    default = default if default is not None else (speakers[0] if speakers else None)
    english_first = sorted(speakers, key=lambda s: not s.startswith("英文"))
    others = [s for s in english_first if s != default] or list(speakers)
    out: dict[str, str | None] = {"alloy": default}
    for names, mark in ((_FEMALE, "女"), (_MALE, "男")):
        _round(names, [s for s in english_first if mark in s] or others, out)
    out |= dict(overrides or {})
    return {name: out.get(name, default) for name in OPENAI_VOICES}
