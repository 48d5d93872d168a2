"""Ray Serve replica start vs a plain `cosyserve serve` start, on the same bundle, side by side.

    python bench/ray_serve_start.py --bundle out/full-bundle [--rounds 3]

Each round, interleaved: (1) `cosyserve serve --model BUNDLE` in a fresh process, process start -> the first
`/health/ready` 200; (2) on a local Ray instance started once (its own start is printed apart), `serve.run` of
cosyserve.deploy.ray_serve with one replica: the call -> the application RUNNING (a replica's READY: the app's
startup waits for its models), and the replica's own process start -> READY (its `/health/startup` ready_ms),
then `serve.delete`; then one streamed request through Ray's proxy (time to first byte, total). Needs Ray Serve
(`pip install 'cosyserve[ray]'`). Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(port: int, path: str) -> tuple[int, dict]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        c.close()


def plain_start(bundle: str) -> float:
    port = free_port()
    t = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cosyserve", "serve", "--model", bundle, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            try:
                if get(port, "/health/ready")[0] == 200:
                    return time.time() - t
            except OSError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"cosyserve serve exited with {proc.returncode}")
            time.sleep(0.01)
    finally:
        proc.terminate()
        proc.wait(30)


def stream_once(port: int) -> tuple[float, float]:
    body = json.dumps({"input": "Hello there.", "voice": "英文女", "response_format": "pcm", "stream": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t = time.perf_counter()
    c.request("POST", "/v1/audio/speech", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    r.read(1)
    first = time.perf_counter() - t
    r.read()
    c.close()
    return first, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import ray
    from ray import serve

    from cosyserve.deploy.ray_serve import app_builder

    t = time.time()
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    print(f"ray.init + serve.start: {time.time() - t:.2f} s (once)")
    plain, deploy, replica, first, total = [], [], [], [], []
    for _ in range(args.rounds):
        plain.append(plain_start(args.bundle))
        t = time.time()
        serve.run(
            app_builder({"model": args.bundle, "num_replicas": "1"}), name="cosyserve", route_prefix="/"
        )
        deploy.append(time.time() - t)
        replica.append(get(port, "/health/startup")[1]["ready_ms"] / 1e3)
        f, tt = stream_once(port)
        first.append(f)
        total.append(tt)
        serve.delete("cosyserve")
    med = statistics.median
    print(
        f"plain `cosyserve serve` process start -> ready: median {med(plain):.2f} s {[round(x, 2) for x in plain]}"
    )
    print(
        f"serve.run -> application RUNNING:            median {med(deploy):.2f} s {[round(x, 2) for x in deploy]}"
    )
    print(
        f"replica process start -> READY (ready_ms):     median {med(replica):.2f} s  ratio to plain {med(replica) / med(plain):.2f}"
    )
    print(f"serve.run -> RUNNING vs plain:                 ratio {med(deploy) / med(plain):.2f}")
    print(
        f"one streamed request through Ray's proxy: first byte {med(first):.2f} s, total {med(total):.2f} s"
    )
    print(f"load average: {os.getloadavg()[0]:.2f}")
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
