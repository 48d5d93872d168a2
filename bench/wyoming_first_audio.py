"""Wyoming's first audio (Home Assistant's protocol, `serve --wyoming-uri`), one-shot and streamed, per family.

    python bench/wyoming_first_audio.py --work /data/wy-bench        # 300M, CosyVoice2, CosyVoice3 at full size
    python bench/wyoming_first_audio.py --families cosyvoice2 --rounds 15
    python bench/wyoming_first_audio.py --url http://127.0.0.1:8000 --wyoming tcp://127.0.0.1:10200 \\
        --family cosyvoice                                       # a running server (loopback)
    python bench/wyoming_first_audio.py --dry-run                # tiny models, 2 rounds (CI: tests/test_bench_ws.py)

Per family: a random-weight test model (``make-test-model --size full``), converted once (reused from ``--work``),
served by ``cosyserve serve`` on 127.0.0.1 with ``COSYSERVE_WYOMING_URI=tcp://127.0.0.1:PORT`` (cpu unless
``--device``, low-latency chunks, batch 1). The client is the ``wyoming`` package's, as Home Assistant's is: a new
connection per synthesis. One warm-up of each kind, then ``--rounds`` pairs, interleaved (one-shot first in even
rounds, streamed first in odd ones), with the same text and voice (the model's default):

- one-shot: ``synthesize`` with the whole text; first audio = the first ``audio-chunk``'s arrival minus the
  connection's opening (Home Assistant opens one per synthesis; on loopback well under a millisecond);
- streamed: ``synthesize-start`` on a new connection, then the text one word per ``synthesize-chunk`` (each with
  the blank after it), one every ``--word-ms`` (50) on a fixed schedule, as an LLM writes it; after the last word
  the whole text again as a ``synthesize`` (Home Assistant sends it for servers that do not stream), then
  ``synthesize-stop``. First audio after the first text = the first ``audio-chunk``'s arrival minus the first
  chunk's sending; after the last word = the same minus the last chunk's sending (negative: audio came while text
  still did, as CosyVoice2/3 read text as it arrives and the 300M family speaks each sentence once its end does).

Each measurement ends at its first audio: the client closes the connection, which cancels the rest of the work,
and the next starts once the server holds no request (polled on /health/startup): none overlap, and random
weights' long utterances cost nothing. Reported per family: the medians, and which of the streamed figures is the
one to compare with the one-shot (from the first text for CosyVoice2/3, from the last word for 300M, as
bench/ws_first_audio.py counts the WebSocket's). The figures share the machine's cores with the server: run on a
quiet machine. The rate of the audio (``audio-start``) is shown too: the model's, or the encoder's once it
resamples.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gpu import made_bundle
from load_test import free_port
from ws_load import (
    LOOPBACK,
    TEXT,
    Target,
    loopback_target,
    served,
    shared_options,
    shared_values,
    table,
    until_idle,
    words,
)

FAMILIES = ("cosyvoice", "cosyvoice2", "cosyvoice3")
FROM_LAST_WORD = frozenset({"cosyvoice"})  # the families whose streamed figure counts from the last word


def _wyoming() -> Any:
    with warnings.catch_warnings():  # wyoming.audio imports audioop, which warns of its removal
        warnings.simplefilter("ignore", DeprecationWarning)
        import wyoming.audio
        import wyoming.client
        import wyoming.tts
    return wyoming


@dataclass(frozen=True)
class Plan:
    text: str = TEXT
    word_s: float = 0.05
    rounds: int = 9
    timeout_s: float = 300.0  # per measurement


@dataclass(frozen=True)
class Heard:
    first_s: float  # the first audio-chunk after the clock's start (see the module docstring)
    last_word_s: float | None  # streamed: after the last chunk's sending
    rate: int  # audio-start's


async def _first_audio(client: Any, timeout_s: float) -> tuple[float, int]:
    """(the monotonic time the first audio-chunk arrived, audio-start's rate)."""
    wy = _wyoming()
    rate = 0
    while True:
        ev = await asyncio.wait_for(client.read_event(), timeout_s)
        if ev is None:
            raise RuntimeError("the server closed the connection before any audio")
        if wy.audio.AudioStart.is_type(ev.type):
            rate = int(ev.data["rate"])
        elif wy.audio.AudioChunk.is_type(ev.type):
            return time.perf_counter(), rate
        elif ev.type == "error":
            raise RuntimeError(f"the server answered an error: {ev.data}")


async def one_shot(uri: str, plan: Plan) -> Heard:
    """One ``synthesize`` on a new connection, left at its first audio."""
    wy = _wyoming()
    t0 = time.perf_counter()
    async with wy.client.AsyncClient.from_uri(uri) as c:
        await c.write_event(wy.tts.Synthesize(text=plan.text).event())
        heard, rate = await _first_audio(c, plan.timeout_s)
    return Heard(heard - t0, None, rate)


async def streamed(uri: str, plan: Plan) -> Heard:
    """One streamed text on a new connection, word by word on a fixed schedule, left at its first audio."""
    wy = _wyoming()
    pieces = words(plan.text)
    sent: list[float] = []
    async with wy.client.AsyncClient.from_uri(uri) as c:
        await c.write_event(wy.tts.SynthesizeStart().event())

        async def write() -> None:
            start = time.perf_counter()
            for i, piece in enumerate(pieces):
                await asyncio.sleep(max(0.0, start + i * plan.word_s - time.perf_counter()))
                sent.append(time.perf_counter())
                await c.write_event(wy.tts.SynthesizeChunk(text=piece).event())
            await c.write_event(wy.tts.Synthesize(text=plan.text).event())
            await c.write_event(wy.tts.SynthesizeStop().event())

        writer = asyncio.ensure_future(write())
        try:
            heard, rate = await _first_audio(c, plan.timeout_s)
            if not writer.done():  # audio came while text still did: the last word's time is still to come
                await writer
        finally:
            writer.cancel()
    return Heard(heard - sent[0], heard - sent[-1], rate)


async def measure(uri: str, target: Target, family: str, plan: Plan) -> dict[str, Any]:
    """The warm-up, then ``plan.rounds`` interleaved pairs (see the module docstring)."""
    for kind in (one_shot, streamed):
        await until_idle(target)
        await kind(uri, plan)
    shot: list[Heard] = []
    stream: list[Heard] = []
    for r in range(plan.rounds):
        for kind in ("one-shot", "streamed") if r % 2 == 0 else ("streamed", "one-shot"):
            await until_idle(target)
            if kind == "one-shot":
                shot.append(await one_shot(uri, plan))
            else:
                stream.append(await streamed(uri, plan))
    await until_idle(target)
    first_text = [h.first_s for h in stream]
    last_word = [h.last_word_s for h in stream if h.last_word_s is not None]
    row = {
        "family": family,
        "rounds": plan.rounds,
        "rate": shot[0].rate,
        "one_shot_ms": statistics.median(h.first_s for h in shot) * 1e3,
        "streamed_first_text_ms": statistics.median(first_text) * 1e3,
        "streamed_last_word_ms": statistics.median(last_word) * 1e3,
        "compare_from": "last word" if family in FROM_LAST_WORD else "first text",
        "samples_ms": {
            "one_shot": [h.first_s * 1e3 for h in shot],
            "streamed_first_text": [x * 1e3 for x in first_text],
            "streamed_last_word": [x * 1e3 for x in last_word],
        },
    }
    key = "streamed_last_word_ms" if family in FROM_LAST_WORD else "streamed_first_text_ms"
    row["ratio"] = row[key] / row["one_shot_ms"]
    return row


COLUMNS: list[tuple[str, str]] = [
    ("family", "family"),
    ("rounds", "rounds"),
    ("rate", "rate"),
    ("one_shot_ms", "one-shot first audio ms"),
    ("streamed_first_text_ms", "streamed first text->audio ms"),
    ("streamed_last_word_ms", "streamed last word->audio ms"),
    ("compare_from", "streamed compared from"),
    ("ratio", "streamed / one-shot"),
]


def loopback_wyoming(uri: str) -> str:
    """``uri`` if it is a ``tcp://`` address on the loopback interface (ValueError otherwise): this script's
    traffic stays on the machine."""
    parts = urlsplit(uri)
    if parts.scheme != "tcp" or parts.hostname is None or parts.port is None:
        raise ValueError(f"--wyoming must be tcp://HOST:PORT, got {uri!r}")
    if parts.hostname not in LOOPBACK:
        raise ValueError(f"--wyoming must be on the loopback interface ({', '.join(LOOPBACK)}), got {uri!r}")
    return uri


@contextlib.contextmanager
def wyoming_served(bundle: Path, family: str, device: str, work: Path) -> Iterator[tuple[str, Target]]:
    """``cosyserve serve`` of ``bundle`` with Wyoming on a free loopback port (its variable, which the server's
    process inherits), READY: (the Wyoming URI, the HTTP target)."""
    uri = f"tcp://127.0.0.1:{free_port()}"
    saved = os.environ.get("COSYSERVE_WYOMING_URI")
    os.environ["COSYSERVE_WYOMING_URI"] = uri
    try:
        with served(str(bundle), family, device, 1, work, timeout_s=600) as target:
            yield uri, target
    finally:
        if saved is None:
            os.environ.pop("COSYSERVE_WYOMING_URI", None)
        else:
            os.environ["COSYSERVE_WYOMING_URI"] = saved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shared_options(ap, "tiny models, a short text, 2 rounds (CI)", voice_and_seed=False)
    ap.add_argument("--wyoming", default=None, help="with --url: its Wyoming address (tcp://127.0.0.1:PORT)")
    ap.add_argument("--family", default=None, help="with --url: the family it serves (which figure compares)")
    ap.add_argument("--families", default=None, help=f"comma-separated (default {','.join(FAMILIES)})")
    ap.add_argument("--rounds", type=int, default=None, help="pairs per family (default 9; dry run 2)")
    args = ap.parse_args(argv)
    dry = args.dry_run
    if args.url is not None:
        if args.wyoming is None or args.families is not None or args.family not in FAMILIES:
            ap.error(f"--url takes --wyoming and --family (one of {', '.join(FAMILIES)}), and no --families")
        try:
            target: Target | None = loopback_target(args.url)
            uri = loopback_wyoming(args.wyoming)
        except ValueError as e:
            ap.error(str(e))
        families: tuple[str, ...] = (args.family,)
    else:
        target, uri = None, ""
        families = tuple(f.strip() for f in (args.families or ",".join(FAMILIES)).split(",") if f.strip())
        unknown = [f for f in families if f not in FAMILIES]
        if unknown or not families:
            ap.error(f"--families takes {', '.join(FAMILIES)}; got {args.families!r}")
    text, word_s, size = shared_values(ap, args)
    plan = Plan(text, word_s, args.rounds or (2 if dry else 9))
    if plan.rounds < 1:
        ap.error("--rounds must be 1 or more")
    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    print(table(rows, COLUMNS), flush=True)
    with tempfile.TemporaryDirectory(prefix="cosyserve-wyoming-first-audio-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for family in families:
            if target is not None:
                rows.append(asyncio.run(measure(uri, target, family, plan)))
            else:
                bundle = made_bundle(sys.executable, family, size, work)
                with wyoming_served(bundle, family, args.device, work) as (wy_uri, t):
                    rows.append(asyncio.run(measure(wy_uri, t, family, plan)))
            print(table(rows, COLUMNS).splitlines()[-1], flush=True)
    what = f"the server at {args.url}" if args.url else f"{size} random-weight models, {args.device}, batch 1"
    print()
    print(
        f"{'dry run: ' if dry else ''}{what}; text {plan.text!r} ({len(words(plan.text))} words; streamed: one "
        f"every {plan.word_s * 1e3:g} ms, then synthesize and synthesize-stop, as Home Assistant sends them); "
        f"medians of {plan.rounds} interleaved pairs"
    )
    print(
        "one-shot: connection opened -> first audio-chunk; streamed: first (last) synthesize-chunk sent -> first"
    )
    print("audio-chunk; ratio: the streamed median (counted from the column named) / the one-shot median")
    print(table(rows, COLUMNS))
    print(f"total {time.perf_counter() - t_start:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps({"plan": asdict(plan), "what": what, "families": rows}, indent=1))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a timeout's kill still removes the temp dir
    sys.exit(main())
