"""The engine, the pool and the server know models only through the Runtime interface: with torch made
unimportable they still load a (fake) runtime, admit, stream, cancel and answer HTTP. If this fails, a layer above
the runtime imports the torch runtime (or torch) and a second runtime (the lite one) could not plug in."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from proc_util import run_in_session

TESTS = Path(__file__).resolve().parent

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["torch"] = None  # `import torch` now raises ImportError anywhere in the process
    sys.modules["onnxruntime"] = None
    sys.path.insert(0, sys.argv[1])

    import io, wave

    from cosyserve.engine.engine import Engine
    from cosyserve.engine.pool import ModelPool, ModelSpec
    from cosyserve.engine.quotas import Tenant, TenantQuota
    from cosyserve.core.errors import QuotaExceededError, UnknownVoiceError
    from cosyserve.core.request import SynthesisRequest
    from cosyserve.core.settings import Settings
    from cosyserve.server.app import create_app
    from fake_runtime import FakeRuntime
    from starlette.testclient import TestClient

    # the engine alone: load, stream, refuse a bad voice
    e = Engine("fake", lambda: FakeRuntime())
    e.load_sync(5)
    chunks = list(e.synthesize_sync(SynthesisRequest(text="hi", seed=3)))
    assert [float(c[0]) for c in chunks] == [3.0, 4.0, 5.0], chunks
    try:
        e.synthesize_sync(SynthesisRequest(text="hi", speaker="nobody"))
        raise AssertionError("an unknown voice was admitted")
    except UnknownVoiceError:
        pass
    e.release_sync()

    # the pool: on-demand load, a tenant's quota
    pool = ModelPool(
        [ModelSpec("a", policy="preload"), ModelSpec("b", policy="lazy")],
        tenants=[Tenant("t", frozenset({"a", "b"}), TenantQuota(max_concurrent=1))],
        load_model=lambda spec, reload: FakeRuntime(delay=0.05),
        memory_probe=None,
    )
    held = pool.submit_sync("b", SynthesisRequest(text="x"), tenant="t", load_timeout=10)
    try:
        pool.submit_sync("b", SynthesisRequest(text="y"), tenant="t", load_timeout=10)
        raise AssertionError("the tenant's max_concurrent=1 did not hold")
    except QuotaExceededError:
        pass
    assert len(list(held)) == 3
    for f in pool.start_close(timeout=5):
        f.result(10)

    # the server over the same fake
    pool = ModelPool(
        [ModelSpec("m", policy="preload")], load_model=lambda spec, reload: FakeRuntime(), memory_probe=None
    )
    with TestClient(create_app(Settings.load(env={}), pool=pool)) as client:
        for _ in range(200):
            if client.get("/health/ready").status_code == 200:
                break
            import time; time.sleep(0.05)
        r = client.post(
            "/v1/audio/speech",
            json={"model": "m", "input": "hello", "voice": "bob", "response_format": "wav", "stream": False},
        )
        assert r.status_code == 200, r.text
        with wave.open(io.BytesIO(r.content)) as w:
            assert w.getframerate() == 24000 and w.getnframes() == 150, (w.getframerate(), w.getnframes())
        r = client.post(
            "/v1/audio/speech",
            json={"model": "m", "input": "hello", "voice": "nobody", "response_format": "pcm"},
        )
        assert r.status_code == 400 and "nobody" in r.text, (r.status_code, r.text)
        with client.stream(
            "POST", "/v1/audio/speech",
            json={"model": "m", "input": "hello", "voice": "alice", "response_format": "pcm", "stream": True},
        ) as s:
            assert s.status_code == 200 and len(b"".join(s.iter_bytes())) == 300
    loaded = sorted(m for m in sys.modules if m.startswith("cosyserve.runtime.") or m == "torch")
    print("LOADED", loaded)
    assert "cosyserve.runtime.pytorch" not in loaded, loaded
    print("OK")
    """
)


def test_engine_pool_and_server_run_with_torch_unimportable() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COSYSERVE_")}
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(TESTS)], capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode == 0 and "OK" in r.stdout, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}"


# -- a torch-free install: every entry point picks the lite runtime by itself ----------------------------------------
# (item 8 of issue 25: before, `cosyserve.load(bundle)` was a ModuleNotFoundError traceback, `serve` exited 3 with
# a log line and `speakers` said "this needs torch", for a bundle the lite runtime serves)

SRC = str(TESTS.parent / "src")


def _no_torch_env(tmp: Path) -> dict[str, str]:
    """An environment whose Python processes (``python -m cosyserve``, a server, its probes) find no torch, as on
    an install without it: a ``sitecustomize`` first on the path puts None for torch in ``sys.modules``."""
    folder = tmp / "no-torch"
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text('import sys\nsys.modules["torch"] = None\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("COSYSERVE_")}
    env["COSYSERVE_CACHE_DIR"] = str(tmp / "cache")
    env["COSYSERVE_REGISTRY_DIR"] = str(tmp / "voices")
    env["PYTHONPATH"] = os.pathsep.join([str(folder), SRC])
    return env


API_SCRIPT = textwrap.dedent(
    """
    import logging, sys
    assert sys.modules["torch"] is None, "the sitecustomize did not run"
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s")
    import cosyserve
    from cosyserve.engine.poolfile import load_pool_config
    from cosyserve.core.errors import InputError
    from cosyserve.core.settings import Settings

    lite, torch_only, pool_file = sys.argv[1:4]
    model = cosyserve.load(lite, warmup=False, threads=1)
    assert type(model.runtime).__name__ == "LiteRuntime", type(model.runtime)
    assert model.speakers, model.speakers
    model.close()
    # a pool file's model without a runtime of its own, and the setting itself
    settings = Settings.load(env={}, file=pool_file)
    assert settings.runtime == "lite" and settings.origin("runtime") == "default"
    assert load_pool_config(settings).models["m"].runtime == "lite"
    for path, kwargs, says in (
        (torch_only, {}, "pip install torch"),
        (lite, {"runtime": "torch"}, "--runtime lite serves it"),
    ):
        try:
            cosyserve.load(path, warmup=False, **kwargs)
            raise AssertionError(f"{path} {kwargs} loaded without torch")
        except InputError as e:
            assert says in str(e) and "\\n" not in str(e), str(e)
            print("REFUSED", e)
    print("OK")
    """
)


def test_every_entry_point_picks_the_lite_runtime_where_torch_is_not_installed(
    tiny_lite_bundle: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """If this fails, an install without torch cannot use a lite bundle through some entry point unless it says
    `--runtime lite` (or the choice is not said at INFO)."""
    from server_util import running_server

    env = _no_torch_env(tmp_path)
    pool = tmp_path / "pool.toml"
    pool.write_text(f'[models.m]\npath = "{tiny_lite_bundle}"\n', encoding="utf-8")
    r = subprocess.run(
        [sys.executable, "-c", API_SCRIPT, str(tiny_lite_bundle), str(tiny_model_dir), str(pool)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout.endswith("OK\n"), f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert (
        f"INFO cosyserve.api: torch is not installed: {tiny_lite_bundle} runs on the lite runtime" in r.stdout
    )

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "cosyserve", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)

    out = tmp_path / "o.wav"
    r = cli("synth", "--model", str(tiny_lite_bundle), "--text", "Hello.", "--seed", "1", "--out", str(out),
            "--threads", "1", "--log-level", "info")  # fmt: skip
    assert r.returncode == 0 and out.stat().st_size > 44, r.stderr[-3000:]
    assert "torch is not installed" in r.stderr, r.stderr[-3000:]
    r = cli("speakers", "--model", str(tiny_lite_bundle))
    assert r.returncode == 0 and "英文女" in r.stdout.splitlines(), r.stderr[-3000:]
    r = cli("startup-report", "--model", str(tiny_lite_bundle), "--runs", "1", "--no-warmup", "--json")
    assert r.returncode == 0 and '"floor_module": "onnxruntime"' in r.stdout, r.stderr[-3000:]
    with running_server(tiny_lite_bundle, tmp_path / "srv", env={**env, "COSYSERVE_THREADS": "1"}) as s:
        with s.client() as c:
            r2 = c.post(
                "/v1/audio/speech", json={"input": "Hi.", "voice": "英文女", "response_format": "pcm"}
            )
            assert r2.status_code == 200 and len(r2.content) > 0, r2.text
        assert "torch is not installed" in s.log(), s.log()[-3000:]


def test_without_torch_a_command_that_needs_it_says_what_to_install_in_one_line(
    tiny_lite_bundle: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """If this fails, a command that cannot run without torch prints a traceback, a log line or exit code 3
    instead of one line naming what to install (and, for conformance, that it needs torch with --runtime lite)."""
    env = _no_torch_env(tmp_path)
    cases = [
        (["synth", "--model", str(tiny_model_dir), "--text", "Hi.", "--out", str(tmp_path / "o.wav")],
         "pip install torch"),
        (["serve", "--model", str(tiny_model_dir), "--port", "0"], "pip install torch"),
        (["serve", "--model", str(tiny_lite_bundle), "--runtime", "torch", "--port", "0"], "--runtime lite serves it"),
        (["conformance", str(tmp_path), "--runtime", "lite"], "conformance reads the fixture tensors and converts"),
    ]  # fmt: skip
    for args, says in cases:
        r = run_in_session([sys.executable, "-m", "cosyserve", *args], timeout=300, env=env)
        assert r.returncode == 1, (args, r.returncode, r.stderr[-3000:])
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0] and "torch" in lines[0], (args, r.stderr[-3000:])


def _register_stored_voice(registry: Path) -> None:
    """A CosyVoice3 voice registered from stored features (numpy, as a torch runtime's registration writes them),
    in the shared registry folder's CosyVoice3 part: what a torch-free server clones without analysing audio."""
    from cosyserve.voices.registry import SpeakerRegistry

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 6561, (1, 30), dtype=np.int32)
    embedding = rng.standard_normal((1, 192), dtype=np.float32)
    features = {
        "prompt_text": np.asarray([[9707, 13]], np.int32),
        "prompt_text_len": np.asarray([2], np.int32),
        "llm_prompt_speech_token": tokens,
        "llm_prompt_speech_token_len": np.asarray([30], np.int32),
        "flow_prompt_speech_token": tokens,
        "flow_prompt_speech_token_len": np.asarray([30], np.int32),
        "prompt_speech_feat": rng.standard_normal((1, 60, 80), dtype=np.float32),
        "prompt_speech_feat_len": np.asarray([60], np.int32),
        "llm_embedding": embedding,
        "flow_embedding": embedding,
    }
    SpeakerRegistry(registry / "cosyvoice3", arrays="numpy", token_rate=25).add(
        "kept", features, prompt_text="Hi."
    )


def test_a_torch_free_server_serves_a_cosyvoice3_lite_bundle_over_http_and_the_websocket(
    cv3_lite_bundle: Path, tmp_path: Path
) -> None:
    """`cosyserve serve` on a CosyVoice3 lite bundle where torch is not installed picks the lite runtime by itself
    and serves a model speaker (one-shot and streamed), a registered voice (zero_shot) and text streamed over the
    WebSocket; a voice to clone from new audio is refused with a 4xx naming why. If this fails, serving
    CosyVoice3 without torch is broken somewhere between the picker, the pipeline and the transports."""
    import base64
    import io
    import json

    import soundfile as sf
    from websockets.sync.client import connect

    from server_util import running_server

    env = _no_torch_env(tmp_path)
    _register_stored_voice(Path(env["COSYSERVE_REGISTRY_DIR"]))
    with running_server(cv3_lite_bundle, tmp_path / "srv", env={**env, "COSYSERVE_THREADS": "1"}) as s:
        with s.client(timeout=120) as c:
            for body in (
                {"input": "Hi there.", "voice": "中文女", "response_format": "pcm"},
                {"input": "Hi there.", "voice": "中文女", "response_format": "pcm", "stream": True},
                {"input": "Hi there.", "voice": "kept", "response_format": "pcm"},
            ):
                r = c.post("/v1/audio/speech", json={**body, "seed": 0})  # seed 1: the random LM ends at once
                assert r.status_code == 200 and len(r.content) > 0, (body, r.status_code, r.text[:500])
            wav = io.BytesIO()
            sf.write(wav, (0.3 * np.sin(np.arange(16000) * 0.08)).astype(np.float32), 16000, format="WAV")
            ref = base64.b64encode(wav.getvalue()).decode()
            r = c.post(
                "/v1/audio/speech", json={"input": "Hi.", "ref_audio": ref, "ref_text": "Hi.", "seed": 0}
            )
            assert r.status_code == 200 and len(r.content) > 0, (r.status_code, r.text[:500])
        with connect(s.base_url.replace("http", "ws", 1) + "/v1/audio/speech/stream", open_timeout=30) as ws:
            ws.send(
                json.dumps({"type": "session.config", "voice": "中文女", "seed": 1, "response_format": "pcm"})
            )
            for piece in ("Hi ", "there, ", "you."):
                ws.send(json.dumps({"type": "input.text", "text": piece}))
            ws.send(json.dumps({"type": "input.done"}))
            events, audio = [], 0
            while not events or events[-1]["type"] not in ("session.done", "error"):
                msg = ws.recv(timeout=120)
                if isinstance(msg, bytes):
                    audio += len(msg)
                else:
                    events.append(json.loads(msg))
            kinds = [e["type"] for e in events]
            assert kinds == ["audio.start", "audio.done", "session.done"] and audio > 0, (kinds, events[-1])
        log = s.log()
        assert "torch is not installed" in log and "lite runtime ready" in log, log[-3000:]
