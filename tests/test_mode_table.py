"""The mode table (cosyserve.core.modes) is the one place a mode is declared: request checks, the families and the
docs/usage.md agree with it. No model: the families' tables and methods only (no torch)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cosyserve.core.modes import MODE_TABLE, MODES, markdown_table
from cosyserve.core.request import field_errors
from cosyserve.families import FAMILIES, family_named

README = Path(__file__).resolve().parents[1] / "docs" / "usage.md"


def _offered_by() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name in FAMILIES:
        family = family_named(name)
        for m in family.modes:
            out.setdefault(m, []).append(family.title)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_takes_what_its_table_entry_says(mode: str) -> None:
    """A request with what the entry needs (and a voice, where it clones one) is valid; leaving out any field it
    needs names that field; any field it does not take is refused naming that field. If this fails, request
    checks no longer follow the table."""
    spec = MODE_TABLE[mode]
    full = set(spec.needs) | (
        {"prompt_wav"} | ({"prompt_text"} if spec.transcript else set()) if spec.voice == "clone" else set()
    )
    assert field_errors(mode, full) == [], (mode, full)
    for f in spec.needs:
        assert f in [name for name, _ in field_errors(mode, full - {f})], (mode, f)
    for f in {"text", "speaker", "prompt_wav", "prompt_text", "instruct_text", "source_wav"} - set(
        spec.takes
    ):
        assert f in [name for name, _ in field_errors(mode, full | {f})], (mode, f)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_family_offers_modes_of_the_table_and_assembles_each(name: str) -> None:
    """A family's modes are the table's; every mode it does not offer has a reason (a request for it gets one);
    it assembles the model input of each mode with text that it offers. If this fails, a mode was added to a
    family without its assembly, or to the table without the families saying whether they offer it."""
    family = family_named(name)
    assert set(family.modes) <= set(MODES)
    assert set(family.unavailable_modes(True)) == set(MODES) - set(family.modes)
    text, voice, instruction = (
        ("ids", "n"),
        {"embedding": "e", "llm_prompt_speech_token": "t"},
        ("iids", "in"),
    )
    for mode in family.modes:
        spec = MODE_TABLE[mode]
        if "text" not in spec.takes:
            continue  # vc: the runtime's frontend builds its input from the two recordings
        got = family.model_input(mode, text, voice, instruction if spec.instruction else None)
        assert got["text"] == "ids" and got["text_len"] == "n", (name, mode)
        if spec.instruction:
            assert got["prompt_text"] == "iids", (name, mode)


def test_the_readme_lists_the_table() -> None:
    """docs/usage.md's modes block is the table (regenerate it with ``markdown_table`` after changing the table)."""
    readme = README.read_text(encoding="utf-8")
    block = re.search(r"<!-- modes -->\n(.*?)\n<!-- /modes -->", readme, re.S)
    assert block is not None, "docs/usage.md lost its <!-- modes --> block"
    assert block.group(1) == markdown_table(_offered_by()), markdown_table(_offered_by())
