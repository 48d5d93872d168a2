"""First byte and total time of ``POST /v1/audio/speech`` as clients send it: every format streamed (no extra
field, as OpenAI's), and one-shot (``stream: false``), per model family (issue 33's figures).

    python bench/first_byte.py                                   # tiny 300M, CosyVoice2, CosyVoice3 + full 300M
    python bench/first_byte.py --families cosyvoice --sizes full --work /data/bench
    python bench/first_byte.py --url http://127.0.0.1:8000       # a running server (loopback)
    python bench/first_byte.py --dry-run                         # tiny 300M, two formats, one round (CI)

Per family and size: a random-weight test model (``make-test-model``, converted once and reused from ``--work``:
bench/ws_load.py's), served by ``cosyserve serve`` on 127.0.0.1 with its defaults. One warm-up request, then
``--rounds`` rounds; each round sends, one after another, for each format, ``{"input": TEXT, "voice": "alloy",
"response_format": FMT, "seed": 1}`` streamed (no ``stream`` field), the same with ``"stream": false`` (one-shot),
and LiveKit's shape (``mp3`` with ``"stream_format": "sse"``). TEXT is six sentences (issue 33's target: the first
byte of pcm, wav, mp3 and opus before half of the request's total time). First byte = the first body byte's
arrival minus the request's start (its loopback connection included); total = the last byte's. Reported: the
medians, their ratio, and whether the streamed ratio meets the target (below 0.5).

Random weights never draw a stop token, so every request of a text is the same work (20 speech tokens per text
token) and rounds compare. The figures share the machine's cores with the server: run on a quiet machine, and name
the CPU beside them.
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu import made_bundle
from load_test import free_port, start_server, stop_server
from ws_load import loopback_target

FAMILIES = ("cosyvoice", "cosyvoice2", "cosyvoice3")
FORMATS = ("pcm", "wav", "mp3", "opus", "aac", "flac")
TEXT = (
    "The first sentence is here. Then comes a second one. A third follows it. "
    "Here is the fourth. The fifth is short. And the sixth ends it."
)
DRY_TEXT = "The first sentence is here. And the second ends it."
TARGET = 0.5  # issue 33: the first byte before half of the request's total time
COLUMNS = [
    ("model", "model"),
    ("format", "format"),
    ("mode", "mode"),
    ("first_ms", "first byte ms"),
    ("total_ms", "total ms"),
    ("ratio", "first/total"),
    ("met", f"< {TARGET:g}"),
    ("rate", "Hz"),
]


def one(host: str, port: int, body: dict[str, Any], key: str | None) -> tuple[float, float, int, str]:
    """(first byte s, total s, bytes, X-Sample-Rate) of one request; SystemExit on an error answer."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=600)
    try:
        conn.request("POST", "/v1/audio/speech", json.dumps(body), headers)
        r = conn.getresponse()
        if r.status != 200:
            raise SystemExit(f"{body}: {r.status} {r.read()[:300]!r}")
        first = r.read1(65536)
        t_first = time.perf_counter() - t0
        n = len(first)
        while chunk := r.read1(65536):
            n += len(chunk)
        return t_first, time.perf_counter() - t0, n, r.getheader("x-sample-rate", "")
    finally:
        conn.close()


def shapes(formats: tuple[str, ...]) -> list[tuple[str, str, dict[str, Any]]]:
    """(format, mode, the request's own fields) of every request a round sends."""
    out: list[tuple[str, str, dict[str, Any]]] = []
    for fmt in formats:
        out.append((fmt, "streamed", {"response_format": fmt}))
        out.append((fmt, "one-shot", {"response_format": fmt, "stream": False}))
    if "mp3" in formats:
        out.append(("mp3", "sse", {"response_format": "mp3", "stream_format": "sse"}))
    return out


def measure(
    host: str, port: int, model: str, text: str, formats: tuple[str, ...], rounds: int, key: str | None
) -> list[dict[str, Any]]:
    """Rows of the table: the medians of ``rounds`` rounds for each format and mode of ``model``."""
    base = {"input": text, "voice": "alloy", "seed": 1}
    one(host, port, base | {"response_format": "pcm"}, key)  # warm-up
    times: dict[tuple[str, str], list[tuple[float, float, str]]] = {}
    for _ in range(rounds):
        for fmt, mode, fields in shapes(formats):
            first, total, _, rate = one(host, port, base | fields, key)
            times.setdefault((fmt, mode), []).append((first, total, rate))
    rows = []
    for (fmt, mode), got in times.items():
        first = statistics.median(t[0] for t in got)
        total = statistics.median(t[1] for t in got)
        ratio = first / total if total > 0 else 0.0
        rows.append(
            {
                "model": model,
                "format": fmt,
                "mode": mode,
                "first_ms": round(first * 1e3),
                "total_ms": round(total * 1e3),
                "ratio": round(ratio, 3),
                "met": ("yes" if ratio < TARGET else "NO") if mode != "one-shot" and fmt != "flac" else "-",
                "rate": got[0][2],
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    cells = [[label for _, label in COLUMNS]] + [[str(r[k]) for k, _ in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--dry-run", action="store_true", help="tiny 300M, a two-sentence text, pcm and mp3, 1 round"
    )
    ap.add_argument("--url", default=None, help="a running server (http://127.0.0.1:PORT); loopback only")
    ap.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    ap.add_argument("--families", default=None, help=f"comma-separated (default {','.join(FAMILIES)})")
    ap.add_argument(
        "--sizes",
        default=None,
        help="comma-separated test model sizes: tiny for every family, full for the 300M family (default "
        "tiny,full; dry run tiny)",
    )
    ap.add_argument("--formats", default=None, help=f"comma-separated (default {','.join(FORMATS)})")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per model (default 3; dry run 1)")
    ap.add_argument("--text", default=None, help="the text (default: six sentences)")
    ap.add_argument("--work", type=Path, default=None, help="keep test models here and reuse them")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here as JSON")
    args = ap.parse_args(argv)
    dry = args.dry_run
    formats = tuple(f.strip() for f in (args.formats or ("pcm,mp3" if dry else ",".join(FORMATS))).split(","))
    if not formats or any(f not in FORMATS for f in formats):
        ap.error(f"--formats takes {', '.join(FORMATS)}; got {args.formats!r}")
    families = tuple(
        f.strip() for f in (args.families or ("cosyvoice" if dry else ",".join(FAMILIES))).split(",")
    )
    if not families or any(f not in FAMILIES for f in families):
        ap.error(f"--families takes {', '.join(FAMILIES)}; got {args.families!r}")
    sizes = tuple(s.strip() for s in (args.sizes or ("tiny" if dry else "tiny,full")).split(","))
    if any(s not in ("tiny", "full") for s in sizes):
        ap.error(f"--sizes takes tiny and full; got {args.sizes!r}")
    rounds = args.rounds or (1 if dry else 3)
    if rounds < 1:
        ap.error("--rounds must be 1 or more")
    text = args.text or (DRY_TEXT if dry else TEXT)
    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    if args.url is not None:
        try:
            target = loopback_target(args.url, None, args.api_key)
        except ValueError as e:
            ap.error(str(e))
        rows += measure(target.host, target.port, args.url, text, formats, rounds, args.api_key)
    else:
        # full size for the 300M family only (issue 33's figures); tiny for every family asked
        plan = [(f, s) for s in sizes for f in families if s == "tiny" or f == "cosyvoice"]
        with tempfile.TemporaryDirectory(prefix="cosyserve-first-byte-") as tmp:
            work = args.work or Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            for family, size in plan:
                bundle = made_bundle(sys.executable, family, size, work)
                port = free_port()
                run_dir = work / f"serve-{family}-{size}"
                run_dir.mkdir(exist_ok=True)
                proc, _ = start_server(str(bundle), run_dir, port, ready_timeout_s=900)
                try:
                    rows += measure("127.0.0.1", port, f"{family}-{size}", text, formats, rounds, None)
                finally:
                    stop_server(proc)
                print(table(rows), flush=True)
    print()
    print(
        f"{'dry run: ' if dry else ''}text of {text.count('.')} sentences ({len(text)} characters), voice alloy, "
        f"seed 1; medians of {rounds} round(s), requests one after another; streamed: no extra field (as "
        "OpenAI's), one-shot: stream false, sse: mp3 over Server-Sent Events (LiveKit's shape); first byte: "
        f"the first body byte (sse: the first event); target: streamed first/total < {TARGET:g}"
    )
    print(table(rows))
    print(f"total {time.perf_counter() - t_start:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps({"text": text, "rounds": rounds, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a timeout's kill still removes the temp dir
    sys.exit(main())
