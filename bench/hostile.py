"""The hostile pass of issue 32 replayed against `cosyserve serve`: each case's answer, /health/live's worst latency
while it runs, and the growth of the server's memory.

    python bench/hostile.py                                     # serves a full-size CosyVoice-300M test model made here
    python bench/hostile.py --work /data/bench                  # keep (and reuse) the model made
    python bench/hostile.py --url http://127.0.0.1:8000 --server-pid PID --api-key KEY --voice NAME
    python bench/hostile.py --dry-run                           # tiny model, short cases (CI: tests/test_bench_hostile.py)

The cases, one after another, each bounded to ``--case-s`` seconds (default 60; dry run 2):

- ``ws-ref_text-1MB``: a WebSocket ``session.config`` with ``ref_audio`` (a 1 s tone) and a 1 MB ``ref_text``
  (it wedged the server: no answer on /health/live for over 60 s, RSS 0.9 -> 8 GB);
- ``ws-ref_text-5000``: 5,000 characters of ``ref_text`` (POST refused it, the WebSocket took it);
- ``ws-instructions-120k`` and ``ws-instructions-1MB`` (4.8 GB in 4 s; an allocation of 244 GB);
- ``ws-text-piece-1MB``: one ``input.text`` of 1 MB ("hello " repeated), then ``input.done`` (normalised whole:
  64k characters took 13.8 s and 1.1 GB, the server unresponsive);
- ``ws-text-1MB-in-pieces``: 1 MB of text in pieces within the piece limit, sent as fast as the server reads
  them, the audio read, until the case's time is up; then the client disconnects (which must free the work);
- ``post-input-1MB``: ``POST /v1/audio/speech`` with a 1 MB ``input``;
- ``ws-tenant-voice``: with an API key and a voice registered for its tenant (``--api-key`` and ``--voice`` with
  ``--url``; a server this script starts has keys, and the voice is registered through ``/v1/audio/voices``),
  one utterance over the WebSocket: ``audio.start`` with the voice, or the error (it was ``voice_not_found``
  there while POST spoke it).

Per case: the answer (an ``error`` event's or response's code and field, the audio bytes received, how the
connection ended), /health/live's worst latency while the case ran and one second after (0.2 s in a dry run; polled from another
thread every 50 ms, each poll bounded to 10 s: a poll that gets no answer counts as 10 s), and the server's RSS
(``/proc``: before the case, its peak sampled with each poll, its growth). The issue's targets: each case is an
error naming its field, or is served with /health/live answering within 2 s throughout and RSS growth under 1 GB.
Traffic goes to the loopback interface only. The figures share the machine's cores with the server: run it on a
quiet machine, and name the CPU beside them.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import sys
import tempfile
import threading
import time
import wave
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu import made_bundle
from load_test import free_port, get, start_server, stop_server
from ws_load import Target, counts, loopback_target

MB = 1 << 20
POLL_S = 0.05
POLL_TIMEOUT_S = 10.0
KEYS = {"hostile-key-a": "a", "hostile-key-b": "b"}  # a server this script starts


def tone_wav(seconds: float = 1.0, rate: int = 16000) -> bytes:
    """A 220 Hz tone as a 16-bit mono WAV file: a voice sample stand-in."""
    import math

    n = int(seconds * rate)
    frames = b"".join(
        int(9000 * math.sin(2 * math.pi * 220 * i / rate)).to_bytes(2, "little", signed=True)
        for i in range(n)
    )
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes(frames)
    return buf.getvalue()


@dataclass
class Watch:
    """/health/live's latency and the server's RSS, polled from a thread while a case runs."""

    target: Target
    settle_s: float = 1.0  # watched on after the case: the server's answer may still hold it up
    worst_s: float = 0.0
    polls: int = 0
    rss_kib: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                status, _ = get(self.target.host, self.target.port, "/health/live", timeout=POLL_TIMEOUT_S)
                took = time.perf_counter() - t0 if status == 200 else POLL_TIMEOUT_S
            except OSError:
                took = POLL_TIMEOUT_S
            self.worst_s = max(self.worst_s, took)
            self.polls += 1
            if self.target.pid is not None:
                self.rss_kib.append(counts(self.target.pid).rss_kib)
            self._stop.wait(POLL_S)

    def __enter__(self) -> Watch:
        if self.target.pid is not None:
            self.rss_kib.append(counts(self.target.pid).rss_kib)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(self.settle_s)
        self._stop.set()
        assert self._thread is not None
        self._thread.join(2 * POLL_TIMEOUT_S)


def connect(target: Target) -> Any:
    from websockets.sync.client import connect as ws_connect

    return ws_connect(
        target.ws_url, additional_headers=target.headers(), proxy=None, open_timeout=30, max_size=None
    )


def answer(ws: Any, until: float) -> str:
    """What the server says to a session until its utterance ends, an error comes or ``until``: a short line."""
    audio, voice = 0, ""
    while time.perf_counter() < until:
        try:
            msg = ws.recv(timeout=max(0.01, until - time.perf_counter()))
        except TimeoutError:
            break
        except Exception as e:  # noqa: BLE001 - the connection closed: say how
            code = getattr(getattr(e, "rcvd", None), "code", type(e).__name__)
            return f"closed ({code}) after {audio} audio bytes"
        if isinstance(msg, bytes):
            audio += len(msg)
            continue
        ev = json.loads(msg)
        if ev["type"] == "error":
            return f"error {ev['code']} naming {ev['param']}"
        if ev["type"] == "audio.start":
            voice = f" in voice {ev.get('voice')}"
        if ev["type"] == "session.done":
            return f"served {audio} audio bytes{voice}"
    return f"still serving when the case's time was up: {audio} audio bytes{voice} (disconnected)"


def ws_case(config: dict[str, Any], texts: Callable[[], Any] | None = None) -> Callable[[Target, float], str]:
    """A session that sends ``config``, then (``texts``) each piece and ``input.done`` from another thread (a send
    waits while the server reads no more), and reads the answer; cut off (the socket shut) when the time is up."""

    def run(target: Target, case_s: float) -> str:
        import socket

        until = time.perf_counter() + case_s
        with connect(target) as ws:
            ws.send(json.dumps({"type": "session.config", **config}))

            def feed() -> None:
                try:
                    for piece in texts():  # type: ignore[misc]
                        ws.send(json.dumps({"type": "input.text", "text": piece}))
                    ws.send(json.dumps({"type": "input.done"}))
                except Exception:  # noqa: BLE001, S110 - the connection was cut: the answer says how
                    pass

            sender = threading.Thread(target=feed, daemon=True) if texts is not None else None
            if sender is not None:
                sender.start()
            said = answer(ws, until)
            try:
                ws.socket.shutdown(socket.SHUT_RDWR)  # a sender blocked on a full socket lets go
            except OSError:
                pass
            if sender is not None:
                sender.join(10)
            return said

    return run


def pieces_of(total: int, size: int) -> Callable[[], Any]:
    def gen() -> Any:
        piece = ("hello " * (size // 6 + 1))[:size]
        for _ in range(total // size):
            yield piece

    return gen


def post_case(body: dict[str, Any]) -> Callable[[Target, float], str]:
    def run(target: Target, case_s: float) -> str:
        import http.client

        conn = http.client.HTTPConnection(target.host, target.port, timeout=case_s)
        try:
            conn.request(
                "POST",
                "/v1/audio/speech",
                json.dumps(body),
                {"Content-Type": "application/json", **target.headers()},
            )
            r = conn.getresponse()
            data = r.read()
        finally:
            conn.close()
        if r.status != 200:
            err = json.loads(data)["error"]
            return f"{r.status} {err['code']} naming {err['param']}"
        return f"200 with {len(data)} bytes"

    return run


def cases(voice: str | None, piece_chars: int) -> dict[str, Callable[[Target, float], str]]:
    sample = base64.b64encode(tone_wav()).decode()
    out = {
        "ws-ref_text-1MB": ws_case({"ref_audio": sample, "ref_text": "r" * MB}),
        "ws-ref_text-5000": ws_case({"ref_audio": sample, "ref_text": "r" * 5000}),
        "ws-instructions-120k": ws_case({"instructions": "i" * 120_000}),
        "ws-instructions-1MB": ws_case({"instructions": "i" * MB}),
        "ws-text-piece-1MB": ws_case({}, pieces_of(MB, MB)),
        "ws-text-1MB-in-pieces": ws_case({}, pieces_of(MB, piece_chars)),
        "post-input-1MB": post_case(
            {"input": "hello " * (MB // 6), "voice": "alloy", "response_format": "pcm"}
        ),
    }
    if voice is not None:
        out["ws-tenant-voice"] = ws_case({"voice": voice}, lambda: iter(["Hello there, a test."]))
    return out


def run_cases(
    target: Target, voice: str | None, case_s: float, piece_chars: int, settle_s: float = 1.0
) -> list[dict[str, Any]]:
    print(" ".join(f"{c:<24}" if c == "case" else f"{c:>14}" for c in COLUMNS[:-1]) + "  answer", flush=True)
    rows = []
    for name, case in cases(voice, piece_chars).items():
        with Watch(target, settle_s) as watch:
            try:
                said = case(target, case_s)
            except Exception as e:  # noqa: BLE001 - a case that fails says why in its row
                said = f"client failed: {type(e).__name__}: {e}"[:120]
        rss = watch.rss_kib
        rows.append(
            {
                "case": name,
                "answer": said,
                "live_worst_ms": round(watch.worst_s * 1e3, 1),
                "rss_before_mib": round(rss[0] / 1024, 1) if rss else None,
                "rss_peak_mib": round(max(rss) / 1024, 1) if rss else None,
                "rss_growth_mib": round((max(rss) - rss[0]) / 1024, 1) if rss else None,
            }
        )
        print(_row(rows[-1]), flush=True)
    return rows


COLUMNS = ("case", "live_worst_ms", "rss_before_mib", "rss_peak_mib", "rss_growth_mib", "answer")


def _row(r: dict[str, Any]) -> str:
    cells = [
        f"{r[c]!s:<24}" if c == "case" else f"{'-' if r[c] is None else r[c]!s:>14}" for c in COLUMNS[:-1]
    ]
    return " ".join(cells) + "  " + str(r["answer"])


def register_voice(target: Target, name: str) -> None:
    """Register ``name`` for the key's tenant through ``POST /v1/audio/voices`` (multipart, written by hand)."""
    import http.client

    boundary = "hostile-bench-boundary"
    parts = []
    for k, v in (("name", name), ("consent", "bench"), ("ref_text", "A short test prompt.")):
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode())
    parts.append(
        f'--{boundary}\r\nContent-Disposition: form-data; name="audio_sample"; filename="s.wav"\r\n'
        "Content-Type: audio/wav\r\n\r\n".encode()
        + tone_wav()
        + b"\r\n"
    )
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    conn = http.client.HTTPConnection(target.host, target.port, timeout=120)
    try:
        conn.request(
            "POST",
            "/v1/audio/voices",
            body,
            {"Content-Type": f"multipart/form-data; boundary={boundary}", **target.headers()},
        )
        r = conn.getresponse()
        data = r.read()
    finally:
        conn.close()
    if r.status != 200 and b"voice_exists" not in data:  # registered by an earlier run in the same --work
        raise SystemExit(f"registering voice {name!r} failed: {r.status} {data[:300]!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="a tiny model and short cases (CI)")
    ap.add_argument("--url", default=None, help="a running server (http://127.0.0.1:PORT); loopback only")
    ap.add_argument("--server-pid", type=int, default=None, help="with --url: its process, for its RSS")
    ap.add_argument("--api-key", default=None, help="with --url: sent as Authorization: Bearer KEY")
    ap.add_argument("--voice", default=None, help="with --url: a voice registered for the key's tenant")
    ap.add_argument(
        "--model", default=None, help="serve this bundle or model dir (default: a test model made)"
    )
    ap.add_argument(
        "--work", type=Path, default=None, help="keep the test model here and reuse it (default temp)"
    )
    ap.add_argument("--case-s", type=float, default=None, help="bound on each case (default 60; dry run 2)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here as JSON")
    args = ap.parse_args(argv)
    if args.url is None and (args.server_pid or args.api_key or args.voice):
        ap.error("--server-pid, --api-key and --voice go with --url")
    case_s = args.case_s if args.case_s is not None else 2.0 if args.dry_run else 60.0
    settle_s = 0.2 if args.dry_run else 1.0
    piece_chars = 4000  # within the default limit of a streamed piece (4096)
    with tempfile.TemporaryDirectory(prefix="cosyserve-hostile-") as tmp:
        if args.url is not None:
            try:
                target = loopback_target(args.url, args.server_pid, args.api_key)
            except ValueError as e:
                ap.error(str(e))
            rows = run_cases(target, args.voice, case_s, piece_chars, settle_s)
        else:
            work = args.work or Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            model = args.model or str(
                made_bundle(sys.executable, "cosyvoice", "tiny" if args.dry_run else "full", work)
            )
            os.environ["COSYSERVE_API_KEYS"] = ",".join(f"{k}={t}" for k, t in KEYS.items())
            port = free_port()
            proc, ready_s = start_server(model, work, port, 600.0)
            try:
                key = next(iter(KEYS))
                target = Target("127.0.0.1", port, proc.pid, key)
                register_voice(target, "hostile-voice")
                print(
                    f"server READY in {ready_s:.1f} s (pid {proc.pid}); voice 'hostile-voice' registered",
                    flush=True,
                )
                rows = run_cases(target, "hostile-voice", case_s, piece_chars, settle_s)
            finally:
                stop_server(proc)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
