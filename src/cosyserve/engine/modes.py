"""The synthesis modes and which request fields each one takes. Pure Python (no torch): the CLI checks its flags
with these rules before loading anything, the pipeline checks requests with the same rules.

| mode | text | speaker | prompt_wav | prompt_text | instruct_text | source_wav |
|---|---|---|---|---|---|---|
| ``sft`` | required | required (pre-defined or registered embedding) | - | - | - | - |
| ``zero_shot`` | required | a registered voice, **or** ... | ... required | ... required | - | - |
| ``cross_lingual`` | required | a registered voice, **or** ... | ... required | - | - | - |
| ``instruct`` | required | required (pre-defined or registered embedding) | - | - | required | - |
| ``vc`` | - | - | required | - | - | required |
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

__all__ = [
    "MODES",
    "PROMPT_MODES",
    "SPEED_MAX",
    "SPEED_MIN",
    "Mode",
    "field_errors",
    "present_fields",
    "speed_error",
]

Mode = Literal["sft", "zero_shot", "cross_lingual", "instruct", "vc"]
MODES: tuple[Mode, ...] = ("sft", "zero_shot", "cross_lingual", "instruct", "vc")
PROMPT_MODES: tuple[Mode, ...] = ("zero_shot", "cross_lingual", "vc")  # need campplus + the speech tokenizer

# The tempo range every entry point accepts (OpenAI's). Speed stretches the whole utterance's mel in time before
# the vocoder (the reference's rule), which works for any factor > 0; the bounds keep requests sane.
SPEED_MIN = 0.25
SPEED_MAX = 4.0

# field -> modes that accept it
_ACCEPTS: dict[str, tuple[Mode, ...]] = {
    "text": ("sft", "zero_shot", "cross_lingual", "instruct"),
    "speaker": ("sft", "zero_shot", "cross_lingual", "instruct"),
    "prompt_wav": ("zero_shot", "cross_lingual", "vc"),
    "prompt_text": ("zero_shot",),
    "instruct_text": ("instruct",),
    "source_wav": ("vc",),
}


def present_fields(request: object) -> set[str]:
    """Names of the content fields ``request`` gives (non-blank strings, non-None audio)."""
    out = {
        name
        for name in ("text", "speaker", "prompt_text", "instruct_text")
        if isinstance(getattr(request, name, None), str) and getattr(request, name).strip()
    }
    return out | {name for name in ("prompt_wav", "source_wav") if getattr(request, name, None) is not None}


def speed_error(speed: object) -> str | None:
    """Why ``speed`` is not an accepted tempo factor (a finite number in [SPEED_MIN, SPEED_MAX]); None if it is."""
    if isinstance(speed, bool) or not isinstance(speed, int | float) or not math.isfinite(speed):
        return f"speed must be a number, got {speed!r}"
    if not SPEED_MIN <= speed <= SPEED_MAX:
        return f"speed must be between {SPEED_MIN} and {SPEED_MAX}, got {speed!r}"
    return None


def field_errors(mode: str, present: set[str], names: Mapping[str, str] | None = None) -> list[str]:
    """What is wrong with a request of ``mode`` that gives the fields in ``present``.

    Args:
        mode: one of :data:`MODES`.
        present: names of the given (non-empty) fields among text, speaker, prompt_wav, prompt_text,
            instruct_text, source_wav.
        names: how messages spell each field (the CLI passes its flags); default the field names.
    Returns:
        One message per problem (empty when the combination is valid).
    """
    n = {f: f for f in _ACCEPTS} | dict(names or {})
    if mode not in MODES:
        return [f"unknown mode {mode!r}; expected one of {', '.join(MODES)}"]
    errors = [
        f"{n[f]} is not used in {mode} mode (it is for {' / '.join(modes)})"
        for f, modes in _ACCEPTS.items()
        if f in present and mode not in modes
    ]
    if mode != "vc" and "text" not in present:
        errors.append(f"{mode} mode needs {n['text']} (what to say)")
    if mode in ("sft", "instruct") and "speaker" not in present:
        errors.append(
            f"{mode} mode needs {n['speaker']} (a pre-defined speaker id or a registered embedding)"
        )
    if mode == "instruct" and "instruct_text" not in present:
        errors.append(f"instruct mode needs {n['instruct_text']} (the style instruction)")
    if mode in ("zero_shot", "cross_lingual"):
        if "speaker" in present and "prompt_wav" in present:
            errors.append(
                f"{mode} mode takes {n['speaker']} (a registered voice) or {n['prompt_wav']}, not both"
            )
        elif "speaker" in present and "prompt_text" in present:
            errors.append(
                f"{n['prompt_text']} comes with {n['prompt_wav']}; a registered voice holds its transcript"
            )
        elif "speaker" not in present:
            if "prompt_wav" not in present:
                errors.append(
                    f"{mode} mode needs {n['prompt_wav']} (the voice to clone) or {n['speaker']} (a registered voice)"
                )
            if mode == "zero_shot" and "prompt_text" not in present:
                errors.append(
                    f"zero_shot mode needs {n['prompt_text']} (the transcript of {n['prompt_wav']}); "
                    "without one use cross_lingual mode"
                )
    if mode == "vc":
        for f in ("source_wav", "prompt_wav"):
            if f not in present:
                errors.append(f"vc mode needs {n[f]}")
    return errors
