import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _fixtures_root() -> Path:
    env = os.environ.get("COSYSERVE_FIXTURES")
    return Path(env) if env else ROOT.parent / "shared" / "fixtures"


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Keep conversions and registered voices of the tests (and their subprocesses) out of the user's cache."""
    root = tmp_path_factory.mktemp("cache")
    os.environ["COSYSERVE_CACHE_DIR"] = str(root / "cache")
    os.environ["COSYSERVE_REGISTRY_DIR"] = str(root / "registry")


@pytest.fixture(scope="session")
def fixture_set_dir() -> Path:
    """The tiny CosyVoice-300M conformance set; skips when the fixtures are not beside the clone."""
    path = _fixtures_root() / "cosyvoice-300m-tiny"
    if not (path / "cases.json").is_file():
        pytest.skip(f"conformance fixtures not found at {path} (set COSYSERVE_FIXTURES to their folder)")
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight model dir in the official layout, made once per test session by make-test-model."""
    from cosyserve.testmodel import make_test_model

    out = tmp_path_factory.mktemp("models") / "tiny"
    make_test_model(out, size="tiny", seed=0)
    return out
