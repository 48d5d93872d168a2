import fcntl
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# ONNX Runtime's telemetry off in the tests and their subprocesses, as cosyserve's entry points turn it off
# (cosyserve.api.quiet_onnxruntime): else every process that imports it leaves a mat-debug-<pid>.log in /tmp
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Path]) -> Path:
    """What ``build(dir)`` makes, made once per test run: xdist's workers share it (the first to ask builds it under a
    lock, the others wait and reuse it), so a tiny model or its conversion is not made once per worker. Tests read
    it and never write into it."""
    root = factory.getbasetemp()
    root = (
        root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    )  # the run's folder, above the workers'
    shared = root / "shared"
    shared.mkdir(exist_ok=True)
    done = shared / f"{name}.done"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when a worker dies
        if not done.is_file():
            target = shared / name
            shutil.rmtree(target, ignore_errors=True)  # a worker that died while building it
            done.write_text(str(build(target)))
        return Path(done.read_text())


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
def cv2_set_dir() -> Path:
    """The tiny CosyVoice2 conformance set; skips when the fixtures are not beside the clone."""
    path = _fixtures_root() / "cosyvoice2-tiny"
    if not (path / "cases.json").is_file():
        pytest.skip(f"conformance fixtures not found at {path} (set COSYSERVE_FIXTURES to their folder)")
    return path


@pytest.fixture(scope="session")
def cv3_set_dir() -> Path:
    """The tiny CosyVoice3 conformance set; skips when the fixtures are not beside the clone."""
    path = _fixtures_root() / "cosyvoice3-tiny"
    if not (path / "cases.json").is_file():
        pytest.skip(f"conformance fixtures not found at {path} (set COSYSERVE_FIXTURES to their folder)")
    return path


@pytest.fixture(scope="session")
def cv3_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight CosyVoice3 model dir in the official layout, its ONNX stand-ins included
    (make-test-model --family cosyvoice3)."""
    from cosyserve.families.testmodel import make_test_model

    def build(out: Path) -> Path:
        make_test_model(out, size="tiny", seed=0, family="cosyvoice3")
        return out

    return _once(tmp_path_factory, "tiny-cv3", build)


@pytest.fixture(scope="session")
def cv2_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight CosyVoice2 model dir in the official layout (make-test-model --family cosyvoice2)."""
    from cosyserve.families.testmodel import make_test_model

    def build(out: Path) -> Path:
        make_test_model(out, size="tiny", seed=0, family="cosyvoice2")
        return out

    return _once(tmp_path_factory, "tiny-cv2", build)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight model dir in the official layout, made once per test session by make-test-model.
    Named like an instruct model (CosyVoice-300M-Instruct) so that it serves every mode, instruct included;
    :func:`plain_model_dir` is the same files under a name that is not."""
    from cosyserve.families.testmodel import make_test_model

    def build(out: Path) -> Path:
        out = out / "tiny-Instruct"  # the name is what makes it an instruct model
        make_test_model(out, size="tiny", seed=0)
        return out

    return _once(tmp_path_factory, "tiny-300m", build)


@pytest.fixture(scope="session")
def plain_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's files under a name without ``-Instruct``: a model that refuses instruct mode."""
    import shutil

    out = tmp_path_factory.mktemp("models") / "tiny-sft"
    shutil.copytree(tiny_model_dir, out, copy_function=os.link)  # hard links: the same bytes, another dir
    return out


@pytest.fixture(scope="session")
def tiny_lite_bundle(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model converted with ``--runtime lite`` (its ONNX graphs beside the torch runtime's files)."""
    from cosyserve.bundle.convert import convert

    def build(out: Path) -> Path:
        return convert(tiny_model_dir, out / "tiny-Instruct", runtime="lite", progress=False)

    return _once(tmp_path_factory, "lite-300m", build)


def _qwen_lite_bundle(model_dir: Path, out: Path, int8: bool) -> Path:
    from cosyserve.bundle.convert import convert
    from cosyserve.bundle.lite.export import export_lite

    bundle = convert(model_dir, out, progress=False)
    export_lite(bundle, model_dir=model_dir, int8=int8)  # every part, as `convert --runtime lite` does
    return bundle


@pytest.fixture(scope="session")
def cv2_lite_bundle(cv2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny CosyVoice2 model converted with ``--runtime lite`` (LM, flow and vocoder graphs)."""
    return _once(tmp_path_factory, "lite-cv2", lambda out: _qwen_lite_bundle(cv2_model_dir, out, int8=False))


@pytest.fixture(scope="session")
def cv3_lite_bundle(cv3_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny CosyVoice3 model converted with ``--runtime lite``, with the int8 LM step graph too."""
    return _once(tmp_path_factory, "lite-cv3", lambda out: _qwen_lite_bundle(cv3_model_dir, out, int8=True))


@pytest.fixture(autouse=True)
def _close_openai_clients() -> Iterator[None]:
    """Close the openai clients a test made (server_util.openai_client): left open, their pooled sockets are
    reported by whichever later test's collection finds them."""
    yield
    from server_util import OPENAI_CLIENTS

    while OPENAI_CLIENTS:
        OPENAI_CLIENTS.pop().close()


@pytest.fixture(autouse=True)
def _stop_servers() -> Iterator[None]:
    """Stop, with its process group, every ``cosyserve serve`` a test started (server_util.start_server) and left
    running because it failed before its own stop: its prefork workers would outlive the run. The servers of
    module fixtures were started before this and are theirs to stop."""
    from server_util import LIVE, stop_servers

    since = len(LIVE)
    yield
    stop_servers(since)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    """A SIGTERM (a CI job's timeout, a supervisor) ends the run as Ctrl-C does, through the teardowns and
    :func:`pytest_sessionfinish`: by default it would kill pytest and leave the servers the tests started."""
    import signal
    import threading

    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, _interrupt)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """After the last teardown: an interrupted run (Ctrl-C) may have skipped the stops of a test and of its
    fixtures; what they started is stopped here, process groups and all."""
    import sys

    if "server_util" in sys.modules:
        sys.modules["server_util"].stop_servers()
