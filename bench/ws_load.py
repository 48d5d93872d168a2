"""WebSocket load test of `cosyserve serve`: sessions that feed text at an LLM's pace; then sessions opened and closed
in a loop, with what the server process holds counted before and after.

    python bench/ws_load.py                                     # a full-size CosyVoice-300M test model, made here
    python bench/ws_load.py --family cosyvoice2 --work /data/ws-bench    # keep (and reuse) the model made
    python bench/ws_load.py --model path/to/bundle-or-model-dir --sessions 1,4,8
    python bench/ws_load.py --url http://127.0.0.1:8000 --server-pid 1234   # a server already running (loopback)
    python bench/ws_load.py --dry-run                           # tiny model, small counts (CI: tests/test_bench_ws.py)

Each session connects to ``/v1/audio/speech/stream`` (the ``websockets`` asyncio client) and sends
``session.config`` (``--voice``, ``--seed``, pcm); then, for each of ``--utterances`` utterances, the text one word
per ``input.text`` (each word with the blank after it, as an LLM's tokens come), one every ``--word-ms`` on a fixed
schedule, and ``input.done`` right after the last word; it reads the utterance's audio up to its ``session.done``
before it starts the next one, and ends with ``session.close``. A level's sessions are connected and configured
first, then start together. Measured on the client's clock, per utterance:

- first audio after the first text: the arrival of its first binary (audio) frame minus the sending of its first
  ``input.text``;
- first audio after the last word: the arrival of its first audio frame minus the sending of its last
  ``input.text``; negative when audio came before the text ended (CosyVoice2/3 read text as it arrives; the
  300M family speaks each finished sentence once text follows it);
- p50 and p99 over a level's utterances (``load_test.quantile``: the value of rank round(q * (n - 1)), so the
  p99 of up to 50 utterances is the slowest);
- audio s per wall s: the audio seconds all sessions received (PCM bytes / 2 / ``audio.start``'s sample rate)
  over the level's wall time, from its first text sent to its last ``session.done`` (or cut, below);
- errors: ``error`` events, closes other than 1000, connections refused or cut, and utterances not done within
  the level's bound (``--timeout-s``).

Random weights never draw a stop token. Text given whole runs the LM to its length limit, 20 speech tokens per
text token, so one fixed text (``--text``) makes every one-shot request, and every 300M utterance, the same work.
Text streamed to CosyVoice2/3 has no known length: their LM runs to the 60 s cap of a piece. So the client leaves
an utterance (a disconnect, which frees its work at once; its next utterance opens a new session, configured
before its first text) once its audio passes ``--max-audio-ratio`` (1.5) times the audio of a one-shot request for
the same text (``POST /v1/audio/speech``, stream, same voice and seed, made once before the levels): the work a
model that stops would do. A real model's utterance stays under that and is read to its end; the table says how
many were cut.

Then ``--churn N`` (default 100; 0 skips it): N sessions opened and closed one after another, by turns configured
and closed; one utterance spoken to its end, then closed; one utterance left by the client at its first audio (a
disconnect mid-utterance, which cancels its work). The server process's threads, file descriptors and RSS
(``/proc``) are read after N such sessions of warm-up (lazy imports, pools, allocator arenas), once the server
has no request in flight and its counts hold still, and again after N more once it has no request in flight and
its threads and descriptors are back to their count before (polled, up to 30 s). The loop's utterances
(``CHURN_TEXT``, sent at once) are cut as the levels' are, past ``--max-audio-ratio`` times a one-shot request's
audio for their text. The server's asyncio tasks cannot be seen from outside: tests/test_server_ws.py counts them
in-process (with its Python heap and its Session objects). With ``--url`` the counts need ``--server-pid``.

Traffic goes to the loopback interface only; every level and the loop are bounded in count and time. The server
runs on the device given (``--device``, default cpu), low-latency chunks, the server's default batch size unless
``--batch-size``; each level also shows the LM's mean rows per decode step (``cosyserve_lm_batch_rows`` from
/metrics, over the level: four CosyVoice2 sessions streaming text word by word should average 2 or more). The figures
share the machine's cores with the server and the clients: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gpu import GPU, made_bundle, post_stream, serve
from load_test import get, quantile

WS_PATH = "/v1/audio/speech/stream"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# one sentence, as an LLM would answer: 17 words, 0.8 s from the first to the last at 50 ms a word
TEXT = "Sure, the meeting has moved to the small room on the third floor, right after lunch today."
CHURN_TEXT = "Hi there."
SETTLE_S = 30.0  # how long the server's counts may take to settle after a loop


@dataclass(frozen=True)
class Target:
    """A server to send to: loopback only."""

    host: str
    port: int
    pid: int | None = None  # its process, for the counts (None: not known)
    api_key: str | None = None

    @property
    def ws_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"ws://{host}:{self.port}{WS_PATH}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def loopback_target(url: str, pid: int | None = None, api_key: str | None = None) -> Target:
    """The :class:`Target` of ``url`` (``http://``, ``ws://``: only its host and port are used); a host other than
    the loopback interface's is refused (ValueError): this script's traffic stays on the machine."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "ws") or parts.hostname is None or parts.port is None:
        raise ValueError(f"--url must be http://HOST:PORT or ws://HOST:PORT, got {url!r}")
    if parts.hostname not in LOOPBACK:
        raise ValueError(
            f"--url must be on the loopback interface ({', '.join(LOOPBACK)}), got {parts.hostname!r}"
        )
    return Target(parts.hostname, parts.port, pid, api_key)


def words(text: str) -> list[str]:
    """``text`` as an LLM streams it: one piece per word, each with the blank after it (the last without)."""
    parts = text.split()
    if not parts:
        raise ValueError("the text has no word")
    return [w + " " for w in parts[:-1]] + [parts[-1]]


@contextmanager
def served(
    model: str, name: str, device: str, batch_size: int | None, work: Path, timeout_s: float
) -> Iterator[Target]:
    """``cosyserve serve`` of ``model`` (a bundle or model dir) on 127.0.0.1 as model ``name``, READY; stopped on
    exit."""
    plan = replace(GPU, device=device, batch_size=batch_size)
    with serve(sys.executable, Path(model), name, plan, work, timeout_s) as srv:
        yield Target("127.0.0.1", srv.port, srv.proc.pid)


def lm_rows(target: Target) -> tuple[float, float]:
    """(sum, count) of ``cosyserve_lm_batch_rows`` (rows per LM decode step) over every model and worker."""
    status, body = get(target.host, target.port, "/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}: {body[:200]!r}")
    total = {"sum": 0.0, "count": 0.0}
    for line in body.decode().splitlines():
        for kind in total:
            if line.startswith(f"cosyserve_lm_batch_rows_{kind}{{"):
                total[kind] += float(line.rsplit(" ", 1)[1])
    return total["sum"], total["count"]


def in_flight(target: Target) -> int:
    """Requests the server holds (running or queued), every model together (``/health/startup``)."""
    status, body = get(target.host, target.port, "/health/startup")
    if status != 200:
        raise RuntimeError(f"/health/startup answered {status}: {body[:200]!r}")
    return sum(int(m.get("in_flight", 0)) for m in json.loads(body)["models"].values())


async def until_idle(target: Target, timeout_s: float = SETTLE_S) -> None:
    """Wait until the server holds no request (polled); RuntimeError after ``timeout_s``."""
    deadline = time.perf_counter() + timeout_s
    while await asyncio.to_thread(in_flight, target):
        if time.perf_counter() > deadline:
            raise RuntimeError(f"the server still holds requests {timeout_s:g} s after the clients left")
        await asyncio.sleep(0.05)


@dataclass
class OneShot:
    """A one-shot streamed ``POST /v1/audio/speech``, as the client saw it."""

    status: int
    first_audio_s: float | None  # request sent (connection opened) -> first body byte
    audio_s: float  # the audio read (up to the first body bytes when cut there)


def one_shot(target: Target, text: str, voice: str, seed: int, first_only: bool, timeout_s: float) -> OneShot:
    """The whole ``text`` in one streamed request (16-bit PCM), read to its end, or to its first body bytes
    (``first_only``: the connection is then closed, which cancels the rest)."""
    body = {"input": text, "voice": voice, "response_format": "pcm", "stream": True, "seed": seed}
    status, first, n, rate, _ = post_stream(
        target.host, target.port, body, target.headers(), timeout_s, first_only
    )
    ok = status == 200
    return OneShot(status, first if ok else None, n / 2 / rate if ok and rate else 0.0)


# -- one session -------------------------------------------------------------------------------------------------


@dataclass
class Utterance:
    """One utterance's times (``time.perf_counter``) and audio, as the client saw them."""

    first_text: float | None = None  # its first input.text sent
    last_text: float | None = None  # its last input.text sent
    first_audio: float | None = None  # its first audio frame received
    last_audio: float = 0.0  # its last audio frame received (a cut one: the frame that cut it)
    done: float | None = None  # its session.done received (without an error)
    audio_bytes: int = 0
    sample_rate: int = 0
    error: str | None = None
    cap_s: float | None = None  # the client leaves it once this much audio came (None: read to its end)
    cut: bool = False  # it was left at cap_s
    heard: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # its first audio (or its end)
    ended: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # its session.done (or the end)

    @property
    def audio_s(self) -> float:
        return self.audio_bytes / 2 / self.sample_rate if self.sample_rate else 0.0

    @property
    def over(self) -> bool:
        """Done (its session.done came) or cut, without an error."""
        return self.error is None and (self.done is not None or self.cut)

    @property
    def after_first_text(self) -> float | None:
        """First audio after the first text (s)."""
        if self.first_audio is None or self.first_text is None:
            return None
        return self.first_audio - self.first_text

    @property
    def after_last_word(self) -> float | None:
        """First audio after the last word (s); negative: it came before the text ended."""
        if self.first_audio is None or self.last_text is None:
            return None
        return self.first_audio - self.last_text


class Session:
    """One WebSocket session (see the module docstring): its messages are read in a task as they come, its audio
    filed under the utterance being spoken (one at a time)."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.utterances: list[Utterance] = []
        self.errors: list[str] = []
        self.closing = False  # session.close sent, or the client leaves: a close is expected
        self._aborted = False  # the client gave up on it: its end is no news
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def open(cls, target: Target, voice: str, seed: int) -> Session:
        from websockets.asyncio.client import connect

        ws = await connect(
            target.ws_url,
            proxy=None,
            compression=None,
            open_timeout=30,
            additional_headers=target.headers(),
        )
        await ws.send(
            json.dumps({"type": "session.config", "voice": voice, "seed": seed, "response_format": "pcm"})
        )
        return cls(ws)

    async def _read(self) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            async for message in self.ws:
                now = time.perf_counter()
                utt = self.utterances[-1] if self.utterances else None
                if isinstance(message, bytes):
                    if utt is None:
                        self.errors.append("audio_outside_an_utterance")
                        continue
                    if utt.cut:
                        continue  # what comes while the client leaves
                    if utt.first_audio is None:
                        utt.first_audio = now
                        utt.heard.set()
                    utt.audio_bytes += len(message)
                    utt.last_audio = now
                    if utt.cap_s is not None and utt.audio_s >= utt.cap_s:
                        utt.cut = True
                        utt.ended.set()
                    continue
                event = json.loads(message)
                kind = event.get("type")
                if kind == "audio.start" and utt is not None:
                    utt.sample_rate = int(event["sample_rate"])
                elif kind == "error":
                    self.errors.append(str(event.get("code")))
                    if utt is not None:
                        utt.error = str(event.get("code"))
                elif kind == "session.done" and utt is not None:
                    if not event.get("error"):
                        utt.done = now
                    utt.ended.set()
                    utt.heard.set()
        except ConnectionClosed:
            pass  # its code is read below
        finally:
            code = self.ws.close_code
            if not self._aborted and (code != 1000 or not self.closing):
                self.errors.append(f"closed_{code}" if code is not None else "connection_lost")
            for utt in self.utterances:  # nobody waits for what will not come
                utt.heard.set()
                utt.ended.set()

    async def speak(self, pieces: list[str], word_s: float, cap_s: float | None = None) -> Utterance:
        """Send an utterance's ``pieces`` one every ``word_s`` (a fixed schedule from the first), then
        ``input.done``; returns it at once (wait on its ``heard`` / ``ended``; once ``ended``, a ``cut`` one is to
        be left)."""
        from websockets.exceptions import ConnectionClosed

        utt = Utterance(cap_s=cap_s)
        self.utterances.append(utt)
        t0 = time.perf_counter()
        try:
            for i, piece in enumerate(pieces):
                while (wait := t0 + i * word_s - time.perf_counter()) > 0:  # never before its time
                    await asyncio.sleep(wait)
                now = time.perf_counter()
                await self.ws.send(json.dumps({"type": "input.text", "text": piece}))
                if utt.first_text is None:
                    utt.first_text = now
                utt.last_text = now
            await self.ws.send(json.dumps({"type": "input.done"}))
        except ConnectionClosed:
            utt.error = utt.error or "connection_closed_while_sending"
            utt.heard.set()
            utt.ended.set()
        return utt

    async def close(self, timeout_s: float = 30.0) -> None:
        """``session.close``, then the server's close (its code checked by the reader)."""
        from websockets.exceptions import ConnectionClosed

        self.closing = True
        try:
            await self.ws.send(json.dumps({"type": "session.close"}))
        except ConnectionClosed:
            pass
        await self.wait_closed(timeout_s)

    async def leave(self, timeout_s: float = 30.0) -> None:
        """The client closes the connection itself (in the middle of an utterance: a disconnect)."""
        self.closing = True
        await self.ws.close()
        await self.wait_closed(timeout_s)

    async def wait_closed(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self._reader), timeout_s)
        except TimeoutError:
            self.errors.append("close_timeout")
            self._reader.cancel()
            await self.ws.close()

    async def abort(self) -> None:
        self.closing = self._aborted = True
        self._reader.cancel()
        await self.ws.close()


async def open_sessions(target: Target, n: int, voice: str, seed: int, errors: Counter[str]) -> list[Session]:
    """``n`` sessions opened and configured at once; each that fails counts in ``errors``."""
    from websockets.exceptions import InvalidHandshake

    async def one() -> Session | None:
        try:
            return await Session.open(target, voice, seed)
        except (OSError, TimeoutError, InvalidHandshake) as e:
            errors[f"connect_{type(e).__name__}"] += 1
            return None

    return [s for s in await asyncio.gather(*(one() for _ in range(n))) if s is not None]


# -- a level: N sessions at once ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    text: str = TEXT
    word_s: float = 0.05
    utterances: int = 4  # per session
    voice: str = "alloy"
    seed: int = 1
    timeout_s: float = 600.0  # per level
    max_audio_ratio: float = 1.5  # utterances are left past this x a one-shot request's audio (0: never)


def caps(target: Target, opt: Options, texts: list[str]) -> dict[str, float | None]:
    """text -> the audio (s) past which its utterances are left: ``opt.max_audio_ratio`` x a one-shot request's
    (see the module docstring)."""
    out: dict[str, float | None] = {}
    for text in texts:
        r = one_shot(target, text, opt.voice, opt.seed, first_only=False, timeout_s=opt.timeout_s)
        if r.status != 200 or r.audio_s <= 0:
            raise RuntimeError(
                f"a one-shot request for {text!r} answered {r.status} with {r.audio_s} s of audio"
            )
        out[text] = opt.max_audio_ratio * r.audio_s if opt.max_audio_ratio > 0 else None
    return out


def ms(xs: list[float], q: float) -> float | None:
    return quantile(xs, q) * 1e3 if xs else None


async def run_level(target: Target, n: int, opt: Options, cap_s: float | None) -> dict[str, Any]:
    """``n`` sessions at once, each speaking ``opt.utterances`` utterances (see the module docstring)."""
    errors: Counter[str] = Counter()
    opened = await open_sessions(target, n, opt.voice, opt.seed, errors)
    sessions = list(opened)  # every session, those opened after a cut included
    pieces = words(opt.text)

    async def talk(s: Session | None) -> None:
        for _ in range(opt.utterances):
            if s is None:  # the last utterance was cut: a new session, configured before the clock starts
                more = await open_sessions(target, 1, opt.voice, opt.seed, errors)
                if not more:
                    return
                s = more[0]
                sessions.append(s)
            utt = await s.speak(pieces, opt.word_s, cap_s)
            await utt.ended.wait()
            if utt.cut:
                await s.leave()
                s = None
            elif utt.done is None:
                return  # failed: the session is not trusted further
        if s is not None:
            await s.close()

    rows0 = await asyncio.to_thread(lm_rows, target)
    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(talk(s)) for s in opened]
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=opt.timeout_s)
        if pending:
            errors["level_timeout"] += len(pending)
            for task in pending:
                task.cancel()
            await asyncio.wait(pending)
    for s in sessions:
        if not s.closing:
            await s.abort()
        else:
            await s.wait_closed(5.0)
        errors.update(s.errors)
    utts = [u for s in sessions for u in s.utterances]
    ok = [u for u in utts if u.over]
    errors["utterance_unfinished"] += sum(1 for u in utts if not u.over and u.error is None)
    errors["utterance_missing"] += max(0, n * opt.utterances - len(utts))
    ends = [u.done if u.done is not None else u.last_audio for u in ok]  # a cut one: when it was cut
    wall = (max(ends) - t0) if ends else None
    rows1 = await asyncio.to_thread(lm_rows, target)
    steps = rows1[1] - rows0[1]
    first = [x for u in ok if (x := u.after_first_text) is not None]
    last = [x for u in ok if (x := u.after_last_word) is not None]
    return {
        "sessions": n,
        "utterances": len(ok),
        "cut": sum(1 for u in ok if u.cut),
        "errors": sum(errors.values()),
        "error_kinds": dict(+errors),
        "first_text_p50_ms": ms(first, 0.5),
        "first_text_p99_ms": ms(first, 0.99),
        "last_word_p50_ms": ms(last, 0.5),
        "last_word_p99_ms": ms(last, 0.99),
        "audio_s": sum(u.audio_s for u in ok),
        "xrt": sum(u.audio_s for u in ok) / wall if wall else None,
        "lm_rows": (rows1[0] - rows0[0]) / steps if steps else None,
        "wall_s": wall,
    }


COLUMNS: list[tuple[str, str]] = [
    ("sessions", "sessions"),
    ("utterances", "utterances"),
    ("cut", "cut"),
    ("errors", "errors"),
    ("first_text_p50_ms", "first text->audio p50 ms"),
    ("first_text_p99_ms", "p99 ms"),
    ("last_word_p50_ms", "last word->audio p50 ms"),
    ("last_word_p99_ms", "p99 ms"),
    ("xrt", "audio s/wall s"),
    ("lm_rows", "LM rows/step"),
    ("wall_s", "wall s"),
]


def _cell(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, str | int):
        return str(v)
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.2f}"


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]] = COLUMNS) -> str:
    """One line per row (a level), one column per measurement (``columns``: key, label)."""
    cells = [[_cell(row.get(k)) for k, _ in columns] for row in rows]
    widths = [max([len(label), 6, *(len(c[i]) for c in cells)]) for i, (_, label) in enumerate(columns)]
    lines = [[label for _, label in columns], *cells]
    return "\n".join("  ".join(f"{c:>{w}}" for c, w in zip(line, widths, strict=True)) for line in lines)


# -- sessions opened and closed in a loop ------------------------------------------------------------------------


@dataclass(frozen=True)
class Counts:
    threads: int
    fds: int
    rss_kib: int


def counts(pid: int) -> Counts:
    """The threads, open file descriptors and resident memory of process ``pid`` (``/proc``)."""
    proc = Path(f"/proc/{pid}")
    status = (proc / "status").read_text()
    rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return Counts(len(list((proc / "task").iterdir())), len(list((proc / "fd").iterdir())), rss)


async def churn(target: Target, n: int, opt: Options, cap_s: float | None) -> Counter[str]:
    """``n`` sessions one after another, three kinds by turns (see the module docstring); their errors."""
    errors: Counter[str] = Counter()
    pieces = words(CHURN_TEXT)
    for i in range(n):
        opened = await open_sessions(target, 1, opt.voice, opt.seed, errors)
        if not opened:
            continue
        s = opened[0]
        kind = i % 3
        try:
            if kind == 0:
                await s.close()
            else:
                utt = await s.speak(pieces, 0.0, cap_s)
                await asyncio.wait_for((utt.ended if kind == 1 else utt.heard).wait(), opt.timeout_s)
                if utt.error is not None or (utt.over if kind == 1 else utt.first_audio is not None) is False:
                    errors["utterance_unfinished"] += 1
                await (s.close() if kind == 1 and not utt.cut else s.leave())
        except TimeoutError:
            errors["churn_timeout"] += 1
            await s.abort()
        errors.update(s.errors)
    return errors


async def settled(target: Target, before: Counts | None) -> Counts:
    """The server's counts once it holds no request and its threads and descriptors are back to ``before``'s
    (``before`` None: the same in two reads 0.2 s apart); the last read after SETTLE_S if they never are."""
    assert target.pid is not None
    await until_idle(target)
    deadline = time.perf_counter() + SETTLE_S
    last = counts(target.pid)
    while time.perf_counter() < deadline:
        await asyncio.sleep(0.2)
        now = counts(target.pid)
        if before is None and (now.threads, now.fds) == (last.threads, last.fds):
            return now
        if before is not None and now.threads <= before.threads and now.fds <= before.fds:
            return now
        last = now
    return last


async def leak_check(target: Target, n: int, opt: Options, cap_s: float | None) -> dict[str, Any]:
    """``n`` sessions of warm-up, the server's counts, ``n`` more sessions, its counts again."""
    errors = await churn(target, n, opt, cap_s)  # warm-up: counted for errors, not for leftovers
    before = await settled(target, None) if target.pid is not None else None
    errors += await churn(target, n, opt, cap_s)
    after = await settled(target, before) if target.pid is not None else None
    return {
        "sessions": n,
        "errors": sum(errors.values()),
        "error_kinds": dict(+errors),
        "before": asdict(before) if before else None,
        "after": asdict(after) if after else None,
    }


def leak_line(r: dict[str, Any]) -> str:
    n = r["sessions"]
    head = f"{n} sessions opened and closed (after {n} of warm-up), errors {r['errors']}"
    if r["before"] is None:
        return head + "; server counts n/a (no --server-pid)"
    b, a = r["before"], r["after"]
    grown = a["rss_kib"] - b["rss_kib"]
    return (
        f"{head}: server threads {b['threads']} -> {a['threads']}, file descriptors {b['fds']} -> {a['fds']}, "
        f"RSS {b['rss_kib'] / 1024:.1f} -> {a['rss_kib'] / 1024:.1f} MiB ({grown:+d} KiB, "
        f"{grown / n:+.1f} KiB per session)"
    )


# -- the command -------------------------------------------------------------------------------------------------


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--sessions takes comma-separated counts like 1,4,8, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"--sessions takes counts of 1 or more, got {text!r}")
    return levels


async def bench(target: Target, levels: list[int], opt: Options, churn_n: int) -> dict[str, Any]:
    """The levels, then the loop; also the warm-up and the one-shot requests that set the caps."""
    cap = await asyncio.to_thread(caps, target, opt, [opt.text, CHURN_TEXT])
    warm = await open_sessions(target, 1, opt.voice, opt.seed, Counter())  # lazy parts out of the way
    for s in warm:
        utt = await s.speak(words(opt.text), 0.0, cap[opt.text])
        await asyncio.wait_for(utt.ended.wait(), opt.timeout_s)
        await (s.leave() if utt.cut else s.close())
    rows: list[dict[str, Any]] = []
    print(table(rows), flush=True)
    for n in levels:
        await until_idle(target)
        rows.append(await run_level(target, n, opt, cap[opt.text]))
        print(table(rows).splitlines()[-1], flush=True)
    leaks = await leak_check(target, churn_n, opt, cap[CHURN_TEXT]) if churn_n else None
    return {"levels": rows, "churn": leaks, "cap_s": cap[opt.text]}


DRY_TEXT = "Hello there, this is a test."


def shared_options(ap: argparse.ArgumentParser, dry_run_help: str, voice_and_seed: bool = True) -> None:
    """The options the streamed-text benches take (this one, bench/ws_first_audio.py, bench/wyoming_first_audio.py:
    no ``--api-key``, ``--voice``, ``--seed`` without ``voice_and_seed``, as Wyoming has none of them)."""
    ap.add_argument("--dry-run", action="store_true", help=dry_run_help)
    ap.add_argument("--url", default=None, help="a running server (http://127.0.0.1:PORT); loopback only")
    if voice_and_seed:
        ap.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    ap.add_argument(
        "--size", default=None, help="test models' size, tiny or full (default full; dry run tiny)"
    )
    ap.add_argument(
        "--work", type=Path, default=None, help="keep test models here and reuse them (default temp)"
    )
    ap.add_argument("--device", default="cpu", help="where the server computes (default cpu)")
    ap.add_argument("--word-ms", type=float, default=None, help="ms between words (default 50; dry run 20)")
    ap.add_argument("--text", default=None, help="the text of an utterance (default: a 17-word sentence)")
    if voice_and_seed:
        ap.add_argument("--voice", default="alloy", help="the voice (default alloy: the default voice)")
        ap.add_argument("--seed", type=int, default=1, help="the seed (default 1)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here as JSON")


def shared_values(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, float, str]:
    """(text, seconds between words, test models' size) from :func:`shared_options`' options; the dry run's
    defaults with ``--dry-run``. A text without a word is a usage error."""
    dry = args.dry_run
    text = args.text or (DRY_TEXT if dry else TEXT)
    try:
        words(text)
    except ValueError as e:
        ap.error(f"--text: {e}")
    word_ms = args.word_ms if args.word_ms is not None else 20.0 if dry else 50.0
    if word_ms < 0:
        ap.error(f"--word-ms must be 0 or more, got {word_ms:g}")
    return text, word_ms / 1e3, args.size or ("tiny" if dry else "full")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shared_options(ap, "a tiny model, a short text, small counts (CI)")
    ap.add_argument("--server-pid", type=int, default=None, help="with --url: its process, for the counts")
    ap.add_argument(
        "--model", default=None, help="serve this bundle or model dir (default: a test model made)"
    )
    ap.add_argument("--family", default="cosyvoice", help="the test model's family (default cosyvoice)")
    ap.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="requests the server runs at once (default: the server's)",
    )
    ap.add_argument("--sessions", default=None, help="comma-separated levels (default 1,4,8; dry run 1,2)")
    ap.add_argument("--utterances", type=int, default=None, help="per session (default 4; dry run 2)")
    ap.add_argument(
        "--churn", type=int, default=None, help="sessions opened and closed (default 100; dry run 15)"
    )
    ap.add_argument("--timeout-s", type=float, default=600.0, help="bound on each level (default 600)")
    ap.add_argument(
        "--max-audio-ratio",
        type=float,
        default=1.5,
        help="leave an utterance past this x a one-shot request's audio for its text (0: never; default 1.5)",
    )
    args = ap.parse_args(argv)
    dry = args.dry_run
    try:
        levels = parse_levels(args.sessions or ("1,2" if dry else "1,4,8"))
        target = loopback_target(args.url, args.server_pid, args.api_key) if args.url else None
    except ValueError as e:
        ap.error(str(e))
    if args.server_pid is not None and args.url is None:
        ap.error("--server-pid goes with --url (a server this script starts is counted anyway)")
    if args.url is not None and args.model is not None:
        ap.error("--url and --model exclude each other: send to a running server, or serve a model here")
    text, word_s, size = shared_values(ap, args)
    opt = Options(
        text=text,
        word_s=word_s,
        utterances=args.utterances or (2 if dry else 4),
        voice=args.voice,
        seed=args.seed,
        timeout_s=args.timeout_s,
        max_audio_ratio=args.max_audio_ratio,
    )
    churn_n = args.churn if args.churn is not None else 15 if dry else 100
    if opt.utterances < 1 or churn_n < 0:
        ap.error("--utterances must be 1 or more, --churn 0 or more")
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cosyserve-ws-bench-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if target is not None:
            what = f"the server at {args.url}"
            results = asyncio.run(bench(target, levels, opt, churn_n))
        else:
            model = args.model or str(made_bundle(sys.executable, args.family, size, work))
            what = args.model or f"{args.family} {size} random-weight model"
            what += f", {args.device}, batch {args.batch_size or 'default'}"
            with served(model, "m", args.device, args.batch_size, work, timeout_s=600) as target:
                results = asyncio.run(bench(target, levels, opt, churn_n))
    print()
    cap = results["cap_s"]
    left = (
        f"left past {cap:.2f} s of audio ({opt.max_audio_ratio:g} x a one-shot request's)"
        if cap
        else "read whole"
    )
    print(
        f"{'dry run: ' if dry else ''}{what}; text {opt.text!r} ({len(words(opt.text))} words, one every "
        f"{opt.word_s * 1e3:g} ms, input.done after the last); {opt.utterances} utterances per session, {left}"
    )
    print(
        "first text->audio: first audio frame received - first input.text sent; last word->audio: the same from"
    )
    print(
        "the last input.text sent (negative: audio before the text ended); audio s/wall s: all sessions' audio"
    )
    print("over the level's wall time, first text to the last session.done (or cut)")
    print(table(results["levels"]))
    for row in results["levels"]:
        if row["error_kinds"]:
            print(f"errors at {row['sessions']} sessions: {row['error_kinds']}")
    if results["churn"] is not None:
        print(leak_line(results["churn"]))
        if results["churn"]["error_kinds"]:
            print(f"errors in the loop: {results['churn']['error_kinds']}")
    print(f"total {time.perf_counter() - t_start:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps({"options": asdict(opt), "what": what, **results}, indent=1))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a timeout's kill still removes the temp dir
    sys.exit(main())
