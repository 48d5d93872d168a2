"""GPU serving benchmark: one command on a fresh GPU machine, one table.

    python bench/gpu.py                          # on the GPU machine: torch with CUDA preinstalled, no network
    python bench/gpu.py --dry-run                # the same code on the CPU at tiny size (CI: tests/test_bench_gpu.py)
    python bench/gpu.py --families cosyvoice2 --work /data/gpu-bench   # keep (and reuse) the models made

Steps, all within one budget (``--budget-s``, 450 s, so that a run ends within the 8 minutes an H200 is lent):

1. Dependencies: the project's requirements (pyproject.toml) that the interpreter lacks are installed from the
   wheels carried beside this script (``--wheels``, default ``bench/gpu-wheels``; ``scripts/gpu_wheels.sh`` downloads
   them where there is network) with ``pip --no-index``, nothing fetched: into this interpreter's virtual environment
   if it runs in one, else into one made over the system's packages (torch stays the machine's). Nothing missing (the dry run in CI): nothing is installed. cosyserve
   itself runs from ``src/`` (PYTHONPATH), uninstalled.
2. Per family (``--families``; CosyVoice3 once ``make-test-model --family cosyvoice3`` serves): ``cosyserve
   make-test-model --size full`` (random weights at the release's dimensions) and ``cosyserve convert`` (reused when
   ``--work`` already holds them).
3. ``cosyserve serve`` on the device (``--device``; loopback only), and: process start -> READY (polled at the client;
   and the server's own ``ready_ms`` from ``/health/startup``), the first request after READY, first audio at one
   client over 20 streamed requests (the server's time from the request's arrival to its first audio, from its
   access log line, ``ttfa_ms``; and the client's, to the first body byte), then 1, 4, 16 and 64 concurrent clients
   (audio seconds per wall second, the clients' time to first audio p50/p99), the peak GPU memory of the server
   (nvidia-smi, sampled every 0.5 s; the GPU's whole use above its use before the start where the process is not
   listed) and its peak RSS. The startup phases (``/v1/startup``) are printed under the table.

Random weights never draw a stop token, so every request runs to the LM's length limit (20 speech tokens per text
token): one fixed text makes every request the same number of speech tokens (8 text tokens -> 160 speech tokens),
and the table shows the count measured from the audio, so runs compare. A level that would start after the
family's share of the budget is skipped (shown as ``skipped``), so the run ends in time whatever the speed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any

from load_test import free_port, get, quantile, stop_server

ROOT = Path(__file__).resolve().parents[1]
LEVELS = (1, 4, 16, 64)
DEFAULT_FAMILIES = ("cosyvoice", "cosyvoice2")
HOST = "127.0.0.1"


@dataclass(frozen=True)
class Plan:
    """What one run does: the models' size, the device, the request and how many of them."""

    size: str
    device: str
    text: str  # its text tokens x 20 = the speech tokens of every request
    first_audio_requests: int  # streamed one after another at one client
    level_requests: dict[int, int]  # clients -> requests in all at that level
    batch_size: int | None  # requests the server runs at once (LM steps batched); None: the server's default
    budget_s: float
    families: tuple[str, ...] = DEFAULT_FAMILIES


GPU = Plan(
    size="full",
    device="cuda",
    text="Hello world, this is a test.",
    first_audio_requests=20,
    level_requests={1: 4, 4: 8, 16: 32, 64: 64},
    batch_size=16,
    budget_s=450.0,
)
# the same code at tiny size on the CPU, on a short text: every level starts its clients at once (64 threads at the
# barrier), but the 16- and 64-client levels send 4 requests each (their other clients find none left): every
# figure is filled and every path runs, in seconds (the load itself is the GPU run's to measure)
DRY_RUN = replace(
    GPU,
    size="tiny",
    device="cpu",
    text="A",
    first_audio_requests=2,
    level_requests={1: 1, 4: 4, 16: 4, 64: 4},
    budget_s=120.0,
)

# (key, label) of the table's rows, in order
ROWS: list[tuple[str, str]] = [
    ("make_s", "make-test-model (s)"),
    ("convert_s", "convert (s)"),
    ("speech_tokens", "speech tokens per request (from its audio)"),
    ("audio_s", "audio per request (s)"),
    ("ready_client_s", "process start -> READY, client (s)"),
    ("ready_server_s", "process start -> READY, server (s)"),
    ("first_request_ms", "first request after READY: first audio (ms)"),
    ("server_ttfa_p50_ms", "first audio, 1 client, server p50 (ms)"),
    ("server_ttfa_p95_ms", "first audio, 1 client, server p95 (ms)"),
    ("client_ttfa_p50_ms", "first audio, 1 client, client p50 (ms)"),
    ("client_ttfa_p95_ms", "first audio, 1 client, client p95 (ms)"),
    *[
        row
        for c in LEVELS
        for row in (
            (f"c{c}_xrt", f"{c} client{'s' * (c > 1)}: audio s per wall s"),
            (f"c{c}_ttfa_p50_ms", f"{c} client{'s' * (c > 1)}: first audio p50 (ms)"),
            (f"c{c}_ttfa_p99_ms", f"{c} client{'s' * (c > 1)}: first audio p99 (ms)"),
        )
    ],
    ("failed", "refused or failed requests"),
    ("gpu_mib", "GPU memory peak (MiB)"),
    ("rss_mib", "server RSS peak (MiB)"),
]
SKIPPED = "skipped"


# -- dependencies --------------------------------------------------------------------------------------------------


def requirements() -> list[str]:
    """The project's requirements (pyproject.toml ``[project] dependencies``)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", v.split("+")[0])[:4])


def missing(reqs: list[str]) -> list[str]:
    """The requirements not met by what is installed: the distribution is absent, or its version fails one of the
    specifier's clauses (``>=``, ``<=``, ``==``, ``<``, ``>``, ``!=``, comma-separated: all pyproject.toml uses)."""
    out = []
    for req in reqs:
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(.*)$", req)
        if m is None:
            raise ValueError(f"cannot read requirement {req!r}")
        name, spec = m.groups()
        try:
            have = _version(metadata.version(name))
        except metadata.PackageNotFoundError:
            out.append(req)
            continue
        for clause in filter(None, (c.strip() for c in spec.split(";")[0].split(","))):
            op, want = re.match(r"(>=|<=|==|!=|<|>)\s*(.+)", clause).groups()  # type: ignore[union-attr]
            w = _version(want)
            ok = {
                ">=": have >= w,
                "<=": have <= w,
                "==": have[: len(w)] == w,
                "!=": have[: len(w)] != w,
                "<": have < w,
                ">": have > w,
            }[op]
            if not ok:
                out.append(req)
                break
    return out


def ensure_dependencies(wheels: Path, work: Path) -> str:
    """The Python to run cosyserve with: this one when it has every requirement; else, with the missing ones
    installed from ``wheels`` offline, this one when it is a virtual environment's (torch is in it), or a virtual
    environment over the system's packages (torch stays the machine's; a system Python may refuse pip: PEP 668)."""
    need = missing(requirements())
    if not need:
        return sys.executable
    if not wheels.is_dir():
        raise SystemExit(
            f"missing {', '.join(need)} and no wheels at {wheels}: run scripts/gpu_wheels.sh {wheels} on a machine "
            "with network access and carry the folder here"
        )
    python = Path(sys.executable)
    if sys.prefix == sys.base_prefix:
        venv = work / "venv"
        python = venv / "bin" / "python"
        if not python.exists():
            # without pip (no ensurepip needed): this interpreter's pip installs into it through --python
            subprocess.run(
                [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                check=True,
            )
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "--find-links", str(wheels),
         "--quiet", "--disable-pip-version-check", *need],
        check=True,
    )  # fmt: skip
    print(f"installed {len(need)} requirements from {wheels} in {time.perf_counter() - t0:.1f} s", flush=True)
    return str(python)


# -- the server ----------------------------------------------------------------------------------------------------


def _env(work: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "COSYSERVE_CACHE_DIR": str(work / "cache"),
        "COSYSERVE_REGISTRY_DIR": str(work / "registry"),
        **(extra or {}),
    }


def cosyserve(python: str, work: Path, *args: str) -> float:
    """Run a ``cosyserve`` command; its seconds."""
    t0 = time.perf_counter()
    r = subprocess.run([python, "-m", "cosyserve", *args], env=_env(work), capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"cosyserve {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def made_bundle(python: str, family: str, size: str, work: Path, times: dict[str, Any] | None = None) -> Path:
    """A random-weight model of ``family`` at ``size`` (``make-test-model``), converted: made once in ``work``,
    reused from there after (every bench script that serves a test model makes it here, so they share a
    ``--work`` folder). ``times`` gets ``make_s`` and ``convert_s``: the commands' seconds, or ``"reused"``."""
    times = {} if times is None else times
    bundle = work / f"{family}-{size}-bundle"
    if (bundle / "manifest.json").exists():
        times["make_s"] = times["convert_s"] = "reused"
        return bundle
    model = work / f"{family}-{size}-model"
    made = ["--size", size, "--family", family, "--seed", "0", "--force"]
    times["make_s"] = cosyserve(python, work, "make-test-model", str(model), *made)
    times["convert_s"] = cosyserve(python, work, "convert", str(model), str(bundle), "--force")
    shutil.rmtree(model)  # the bundle is all the server reads
    return bundle


class GpuMemory:
    """Peak GPU memory of process ``pid`` from nvidia-smi, sampled every 0.5 s in a thread (None: no nvidia-smi).
    Where nvidia-smi does not list the process (a container's own pid namespace), the GPU's whole use above its
    use before the process started."""

    def __init__(self) -> None:
        self.smi = shutil.which("nvidia-smi")
        self.baseline = self._gpu_used() if self.smi else 0
        self.peak: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _query(self, *args: str) -> list[list[str]]:
        assert self.smi is not None
        try:
            out = subprocess.run(
                [self.smi, *args, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return []
        return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]

    def _gpu_used(self) -> float:
        return sum(float(r[0]) for r in self._query("--query-gpu=memory.used") if r and r[0].isdigit())

    def sample(self, pid: int) -> None:
        if self.smi is None:
            return
        mine = [float(r[1]) for r in self._query("--query-compute-apps=pid,used_memory") if r[0] == str(pid)]
        used = sum(mine) if mine else self._gpu_used() - self.baseline
        self.peak = max(self.peak or 0.0, used)

    def start(self, pid: int) -> None:
        if self.smi is None:
            return

        def run() -> None:
            while not self._stop.wait(0.5):
                self.sample(pid)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stop(self, pid: int) -> float | None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.sample(pid)
        return self.peak


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path
    ready_client_s: float
    memory: GpuMemory = field(default_factory=GpuMemory)


@contextmanager
def serve(python: str, bundle: Path, name: str, plan: Plan, work: Path, timeout_s: float) -> Iterator[Server]:
    """``cosyserve serve`` of ``bundle`` as model ``name``, READY; stopped on exit."""
    port = free_port()
    log = work / f"server-{name}.log"
    settings = {
        "COSYSERVE_DEVICE": plan.device,
        "COSYSERVE_QUEUE_LIMIT": str(2 * max(LEVELS)),
        "COSYSERVE_CHUNK_POLICY": "low-latency",
        "COSYSERVE_DRAIN_DELAY": "0",
        "COSYSERVE_SERVE_LOG_LEVEL": "info",  # one access log line per request: its ttfa_ms
    }
    if plan.batch_size is not None:
        settings["COSYSERVE_BATCH_SIZE"] = str(plan.batch_size)
    env = _env(work, settings)
    cmd = [
        python,
        "-m",
        "cosyserve",
        "serve",
        "--model",
        f"{name}={bundle}",
        "--host",
        HOST,
        "--port",
        str(port),
    ]
    memory = GpuMemory()  # its baseline before the process starts
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    memory.start(proc.pid)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            if time.perf_counter() - t0 > timeout_s:
                raise SystemExit(f"server not READY in {timeout_s:.0f} s; log: {log}")
            try:
                if get(HOST, port, "/health/ready", timeout=2.0)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.01)
        yield Server(proc, port, log, time.perf_counter() - t0, memory)
    finally:
        memory.stop(proc.pid)
        stop_server(proc)


def rss_peak_mib(pid: int) -> float | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^VmHWM:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) / 1024 if m else None


# -- requests ------------------------------------------------------------------------------------------------------


@dataclass
class Result:
    request_id: str
    status: int
    ttfa_s: float | None  # to the first body byte
    total_s: float
    audio_s: float


def post_stream(
    host: str,
    port: int,
    body: dict[str, Any],
    headers: dict[str, str],
    timeout_s: float,
    first_only: bool = False,
) -> tuple[int, float | None, int, int, float]:
    """One streamed ``POST /v1/audio/speech``, read to its end or (``first_only``) to its first body bytes, the
    connection then closed (which cancels the rest): (status, seconds to the first body byte, bytes read, the
    X-Sample-Rate header or 0, seconds in all)."""
    import http.client

    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request(
            "POST",
            "/v1/audio/speech",
            json.dumps(body).encode(),
            {"Content-Type": "application/json", **headers},
        )
        r = conn.getresponse()
        first, n = None, 0
        while chunk := r.read1(65536):
            first = first if first is not None else time.perf_counter() - t0
            n += len(chunk)
            if first_only:
                break
        return r.status, first, n, int(r.getheader("X-Sample-Rate") or 0), time.perf_counter() - t0
    finally:
        conn.close()


def stream(port: int, text: str, request_id: str, timeout_s: float) -> Result:
    """One streamed ``POST /v1/audio/speech`` (16-bit PCM), read to its end."""
    body = {"input": text, "voice": "alloy", "response_format": "pcm", "stream": True, "seed": 1}
    status, first, n, rate, total = post_stream(
        HOST, port, body, {"X-Request-Id": request_id}, max(timeout_s, 1.0)
    )
    audio_s = n / 2 / rate if rate and status == 200 else 0.0
    return Result(request_id, status, first if status == 200 else None, total, audio_s)


def run_level(
    port: int, text: str, clients: int, requests: int, prefix: str, deadline: float
) -> dict[str, Any]:
    """``requests`` streamed requests from ``clients`` clients at once (each sends its share in turn; none starts
    after ``deadline``): audio seconds per wall second, time to first audio, failures."""
    results: list[Result] = []
    failed = [0]
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)

    def client(k: int) -> None:
        barrier.wait()
        for j in range(k, requests, clients):
            if time.perf_counter() > deadline:
                return
            try:
                res = stream(port, text, f"{prefix}-{j}", deadline - time.perf_counter() + 60)
            except OSError:
                with lock:
                    failed[0] += 1
                continue
            with lock:
                results.append(res)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if r.status == 200]
    return {
        "ok": ok,
        "wall_s": wall,
        "failed": failed[0] + len(results) - len(ok),
        "xrt": sum(r.audio_s for r in ok) / wall if ok else None,
        "ttfa": [r.ttfa_s for r in ok if r.ttfa_s is not None],
    }


def server_ttfa(log: Path, ids: set[str], timeout_s: float = 10.0) -> dict[str, float]:
    """request id -> the server's time to first audio (s), from its access log lines; waits for every id."""
    found: dict[str, float] = {}
    t0 = time.perf_counter()
    while True:
        for line in log.read_text(errors="replace").splitlines():
            i = line.find('{"event": "request"')
            if i < 0:
                continue
            rec = json.loads(line[i:])
            if rec.get("id") in ids and rec.get("ttfa_ms") is not None:
                found[rec["id"]] = rec["ttfa_ms"] / 1e3
        if set(found) >= ids or time.perf_counter() - t0 > timeout_s:
            return found
        time.sleep(0.1)


def _frame_rate(config: Any) -> float | None:
    # the speech tokens' rate (Hz): the flow's input_frame_rate, wherever the manifest's config holds it
    if isinstance(config, dict):
        if isinstance(config.get("input_frame_rate"), int | float):
            return float(config["input_frame_rate"])
        found = (_frame_rate(v) for v in config.values())
        return next((r for r in found if r is not None), None)
    return None


# -- one family ----------------------------------------------------------------------------------------------------


def _ms(xs: list[float], q: float) -> float | None:
    return quantile(xs, q) * 1e3 if xs else None


def bench_family(python: str, family: str, plan: Plan, work: Path, deadline: float) -> dict[str, Any]:
    """Every row of the table for ``family``; a level that would start after ``deadline`` is skipped."""
    row: dict[str, Any] = {k: SKIPPED for k, _ in ROWS}
    bundle = made_bundle(python, family, plan.size, work, row)
    rate = _frame_rate(json.loads((bundle / "manifest.json").read_text()).get("config"))
    with serve(python, bundle, family, plan, work, timeout_s=max(deadline - time.perf_counter(), 60)) as srv:
        row["ready_client_s"] = srv.ready_client_s
        row["ready_server_s"] = json.loads(get(HOST, srv.port, "/health/startup")[1])["ready_ms"] / 1e3
        first = stream(srv.port, plan.text, f"{family}-first", deadline - time.perf_counter() + 60)
        if first.status != 200:
            raise SystemExit(f"{family}: the first request failed with {first.status}; log: {srv.log}")
        row["first_request_ms"] = (first.ttfa_s or 0) * 1e3
        row["audio_s"] = first.audio_s
        # the vocoder's audio ends on a whole mel frame: up to a frame (less than a token) short of the tokens'
        row["speech_tokens"] = math.ceil(first.audio_s * rate - 1e-6) if rate else None
        failed = 0
        lone = run_level(srv.port, plan.text, 1, plan.first_audio_requests, f"{family}-one", deadline)
        failed += lone["failed"]
        server = list(server_ttfa(srv.log, {r.request_id for r in lone["ok"]}).values())
        row |= {
            "server_ttfa_p50_ms": _ms(server, 0.5),
            "server_ttfa_p95_ms": _ms(server, 0.95),
            "client_ttfa_p50_ms": _ms(lone["ttfa"], 0.5),
            "client_ttfa_p95_ms": _ms(lone["ttfa"], 0.95),
        }
        lengths = {round(r.audio_s, 3) for r in lone["ok"]} | {round(first.audio_s, 3)}
        if len(lengths) > 1:
            print(
                f"warning: {family}: requests made different lengths of audio {sorted(lengths)}", flush=True
            )
        for c in LEVELS:
            if time.perf_counter() > deadline:
                break
            level = run_level(srv.port, plan.text, c, plan.level_requests[c], f"{family}-c{c}", deadline)
            failed += level["failed"]
            row |= {
                f"c{c}_xrt": level["xrt"],
                f"c{c}_ttfa_p50_ms": _ms(level["ttfa"], 0.5),
                f"c{c}_ttfa_p99_ms": _ms(level["ttfa"], 0.99),
            }
        row["failed"] = failed
        row["rss_mib"] = rss_peak_mib(srv.proc.pid)
        phases = json.loads(get(HOST, srv.port, "/v1/startup")[1]).get("models", {}).get(family, {})
        row["phases_ms"] = phases.get("phases_ms")
    row["gpu_mib"] = srv.memory.peak
    if plan.device != "cpu" and srv.memory.smi is not None and not srv.memory.peak:
        print(f"warning: {family}: the server held no GPU memory: it did not compute on the GPU", flush=True)
    return row


# -- the table -----------------------------------------------------------------------------------------------------


def _cell(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    if isinstance(v, int):
        return str(v)
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.2f}"


def table(results: dict[str, dict[str, Any]]) -> str:
    """One row per measurement, one column per family."""
    families = list(results)
    width = max(len(label) for _, label in ROWS)
    cols = [max(10, len(f)) for f in families]
    lines = [f"{'':<{width}}  " + "  ".join(f"{f:>{w}}" for f, w in zip(families, cols, strict=True))]
    for key, label in ROWS:
        cells = (f"{_cell(results[f].get(key)):>{w}}" for f, w in zip(families, cols, strict=True))
        lines.append(f"{label:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)


def _device_name(python: str, device: str, work: Path) -> str:
    if device == "cpu":
        return "cpu"
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        r = subprocess.run(
            [smi, "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
        return f"{device} ({r.stdout.strip().splitlines()[0] if r.stdout.strip() else 'nvidia-smi: ' + r.stderr[-200:]})"
    code = "import torch; print(torch.cuda.get_device_name(0), torch.__version__, torch.version.cuda)"
    r = subprocess.run([python, "-c", code], env=_env(work), capture_output=True, text=True)
    return f"{device} ({r.stdout.strip() or r.stderr.strip()[-200:]})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="the same code on the CPU at tiny size (CI)")
    ap.add_argument(
        "--families", default=None, help=f"comma-separated (default {','.join(DEFAULT_FAMILIES)})"
    )
    ap.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default cuda; cpu with --dry-run)")
    ap.add_argument(
        "--batch-size", type=int, default=None, help="requests served at once, LM steps batched (default 16)"
    )
    ap.add_argument(
        "--budget-s", type=float, default=None, help="seconds for the whole run (default 450; dry run 120)"
    )
    ap.add_argument(
        "--wheels", type=Path, default=ROOT / "bench" / "gpu-wheels", help="scripts/gpu_wheels.sh's"
    )
    ap.add_argument(
        "--work", type=Path, default=None, help="keep models here and reuse them (default: a temp dir)"
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the results here as JSON")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    plan = DRY_RUN if args.dry_run else GPU
    plan = replace(
        plan,
        device=args.device or plan.device,
        batch_size=args.batch_size or plan.batch_size,
        budget_s=args.budget_s or plan.budget_s,
        families=tuple(f.strip() for f in args.families.split(",") if f.strip())
        if args.families
        else plan.families,
    )
    with tempfile.TemporaryDirectory(prefix="cosyserve-gpu-bench-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        python = ensure_dependencies(args.wheels, work)
        device = _device_name(python, plan.device, work)
        results: dict[str, dict[str, Any]] = {}
        n = len(plan.families)
        for i, family in enumerate(plan.families):
            # each family gets an equal share of what is left, so a slow one cannot starve the next
            left = plan.budget_s - (time.perf_counter() - t_start)
            deadline = time.perf_counter() + left / (n - i)
            results[family] = bench_family(python, family, plan, work, deadline)
    print()
    print(
        f"{'dry run: ' if args.dry_run else ''}{device}, {plan.size} random-weight models, low-latency chunks, "
        f"batch {plan.batch_size}; text {plan.text!r}; requests per level "
        + ", ".join(f"{c} clients: {k}" for c, k in plan.level_requests.items())
    )
    print(table(results))
    for family, row in results.items():
        phases = row.get("phases_ms") or {}
        print(f"startup phases of {family} (ms): " + ", ".join(f"{k} {v:.0f}" for k, v in phases.items()))
    print(f"total {time.perf_counter() - t_start:.0f} s")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"plan": plan.__dict__, "device": device, "results": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a timeout's kill still removes the temp dir
    sys.exit(main())
