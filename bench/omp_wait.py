"""OpenMP wait policy: spinning vs passive waits, alone and beside a busy neighbour (issue 25, item 9).

    PYTHONPATH=src python bench/omp_wait.py [--model DIR_OR_BUNDLE] [--rounds 3] [--text ...] [--workers 2]

torch's CPU kernels run on a libgomp thread team; between parallel regions its threads spin (GOMP_SPINCOUNT) before
they sleep, unless ``OMP_WAIT_POLICY=PASSIVE``. Alone on its cores spinning saves a wake-up per region; beside
another busy process on the same cores the spinning threads burn the time the other needs, and both slow down.
This measures, for each policy (``OMP_WAIT_POLICY`` unset, ``PASSIVE``, ``ACTIVE``), in interleaved rounds:

- cli: ``cosyserve synth`` wall time (a fresh process per run), alone and with a neighbour: another process doing
  torch matrix products on every core with the same policy (what a second prefork worker or a second server is);
- server: ``cosyserve serve --workers N`` with N concurrent clients, each request's wall time (the workers are
  each other's neighbours), and one lone request.

It prints medians per policy and scenario. ``cosyserve`` sets the policy it measures best as the default for its
own processes (``COSYSERVE``'s CLI and server: see :mod:`cosyserve.cli`); a policy set in the environment wins.
Figures are wall-clock: run it on a quiet machine and say which CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("unset", "PASSIVE", "ACTIVE")
NEIGHBOUR = (
    "import torch, time\n"
    "torch.set_num_threads(os.cpu_count() or 2)\n"
    "a = torch.randn(384, 384)\n"
    "end = time.monotonic() + 3600\n"
    "parent = os.getppid()\n"
    "while time.monotonic() < end and os.getppid() == parent:\n"  # a killed bench leaves no neighbour busy
    "    for _ in range(20):\n"
    "        a @ a\n"
    "    time.sleep(0.002)\n"  # gaps between regions, as a serving process has (where spinning shows)
)


def _env(policy: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "COSYSERVE_OMP_WAIT_POLICY")}
    env["PYTHONPATH"] = str(ROOT / "src")
    env["OMP_WAIT_POLICY"] = "" if policy == "unset" else policy
    if policy == "unset":
        env.pop("OMP_WAIT_POLICY")
        env["COSYSERVE_OMP_WAIT_POLICY"] = "unset"  # cosyserve's own default off: torch's libgomp default
    return env


def _neighbour(policy: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", "import os\n" + NEIGHBOUR], env=_env(policy), stdout=subprocess.DEVNULL
    )


def _synth(model: str, text: str, policy: str, out: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "cosyserve", "synth", "--model", model, "--text", text, "--seed", "1",
         "--out", str(out)],
        env=_env(policy), check=True, capture_output=True, timeout=1800,
    )  # fmt: skip
    return time.perf_counter() - t0


def cli(model: str, text: str, rounds: int) -> dict[str, dict[str, float]]:
    times: dict[str, dict[str, list[float]]] = {p: {"alone": [], "neighbour": []} for p in POLICIES}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "a.wav"
        for _ in range(rounds):
            for policy in POLICIES:
                times[policy]["alone"].append(_synth(model, text, policy, out))
            for policy in POLICIES:
                n = _neighbour(policy)
                try:
                    time.sleep(1.0)  # the neighbour's torch import done: it computes
                    times[policy]["neighbour"].append(_synth(model, text, policy, out))
                finally:
                    n.kill()
                    n.wait()
    return {p: {k: statistics.median(v) for k, v in d.items()} for p, d in times.items()}


def server(model: str, text: str, rounds: int, workers: int) -> dict[str, dict[str, float]]:
    import httpx

    sys.path.insert(0, str(ROOT / "tests"))
    from server_util import running_server  # the tests' server starter: loopback, a clean environment

    out: dict[str, dict[str, list[float]]] = {p: {"lone": [], "concurrent": []} for p in POLICIES}
    body = {"input": text, "voice": "alloy", "seed": 1, "response_format": "pcm"}
    for _ in range(rounds):
        for policy in POLICIES:
            with tempfile.TemporaryDirectory() as tmp:
                env = _env(policy)
                with running_server(model, Path(tmp), args=["--workers", str(workers)], env=env) as srv:
                    with httpx.Client(base_url=srv.base_url, timeout=1800) as c:
                        c.post("/v1/audio/speech", json=body)  # each worker's first request after its fork
                        t0 = time.perf_counter()
                        c.post("/v1/audio/speech", json=body).raise_for_status()
                        out[policy]["lone"].append(time.perf_counter() - t0)

                    def one() -> float:
                        with httpx.Client(base_url=srv.base_url, timeout=1800) as cc:
                            t = time.perf_counter()
                            cc.post("/v1/audio/speech", json=body).raise_for_status()
                            return time.perf_counter() - t

                    import concurrent.futures

                    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
                        out[policy]["concurrent"] += list(ex.map(lambda _: one(), range(workers)))
    return {p: {k: statistics.median(v) for k, v in d.items()} for p, d in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model dir or bundle (default: a tiny random-weight model made now)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--text", default="Hello world, this is a test of the wait policy.")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--what", choices=["cli", "server", "both"], default="both")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model = args.model
    tmp = None
    if model is None:
        tmp = tempfile.TemporaryDirectory()
        model = str(Path(tmp.name) / "tiny")
        subprocess.run(
            [sys.executable, "-m", "cosyserve", "make-test-model", model, "--size", "tiny"],
            env=_env("PASSIVE"), check=True, capture_output=True,
        )  # fmt: skip
    results: dict[str, object] = {"cpu": _cpu(), "model": model}
    if args.what in ("cli", "both"):
        results["cli"] = cli(model, args.text, args.rounds)
    if args.what in ("server", "both"):
        results["server"] = server(model, args.text, args.rounds, args.workers)
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"CPU: {results['cpu']}; model {model}; medians of {args.rounds} interleaved rounds (seconds)")
    for what in ("cli", "server"):
        table = results.get(what)
        if not isinstance(table, dict):
            continue
        cols = list(next(iter(table.values())))
        print(f"\n{what:<8}" + "".join(f"{c:>14}" for c in cols))
        for policy, row in table.items():
            print(f"{policy:<8}" + "".join(f"{row[c]:>14.2f}" for c in cols))


def _cpu() -> str:
    from cosyserve.system.cpus import cpu_name

    name = cpu_name()
    return f"{name} x{os.cpu_count()}" if name else f"{os.cpu_count()} CPUs"


if __name__ == "__main__":
    main()
