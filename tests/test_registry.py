"""The speaker registry: persistence, atomic writes, spk2info.pt import/export, tenants, names; the CLI's
``speakers`` and ``synth --mode`` flags.

Most tests use synthetic entries shaped like the reference's ``add_zero_shot_spk`` output (no model needed);
the CLI round trip uses the tiny test model.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cosyserve.core.settings import Settings, SettingsError
from cosyserve.voices.registry import (
    ZERO_SHOT_KEYS,
    RegistryError,
    SpeakerRegistry,
    default_registry_dir,
    entry_kind,
)


def default_dir(model: str, key: str | None = None) -> Path:
    """Where the model's registry is under the environment's settings (as a CLI or server start reads them)."""
    s = Settings.load()
    return default_registry_dir(model, key, registry_dir=s.registry_dir, cache_dir=s.cache_dir)


SRC = str(Path(__file__).resolve().parents[1] / "src")


def zero_shot_entry(seed: int, tokens: int = 40, frames: int = 70) -> dict[str, torch.Tensor]:
    """An entry as the reference's add_zero_shot_spk stores it (llm/flow tensors are the same objects)."""
    g = torch.Generator().manual_seed(seed)
    speech = torch.randint(0, 4096, (1, tokens), generator=g, dtype=torch.int32)
    speech_len = torch.tensor([tokens], dtype=torch.int32)
    emb = torch.randn(1, 192, generator=g)
    text = torch.randint(0, 50000, (1, 6), generator=g, dtype=torch.int32)
    return {
        "prompt_text": text,
        "prompt_text_len": torch.tensor([6], dtype=torch.int32),
        "llm_prompt_speech_token": speech,
        "llm_prompt_speech_token_len": speech_len,
        "flow_prompt_speech_token": speech,
        "flow_prompt_speech_token_len": speech_len,
        "prompt_speech_feat": torch.randn(1, frames, 80, generator=g),
        "prompt_speech_feat_len": torch.tensor([frames], dtype=torch.int32),
        "llm_embedding": emb,
        "flow_embedding": emb,
    }


def equal_entries(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_round_trip_survives_restart(tmp_path: Path) -> None:
    reg = SpeakerRegistry(tmp_path)
    assert reg.list() == [] and reg.get("alice") is None and not tmp_path.joinpath("default").exists()
    entry = zero_shot_entry(1)
    reg.add("alice", entry, prompt_text="Hi, I am Alice.")
    reg.add("中文女声", zero_shot_entry(2))
    again = SpeakerRegistry(tmp_path)  # a new process would see the same
    alice = again.get("alice")
    assert alice is not None and alice.kind == "zero_shot" and alice.prompt_text == "Hi, I am Alice."
    assert equal_entries(alice.features, entry)
    assert again.names() == sorted(["alice", "中文女声"])
    again.remove("alice")
    assert reg.get("alice") is None and reg.names() == ["中文女声"]
    with pytest.raises(RegistryError, match="not registered"):
        reg.remove("alice")


def test_overwrite_is_explicit(tmp_path: Path) -> None:
    reg = SpeakerRegistry(tmp_path)
    reg.add("bob", zero_shot_entry(1))
    with pytest.raises(RegistryError, match="already registered"):
        reg.add("bob", zero_shot_entry(2))
    reg.add("bob", zero_shot_entry(2), overwrite=True)
    got = reg.get("bob")
    assert got is not None and equal_entries(got.features, zero_shot_entry(2))


def test_tenants_are_isolated(tmp_path: Path) -> None:
    reg = SpeakerRegistry(tmp_path)
    reg.add("voice", zero_shot_entry(1), tenant="acme")
    reg.add("voice", zero_shot_entry(2), tenant="globex")
    assert reg.get("voice") is None and reg.names("default") == []
    a, b = reg.get("voice", "acme"), reg.get("voice", "globex")
    assert (
        a is not None
        and b is not None
        and not torch.equal(a.features["flow_embedding"], b.features["flow_embedding"])
    )
    reg.remove("voice", tenant="acme")
    assert reg.get("voice", "acme") is None and reg.get("voice", "globex") is not None
    assert reg.tenants() == ["acme", "globex"]


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("", "empty"),
        ("a/b", "path separator"),
        ("..\\x", "path separator"),
        ("..", "reserved"),
        (" lead", "blanks"),
        ("x" * 65, "at most 64"),
        ("tab\there", "control"),
        (42, "must be a string"),
    ],
)
def test_bad_names_are_refused(tmp_path: Path, name: Any, needle: str) -> None:
    with pytest.raises(RegistryError, match=needle):
        SpeakerRegistry(tmp_path).add(name, zero_shot_entry(1))
    assert not any(tmp_path.rglob("*.safetensors"))


@pytest.mark.parametrize("tenant", ["", "../up", "a/b", ".hidden", "x" * 65])
def test_bad_tenants_are_refused(tmp_path: Path, tenant: str) -> None:
    with pytest.raises(RegistryError, match="tenant"):
        SpeakerRegistry(tmp_path).add("ok", zero_shot_entry(1), tenant=tenant)


def test_bad_entries_are_refused() -> None:
    e = zero_shot_entry(1)
    e["prompt_speech_feat_len"] = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(RegistryError, match="prompt_speech_feat_len disagrees"):
        entry_kind(e)
    with pytest.raises(RegistryError, match="neither a zero-shot entry"):
        entry_kind({"speech_feat": torch.zeros(1, 3, 80)})
    with pytest.raises(RegistryError, match="192 floats"):
        entry_kind({"embedding": torch.zeros(1, 80)})
    assert entry_kind({"embedding": torch.zeros(192)})[0] == "sft"


def test_corrupt_file_is_named_and_skipped_in_listing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reg = SpeakerRegistry(tmp_path)
    reg.add("good", zero_shot_entry(1))
    reg.add("bad", zero_shot_entry(2))
    path = reg.path_for("bad")
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(RegistryError, match="truncated|corrupt"):
        reg.get("bad")
    assert reg.names() == ["good"]
    assert "skipping unreadable speaker file" in caplog.text


# ---------------------------------------------------------------------------------------------------------------------
# atomicity: a process killed while writing leaves the old registry intact

_WRITER = textwrap.dedent(
    """
    import os, signal, sys, torch
    sys.path.insert(0, {src!r})
    sys.path.insert(0, {tests!r})
    from test_registry import zero_shot_entry
    from cosyserve.voices.registry import SpeakerRegistry

    mode = sys.argv[1]
    reg = SpeakerRegistry({root!r})
    if mode == "half":
        # die with SIGKILL after writing half of the new file's bytes
        real_write = os.write
        def dying_write(fd, data):
            n = real_write(fd, bytes(data[: len(data) // 2]))
            os.kill(os.getpid(), signal.SIGKILL)
        os.write = dying_write
        reg.add("alice", zero_shot_entry(99, tokens=3000, frames=5000), overwrite=True)
    else:
        print("ready", flush=True)
        i = 0
        while True:
            i += 1
            reg.add("alice", zero_shot_entry(100 + i % 2, tokens=3000, frames=5000), overwrite=True)
    """
)


def _writer(tmp_path: Path) -> Path:
    script = tmp_path / "writer.py"
    script.write_text(_WRITER.format(src=SRC, tests=str(Path(__file__).parent), root=str(tmp_path / "reg")))
    return script


def test_sigkill_mid_write_keeps_old_entry(tmp_path: Path) -> None:
    reg = SpeakerRegistry(tmp_path / "reg")
    old = zero_shot_entry(1)
    reg.add("alice", old)
    r = subprocess.run([sys.executable, str(_writer(tmp_path)), "half"], capture_output=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr.decode()
    leftovers = list((tmp_path / "reg" / "default").glob(".*.tmp"))
    assert leftovers, "the writer did not get as far as its temporary file"
    fresh = SpeakerRegistry(tmp_path / "reg")
    got = fresh.get("alice")
    assert got is not None and equal_entries(got.features, old), "a killed write damaged the registered entry"
    assert fresh.names() == ["alice"]
    fresh.add("alice", zero_shot_entry(2), overwrite=True)  # the registry stays writable
    assert equal_entries(fresh.get("alice").features, zero_shot_entry(2))  # type: ignore[union-attr]


def test_sigkill_at_random_points_always_leaves_a_valid_entry(tmp_path: Path) -> None:
    SpeakerRegistry(tmp_path / "reg").add("alice", zero_shot_entry(1))
    valid = [zero_shot_entry(1), zero_shot_entry(100, 3000, 5000), zero_shot_entry(101, 3000, 5000)]
    script = _writer(tmp_path)
    for delay in (0.05, 0.3):
        with subprocess.Popen(
            [sys.executable, str(script), "loop"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        ) as p:
            assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
            time.sleep(delay)
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=60)
        got = SpeakerRegistry(tmp_path / "reg").get("alice")
        assert got is not None and any(equal_entries(got.features, v) for v in valid)


# ---------------------------------------------------------------------------------------------------------------------
# spk2info.pt


def test_import_official_style_spk2info_and_export_round_trip(tmp_path: Path) -> None:
    spk2info = {
        "中文女": {"embedding": torch.randn(1, 192)},  # a pre-defined speaker of the model: skipped
        "narrator": {"embedding": torch.randn(1, 192)},  # an sft entry
        "cloned": zero_shot_entry(7),  # what add_zero_shot_spk + save_spkinfo write
    }
    torch.save(spk2info, tmp_path / "spk2info.pt")
    reg = SpeakerRegistry(tmp_path / "reg")
    result = reg.import_spk2info(tmp_path / "spk2info.pt", reserved={"中文女"})
    assert result.imported == ["cloned", "narrator"] and result.skipped == ["中文女"]
    cloned, narrator = reg.get("cloned"), reg.get("narrator")
    assert (
        cloned is not None
        and cloned.kind == "zero_shot"
        and equal_entries(cloned.features, spk2info["cloned"])
    )
    assert narrator is not None and narrator.kind == "sft"
    assert torch.equal(narrator.features["embedding"], spk2info["narrator"]["embedding"])
    with pytest.raises(RegistryError, match="already registered for tenant 'default': cloned, narrator"):
        reg.import_spk2info(tmp_path / "spk2info.pt", reserved={"中文女"})

    names = reg.export_spk2info(tmp_path / "out.pt", extra={"中文女": spk2info["中文女"]})
    assert names == sorted(spk2info)
    back = torch.load(tmp_path / "out.pt", weights_only=True)
    assert set(back) == set(spk2info)
    assert all(equal_entries(back[k], spk2info[k]) for k in spk2info)
    assert list(back["cloned"]) == list(ZERO_SHOT_KEYS)


def test_import_refuses_pickled_code_and_bad_entries(tmp_path: Path) -> None:
    torch.save({"evil": {"embedding": Path("/etc/passwd")}}, tmp_path / "evil.pt")
    reg = SpeakerRegistry(tmp_path / "reg")
    with pytest.raises(RegistryError, match="weights-only"):
        reg.import_spk2info(tmp_path / "evil.pt")
    torch.save({"ok": {"embedding": torch.zeros(1, 192)}, "bad": {"x": torch.zeros(3)}}, tmp_path / "bad.pt")
    with pytest.raises(RegistryError, match="'bad' is neither"):
        reg.import_spk2info(tmp_path / "bad.pt")
    assert reg.names() == [], "a failed import wrote some entries"


def test_default_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("COSYSERVE_REGISTRY_DIR", raising=False)
    monkeypatch.setenv("COSYSERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert default_dir("/models/CosyVoice-300M") == tmp_path / "cache" / "speakers" / "CosyVoice-300M"
    monkeypatch.setenv("COSYSERVE_REGISTRY_DIR", str(tmp_path / "mine"))
    assert default_dir("/models/CosyVoice-300M") == tmp_path / "mine"
    monkeypatch.setenv("COSYSERVE_REGISTRY_DIR", " ")
    with pytest.raises(SettingsError, match="COSYSERVE_REGISTRY_DIR"):
        default_dir("/m")


@pytest.mark.parametrize(("mask", "mode"), [(0o002, 0o664), (0o022, 0o644), (0o077, 0o600)])
def test_speaker_files_follow_the_umask(tmp_path: Path, mask: int, mode: int) -> None:
    import os

    saved = os.umask(mask)
    try:
        reg = SpeakerRegistry(tmp_path)
        reg.add("alice", zero_shot_entry(0))
        reg.export_spk2info(tmp_path / "spk2info.pt")
    finally:
        os.umask(saved)
    for path in (reg.path_for("alice"), tmp_path / "spk2info.pt"):
        got = path.stat().st_mode & 0o777
        assert got == mode, f"{path.name}: {oct(got)}; the umask alone decides, as for open()"


def test_models_in_folders_of_the_same_name_keep_separate_voices(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cosyserve
    from cosyserve.bundle.convert import convert
    from cosyserve.bundle.loader import open_bundle
    from cosyserve.families.testmodel import make_test_model

    monkeypatch.delenv("COSYSERVE_REGISTRY_DIR", raising=False)
    monkeypatch.setenv("COSYSERVE_CACHE_DIR", str(tmp_path / "cache"))
    other = tmp_path / "other-model"
    make_test_model(other, size="tiny", seed=1, onnx=False)
    a = convert(tiny_model_dir, tmp_path / "a" / "bundle", progress=False)
    b = convert(other, tmp_path / "b" / "bundle", progress=False)
    model_a = cosyserve.load(a, warmup=False)
    model_a.runtime.pipeline.registry.add("alice", {"embedding": torch.randn(1, 192)})
    assert "alice" in model_a.speakers
    model_b = cosyserve.load(b, warmup=False)
    assert model_b.runtime.registry_root != model_a.runtime.registry_root
    assert "alice" not in model_b.speakers, (
        "another model in a folder of the same name lists the first's voices"
    )
    # the key is the model's weights: a bfloat16 conversion of the same model, elsewhere, shares the voices
    a16 = convert(tiny_model_dir, tmp_path / "c" / "renamed", dtype="bfloat16", progress=False)
    assert open_bundle(a16).model_key == open_bundle(a).model_key != open_bundle(b).model_key


def _manifest_for(seed: int) -> dict[str, Any]:
    files = {
        f"{c}.pt": {"bytes": 1, "sha256": f"{seed:02d}{c}".ljust(64, "0")} for c in ("llm", "flow", "hift")
    }
    return {"source": {"files": files}, "components": {}}


def test_voices_kept_under_the_folder_name_move_to_their_model_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    monkeypatch.delenv("COSYSERVE_REGISTRY_DIR", raising=False)
    monkeypatch.setenv("COSYSERVE_CACHE_DIR", str(tmp_path / "cache"))
    speakers = tmp_path / "cache" / "speakers"
    legacy = default_dir("/models/a/bundle")  # how older versions keyed it
    assert legacy == speakers / "bundle"
    SpeakerRegistry(legacy).add("old-voice", zero_shot_entry(1), tenant="t1")
    key_a, key_b = "a" * 32, "b" * 32
    caplog.set_level(logging.INFO, logger="cosyserve.voices.registry_location")

    root_a = default_dir("/models/a/bundle", key_a)
    assert root_a == speakers / key_a
    assert SpeakerRegistry(root_a).names("t1") == ["old-voice"], "the model lost its registered voice"
    assert legacy.is_symlink() and SpeakerRegistry(legacy).names("t1") == ["old-voice"], (
        "older versions see it"
    )
    assert any("moved the registered voices" in r.getMessage() for r in caplog.records)
    # another model in a folder of the same name starts with its own (empty) registry
    root_b = default_dir("/models/b/bundle", key_b)
    assert root_b == speakers / key_b and SpeakerRegistry(root_b).names("t1") == []
    assert default_dir("/models/a/bundle", key_a) == root_a
    assert SpeakerRegistry(root_a).names("t1") == ["old-voice"]


def test_voices_under_a_folder_name_several_models_had_are_not_moved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import json

    from cosyserve.bundle.loader import model_key

    monkeypatch.delenv("COSYSERVE_REGISTRY_DIR", raising=False)
    monkeypatch.setenv("COSYSERVE_CACHE_DIR", str(tmp_path / "cache"))
    legacy = default_dir("/models/v1/CosyVoice-300M")
    SpeakerRegistry(legacy).add("whose", zero_shot_entry(2))
    keys = []
    for seed, digest in ((1, "1" * 16), (2, "2" * 16)):  # the bundle cache converted two such models
        entry = tmp_path / "cache" / "bundles" / f"CosyVoice-300M-{digest}"
        entry.mkdir(parents=True)
        (entry / "manifest.json").write_text(json.dumps(_manifest_for(seed)))
        keys.append(model_key(_manifest_for(seed)))
    root = default_dir("/models/v2/CosyVoice-300M", keys[0])
    assert SpeakerRegistry(root).names() == []
    assert not legacy.is_symlink() and SpeakerRegistry(legacy).names() == ["whose"], (
        "ambiguous voices were moved"
    )
    assert any("unclear whose voices" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------------------------------------------------
# CLI


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["synth", "--text", "Hi.", "--prompt-wav", "p.wav"], "--prompt-wav needs a mode that takes it"),
        (["synth", "--mode", "zero_shot", "--text", "Hi.", "--prompt-wav", "p.wav"], "needs --prompt-text"),
        (["synth", "--mode", "vc", "--prompt-wav", "p.wav"], "vc mode needs --source-wav"),
        (
            ["synth", "--mode", "vc", "--text", "x", "--source-wav", "s", "--prompt-wav", "p"],
            "--text is not used in vc",
        ),
        (["synth", "--mode", "instruct", "--text", "Hi.", "--speaker", "a"], "needs --instruct-text"),
        (["synth", "--mode", "cross_lingual", "--text", "Hi."], "needs --prompt-wav"),
        (["synth", "--speaker", "a"], "--text is needed"),
        (["synth", "--mode", "sing", "--text", "Hi."], "invalid choice: 'sing'"),
        (["speakers", "add"], "speakers add needs NAME"),
        (["speakers", "add", "bob", "--prompt-wav", "p.wav"], "--prompt-text"),
        (["speakers", "remove", "bob", "--prompt-text", "x"], "are for `speakers add`"),
        (["speakers", "export"], "needs FILE.pt"),
        (["speakers", "list", "--include-builtin"], "--include-builtin is for"),
    ],
)
def test_cli_flag_errors(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    from cosyserve.cli import main

    extra = ["--model", "m", "--out", "o.wav"] if args[0] == "synth" else ["--model", "m"]
    with pytest.raises(SystemExit) as e:
        main([*args, *extra])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_cli_speakers_and_zero_shot_synth(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    import soundfile

    from cosyserve.cli import main

    monkeypatch.setenv("COSYSERVE_REGISTRY_DIR", str(tmp_path / "reg"))
    monkeypatch.setenv("PREWARM_MODELS", "0")
    t = np.arange(32000) / 16000
    soundfile.write(
        tmp_path / "p.wav",
        (0.3 * np.sin(2 * np.pi * 150 * t) * np.sin(2 * np.pi * 2 * t)).astype(np.float32),
        16000,
    )
    model = ["--model", str(tiny_model_dir)]
    main(
        [
            "speakers",
            "add",
            "clara",
            "--prompt-wav",
            str(tmp_path / "p.wav"),
            "--prompt-text",
            "Hello there.",
            *model,
        ]
    )
    main(["speakers", *model])
    lines = capsys.readouterr().out.splitlines()
    # a registered voice is marked, the model's own speakers are listed plain
    assert "clara  (registered)" in lines and "英文女" in lines, lines
    main(
        [
            "synth",
            "--speaker",
            "clara",
            "--text",
            "Hi.",
            "--seed",
            "1",
            "--out",
            str(tmp_path / "a.wav"),
            *model,
        ]
    )
    main(
        [
            "synth",
            "--mode",
            "cross_lingual",
            "--speaker",
            "clara",
            "--text",
            "Hi.",
            "--out",
            str(tmp_path / "b.wav"),
            *model,
        ]
    )
    assert soundfile.info(tmp_path / "a.wav").frames > 0 and soundfile.info(tmp_path / "b.wav").frames > 0
    main(["speakers", "export", str(tmp_path / "spk2info.pt"), *model])
    assert set(torch.load(tmp_path / "spk2info.pt", weights_only=True)) == {"clara"}
    main(["speakers", "remove", "clara", *model])
    main(["speakers", "import", str(tmp_path / "spk2info.pt"), "--tenant", "t2", *model])
    capsys.readouterr()
    main(["speakers", "--tenant", "t2", *model])
    assert "clara" in capsys.readouterr().out.split()
    main(["speakers", *model])
    assert "clara" not in capsys.readouterr().out.split()
    with pytest.raises(SystemExit):
        main(["speakers", "remove", "clara", *model])
    assert "not registered" in capsys.readouterr().err


def test_a_voice_reports_its_prompt_length_at_its_family_token_rate(tmp_path: Path) -> None:
    """CosyVoice2/3 tokens are 25 Hz: a 2 s prompt of 50 tokens was reported as a 1 s one (read at 50 Hz)."""
    import numpy as np

    from cosyserve.voices.registry import Speaker

    features = {"flow_prompt_speech_token": np.zeros((1, 50), np.int32)}
    assert Speaker("v", "t", "zero_shot", features, token_rate=25).seconds == 2.0
    assert Speaker("v", "t", "zero_shot", features, token_rate=50).seconds == 1.0
