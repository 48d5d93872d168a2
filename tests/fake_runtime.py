"""One fake :class:`cosyserve.runtime.Runtime` for the engine, pool, tenant and server tests (no torch).

It speaks sft only: ``chunks`` chunks of ``chunk_len`` samples, chunk ``i`` filled with ``seed + i``, so a test
can tell requests and their order apart. Text given as an iterable of pieces (the runtime's contract, see
:mod:`cosyserve.core.textfeed`) is read as it comes, in the worker thread: one chunk of ``chunk_len`` samples per
piece with something to speak, as soon as it arrives, chunk ``i`` filled with ``seed + i``; the pieces read are
kept in ``pieces`` (one list per request), and an utterance that ended with nothing to speak is refused as the
runtimes refuse it. Knobs: ``hold`` (an Event each chunk waits for), ``delay`` (seconds per chunk), ``size`` (its
mapped bytes, for the pool's budget). Texts with a meaning: ``boom`` fails inside the model (a bug), ``tokens``
runs a 10k-token LM loop before its one chunk (cancellation must stop it at the next token: ``made`` counts the
tokens), ``endless`` streams a chunk at once and then one every ``token_s`` until its request is stopped (a
deadline, a disconnect, a drain: only the stop ends it, whatever the machine's speed).

Voices: the pre-defined ``speakers``, and ``registered`` (tenant -> names): voices only that tenant can use, as a
registry's are. ``resolves`` counts the requests it resolved: a request is resolved once on its way (the engine
takes a :class:`~cosyserve.core.request.ResolvedRequest` as it is, and so does :meth:`FakeRuntime.start`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from cosyserve.core.clock import PhaseClock
from cosyserve.core.errors import ClientError, ModeUnavailableError, RegistryError, UnknownVoiceError
from cosyserve.core.request import MODES, ResolvedRequest, SynthesisRequest, is_text_iterable
from cosyserve.runtime import Runtime, Voice

__all__ = ["FakeRuntime"]


class FakeRuntime:
    sample_rate = 24000  # OpenAI's rate: the OpenAI routes send its audio as it is, not resampled

    def __init__(
        self,
        chunks: int = 3,
        chunk_len: int = 50,
        *,
        hold: threading.Event | None = None,
        delay: float = 0.0,
        size: int = 0,
        speakers: tuple[str, ...] = ("alice", "bob"),
        slots: int = 1,
        token_s: float = 0.001,
        registered: dict[str, tuple[str, ...]] | None = None,
    ) -> None:
        self.registered = dict(registered or {})
        self.resolves = 0
        self.chunks = chunks
        self.chunk_len = chunk_len
        self.hold = hold
        self.delay = delay
        self.size = size
        self._speakers = list(speakers)
        self.slots = slots
        self.precision = dict.fromkeys(("llm", "flow", "hift"), "float32")
        self.token_s = token_s
        self.clock = PhaseClock()
        self.clock.mark("ready")
        self.yielded = 0
        self.made = 0  # tokens of the "tokens" LM loop
        self.running = 0
        self.max_running = 0
        self.closed_in: list[str] = []  # threads where a request's generator was closed
        self.pieces: list[list[str]] = []  # per request given its text as pieces: the pieces read
        self.closed = False
        self._lock = threading.Lock()

    def speakers(self) -> list[str]:
        return sorted(self._speakers)

    def voices(self, tenant: str = "default") -> list[Voice]:
        own = [Voice(s, "registered", "sft") for s in sorted(self.registered.get(tenant, ()))]
        return [Voice(s, "pre-defined", "sft") for s in self.speakers()] + own

    def voice(self, name: str, tenant: str = "default") -> Voice | None:
        return next((v for v in self.voices(tenant) if v.name == name), None)

    def languages(self) -> list[str]:
        return ["en", "zh"]

    def modes(self) -> dict[str, str | None]:
        return {m: None if m == "sft" else "the fake runtime speaks sft only" for m in MODES}

    def resolve(self, request: SynthesisRequest) -> SynthesisRequest:
        self.resolves += 1
        if request.mode not in (None, "sft"):
            raise ModeUnavailableError(  # the field that asked for the mode, as the runtimes name it
                f"{request.mode} synthesis is unavailable: the fake speaks sft only",
                param="instruct_text" if request.mode == "instruct" else None,
            )
        if request.speaker is not None and self.voice(request.speaker, request.tenant) is None:
            known = ", ".join(v.name for v in self.voices(request.tenant))
            raise UnknownVoiceError(
                f"unknown speaker {request.speaker!r}; known speakers: {known}", param="speaker"
            )
        return request.resolved_as("sft", request.speaker or self.speakers()[0], request.instruct_text)

    def start(self, request: SynthesisRequest, should_stop: Callable[[], bool]) -> Iterator[np.ndarray]:
        resolved = request if isinstance(request, ResolvedRequest) else self.resolve(request)
        return self._generate(resolved, should_stop)

    def _generate(self, r: SynthesisRequest, should_stop: Callable[[], bool]) -> Iterator[np.ndarray]:
        with self._lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        try:
            if is_text_iterable(r.text):
                yield from self._generate_pieces(r, should_stop)
                return
            if r.text == "boom":
                raise RuntimeError("kaboom")
            if r.text == "tokens":  # non-streaming: the whole LM loop runs before the first chunk
                n = 0
                for _ in range(10_000):
                    time.sleep(self.token_s)
                    self.made += 1
                    n += 1
                    if should_stop():
                        return
                yield np.zeros(n, np.float32)
                return
            if r.text == "endless":
                i = 0
                while not should_stop():
                    self.yielded += 1
                    yield np.full(self.chunk_len, float(r.seed or 0) + i, np.float32)
                    i += 1
                    time.sleep(self.token_s)
                return
            for i in range(self.chunks):
                if self.hold is not None:
                    assert self.hold.wait(60), "the test never let the fake's chunk go"
                time.sleep(self.delay)
                self.yielded += 1
                yield np.full(self.chunk_len, float(r.seed or 0) + i, np.float32)
        finally:
            with self._lock:
                self.running -= 1
            self.closed_in.append(threading.current_thread().name)

    def _generate_pieces(self, r: SynthesisRequest, should_stop: Callable[[], bool]) -> Iterator[np.ndarray]:
        seen: list[str] = []
        with self._lock:
            self.pieces.append(seen)
        for i, piece in enumerate(r.text):
            seen.append(piece)
            if piece == "boom":
                raise RuntimeError("kaboom")
            if should_stop():
                return
            if not piece.strip():
                continue  # nothing to speak in it
            time.sleep(self.delay)
            self.yielded += 1
            yield np.full(self.chunk_len, float(r.seed or 0) + i, np.float32)
        if not "".join(seen).strip() and not should_stop():
            raise ClientError(
                "the text has nothing to speak: the utterance ended without a word", param="text"
            )

    def warm_up(self) -> None:
        pass

    def mapped_files(self) -> list[Path]:
        return []

    def mapped_bytes(self) -> int:
        return self.size

    def add_voice(self, name: str, prompt_wav: Any, prompt_text: str, **kw: Any) -> Any:
        raise RegistryError("the fake runtime has no voice registry")

    def remove_voice(self, name: str, **kw: Any) -> None:
        raise RegistryError("the fake runtime has no voice registry")

    def import_voices(self, path: Any, **kw: Any) -> Any:
        raise RegistryError("the fake runtime has no voice registry")

    def export_voices(self, path: Any, **kw: Any) -> list[str]:
        raise RegistryError("the fake runtime has no voice registry")

    def after_fork(self) -> None:
        pass

    @property
    def registry_root(self) -> Path | None:
        return None  # no registry

    def join_background(self, timeout: float | None = None) -> None:
        pass  # nothing runs after READY

    def on_lm_step(self, record: Any) -> None:
        self.lm_step = record  # the engine's hook: a fake that decodes calls it

    def close(self) -> None:
        self.closed = True


assert isinstance(FakeRuntime(), Runtime), "the fake must implement the Runtime protocol"
