"""Fuzz the HTTP API from its own OpenAPI document (schemathesis): no 5xx, and every answer conforms.

A real server on 127.0.0.1 (tiny model) with a short text limit, which the document it serves states, so a
synthesis stays short; a bounded, derandomized number of examples per operation. schemathesis's
``positive_data_acceptance`` is replaced by a narrower check: which voices exist is known only at run time,
and whether uploaded bytes (``prompt_wav``, ``audio_sample``, ``ref_audio``) are audio cannot be said in a schema
either, so those are the two reasons a schema-valid request may be refused (400 ``voice_not_found``, 400 "cannot
decode prompt audio"); and the fuzzed model is a CosyVoice-300M one, which refuses CosyVoice2's instruct2
(``/inference_instruct2``, or ``instructions`` with ``ref_audio``: 400 ``mode_unavailable``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from cosyserve.core.limits import Limits
from cosyserve.server.openapi import openapi_document
from server_util import ServerProcess, running_server

MAX_TEXT_CHARS = (
    24  # keeps each synthesis on the tiny model well under a second (transcripts, instructions too)
)
LIMITS = Limits(
    text_chars=MAX_TEXT_CHARS, prompt_text_chars=MAX_TEXT_CHARS, instructions_chars=MAX_TEXT_CHARS
)


@pytest.fixture(scope="module", params=["torch", "lite"])
def server(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The server on each runtime: the model dir on torch, its --runtime lite bundle on the lite runtime."""
    args = [
        "--max-text-chars",
        str(MAX_TEXT_CHARS),
        "--max-prompt-text-chars",
        str(MAX_TEXT_CHARS),
        "--max-instructions-chars",
        str(MAX_TEXT_CHARS),
        "--request-timeout",
        "60",
        "--serve-log-level",
        "warning",
    ]
    if request.param == "lite":
        model, env = request.getfixturevalue("tiny_lite_bundle"), {"COSYSERVE_RUNTIME": "lite"}
    else:
        model, env = tiny_model_dir, {}
    with running_server(model, tmp_path_factory.mktemp("fuzz"), args=args, env=env) as s:
        yield s


# built at import: schemathesis's lazy loader (``from_fixture``) breaks under pytest 9 (``Function._nodeid``);
# the test below checks that the server serves this very document
schema = schemathesis.openapi.from_dict(openapi_document(LIMITS))


def test_served_document_is_the_fuzzed_one(server: ServerProcess) -> None:
    with server.client() as c:
        doc = c.get("/openapi.json").json()
    assert doc == openapi_document(LIMITS)
    assert doc["components"]["schemas"]["SpeechRequest"]["properties"]["input"]["maxLength"] == MAX_TEXT_CHARS


@schema.parametrize()
@settings(max_examples=12, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_schema(case: Any, server: ServerProcess) -> None:
    response = case.call(base_url=server.base_url, timeout=60)
    case.validate_response(response, excluded_checks=[positive_data_acceptance])
    meta = case.meta
    if meta is not None and meta.generation.mode.is_positive and response.status_code == 400:
        err = response.json()["error"]
        uploads = ("prompt_wav", "audio_sample", "ref_audio")  # the fields that carry audio
        undecodable = (
            any(f in str(case.body) for f in uploads) and "cannot decode prompt audio" in err["message"]
        )
        # JSON Schema's regex dialect and Python's disagree on some blanks: a voice of only such characters
        blank_voice = isinstance(case.body, dict) and str(case.body.get("voice", "x")).strip() == ""
        # a voice name the registry refuses for a character of Unicode's categories C (format, private use,
        # unassigned) that a JSON Schema pattern cannot name
        odd_name = (
            case.path == "/v1/audio/voices" and err["param"] == "name" and err["code"] == "invalid_voice"
        )
        # the served model is a CosyVoice-300M one: CosyVoice2's instruct2 is refused by its mode, as documented
        # (its route, and instructions with ref_audio on the speech route)
        instruct2 = case.path == "/inference_instruct2" or "ref_audio" in str(case.body)
        other_family = instruct2 and err["code"] == "mode_unavailable"
        assert err["code"] == "voice_not_found" or undecodable or blank_voice or other_family or odd_name, (
            f"a schema-valid request was refused: {err}"
        )


@pytest.mark.parametrize("text", ["4/", "a 4/ b", "5`\U001078fd4/"])
def test_text_the_normaliser_chokes_on_is_spoken_as_written(server: ServerProcess, text: str) -> None:
    """Found by this fuzz test: wetext's English grammar asserts on "4/", which was a 500."""
    with server.client() as c:
        r = c.post("/inference_sft", data={"tts_text": text, "spk_id": "英文女"})
    assert r.status_code == 200 and len(r.content) > 0, r.text[:300]
