"""Loopback load test of `cosyserve serve`: requests/s and time to first audio at 1, 4 and 16 clients.

    python bench/load_test.py                               # a tiny random-weight model, made here
    python bench/load_test.py --model out/full-bundle --requests 1 --clients 1,4
    python bench/load_test.py --url http://127.0.0.1:8000   # a server that is already running

Without ``--url`` it starts the server twice from a fresh cache dir and reports process start -> the first
``/health/ready`` 200 for both: the first start converts an official model dir into the bundle cache, the
restart maps the cached bundle. Then, for each client count, every client sends ``--requests`` streaming
``POST /v1/audio/speech`` requests one after another (same text and seed, so the same work); all clients start
together. Reported: requests/s over the level's wall time, p50/p99 time to the first audio byte and to the last
byte, audio seconds served per wall second, and any refusals (429/503) or errors by status. Traffic goes to
127.0.0.1 only. The figures share the machine's cores with the server and the clients: run it on a quiet box.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(host: str, port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def start_server(
    model: str, workdir: Path, port: int, ready_timeout_s: float
) -> tuple[subprocess.Popen, float]:
    """Spawn the server; return it and the seconds from spawn to the first /health/ready 200."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "COSYSERVE_CACHE_DIR": str(workdir / "cache"),
        "COSYSERVE_REGISTRY_DIR": str(workdir / "registry"),
    }
    cmd = [
        sys.executable,
        "-m",
        "cosyserve",
        "serve",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    cmd += ["--serve-log-level", "warning"]
    log = open(workdir / f"server-{port}.log", "wb")  # noqa: SIM115 - the child writes it until it exits
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    while True:
        if proc.poll() is not None:
            raise SystemExit(
                f"server exited with {proc.returncode}:\n{(workdir / log.name).read_text()[-3000:]}"
            )
        if time.perf_counter() - t0 > ready_timeout_s:
            stop_server(proc)
            raise SystemExit(f"server not ready in {ready_timeout_s} s; log: {log.name}")
        try:
            if get("127.0.0.1", port, "/health/ready", timeout=2.0)[0] == 200:
                return proc, time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(0.02)


def stop_server(proc: subprocess.Popen) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


def one_request(host: str, port: int, body: bytes) -> tuple[int, float | None, float, int, int]:
    """(status, seconds to the first body byte, seconds to the last, body bytes, sample rate) of one request."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=600)
    try:
        conn.request("POST", "/v1/audio/speech", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        first: float | None = None
        n = 0
        while chunk := r.read1(65536):
            if first is None:
                first = time.perf_counter() - t0
            n += len(chunk)
        rate = int(r.getheader("X-Sample-Rate") or 0)
        return r.status, (first if r.status == 200 else None), time.perf_counter() - t0, n, rate
    finally:
        conn.close()


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[i]


def run_level(host: str, port: int, body: bytes, clients: int, per_client: int) -> dict[str, object]:
    results: list[tuple[int, float | None, float, int, int]] = []
    errors: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)

    def client() -> None:
        barrier.wait()
        for _ in range(per_client):
            try:
                res = one_request(host, port, body)
            except OSError as e:
                with lock:
                    errors.append(type(e).__name__)
                continue
            with lock:
                results.append(res)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if r[0] == 200]
    statuses = Counter(str(r[0]) for r in results if r[0] != 200) + Counter(errors)
    return {
        "clients": clients,
        "requests": clients * per_client,
        "ok": len(ok),
        "wall_s": wall,
        "rps": len(ok) / wall,
        "ttfa": [r[1] for r in ok if r[1] is not None],
        "total": [r[2] for r in ok],
        "bytes": sum(r[3] for r in ok),
        "refused": dict(statuses),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", help="bundle or official model dir (default: a tiny random-weight model made here)"
    )
    ap.add_argument("--url", help="target this running server instead of starting one (no start-up figures)")
    ap.add_argument("--clients", default="1,4,16", help="comma-separated concurrent client counts")
    ap.add_argument("--requests", type=int, default=3, help="requests per client at each level")
    ap.add_argument("--text", default="Hello, this is a short load test of the speech server.")
    ap.add_argument("--voice", default="alloy")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    args = ap.parse_args()
    levels = [int(c) for c in args.clients.split(",") if c.strip()]
    body = json.dumps(
        {"input": args.text, "voice": args.voice, "response_format": "pcm", "stream": True, "seed": 1}
    ).encode()

    with tempfile.TemporaryDirectory(prefix="cosyserve-load-") as tmp:
        work = Path(tmp)
        proc = None
        if args.url:
            u = urlsplit(args.url)
            host, port = u.hostname or "127.0.0.1", u.port or 80
            if host not in ("127.0.0.1", "localhost", "::1"):
                raise SystemExit("--url must be on loopback (127.0.0.1)")
        else:
            model = args.model
            if model is None:
                sys.path.insert(0, str(ROOT / "src"))
                from cosyserve.families.testmodel import make_test_model

                model = str(work / "tiny")
                make_test_model(Path(model), size="tiny", seed=0)
            host = "127.0.0.1"
            first, first_s = start_server(model, work, free_port(), args.ready_timeout)
            rc = stop_server(first)
            port = free_port()
            proc, again_s = start_server(model, work, port, args.ready_timeout)
            print(f"model: {model}")
            print(f"process start -> /health/ready 200: first start {first_s:.2f} s, restart {again_s:.2f} s")
            if not (Path(model) / "manifest.json").exists():
                print("  (the first start converted the official model dir into the bundle cache)")
            print(f"  exit code of the first server after SIGTERM: {rc}")
        status, _ = get(host, port, "/health/ready")
        if status != 200:
            raise SystemExit(f"{host}:{port} is not ready ({status})")
        # one request first, so lazy parts (text normalisers, ...) are loaded before the clock runs
        st, _, warm_s, nbytes, rate = one_request(host, port, body)
        if st != 200:
            raise SystemExit(f"the warm-up request failed with {st}")
        _, raw = get(host, port, "/v1/models")
        print(f"warm-up request: {st}, {warm_s:.2f} s, {nbytes} bytes ({nbytes / 2 / rate:.2f} s of audio)")
        print(
            f"models: {[m['id'] for m in json.loads(raw)['data']]}; text {len(args.text)} chars, pcm, stream"
        )
        print()
        head = (
            f"{'clients':>7} {'reqs':>5} {'ok':>4} {'req/s':>7} {'ttfa p50':>9} {'ttfa p99':>9} "
            f"{'total p50':>10} {'total p99':>10} {'audio x rt':>10}  refused/errors"
        )
        print(head)
        for c in levels:
            r = run_level(host, port, body, c, args.requests)
            ttfa, total = r["ttfa"], r["total"]
            assert isinstance(ttfa, list) and isinstance(total, list)
            audio_rt = int(r["bytes"]) / 2 / rate / float(r["wall_s"])  # type: ignore[arg-type]
            print(
                f"{c:>7} {r['requests']:>5} {r['ok']:>4} {r['rps']:>7.2f} "
                f"{quantile(ttfa, 0.5) * 1e3:>7.0f}ms {quantile(ttfa, 0.99) * 1e3:>7.0f}ms "
                f"{quantile(total, 0.5):>9.2f}s {quantile(total, 0.99):>9.2f}s {audio_rt:>10.2f}  "
                f"{r['refused'] or '-'}",
                flush=True,
            )
        if proc is not None:
            rc = stop_server(proc)
            print(f"\nserver exit code after SIGTERM: {rc}")


if __name__ == "__main__":
    main()
