"""The settings: one declaration per setting, read once (flag > environment > pool config file > default), every
value checked with an error that names where it came from; docs/settings.md's tables generated from the declarations."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

from cosyserve.core.casts import parse_api_keys
from cosyserve.core.errors import SettingsError
from cosyserve.core.settings import DEMO_MODEL, Settings, declared, parse_model_arg

ROOT = Path(__file__).resolve().parents[1]


def settings_tables():  # type: ignore[no-untyped-def]
    """scripts/settings_tables.py, the generator of docs/settings.md's tables."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("settings_tables", ROOT / "scripts" / "settings_tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(**flags: object) -> Settings:
    return Settings.load(flags=flags, env={})


def test_model_args_name_defaults_to_the_directory_and_can_be_given() -> None:
    assert parse_model_arg("/models/CosyVoice-300M-SFT/").name == "CosyVoice-300M-SFT"
    m = parse_model_arg("sft=/models/x")
    assert (m.name, m.source) == ("sft", "/models/x")
    with pytest.raises(SettingsError, match="model name"):
        parse_model_arg("bad name!=/x")
    with pytest.raises(SettingsError, match="no path"):
        parse_model_arg("x=")


def test_flags_win_over_env_and_bad_values_name_their_source() -> None:
    env = {"COSYSERVE_PORT": "9000", "COSYSERVE_MAX_TEXT_CHARS": "100"}
    cfg = Settings.load(env=env)
    assert (cfg.port, cfg.max_text_chars) == (9000, 100)
    assert Settings.load(flags={"port": "8001"}, env=env).port == 8001
    with pytest.raises(SettingsError, match="COSYSERVE_PORT='http'"):
        Settings.load(env={"COSYSERVE_PORT": "http"})
    with pytest.raises(SettingsError, match="between"):
        Settings.load(env={"COSYSERVE_REQUEST_TIMEOUT": "-1"})
    with pytest.raises(SettingsError, match="not an origin"):
        Settings.load(env={"COSYSERVE_CORS_ORIGINS": "example.com"})
    with pytest.raises(SettingsError, match="given twice"):
        load(models=["/a/m", "/b/m"]).model_args()
    assert load().demo, "no model and no pool config must mean the demo model"


def test_bad_flag_values_are_named_as_the_flag() -> None:
    """If this fails, a bad flag value is reported as "flag for COSYSERVE_PORT=99999" instead of the flag the user
    typed (--port 99999)."""
    cases = [
        ({"port": 99999}, "--port 99999: must be between 0 and 65535"),
        ({"request_timeout_s": 0.0}, "--request-timeout 0.0: must be between"),
        ({"cors_origins": "example.com"}, "--cors-origins example.com: 'example.com' is not an origin"),
    ]
    for flags, message in cases:
        with pytest.raises(SettingsError) as exc:
            load(**flags)
        assert str(exc.value).startswith(message) and "COSYSERVE_" not in str(exc.value), exc.value
    with pytest.raises(SettingsError, match="^COSYSERVE_PORT='99999': must be between"):
        Settings.load(env={"COSYSERVE_PORT": "99999"})


def test_drain_delay_has_a_default_a_flag_and_a_variable() -> None:
    """The window after SIGTERM in which the port still answers 503 (so load balancers see the drain)."""
    assert load().drain_delay_s == 5.0
    assert Settings.load(env={"COSYSERVE_DRAIN_DELAY": "2.5"}).drain_delay_s == 2.5
    assert Settings.load(flags={"drain_delay_s": 0}, env={"COSYSERVE_DRAIN_DELAY": "9"}).drain_delay_s == 0
    with pytest.raises(SettingsError, match="COSYSERVE_DRAIN_DELAY='soon'"):
        Settings.load(env={"COSYSERVE_DRAIN_DELAY": "soon"})
    with pytest.raises(SettingsError, match="between"):
        load(drain_delay_s=-1)


def test_api_keys_parse_and_reject_bad_entries(tmp_path: Path) -> None:
    assert parse_api_keys("k-aaaaaaaa=alice, k-bbbbbbbb=bob # comment", "x") == {
        "k-aaaaaaaa": "alice",
        "k-bbbbbbbb": "bob",
    }
    with pytest.raises(SettingsError, match="KEY=TENANT"):
        parse_api_keys("justakey12345", "x")
    with pytest.raises(SettingsError, match="at least 8"):
        parse_api_keys("short=alice", "x")
    with pytest.raises(SettingsError, match="twice"):
        parse_api_keys("k-aaaaaaaa=a,k-aaaaaaaa=b", "x")
    f = tmp_path / "keys"
    f.write_text("# keys\nk-cccccccc=carol\n")
    cfg = Settings.load(flags={"api_keys_file": str(f)}, env={"COSYSERVE_API_KEYS": "k-dddddddd=dan"})
    assert dict(cfg.api_keys) == {"k-cccccccc": "carol", "k-dddddddd": "dan"}
    with pytest.raises(SettingsError, match="cannot read"):
        load(api_keys_file=str(tmp_path / "missing"))


def test_api_keys_stay_out_of_errors_and_repr() -> None:
    """If this fails, a key is printed whole: in the error for a bad COSYSERVE_API_KEYS, or in repr(settings) (which
    lands in logs and tracebacks)."""
    secret = "k-supersecret-0123456789"
    with pytest.raises(SettingsError) as exc:
        Settings.load(env={"COSYSERVE_API_KEYS": f"{secret}=bad tenant!"})
    assert str(exc.value).startswith("COSYSERVE_API_KEYS: entry 1") and secret not in str(exc.value)
    cfg = Settings.load(env={"COSYSERVE_API_KEYS": f"{secret}=acme"})
    assert cfg.api_keys == {secret: "acme"} and secret not in repr(cfg)


def test_precedence_is_flag_then_env_then_file_then_default(tmp_path: Path) -> None:
    """If this fails, a value from a lower source wins over a higher one (the environment over a flag, the pool
    config file over the environment), or a setting nobody sets loses its default."""
    f = tmp_path / "pool.toml"
    f.write_text("[pool]\nlru_k = 3\nqueue_limit = 5\nbatch_size = 2\n")
    env = {"COSYSERVE_POOL_CONFIG": str(f), "COSYSERVE_QUEUE_LIMIT": "7", "COSYSERVE_BATCH_SIZE": "4"}
    s = Settings.load(flags={"batch_size": "6"}, env=env)
    assert (s.batch_size, s.queue_limit, s.lru_k, s.instances) == (6, 7, 3, 1)
    assert [s.origin(n) for n in ("batch_size", "queue_limit", "lru_k", "instances")] == [
        "flag",
        "env",
        "file",
        "default",
    ]
    assert s.where("lru_k") == f"{f}: [pool] lru_k" and s.where("queue_limit") == "COSYSERVE_QUEUE_LIMIT"
    assert Settings.load(env={}, file=f).lru_k == 3, "file= must read that file"


def test_file_values_are_named_with_file_table_and_key(tmp_path: Path) -> None:
    f = tmp_path / "pool.toml"
    f.write_text("[pool]\nlru_k = 0\n")
    with pytest.raises(SettingsError, match=r"^\S*pool.toml: \[pool\] lru_k = 0: expected an integer >= 1$"):
        Settings.load(env={}, file=f)
    f.write_text("[pool]\nlru = 2\n")
    with pytest.raises(SettingsError, match=r"pool.toml: \[pool\]: unknown key 'lru'; expected one of"):
        Settings.load(env={}, file=f)
    with pytest.raises(SettingsError, match="not found"):
        Settings.load(env={"COSYSERVE_POOL_CONFIG": str(tmp_path / "missing.toml")})


def test_loading_settings_keep_their_variables_and_meanings() -> None:
    s = Settings.load(
        env={
            "COSYSERVE_PRELOAD": "0",
            "PREWARM_MODELS": "none",
            "USE_MMAP_LOADING": "no",
            "MODEL_POOL_SIZE": "3",
        }
    )
    assert (s.strategy, s.warmup, s.use_mmap, s.instances) == ("lazy", False, False, 3)
    assert Settings.load(env={"COSYSERVE_PRELOAD": "yes", "PREWARM_MODELS": "all"}).strategy == "preload"
    assert Settings.load(env={"COSYSERVE_PRELOAD": " "}).strategy == "preload", "blank means unset"
    assert Settings.load(env={"XDG_CACHE_HOME": "/x"}).cache_dir == Path("/x/cosyserve")
    assert Settings.load(env={"COSYSERVE_CACHE_DIR": "/c"}).cache_dir == Path("/c")
    with pytest.raises(SettingsError, match="COSYSERVE_REGISTRY_DIR"):
        Settings.load(env={"COSYSERVE_REGISTRY_DIR": " "})  # blank here would put voices in the working dir
    with pytest.raises(SettingsError, match="USE_MMAP_LOADING='maybe'"):
        Settings.load(env={"USE_MMAP_LOADING": "maybe"})


def test_replace_checks_values_and_names_the_caller() -> None:
    s = load().replace(where="cosyserve.load", strategy="lazy", threads=None)
    assert s.strategy == "lazy" and s.threads is None and s.origin("strategy") == "override"
    with pytest.raises(SettingsError, match=r"^cosyserve.load\(strategy='sometimes'\): expected one of"):
        load().replace(where="cosyserve.load", strategy="sometimes")
    with pytest.raises(TypeError, match="not a setting that can be replaced: stratgy"):
        load().replace(stratgy="lazy")
    with pytest.raises(TypeError, match="pool_config"):  # the file is read once, by Settings.load
        load().replace(pool_config="pool.toml")


def test_load_checks_its_keyword_overrides_before_loading_anything(tmp_path: Path) -> None:
    import cosyserve

    with pytest.raises(SettingsError, match=r"cosyserve.load\(verify='sometimes'\)"):
        cosyserve.load(tmp_path / "no-such-model", verify="sometimes")


def test_settings_survive_pickling_for_worker_processes(tmp_path: Path) -> None:
    """Settings pickle: a program may hand them to a process it spawns (serve --workers forks: it does not)."""
    f = tmp_path / "pool.toml"
    f.write_text("[pool]\nmemory_budget = '50%'\n[models.a]\npath = 'a'\n")
    s = Settings.load(
        flags={"models": ["m=/x"], "port": "0"}, env={"COSYSERVE_API_KEYS": "k-aaaaaaaa=t"}, file=f
    )
    back = pickle.loads(pickle.dumps(s))
    assert back == s and back.origins == s.origins and back.pool_file == s.pool_file


def test_every_setting_is_declared_once_with_a_doc() -> None:
    settings = declared()
    for attr in ("env", "flag", "key"):
        names = [getattr(s, attr) for s in settings if getattr(s, attr)]
        assert len(names) == len(set(names)), f"two settings share a {attr}"
    assert all(s.doc for s in settings)
    assert {s.name for s in settings} >= {"models", "port", "instances", "warmup", "cache_dir"}
    assert DEMO_MODEL == "demo"


def test_settings_doc_tables_are_current() -> None:
    """If this fails, a setting was added, renamed or changed without docs/settings.md: regenerate its tables with
    `.venv/bin/python scripts/settings_tables.py`."""
    assert settings_tables().update(check=True) == [], "docs/settings.md's settings tables are stale"


def test_exit_codes_table_is_current() -> None:
    """If this fails, `cosyserve serve`'s exit codes (cosyserve.server.run.EXIT_CODES, what `serve --help` prints)
    changed without docs/http-api.md: regenerate its table with `.venv/bin/python scripts/settings_tables.py`."""
    assert settings_tables().update_exit_codes(check=True) is False, "docs/http-api.md's exit codes are stale"


def test_bench_scripts_table_is_current() -> None:
    """If this fails, a bench/ script was added, removed or its docstring's first sentence changed without
    docs/performance.md: regenerate its table with `.venv/bin/python scripts/settings_tables.py`."""
    assert settings_tables().update_bench(check=True) is False, "docs/performance.md's bench table is stale"


def test_docs_list_every_declared_variable_and_declare_every_named_one() -> None:
    """If this fails, the README or a page of docs/ names an environment variable cosyserve does not read (a typo,
    or one removed), or docs/settings.md leaves out one it reads."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    pattern = r"\b(?:COSYSERVE_[A-Z0-9_]+|MODEL_POOL_SIZE|USE_MMAP_LOADING|PREWARM_MODELS)\b"
    tables = "\n".join(settings_tables().tables().values())
    declared_vars = {s.env for s in declared() if s.env}
    for s in declared():
        if s.env:
            row = next(line for line in tables.splitlines() if f"`{s.env}`" in line)
            assert s.shown_default().replace("|", "\\|") in row, s.env
    not_settings = {"COSYSERVE_FIXTURES", "COSYSERVE_CHROMIUM"}  # the test suite's own variables
    for page in pages:
        named = set(re.findall(pattern, page.read_text(encoding="utf-8"))) - not_settings
        assert named <= declared_vars, (
            f"{page.name} names variables cosyserve does not read: {named - declared_vars}"
        )
    listed = set(re.findall(pattern, (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")))
    assert declared_vars <= listed, f"docs/settings.md leaves out {declared_vars - listed}"


def test_every_declared_flag_is_taken_by_a_command() -> None:
    """A setting declared with a flag that no command registers is documented (docs/settings.md, the error
    messages) but refused on the command line: `serve --voice-cache-mb 0` was 'unrecognized arguments'."""
    import argparse

    from cosyserve.cli.parser import build_parser

    taken: set[str] = set()

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            taken.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)

    walk(build_parser())
    missing = [s.flag for s in declared() if s.flag and s.flag not in taken]
    assert not missing, missing
