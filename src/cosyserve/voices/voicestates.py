"""Voice states: what a streamed request's flow computes from its voice sample alone, computed once and kept.

A CosyVoice2/3 flow streams with chunk-causal attention and starts from a fixed noise, so the frames of a prompt's
whole attention chunks (those whose tokens' lookahead is prompt too) come out the same for every request with
that prompt: their per-Euler-step keys, values and conv tails (a :class:`~cosyserve.models.flow_stream.FlowStream`)
are computed once, when a voice is registered (or on its first use after a model change, or an inline prompt's
first use), and every later streamed request forks them and computes only its own frames. The lite runtime's flow
(:class:`~cosyserve.runtime.lite.chunkflow.LiteChunkFlow`, numpy arrays in its estimator graph's layout) goes through
the same code: its states are computed, kept, bounded, stored and forked here as the torch flow's are (a lite fork
reads its voice's rows until its first call that keeps frames copies them: the graph takes every kept row as one
array).

States are keyed by a digest of the prompt (speech tokens, mel, speaker embedding) and the Euler steps, held per
loaded model (a model or precision change loads a new one, with an empty :class:`VoiceStates`), least recently used
first out under a byte bound (unregistered prompts before registered voices). They are large: per second of
sample, 2 x Euler steps x (keys + values of every attention layer) x 50 frames, in the flow's dtype, i.e. about
230 MB per second for a full-size CosyVoice2 in float32 and 180 MB for CosyVoice3 (:func:`bytes_per_second`).

With a folder (the voice registry's ``.flow-states/``), a registered voice's state is also written there as one
safetensors file named by the prompt's digest and the model's tag (its weights' key, flow dtype, device kind and
steps; the lite flow's graphs), and mapped from there (zero copy, page cache) by a later process; a file of another
tag means the model changed since: it is recomputed, written anew and the old one removed.

The LM's prompt prefixes are kept here too (:class:`~cosyserve.runtime.lm.Prefix`: the keys and values of a
one-shot prompt's sos, speaker and prompt text, which the new text follows), under the same bound, in memory only.

The streams' own states (what each streamed request adds to its voice's state as it speaks, the same bytes per
second of speech) are accounted here too, under two bounds: one request's (``stream_max_bytes``) and every
stream's of the model together (``streams_max_bytes``). A stream whose next chunk would pass either drops its
state and continues on the cumulative path (each later chunk re-runs the flow on all its tokens, as the reference
does, exact, holding no state between chunks). It is not refused or paused: its audio has started, and its length
is not known in advance (streamed text), so no admission rule could reserve its bytes; what it loses is the
incremental path's speed, for its own later chunks only, while every other stream keeps its state. A stream with
a bounded flow context (``flow_context_seconds``) drops its older frames as it goes: what it holds, and is charged,
stops growing at its prompt's, its window's and one chunk's frames (plus CosyVoice2's small encoder caches).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosyserve.core.stop import check

logger = logging.getLogger(__name__)

__all__ = ["VoiceStates", "bytes_per_second", "prompt_key"]

FOLDER = ".flow-states"
_LM = "lm:"  # the LM's prompt prefixes' keys (runtime.lm.Prefix), beside the flow states' digests
FORMAT = "cosyserve-flow-state"
VERSION = "1"


def prompt_key(prompt_token: Any, prompt_feat: Any, embedding: Any, n_timesteps: int) -> str:
    """The digest a voice state is kept under: the prompt's token ids, mel and embedding values (torch tensors or
    numpy arrays, whatever their dtype or device: the same values give the same key) and the Euler steps."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"steps={n_timesteps};".encode())
    for t, dtype in ((prompt_token, "int64"), (prompt_feat, "float32"), (embedding, "float32")):
        a = _host(t, dtype)
        h.update(repr(tuple(a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _host(t: Any, dtype: str) -> Any:
    # a contiguous numpy array of `dtype` in host memory (the lite runtime's arrays are numpy: no torch there)
    import numpy as np

    if hasattr(t, "detach"):  # a torch tensor: torch is imported where one was made
        import torch

        t = t.detach().to(device="cpu", dtype=getattr(torch, dtype)).contiguous().numpy()
    return np.ascontiguousarray(t, dtype=dtype)


def bytes_per_second(flow: Any, n_timesteps: int | None = None) -> int:
    """Bytes a voice state holds per second of sample for ``flow`` (a
    :class:`~cosyserve.models.causal_flow.ChunkFlow`, or the lite runtime's
    :class:`~cosyserve.runtime.lite.chunkflow.LiteChunkFlow`): its attention layers' keys and values for both CFG
    rows at every Euler step, 50 mel frames a second (conv tails and mel are a few KB more per state)."""
    frame_bytes = getattr(
        flow, "state_frame_bytes", None
    )  # the lite flow's: its estimator graph's state shapes
    if frame_bytes is not None:
        return int(frame_bytes(n_timesteps) * flow.frame_rate)
    import torch

    steps = flow.N_TIMESTEPS if n_timesteps is None else n_timesteps
    per_frame = 0
    for module in flow.decoder.estimator.modules():
        k = getattr(module, "to_k", None)
        if isinstance(k, torch.nn.Linear):
            per_frame += 2 * k.out_features * k.weight.element_size()  # keys and values
    per_frame *= 2 * steps  # CFG rows, Euler steps
    encoder = getattr(flow, "encoder", None)
    if encoder is not None:  # CosyVoice2: the encoder's layers, once (half of them at the token rate)
        width = encoder.cfg.output_size * next(encoder.parameters()).element_size()
        per_frame += 2 * width * (len(encoder.encoders) / flow.token_mel_ratio + len(encoder.up_encoders))
    return int(per_frame * flow.cfg.input_frame_rate * flow.token_mel_ratio)  # mel frames a second


@dataclass
class _Entry:
    state: Any  # FlowStream
    nbytes: int
    registered: bool


class VoiceStates:
    """The voice states of one loaded model (see the module docstring); thread-safe.

    Args:
        max_bytes: the most bytes kept in memory; a state larger than that is computed for its request only.
        folder: where registered voices' states are stored (called at each use: the registry may move), or None.
        model_tag: names the loaded model's weights and precision in stored file names.
        stream_max_bytes: the most a request's own flow state may hold (its stated bound): past it, the request
            continues on the cumulative path (every call re-runs the flow on all its tokens, as the reference
            does), whose memory does not grow with what it kept; None: no bound.
        streams_max_bytes: the most every streamed request's own flow state may hold together (the model's
            bound): a stream whose state would take the sum past it continues on the cumulative path; None: no
            bound.
    """

    def __init__(
        self,
        max_bytes: int,
        folder: Callable[[], Path | None] | None = None,
        model_tag: str = "",
        stream_max_bytes: int | None = None,
        streams_max_bytes: int | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self.stream_max_bytes = stream_max_bytes
        self.streams_max_bytes = streams_max_bytes
        self.stream_bytes = 0  # what the streams' own states hold now
        self.stream_peak = 0
        self.stream_drops = 0  # streams that went on without their state
        self._folder = folder
        self.model_tag = model_tag
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._pending: dict[str, Future[Any]] = {}  # registrations being computed
        self._worker: ThreadPoolExecutor | None = None
        self.nbytes = 0

    @classmethod
    def for_model(cls, options: Any, tag: str, registry: Callable[[], Any]) -> VoiceStates:
        """A loaded model's states under ``options``' bounds (a :class:`~cosyserve.runtime.RuntimeOptions`:
        ``voice_cache_mb``, ``stream_state_mb``, the streams' budget) and, with ``voice_cache_disk``, stored in the
        folder of the registry ``registry()`` gives at each use (it may move). ``tag`` names what a state depends on
        besides its prompt (the weights' key, the flow's dtype and device kind, the Euler steps; the lite flow's
        graphs): a stored state of another tag is recomputed."""

        def folder() -> Path | None:
            r = registry()
            return Path(r.root) if r is not None else None

        return cls(
            options.voice_cache_mb << 20,
            folder if options.voice_cache_disk else None,
            hashlib.blake2b(tag.encode(), digest_size=8).hexdigest(),
            (options.stream_state_mb << 20) or None,
            options.stream_state_budget(),
        )

    def __len__(self) -> int:
        return len(self._entries)

    def stream(
        self,
        flow: Any,
        prompt_token: Any,
        prompt_feat: Any,
        embedding: Any,
        n_timesteps: int | None = None,
        should_stop: Any = None,
    ) -> Any:
        """A request's flow stream, forked from its prompt's state (computed now if no one holds it)."""
        steps = flow.N_TIMESTEPS if n_timesteps is None else n_timesteps
        key = prompt_key(prompt_token, prompt_feat, embedding, steps)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return entry.state.fork()
            pending = self._pending.get(key)
        while pending is not None:  # its registration is computing it: ahead of this request, so waited for
            check(should_stop)
            try:
                return pending.result(timeout=0.2).fork()
            except TimeoutError:
                continue
            except Exception:  # noqa: BLE001 - logged by the registration's worker; this request computes it
                break
        state, registered = self._stored(key, flow, steps), True
        if state is None:
            registered = self._stale(key)  # stored for another model: a registered voice, recomputed
            state = flow.prefill(flow.new_stream(steps), prompt_token, prompt_feat, embedding, should_stop)
            if registered:
                self._store(key, state)
        self._put(key, state, registered)
        return state.fork()

    def prompt_prefix(self, key: str) -> Any:
        """The LM's kept :class:`~cosyserve.runtime.lm.PromptPrefix` under ``key`` (a
        :class:`~cosyserve.runtime.lm.Prefix`'s), or None."""
        with self._lock:
            entry = self._entries.get(_LM + key)
            if entry is None:
                return None
            self._entries.move_to_end(_LM + key)
            return entry.state

    def keep_prompt_prefix(self, key: str, prefix: Any) -> None:
        """Keep the LM's ``prefix`` (a :class:`~cosyserve.runtime.lm.PromptPrefix`) under ``key``, in memory only
        (a few hundred KB per voice at full size), as an unregistered prompt's state; not kept (and not said, as a
        flow state's is) when the cache is off or smaller."""
        if prefix.nbytes() <= self.max_bytes:
            self._put(_LM + key, prefix, registered=False)

    def hold(self, stream: Any, nbytes: int) -> str | None:
        """Account ``nbytes`` as what ``stream`` (a request's stream state: its charge is its ``charged``) holds
        now.

        Returns:
            None when it may keep them; else the setting whose bound it would pass (``stream_state_mb``: its own,
            ``stream_state_budget_mb``: every stream's together), its charge released: it drops its state.
        """
        with self._lock:
            total = self.stream_bytes - stream.charged + nbytes
            over = None
            if self.stream_max_bytes is not None and nbytes > self.stream_max_bytes:
                over = "stream_state_mb"
            elif self.streams_max_bytes is not None and total > self.streams_max_bytes:
                over = "stream_state_budget_mb"
            self.stream_bytes -= stream.charged
            stream.charged = 0 if over else nbytes
            self.stream_bytes += stream.charged
            self.stream_peak = max(self.stream_peak, self.stream_bytes)
            self.stream_drops += over is not None
        return over

    def release(self, stream: Any) -> None:
        """``stream`` holds nothing any more (it ended, or dropped its state)."""
        with self._lock:
            self.stream_bytes -= stream.charged
            stream.charged = 0

    def keep(
        self, flow: Any, prompt_token: Any, prompt_feat: Any, embedding: Any, n_timesteps: int | None
    ) -> Future[Any]:
        """Compute a registered voice's state (stored in the folder too when there is one) in this object's one
        worker thread, registrations in turn: a registration returns at once (a 12 s CosyVoice2 voice is ~20 s of
        flow on 2 CPU cores), and a request with the voice meanwhile waits for it. Returns the future state."""
        steps = flow.N_TIMESTEPS if n_timesteps is None else n_timesteps
        key = prompt_key(prompt_token, prompt_feat, embedding, steps)

        def compute() -> Any:
            try:
                state = flow.prefill(flow.new_stream(steps), prompt_token, prompt_feat, embedding)
                self._put(key, state, registered=True)
                self._store(key, state)
                return state
            except Exception:
                logger.warning("a registered voice's flow state could not be computed", exc_info=True)
                raise
            finally:
                with self._lock:
                    self._pending.pop(key, None)

        with self._lock:
            if self._worker is None:
                # not daemon threads: a process that exits waits for the computation (torch torn down under a
                # running kernel aborts)
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="cosyserve-voice-state")
            future = self._pending[key] = self._worker.submit(compute)
        return future

    def wait(self) -> None:
        """Wait for the voice states being computed (registrations)."""
        with self._lock:
            pending = list(self._pending.values())
        for future in pending:
            future.exception()

    def close(self) -> None:
        """Drop every state; the worker finishes what it computes and stops."""
        with self._lock:
            worker, self._worker = self._worker, None
            self._entries.clear()
            self.nbytes = 0
        if worker is not None:
            worker.shutdown(wait=False, cancel_futures=True)

    def _put(self, key: str, state: Any, registered: bool) -> None:
        n = int(state.nbytes())
        if n > self.max_bytes:
            logger.info(
                "a voice state of %.0f MB exceeds the voice cache's %.0f MB: computed for each request",
                n / 2**20,
                self.max_bytes / 2**20,
            )
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= old.nbytes
                registered = registered or old.registered
            while self._entries and self.nbytes + n > self.max_bytes:
                # the least recently used unregistered prompt first, then registered voices
                victim = next((k for k, e in self._entries.items() if not e.registered), None)
                victim = victim if victim is not None else next(iter(self._entries))
                self.nbytes -= self._entries.pop(victim).nbytes
            self._entries[key] = _Entry(state, n, registered)
            self.nbytes += n

    # -- the folder ---------------------------------------------------------------------------------------------

    def _dir(self) -> Path | None:
        folder = self._folder() if self._folder is not None else None
        return None if folder is None else Path(folder) / FOLDER

    def _path(self, folder: Path, key: str) -> Path:
        return folder / f"{key}.{self.model_tag}.safetensors"

    def _stored(self, key: str, flow: Any, steps: int) -> Any:
        folder = self._dir()
        if folder is None:
            return None
        path = self._path(folder, key)
        if not path.is_file():
            return None
        try:
            return _read(path, flow, steps)
        except Exception as e:  # noqa: BLE001 - a bad file is recomputed, not fatal
            logger.warning("unreadable voice state %s (recomputed): %s", path, e)
            return None

    def _stale(self, key: str) -> bool:
        # the files of this prompt under another model tag: removed (the caller writes the current one)
        folder = self._dir()
        if folder is None or not folder.is_dir():
            return False
        stale = [p for p in folder.glob(f"{key}.*.safetensors") if p != self._path(folder, key)]
        for p in stale:
            p.unlink(missing_ok=True)
        return bool(stale)

    def _store(self, key: str, state: Any) -> None:
        folder = self._dir()
        if folder is None:
            return
        folder.mkdir(parents=True, exist_ok=True)
        self._stale(key)
        try:
            _write(self._path(folder, key), state)
        except OSError as e:
            logger.warning("could not store the voice state in %s: %s", folder, e)


def _write(path: Path, state: Any) -> None:
    # the state's arrays (its to_arrays: torch tensors, or the lite flow's numpy arrays) as one safetensors file
    from cosyserve.system.atomicfile import atomic_replace

    arrays, meta = state.to_arrays()
    meta = {"format": FORMAT, "version": VERSION, **meta}
    if meta.get("arrays") == "numpy":
        import numpy as np
        from safetensors.numpy import save_file

        arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    else:
        from safetensors.torch import save_file

        arrays = {k: v.cpu() for k, v in arrays.items()}
    atomic_replace(path, lambda tmp: save_file(arrays, str(tmp), meta))


def _read(path: Path, flow: Any, steps: int) -> Any:
    # a stored state, mapped (zero copy) as the flow's arrays: numpy for the lite flow (no torch), else torch's
    from cosyserve.bundle.safetensors_np import map_safetensors, safetensors_metadata

    fix = "it is computed again"
    meta = safetensors_metadata(path, fix)
    if (
        meta.get("format") != FORMAT
        or meta.get("version") != VERSION
        or meta.get("n_timesteps") != str(steps)
    ):
        raise ValueError(f"not a version {VERSION} flow state of {steps} steps")
    if meta.get("arrays") == "numpy":
        arrays: dict[str, Any] = map_safetensors(path, fix)
    else:
        from cosyserve.bundle.mmap_safetensors import MappedFile

        arrays = MappedFile(path).state_dict()
    return flow.stream_from_arrays(arrays, meta)


def disk_bytes(folder: Path) -> int:
    """Bytes the stored voice states under a registry ``folder`` take."""
    d = Path(folder) / FOLDER
    return sum(p.stat().st_size for p in d.glob("*.safetensors")) if d.is_dir() else 0
