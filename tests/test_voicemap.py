"""OpenAI's voice names on a model's voices (cosyserve.engine.voicemap): the default rule, the pool file's
overrides, and the engine resolving a request's name once, for every transport."""

from __future__ import annotations

from pathlib import Path

import pytest

from cosyserve.core.errors import SettingsError, UnknownVoiceError
from cosyserve.core.request import SynthesisRequest
from cosyserve.core.settings import Settings
from cosyserve.engine.engine import Engine
from cosyserve.engine.poolfile import load_pool_config
from cosyserve.engine.voicemap import OPENAI_VOICES, language_of, openai_voice_map
from fake_runtime import FakeRuntime

SFT = sorted(["中文女", "中文男", "日语男", "粤语女", "英文女", "英文男", "韩语女"])  # CosyVoice-300M-SFT's


def test_the_default_rule_gives_distinct_voices_by_what_their_names_say() -> None:
    """If this fails, OpenAI's names no longer reach the model's several voices (every name was the default voice:
    a client's voice picker picked nothing), or a female name lands on a male speaker."""
    m = openai_voice_map(SFT, None)
    assert set(m) == set(OPENAI_VOICES) and m["alloy"] == "中文女", (
        "alloy: the default voice (the first speaker)"
    )
    assert (m["nova"], m["shimmer"], m["coral"], m["sage"]) == ("英文女", "中文女", "粤语女", "韩语女")
    assert (m["echo"], m["onyx"], m["ash"]) == ("英文男", "中文男", "日语男")
    assert set(m.values()) == set(SFT), "all seven speakers are reached"
    assert all("女" in m[n] for n in ("nova", "shimmer", "coral", "sage", "marin"))
    assert all("男" in m[n] for n in ("echo", "onyx", "ash", "fable", "ballad", "verse", "cedar"))
    assert openai_voice_map(SFT, "英文男")["alloy"] == "英文男", "--default-voice is alloy's"


def test_names_that_say_nothing_go_round_the_other_speakers_one_speaker_is_every_name() -> None:
    m = openai_voice_map(["alice", "bob"], None)
    assert m["alloy"] == "alice" and m["nova"] == m["echo"] == "bob", (
        "two voices: alloy and the others differ"
    )
    assert set(openai_voice_map(["solo"], None).values()) == {"solo"}
    assert set(openai_voice_map([], None).values()) == {None}, (
        "no speaker: the request needs a registered voice"
    )
    over = openai_voice_map(SFT, None, {"nova": "mine"})
    assert over["nova"] == "mine" and over["shimmer"] == "中文女", "an override changes its name only"
    assert language_of("英文女") == "en" and language_of("粤语女") == "yue" and language_of("alice") is None


def test_the_pool_file_overrides_a_models_map_and_refuses_what_is_not_one(tmp_path: Path) -> None:
    f = tmp_path / "pool.toml"
    f.write_text('[models.m]\npath = "m"\nvoices = { Nova = "bob", alloy = "bob" }\n', encoding="utf-8")
    cfg = load_pool_config(Settings.load(env={}, flags={"pool_config": str(f)}))
    assert dict(cfg.models["m"].voices) == {"nova": "bob", "alloy": "bob"}
    for table, says in (
        ('{ nobody = "bob" }', "'nobody' is not an OpenAI voice name"),
        ('{ nova = " bob" }', "expected the name of one of the model's voices"),
        ('"bob"', "expected a table"),
    ):
        f.write_text(f'[models.m]\npath = "m"\nvoices = {table}\n', encoding="utf-8")
        with pytest.raises(SettingsError, match=says) as e:
            load_pool_config(Settings.load(env={}, flags={"pool_config": str(f)}))
        assert "[models.m] voices" in str(e.value), "the error names the file's table"


def test_the_engine_resolves_an_openai_name_once_as_its_model_maps_it() -> None:
    """If this fails, a transport would have to map the names itself (the WebSocket resolves at its config, POST
    at admission, Wyoming by its own: one place, Engine.resolve, serves them all)."""
    e = Engine("m", lambda: FakeRuntime(speakers=("alice", "bob", "carol")), voices={"echo": "carol"})
    e.load_sync(5)
    try:
        assert e.resolve(SynthesisRequest(text="hi", speaker="Nova")).speaker == "bob"
        assert e.resolve(SynthesisRequest(text="hi", speaker="echo")).speaker == "carol", "the pool file's"
        assert e.resolve(SynthesisRequest(text="hi", speaker="alloy")).speaker == "alice"
        assert e.openai_voices()["echo"] == "carol"
    finally:
        e.release_sync()
    e = Engine("m", lambda: FakeRuntime(), voices={"nova": "gone"})
    e.load_sync(5)
    try:
        with pytest.raises(UnknownVoiceError, match="OpenAI voice 'nova' stands for 'gone' on model 'm'"):
            e.resolve(SynthesisRequest(text="hi", speaker="nova"))
    finally:
        e.release_sync()
