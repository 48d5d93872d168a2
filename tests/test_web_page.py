"""The web page at ``/`` in headless Chromium, driven over the DevTools protocol, against a real server process.

Checks: the page loads, lists the server's models and voices, draws the start-up waterfall and live metrics, a
synthesis plays (the streamed wav/pcm path through WebAudio as the bytes arrive, then every format through the
``<audio>`` element, which must reach HAVE_CURRENT_DATA with the right duration), and the console stays free of
errors. Needs Debian's ``chromium`` (``apt-get install -y chromium``); skips without it.

Raw DevTools protocol rather than Playwright: one small dependency (``websockets``) instead of a 50 MB driver
pinned to its own browser build, and the few commands used here (Page.navigate, Runtime.evaluate, console
events) are the protocol's stable core.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fake_runtime import FakeRuntime
from server_util import ServerProcess, running_server, serve

CHROMIUM = os.environ.get("COSYSERVE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    pytest.skip(
        f"headless Chromium not found at {CHROMIUM}: install it with `apt-get install -y chromium` "
        "(or set COSYSERVE_CHROMIUM) to test the web page",
        allow_module_level=True,
    )
ws_client = pytest.importorskip("websockets.sync.client", reason="the web page test needs `websockets`")

WAIT_S = 60.0  # bound on every wait for the page; a synthesis with the tiny model takes well under a second


class Browser:
    """A headless Chromium with one page, and the DevTools-protocol calls the test needs."""

    def __init__(self, profile: Path) -> None:
        self._stack = contextlib.ExitStack()
        with open(profile.parent / "chromium.log", "wb") as log:
            self.proc = subprocess.Popen(
                [
                    CHROMIUM,
                    "--headless=new",
                    "--no-sandbox",  # root in CI containers
                    "--disable-gpu",
                    "--no-first-run",
                    "--no-default-browser-check",
                    "--disable-extensions",
                    "--mute-audio",
                    "--autoplay-policy=no-user-gesture-required",
                    "--remote-debugging-address=127.0.0.1",
                    "--remote-debugging-port=0",
                    f"--user-data-dir={profile}",
                    "about:blank",
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )
        self.events: list[dict[str, Any]] = []
        self._id = 0
        try:
            port_file = profile / "DevToolsActivePort"
            deadline = time.monotonic() + WAIT_S
            while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"chromium did not start: {(profile.parent / 'chromium.log').read_text()[-3000:]}"
                    )
                time.sleep(0.05)
            port = int(port_file.read_text().split("\n")[0])
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                targets = json.load(r)
            page = next(t for t in targets if t["type"] == "page")
            self.ws = self._stack.enter_context(
                ws_client.connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=10)
            )
            for domain in ("Page", "Runtime", "Log"):
                self.call(f"{domain}.enable")
        except BaseException:
            self.close()
            raise

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        my_id = self._id
        self.ws.send(json.dumps({"id": my_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=WAIT_S))
            if msg.get("id") == my_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg["result"])
            self.events.append(msg)

    def js(self, expression: str, *, gesture: bool = False) -> Any:
        """Evaluate in the page (promises awaited) and return the value as JSON."""
        res = self.call(
            "Runtime.evaluate",
            expression=expression,
            awaitPromise=True,
            returnByValue=True,
            userGesture=gesture,
        )
        if "exceptionDetails" in res:
            raise AssertionError(f"{expression!r} threw: {res['exceptionDetails']}")
        return res["result"].get("value")

    def wait_for(self, expression: str, what: str) -> Any:
        """Poll ``expression`` until it is truthy (bounded by WAIT_S); return its value."""
        deadline = time.monotonic() + WAIT_S
        while True:
            value = self.js(expression)
            if value:
                return value
            uncaught = [e for e in self.console_errors() if e.startswith("uncaught")]
            if uncaught or time.monotonic() > deadline:  # a script that threw will not get there
                raise AssertionError(
                    f"page never showed {what} ({expression!r}); status: {self.js(STATUS)!r}; "
                    f"console: {self.console_errors()}"
                )
            time.sleep(0.1)

    def console_errors(self) -> list[str]:
        out = []
        for ev in self.events:
            method, p = ev.get("method"), ev.get("params", {})
            if method == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
                out.append(
                    "console.error: " + " ".join(str(a.get("value", a.get("description"))) for a in p["args"])
                )
            elif method == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                out.append("uncaught: " + str(d.get("exception", {}).get("description", d.get("text"))))
            elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
                out.append(f"log: {p['entry']['text']} ({p['entry'].get('url', '')})")
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._stack.close()
        for sig in (signal.SIGTERM, signal.SIGKILL):  # the browser's own session: it and its helpers
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
                break


STATUS = "document.getElementById('status').textContent"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("web-srv")) as s:
        yield s


@contextlib.contextmanager
def open_page(url: str, root: Path) -> Iterator[Browser]:
    (root / "profile").mkdir()
    b = Browser(root / "profile")
    try:
        b.call("Page.navigate", url=url)
        b.wait_for("document.readyState === 'complete'", "a loaded document")
        yield b
    finally:
        b.close()  # before the server stops, so the page's polls do not fail into the console


@pytest.fixture(scope="module")
def page(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    with open_page(server.url("/"), tmp_path_factory.mktemp("chromium")) as b:
        yield b


def test_page_lists_models_voices_startup_and_metrics(page: Browser, server: ServerProcess) -> None:
    models = page.wait_for("[...document.querySelectorAll('#model option')].map(o => o.value)", "models")
    with server.client() as c:
        assert models == [m["id"] for m in c.get("/v1/models").json()["data"]]
        voices = [
            v["voice_id"] for v in c.get("/v1/audio/voices", params={"model": models[0]}).json()["voices"]
        ]
    assert voices, "the tiny model has pre-defined speakers"
    shown = page.wait_for("[...document.querySelectorAll('#voice option')].map(o => o.value)", "voices")
    assert shown == voices
    assert page.js("document.getElementById('demo').hidden") is True, "not a demo model: no demo notice"
    labels = page.wait_for(
        "[...document.querySelectorAll('#waterfall .wf span:first-child')].map(s => s.textContent)",
        "a waterfall",
    )
    assert f"{models[0]} · warmup" in labels and "server · ready" in labels, labels
    page.wait_for("document.getElementById('health').textContent === 'health: ready'", "health: ready")
    rows = page.wait_for(
        "[...document.querySelectorAll('#metrics tr')].map(r => r.cells[0].textContent)", "metrics"
    )
    assert {"in flight", "queue depth", "requests", "mean time to first audio"} <= set(rows)
    assert page.console_errors() == []


def test_waterfall_orders_phases_by_start_and_draws_after_ready_phases_after_the_ready_tick(
    page: Browser, server: ServerProcess
) -> None:
    """The text tier and the flow/vocoder warm-up run after READY, in the background: the page must show them
    after the model's READY tick (rows in order of start, bars not left of the tick), or a reader concludes
    they delay READY."""
    with server.client() as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
    rows = page.wait_for(
        """(() => { const rows = [...document.querySelectorAll('#waterfall .wf')].map(r =>
             [r.children[0].textContent, parseFloat(r.querySelector('.fill').style.left)]);
           return rows.some(([l]) => l.endsWith(' · warmup_token2wav')) && rows; })()""",
        "the phases after READY in the waterfall",
    )
    mine = [(label.split(" · ", 1)[1], left) for label, left in rows if label.startswith(f"{model} · ")]
    names = [n for n, _ in mine]
    left = dict(mine)
    assert [x for _, x in mine] == sorted(x for _, x in mine), f"rows are not in order of start: {mine}"
    for phase in ("text_tier", "warmup_token2wav"):
        assert names.index(phase) > names.index("ready"), f"{phase} listed before READY: {names}"
        assert left[phase] >= left["ready"], f"{phase} drawn left of the READY tick: {mine}"
    assert names.index("warmup") < names.index("ready") and left["warmup"] <= left["ready"], mine
    assert page.console_errors() == []


def _speak(page: Browser, fmt: str, stream: bool) -> dict[str, Any]:
    page.js(
        f"""(() => {{
          document.getElementById('format').value = {json.dumps(fmt)};
          document.getElementById('stream').checked = {json.dumps(stream)};
          document.getElementById('text').value = 'Hello from the web page test.';
          window.cosyLast = null;
          document.getElementById('speak').click();
        }})()""",
        gesture=True,  # a click by a user: the page may start its AudioContext
    )
    last = page.wait_for("window.cosyLast", f"a finished {fmt} synthesis")
    audio = page.wait_for(
        """(() => { const a = document.getElementById('audio');
          return a.currentSrc === window.cosyLast.url && (a.readyState >= 2 || a.error) &&
            {ready: a.readyState, duration: a.duration, error: a.error && a.error.code}; })()""",
        f"the {fmt} audio in the <audio> element",
    )
    assert audio["error"] is None, (
        f"Chromium could not decode the {fmt} response: MediaError {audio['error']}"
    )
    assert audio["ready"] >= 2 and audio["duration"] > 0, audio
    return {**last, **audio}


@pytest.mark.parametrize("fmt", ["wav", "pcm"])
def test_streamed_pcm_plays_as_it_arrives(page: Browser, fmt: str) -> None:
    r = _speak(page, fmt, stream=True)
    header = 44 if fmt == "wav" else 0
    samples = (r["bytes"] - header) // 2
    assert samples > 0 and r["first_byte_ms"] is not None
    assert r["live_samples"] == samples, "WebAudio scheduled every received sample while the stream ran"
    assert r["audio_ctx_state"] == "running", r
    assert r["duration"] == pytest.approx(samples / r["sample_rate"], rel=1e-3), (
        "the replay holds all the audio"
    )
    assert page.console_errors() == []


@pytest.mark.parametrize(("fmt", "stream"), [("mp3", False), ("opus", True), ("flac", False), ("wav", False)])
def test_other_formats_play_in_the_audio_element(page: Browser, fmt: str, stream: bool) -> None:
    r = _speak(page, fmt, stream=stream)
    assert r["bytes"] > 0 and r["live_samples"] == 0
    assert page.console_errors() == []


def test_demo_notice_and_api_key(tmp_path: Path) -> None:
    """A demo server with keys: the page says so, shows the demo notice once the key is typed, and speaks."""
    with (
        running_server(None, tmp_path / "srv", env={"COSYSERVE_API_KEYS": "open-sesame=acme"}) as server,
        open_page(server.url("/"), tmp_path) as page,
    ):
        page.wait_for(f"{STATUS}.includes('401')", "the missing-key message")
        assert page.js("document.getElementById('demo').hidden") is True
        page.js(
            """(() => { const k = document.getElementById('key'); k.value = 'open-sesame';
              k.dispatchEvent(new Event('change')); })()"""
        )
        notice = page.wait_for(
            "!document.getElementById('demo').hidden && document.getElementById('demo').textContent",
            "the demo notice",
        )
        assert "noise, not speech" in notice
        assert notice.lower().count("demo model") == 1, f"the notice repeats itself: {notice!r}"
        assert page.wait_for("document.querySelectorAll('#voice option').length", "voices") > 0
        r = _speak(page, "wav", stream=True)
        assert r["live_samples"] > 0
        errors = page.console_errors()
        # the only errors: the browser's own log lines for the key-less requests the page made at load
        assert errors and all("status of 401" in e and "/v1/models" in e for e in errors), errors


# --- type as you go: text over the WebSocket, audio back as it comes ---------------------------------------------


def _type_as_you_go(page: Browser, words: list[str], *, audio_per_word: bool) -> dict[str, Any]:
    """Type ``words`` into the box one by one (each an input event, as keystrokes are), with ``audio_per_word``
    waiting for each one's audio before the next, then press Enter; returns the page's counts once the utterance is
    done (or failed)."""
    page.js("document.getElementById('live').focus()")
    for i, word in enumerate(words):
        page.call("Input.insertText", text=word)
        if audio_per_word:
            page.wait_for(
                f"window.cosyLive && (window.cosyLive.frames >= {i + 1} || window.cosyLive.errors.length)",
                f"the audio of word {i + 1}",
            )
    for kind in ("keyDown", "keyUp"):
        page.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13)
    live = page.wait_for(
        "window.cosyLive && (window.cosyLive.events.includes('session.done') || window.cosyLive.errors.length)"
        " && window.cosyLive",
        "the utterance's session.done",
    )
    assert live["errors"] == [], f"the session said: {live['errors']}; status: {page.js(LIVE_STATUS)!r}"
    return dict(live)


LIVE_STATUS = "document.getElementById('live-status').textContent"


class _SpeakingFake(FakeRuntime):
    sample_rate = 16000  # WebAudio makes buffers at 3 kHz and up


def test_type_as_you_go_streams_text_over_the_websocket_and_plays_the_audio_as_it_comes(
    tmp_path: Path,
) -> None:
    """Over the fake runtime (one chunk per piece of text, as soon as the piece comes): each word typed is
    spoken before the next is typed, WebAudio schedules every sample, and the key travels as a subprotocol."""
    fake = _SpeakingFake(chunk_len=800)
    with (
        serve(fake, api_keys={"page-key-0001": "acme"}) as s,
        open_page(s.url("/", scheme="http"), tmp_path) as page,
    ):
        page.js(
            """(() => { const k = document.getElementById('key'); k.value = 'page-key-0001';
              k.dispatchEvent(new Event('change')); })()"""
        )
        page.wait_for("document.querySelectorAll('#voice option').length", "the voices, with the key")
        words = ["Hello ", "from ", "the ", "type ", "as ", "you ", "go ", "box."]
        live = _type_as_you_go(page, words, audio_per_word=True)
        assert fake.pieces[-1] == words, "the server must get each word as it was typed"
        assert live["frames"] == len(words) and live["bytes"] == 2 * 800 * len(words), live
        assert live["samples"] == live["played"] == 800 * len(words), "WebAudio scheduled every sample"
        assert live["sample_rate"] == 16000 and live["errors"] == [], live
        assert live["events"][:1] == ["audio.start"] and live["events"][-2:] == [
            "audio.done",
            "session.done",
        ], live
        assert page.js("audioCtx.state") == "running"
        page.js("document.getElementById('live-close').click()")
        assert page.wait_for("window.cosyLive.closed", "the session's close") == 1000
        errors = page.console_errors()
        # the only errors: the browser's own log lines for the key-less requests the page made at load
        assert all("status of 401" in e for e in errors), errors


def test_type_as_you_go_speaks_with_the_real_model(page: Browser) -> None:
    page.js("window.cosyLive = null")
    # the 300M family speaks a sentence once its end has come, CosyVoice2/3 once the LM has enough text: the audio
    # may come after the last word
    live = _type_as_you_go(page, ["Hello ", "there, ", "how ", "are ", "you?"], audio_per_word=False)
    assert live["samples"] > 0 and live["played"] == live["samples"] and live["errors"] == [], live
    assert page.console_errors() == []
