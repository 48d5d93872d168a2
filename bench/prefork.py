"""Prefork workers (`serve --workers N`): fork to READY, memory per worker, throughput.

    python bench/prefork.py --bundle /work/benchm/full-bundle [--workers 1,2,4] [--throughput 1,2]
        [--requests 8] [--concurrency 2] [--threads N]

For each N of ``--workers`` a fresh server (the prefork path even for N = 1: a template and one forked worker,
so that N = 1 is the baseline the others add to) loads the bundle on 127.0.0.1 and the bench prints:

- fork to READY: each worker's milliseconds from its fork to its READY notice (the master's log), and the same
  for a replacement after one worker is SIGKILLed;
- PSS (``/proc/PID/smaps_rollup``) of the master and each worker, summed, at READY and after the requests; the
  PSS one more worker adds, ``(total(N) - total(1)) / (N - 1)``, and that as a share of the weight bytes (the
  bundle's ``*.safetensors``);
- throughput (for N in ``--throughput``): ``--requests`` one-shot requests for a short text, ``--concurrency`` at a
  time on fresh connections, after one warm-up request per worker: requests/s.

Take the timings alone on the machine: ``flock -x /tmp/cs-cpu.lock python bench/prefork.py ...``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from startup import byte_compile

ROOT = Path(__file__).resolve().parents[1]
TEXT = "Hello there, how are you today?"
READY_RE = re.compile(r"worker (\d+) ready ([0-9.]+) ms after its fork")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(bundle: str, workers: int, port: int, threads: int | None) -> None:
    """The server the bench measures: ``cosyserve serve`` as the CLI runs it, but prefork for N = 1 too."""
    from cosyserve.system.gchold import hold_gc

    hold_gc()  # as `cosyserve serve` does from its first line
    from cosyserve.core.settings import Settings
    from cosyserve.server.prefork import serve_prefork
    from cosyserve.server.run import setup_logging

    flags: dict[str, Any] = {
        "models": [bundle],
        "workers": str(workers),
        "port": str(port),
        "host": "127.0.0.1",
    }
    if threads is not None:
        flags["threads"] = str(threads)
    settings = Settings.load(flags=flags)
    setup_logging(settings)
    sys.exit(serve_prefork(settings))


def rollup(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0]) * 1024
    return out


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(p) for p in (task / "children").read_text().split()]
    return out


def memory(master: int) -> dict[str, Any]:
    procs = {"master": rollup(master)} | {str(p): rollup(p) for p in children(master)}
    return {
        "total_pss": sum(m["Pss"] for m in procs.values()),
        "per_process": {
            k: {f: m[f] for f in ("Rss", "Pss", "Pss_Anon", "Pss_File", "Private_Dirty")}
            for k, m in procs.items()
        },
    }


def status(port: int) -> dict[str, Any]:
    import httpx

    r = httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=30)
    return dict(r.json().get("workers", {}))


def wait_ready(proc: subprocess.Popen[bytes], port: int, n: int, timeout_s: float = 600) -> None:
    end = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        if time.monotonic() > end:
            raise RuntimeError("not ready in time")
        try:
            if status(port).get("ready") == n:
                return
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        time.sleep(0.05)


def one_request(port: int) -> float:
    import httpx

    t = time.perf_counter()
    body = {"input": TEXT, "voice": "alloy", "response_format": "pcm", "stream": False, "seed": 1}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as c:  # fresh: any worker
        r = c.post("/v1/audio/speech", json=body)
        r.raise_for_status()
    return time.perf_counter() - t


def run_config(args: argparse.Namespace, n: int, weight_bytes: int) -> dict[str, Any]:
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix=f"prefork-{n}-", suffix=".log")[1])
    cmd = [sys.executable, __file__, "--serve", str(n), "--bundle", args.bundle, "--port", str(port)]
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COSYSERVE_DRAIN_DELAY": "0"}
    out: dict[str, Any] = {"workers": n}
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, port, n)
        out["start_to_all_ready_s"] = round(time.perf_counter() - t0, 2)
        out["fork_to_ready_ms"] = [float(m[1]) for m in READY_RE.findall(log_path.read_text())]
        time.sleep(1.0)  # let the after-READY work settle
        out["at_ready"] = memory(proc.pid)
        for _ in range(2 * n):  # warm: every worker most likely served one
            one_request(port)
        if n in args.throughput:
            t = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(args.concurrency) as ex:
                lat = list(ex.map(lambda _: one_request(port), range(args.requests)))
            wall = time.perf_counter() - t
            out["throughput"] = {
                "requests": args.requests,
                "concurrency": args.concurrency,
                "wall_s": round(wall, 2),
                "requests_per_s": round(args.requests / wall, 3),
                "mean_latency_s": round(sum(lat) / len(lat), 2),
            }
        out["after_requests"] = memory(proc.pid)
        # a replacement: SIGKILL one worker, time until the pool is whole again
        victim = status(port)["pids"][0]
        seen = len(READY_RE.findall(log_path.read_text()))
        t = time.perf_counter()
        os.kill(victim, signal.SIGKILL)
        wait_ready(proc, port, n)
        while len(READY_RE.findall(log_path.read_text())) <= seen:
            time.sleep(0.01)
        out["replacement"] = {
            "kill_to_pool_ready_ms": round((time.perf_counter() - t) * 1e3, 1),
            "fork_to_ready_ms": float(READY_RE.findall(log_path.read_text())[seen][1]),
        }
        proc.send_signal(signal.SIGTERM)
        out["sigterm_exit_code"] = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out["log"] = str(log_path)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", required=True, help="a bundle dir (cosyserve convert)")
    p.add_argument("--workers", default="1,2,4", help="worker counts to measure")
    p.add_argument("--throughput", default="1,2", help="worker counts whose throughput to measure")
    p.add_argument("--requests", type=int, default=8, help="requests per throughput run")
    p.add_argument("--concurrency", type=int, default=2, help="requests at once in the throughput run")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: torch's)")
    p.add_argument("--json", action="store_true", help="print the raw results as JSON too")
    p.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    byte_compile(ROOT / "src")  # as pip install leaves it (bench/startup.py)
    if args.serve is not None:
        serve(args.bundle, args.serve, args.port, args.threads)
        return
    args.throughput = {int(x) for x in args.throughput.split(",")}
    weight_bytes = sum(f.stat().st_size for f in Path(args.bundle).glob("*.safetensors"))
    print(f"bundle {args.bundle}: {weight_bytes / 2**20:.0f} MiB of weights; load average {os.getloadavg()}")
    results = [run_config(args, int(n), weight_bytes) for n in args.workers.split(",")]
    base = {r["workers"]: r for r in results}.get(1)
    mib = 2**20
    for r in results:
        n = r["workers"]
        print(f"\n== {n} worker(s): all READY {r['start_to_all_ready_s']} s after exec")
        print(f"fork to READY (ms): {', '.join(f'{x:.1f}' for x in r['fork_to_ready_ms'])}")
        rep = r["replacement"]
        print(
            f"replacement: fork to READY {rep['fork_to_ready_ms']:.1f} ms, kill to pool READY "
            f"{rep['kill_to_pool_ready_ms']:.0f} ms; SIGTERM exit code {r['sigterm_exit_code']}"
        )
        for when in ("at_ready", "after_requests"):
            m = r[when]
            parts = ", ".join(
                f"{k} {v['Pss'] / mib:.0f} (anon {v['Pss_Anon'] / mib:.0f}, private dirty {v['Private_Dirty'] / mib:.0f})"
                for k, v in m["per_process"].items()
            )
            line = f"PSS {when}: total {m['total_pss'] / mib:.0f} MiB = {parts}"
            if base is not None and n > 1:
                added = (m["total_pss"] - base[when]["total_pss"]) / (n - 1)
                line += (
                    f"; per extra worker {added / mib:.0f} MiB = {100 * added / weight_bytes:.1f}% of weights"
                )
            print(line)
        if "throughput" in r:
            t = r["throughput"]
            print(
                f"throughput: {t['requests']} requests, {t['concurrency']} at a time: {t['requests_per_s']:.3f} "
                f"req/s (wall {t['wall_s']} s, mean latency {t['mean_latency_s']} s)"
            )
    print(f"\nload average after: {os.getloadavg()}")
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
