"""The engine, the pool and the server know models only through the Runtime interface: with torch made
unimportable they still load a (fake) runtime, admit, stream, cancel and answer HTTP. If this fails, a layer above
the runtime imports the torch runtime (or torch) and a second runtime (the lite one) could not plug in."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

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
    from cosyserve.errors import QuotaExceededError, UnknownVoiceError
    from cosyserve.request import SynthesisRequest
    from cosyserve.settings import Settings
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
            json={"model": "m", "input": "hello", "voice": "bob", "response_format": "wav"},
        )
        assert r.status_code == 200, r.text
        with wave.open(io.BytesIO(r.content)) as w:
            assert w.getframerate() == 100 and w.getnframes() == 150, (w.getframerate(), w.getnframes())
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
