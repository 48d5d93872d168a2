"""The synthesis modes, as one table: what each takes and needs, its voice, the tier it needs, how its instruction
is read.

:data:`MODE_TABLE` is read by request validation (:func:`cosyserve.core.request.field_errors`), the CLI's
``--mode`` choices and flag checks, the runtimes' mode rules and model-input assembly
(:class:`cosyserve.runtime.modes.ModelModes`), the prompt frontend's availability and the docs that list the
modes. Which modes a model serves is its family's (:attr:`cosyserve.families.base.Family.modes`), and so is how a
mode's model input is assembled (:meth:`cosyserve.families.base.Family.model_input`): a new mode is one entry here
plus its family's code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "FIELDS",
    "MODES",
    "MODE_TABLE",
    "PROMPT_MODES",
    "ROLES",
    "VOICE_MODES",
    "ModeSpec",
    "accepting",
    "markdown_table",
]

# the request's content fields a mode may take, and what each is (messages name it so)
ROLES: dict[str, str] = {
    "text": "what to say",
    "speaker": "a pre-defined speaker or a registered voice",
    "prompt_wav": "the voice to clone",
    "prompt_text": "the transcript of the voice to clone",
    "instruct_text": "the style instruction",
    "source_wav": "the recording to convert",
}
FIELDS = tuple(ROLES)


@dataclass(frozen=True)
class ModeSpec:
    """One mode.

    Attributes:
        name: what requests name it by (``mode``).
        summary: one line for the docs and ``--help``.
        takes: the request fields it accepts (any other given is refused, naming the field).
        needs: the fields it always needs.
        voice: ``speaker``: a pre-defined speaker or a registered embedding (none given: the model's default
            voice); ``clone``: a registered zero-shot voice or ``prompt_wav`` (not both); None: the mode's own
            audio fields (vc).
        transcript: a ``clone`` mode whose prompt recording comes with its transcript (``prompt_text``, which
            the LM reads); without it the prompt's features are extracted with no text.
        prompt_tier: it needs the zero-shot tier's ONNX models (speaker embedding, speech tokenizer).
        instruction: how ``instruct_text`` is read: ``normalized`` (the text frontend's, as prompt text is) or
            ``family`` (as the model's family completes it: CosyVoice2/3's end marker); None: it takes none.
        param: the field that asks for the mode, named when a model cannot run it.
    """

    name: str
    summary: str
    takes: tuple[str, ...]
    needs: tuple[str, ...]
    voice: Literal["speaker", "clone"] | None
    transcript: bool = False
    prompt_tier: bool = False
    instruction: Literal["normalized", "family"] | None = None
    param: str | None = None

    def __post_init__(self) -> None:
        unknown = set(self.takes) - set(FIELDS)
        assert not unknown, f"mode {self.name}: unknown fields {sorted(unknown)}"
        assert set(self.needs) <= set(self.takes), f"mode {self.name}: it needs what it does not take"


MODE_TABLE: dict[str, ModeSpec] = {
    spec.name: spec
    for spec in (
        ModeSpec(
            "sft",
            "a pre-defined speaker (or a registered embedding) says the text",
            takes=("text", "speaker"),
            needs=("text",),
            voice="speaker",
        ),
        ModeSpec(
            "zero_shot",
            "a cloned voice says the text: a registered voice, or prompt_wav with its transcript prompt_text",
            takes=("text", "speaker", "prompt_wav", "prompt_text"),
            needs=("text",),
            voice="clone",
            transcript=True,
            prompt_tier=True,
        ),
        ModeSpec(
            "cross_lingual",
            "a cloned voice says the text, the prompt's transcript unused (the LM speaks the text's language)",
            takes=("text", "speaker", "prompt_wav"),
            needs=("text",),
            voice="clone",
            prompt_tier=True,
        ),
        ModeSpec(
            "instruct",
            "a pre-defined speaker says the text in the style instruct_text asks for (an -Instruct model)",
            takes=("text", "speaker", "instruct_text"),
            needs=("text", "instruct_text"),
            voice="speaker",
            instruction="normalized",
            param="instruct_text",
        ),
        ModeSpec(
            "instruct2",
            "a cloned voice says the text in the style instruct_text asks for",
            takes=("text", "speaker", "prompt_wav", "instruct_text"),
            needs=("text", "instruct_text"),
            voice="clone",
            prompt_tier=True,
            instruction="family",
        ),
        ModeSpec(
            "vc",
            "voice conversion: the speech of source_wav in the voice of prompt_wav",
            takes=("prompt_wav", "source_wav"),
            needs=("source_wav", "prompt_wav"),
            voice=None,
            prompt_tier=True,
        ),
    )
}

MODES: tuple[str, ...] = tuple(MODE_TABLE)
PROMPT_MODES: tuple[str, ...] = tuple(m for m, s in MODE_TABLE.items() if s.prompt_tier)
VOICE_MODES: tuple[str, ...] = tuple(m for m, s in MODE_TABLE.items() if s.voice == "clone")


def accepting(field: str) -> tuple[str, ...]:
    """The modes that take ``field``."""
    return tuple(m for m, s in MODE_TABLE.items() if field in s.takes)


def markdown_table(offered_by: Mapping[str, Sequence[str]]) -> str:
    """The table as docs/usage.md shows it (between its ``<!-- modes -->`` markers; a test keeps them equal), with
    ``offered_by``: mode -> the families that offer it (their ``modes``, asked by the caller: core knows none)."""
    rows = ["| mode | what it does | takes | needs | families |", "|---|---|---|---|---|"]
    for m, s in MODE_TABLE.items():
        needs = list(s.needs)
        if s.voice == "clone":
            needs.append("speaker or prompt_wav" + (" + prompt_text" if s.transcript else ""))
        families = ", ".join(offered_by.get(m, ())) or "none"
        rows.append(f"| `{m}` | {s.summary} | {', '.join(s.takes)} | {', '.join(needs)} | {families} |")
    return "\n".join(rows)
