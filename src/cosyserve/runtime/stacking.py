"""Stacked flow and vocoder calls: concurrent requests' same-shape calls run as one batch.

:class:`FlowBatcher` has the same ``inference(...)`` as :class:`~cosyserve.models.flow.MaskedDiffWithXvec`:
a call draws its noise from its own generator first (the draw the flow would make, so random streams are
unchanged), then waits up to ``gather_s`` for calls of other requests with the same shapes (token count,
prompt tokens and frames, cache frames, timesteps, dtypes: fixed-size streaming windows, equal-length pieces).
The first caller of a group runs the stacked batch in its own thread and every caller takes its row. A call
that finds no partner runs alone, exactly as unbatched; a batched row equals its unbatched call up to float
rounding (the decoder's matrix products over 2B rows instead of 2; tests/test_batching.py states the bound).
:class:`VocoderBatcher` does the same for HiFT calls (same mel frames and cached source length), each call
drawing its sine phase and noise from its own generator before it waits, and for the calls of CosyVoice3's causal
vocoder streams (``stream``: same kept and new mel frames, excitation and output place counted from each stream's
first kept frame, :meth:`~cosyserve.models.causal_hift.CausalHiFTGenerator.stream_shape`; each row keeps its
stream's mel, phase and place in the fixed noise). A stream's call waits for partners only while another live
stream runs (streams are known from ``new_stream`` until their finalizing call): a lone stream never waits, and
when every live stream waits in some group (of any stacker of the model: :class:`Gathering`), all the groups run at
once. The stacked run borrows the
waiting callers' torch threads. On CPU this saves little: the flow's and HiFT's products are already wide
(hundreds of frames), so a stack of full-size calls costs about what the single calls do, while the requests
lose the overlap of one's LM steps with another's flow. It is meant for accelerators, where
per-call overheads dominate, and is off by default (``RuntimeOptions(batch_flow=...)``). A family names the parts
it stacks (``Family.stacks``): CosyVoice-300M's flow and vocoder; CosyVoice2's vocoder (its streamed calls carry
their cached mel and source in their arguments, and reach equal shapes once the hops reach their longest) and
CosyVoice3's (its streams' calls reach equal shapes from the first hop after the prompt's); and both families'
streamed chunk flow (:class:`ChunkFlowBatcher`: chunks that compute as many frames, each stream's rows at its own
offset against its own kept attention state, bounded (``flow_context_seconds``) or not, a bounded stream's last
call too; their one-shot calls and an unbounded stream's last call, full attention over every frame, run alone).

The LM's continuous batching is :mod:`cosyserve.runtime.decode`'s loop.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cosyserve.core.stop import ShouldStop, Stopped
from cosyserve.system.cpus import usable_cpus

__all__ = ["ChunkFlowBatcher", "FlowBatcher", "Gathering", "StackStats", "VocoderBatcher"]


@dataclass
class StackStats:
    """Counters of a :class:`FlowBatcher` or :class:`VocoderBatcher` (read them for benchmarks and metrics)."""

    calls: int = 0  # inference calls
    batches: int = 0  # stacked runs of more than one call
    batched_calls: int = 0  # calls that ran in such a run
    peak: int = 0  # largest run
    timed_out: int = 0  # groups whose gather ran out (a partner still awaited)

    @property
    def runs(self) -> int:
        return self.calls - self.batched_calls + self.batches

    @property
    def mean_batch(self) -> float:
        return self.calls / self.runs if self.runs else 0.0


def _shape_key(call: tuple[Tensor, ...]) -> tuple[Any, ...] | None:
    # a call already batched, or with one row shorter than its tensor (padding), runs alone
    return None if call[0].shape[0] != 1 else tuple((tuple(x.shape), x.dtype, x.device) for x in call)


class Gathering:
    """What the stackers of one model share: their lock, and the threads waiting in a group of any of them. A
    stream's call waits for partners only while another live stream's thread runs, in none of their groups: a
    flow chunk does not wait for a stream whose thread waits in the vocoder's stacker, nor the reverse (each
    would wait out its gather). A stream's calls come from its request's thread (the one that consumes its audio).
    """

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.parked: set[int] = set()  # idents of the threads waiting in a group


class _Group:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.stops: list[ShouldStop | None] = []  # each call's stop signal
        self.closed = False  # no more joiners
        self.done = threading.Event()
        self.results: list[Any] = []
        self.threads: list[int] = []  # the threads of the stream calls waiting here
        self.error: BaseException | None = None


class _Stacker:
    """Groups concurrent calls by a shape key; the first call of a group runs them stacked (``_run``)."""

    NAME = "stacker"  # for logs and errors, unless a name is given

    def __init__(
        self,
        module: Any,
        max_batch_size: int,
        *,
        gather_s: float = 0.005,
        name: str | None = None,
        gathering: Gathering | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if gather_s < 0:
            raise ValueError(f"gather_s must be >= 0, got {gather_s}")
        self.module = module
        self.max_batch_size = max_batch_size
        self.gather_s = gather_s
        self.name = self.NAME if name is None else name
        self.stats = StackStats()
        self.lend_threads = True
        self.gathering = Gathering() if gathering is None else gathering
        self._cv = self.gathering.cv
        self._open: dict[tuple[Any, ...], _Group] = {}
        # streams (stateful calls: VocoderBatcher.new_stream, ChunkFlowBatcher's) until their last call, and the
        # thread of each one's latest call: a stream call's group closes early once no other live stream's thread
        # runs (each waits in a group here or in another stacker of the gathering), so none could still join it
        self._streams: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._threads: dict[int, int] = {}

    def __getattr__(self, name: str) -> Any:
        if name == "module":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.module, name)

    def _run(self, calls: list[tuple[Any, ...]], should_stop: ShouldStop | None, *extra: Any) -> list[Any]:
        raise NotImplementedError

    def _submit(
        self,
        call: tuple[Any, ...],
        *extra: Any,
        key: tuple[Any, ...] | None,
        should_stop: ShouldStop | None = None,
        stream: Any = None,
    ) -> Any:
        # calls with equal keys (and extras) stack; a key of None runs alone. A call of a stream (``stream``, its
        # state) waits for partners only while another live stream is running (not waiting in a group itself)
        if key is None or self.max_batch_size == 1:
            with self._cv:
                self.stats.calls += 1
            return self._run([call], should_stop, *extra)[0]
        key = (*extra, *key)
        with self._cv:
            self.stats.calls += 1
            group = self._open.get(key)
            leader = group is None
            if group is None:
                group = self._open[key] = _Group()
            index = len(group.calls)
            group.calls.append(call)
            group.stops.append(should_stop)
            if stream is not None:
                thread = threading.get_ident()
                self._threads[id(stream)] = thread
                group.threads.append(thread)
                self.gathering.parked.add(thread)
                self._cv.notify_all()  # a leader (here or in another stacker) may wait for this stream only
            if len(group.calls) >= self.max_batch_size:
                self._close_locked(key, group)
            if leader:
                end = time.monotonic() + self.gather_s
                while not group.closed:
                    left = end - time.monotonic()
                    if left <= 0:
                        self.stats.timed_out += 1
                        self._close_locked(key, group)
                        break
                    if stream is not None and self._all_parked():
                        # every live stream waits in a group: none can join another, so all of them run now
                        for k, g in list(self._open.items()):
                            if g.threads:
                                self._close_locked(k, g)
                        break
                    self._cv.wait(left)
                n = len(group.calls)
                if n > 1:
                    self.stats.batches += 1
                    self.stats.batched_calls += n
                self.stats.peak = max(self.stats.peak, n)
        if leader:
            try:
                group.results = self._run_group(group.calls, group.stops, extra)
            except BaseException as e:  # noqa: BLE001 - handed to every caller of the group
                group.error = e
            finally:
                group.done.set()
        else:
            group.done.wait()
        if group.error is not None:
            if len(group.calls) == 1 or isinstance(
                group.error, Stopped
            ):  # Stopped: every caller asked for it
                raise group.error
            raise RuntimeError(f"batched {self.name} failed: {group.error!r}") from group.error
        return group.results[index]

    def _run_group(
        self, calls: list[tuple[Any, ...]], stops: list[ShouldStop | None], extra: tuple[Any, ...]
    ) -> list[Any]:
        # The callers' threads wait idle while this one runs them all: lend their torch threads (per-thread
        # setting) to the stacked run, or a CPU with one torch thread per worker runs the batch on one core.
        threads = torch.get_num_threads()
        lend = min(threads * len(calls), usable_cpus()) if len(calls) > 1 and self.lend_threads else threads
        if lend > threads:
            torch.set_num_threads(lend)

        # a stacked run stops when every request in it has stopped (the others still want their rows)
        def all_stopped() -> bool:
            return all(s is not None and s() for s in stops)

        try:
            return self._run(calls, stops[0] if len(stops) == 1 else all_stopped, *extra)
        finally:
            if lend > threads:
                torch.set_num_threads(threads)

    def track(self, stream: Any) -> None:
        """Make ``stream`` live here until its finalizing call (or until it is dropped: a weak reference): a stream
        call waits for partners only while another live stream runs. A stream's calls track it; a caller that
        knows its streams earlier may track them at once."""
        with self._cv:
            if id(stream) not in self._streams:
                self._threads.pop(id(stream), None)  # an earlier stream's, at the same address
            self._streams[id(stream)] = stream

    def _forget(self, stream: Any) -> None:
        # a stream's last call is done: no group waits for it any more
        with self._cv:
            self._streams.pop(id(stream), None)
            self._threads.pop(id(stream), None)
            self._cv.notify_all()

    def _all_parked(self) -> bool:
        # every live stream's thread waits in a group (a stream not called yet runs: it may still come)
        parked = self.gathering.parked
        return all(self._threads.get(s) in parked for s in self._streams.keys())

    def _close_locked(self, key: tuple[Any, ...], group: _Group) -> None:
        group.closed = True
        self.gathering.parked.difference_update(group.threads)
        if self._open.get(key) is group:
            del self._open[key]
        self._cv.notify_all()


def _rows(outputs: tuple[Tensor, Tensor], n: int) -> list[tuple[Tensor, Tensor]]:
    a, b = outputs
    return [(a[i : i + 1].clone(), b[i : i + 1].clone()) for i in range(n)]


class FlowBatcher(_Stacker):
    """A :class:`~cosyserve.models.flow.MaskedDiffWithXvec` whose concurrent same-shape calls run stacked.

    Other attributes are the flow's (``input_frame_rate``, ...), so
    :class:`~cosyserve.families.cosyvoice.token2wav.Token2Wav` uses it unchanged. Calls stack when their token count, prompt tokens and frames, cache frames, timesteps
    and dtypes match (and every length tensor equals its tensor's width: no padding).

    Args:
        flow: the model; its ``inference`` takes equal-length batches.
        max_batch_size: most calls run together (a full group runs at once, without waiting).
        gather_s: how long the first call of a group waits for partners.
        name: for logs and errors.
        gathering: shared with the model's other stackers (:class:`Gathering`); None: its own.
    """

    NAME = "flow"

    @property
    def flow(self) -> Any:
        return self.module

    @torch.inference_mode()
    def inference(
        self,
        token: Tensor,
        token_len: Tensor,
        prompt_token: Tensor,
        prompt_token_len: Tensor,
        prompt_feat: Tensor,
        prompt_feat_len: Tensor,
        embedding: Tensor,
        flow_cache: Tensor,
        *,
        noise: Tensor | None = None,
        generator: torch.Generator | None = None,
        n_timesteps: int | None = None,
        should_stop: ShouldStop | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Same arguments and result as the flow's ``inference``; may run stacked with other threads' calls
        (a stacked run stops once every request in it asks to stop)."""
        if noise is None:
            if generator is None:
                raise ValueError("flow inference needs either `noise` or a `generator` to draw it from")
            noise = self.module.draw_noise(token.shape[1], prompt_feat.shape[1], generator, token.device)
        call = (token, token_len, prompt_token, prompt_token_len, prompt_feat, prompt_feat_len, embedding)
        call += (flow_cache, noise)
        padded = token.shape[0] == 1 and (
            int(token_len[0]) != token.shape[1] or int(prompt_token_len[0]) != prompt_token.shape[1]
        )
        if padded:
            return self.module.inference(  # type: ignore[no-any-return]
                *call[:-1], noise=noise, n_timesteps=n_timesteps, should_stop=should_stop
            )
        return self._submit(call, n_timesteps, key=_shape_key(call), should_stop=should_stop)  # type: ignore[no-any-return]

    def _run(self, calls: list[tuple[Any, ...]], should_stop: ShouldStop | None, *extra: Any) -> list[Any]:
        (n_timesteps,) = extra
        if len(calls) == 1:
            *args, noise = calls[0]
            return [
                self.module.inference(*args, noise=noise, n_timesteps=n_timesteps, should_stop=should_stop)
            ]
        *args, noise = (torch.cat(xs) for xs in zip(*calls, strict=True))
        # (B, n_mels, M), (B, ...)
        out = self.module.inference(*args, noise=noise, n_timesteps=n_timesteps, should_stop=should_stop)
        return _rows(out, len(calls))


class VocoderBatcher(_Stacker):
    """A :class:`~cosyserve.models.hift.HiFTGenerator` whose concurrent same-shape calls run stacked.

    Calls stack when their mel frames and cached source samples match (same-index streaming chunks,
    equal-length pieces). Each call draws its sine phase and noise from its own generator before it waits,
    as the unbatched call would, and keeps its own ``cache_source`` row.

    Args: as :class:`FlowBatcher`'s, with the vocoder as the model.
    """

    NAME = "vocoder"

    @torch.inference_mode()
    def inference(
        self,
        speech_feat: Tensor,
        cache_source: Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
        sine_phase: Tensor | None = None,
        sine_noise: Tensor | None = None,
        should_stop: ShouldStop | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Same arguments and result as the vocoder's ``inference``; may run stacked with other threads' calls
        (a stacked run stops once every request in it asks to stop)."""
        samples = speech_feat.shape[-1] * self.module.cfg.upsample_factor
        sine_phase, sine_noise = self.module.draw_source_noise(
            speech_feat.shape[0], samples, generator, sine_phase, sine_noise
        )
        if cache_source is None:
            cache_source = speech_feat.new_zeros(speech_feat.shape[0], 1, 0)
        call = (speech_feat, cache_source, sine_phase, sine_noise)
        return self._submit(call, key=_shape_key(call), should_stop=should_stop)  # type: ignore[no-any-return]

    @torch.inference_mode()
    def stream(
        self,
        state: Any,
        mel: Tensor,
        finalize: bool,
        *,
        rand_ini: Tensor,
        sine_waves: Tensor,
        should_stop: ShouldStop | None = None,
    ) -> Tensor:
        """Same arguments and result as a causal vocoder's ``stream`` (CosyVoice3's); runs stacked with other
        streams' calls of the same :meth:`~cosyserve.models.causal_hift.CausalHiFTGenerator.stream_shape` (each
        row keeps its stream's kept frames, phase and place in its noise)."""
        key = None
        if mel.shape[0] == 1:
            key = (*self.module.stream_shape(state, mel, finalize), mel.dtype, mel.device)
        call = (state, mel, rand_ini, sine_waves)
        try:
            return self._submit(  # type: ignore[no-any-return]
                call, "stream", finalize, key=key, should_stop=should_stop, stream=state
            )
        finally:
            if finalize:
                self._forget(state)

    def new_stream(self, whole: bool = False) -> Any:
        """The vocoder's fresh stream state (see its ``new_stream``), live here until its finalizing call: a
        stream call waits for partners only while another live stream runs (a lone stream never waits)."""
        state = self.module.new_stream(whole)
        self.track(state)
        return state

    def _run(self, calls: list[tuple[Any, ...]], should_stop: ShouldStop | None, *extra: Any) -> list[Any]:
        if extra:  # "stream", finalize
            states, mels, rand_ini, sine_waves = (list(xs) for xs in zip(*calls, strict=True))
            return self.module.stream_rows(  # type: ignore[no-any-return]
                states, mels, extra[1], rand_ini, sine_waves, should_stop
            )
        mel, cache_source, sine_phase, sine_noise = (torch.cat(xs) for xs in zip(*calls, strict=True))
        out = self.module.inference(
            mel, cache_source, sine_phase=sine_phase, sine_noise=sine_noise, should_stop=should_stop
        )
        return [out] if len(calls) == 1 else _rows(out, len(calls))


class ChunkFlowBatcher(_Stacker):
    """A :class:`~cosyserve.models.causal_flow.ChunkFlow` (CosyVoice2's, CosyVoice3's) whose concurrent streams'
    chunks run stacked.

    A stream's call that goes through its stream (``inference(..., stream=...)``: a streamed call that does not
    finalize, or any call of a bounded stream, :meth:`~cosyserve.models.causal_flow.ChunkFlow.takes_chunk`) is a
    :class:`~cosyserve.models.causal_flow.Chunk`; chunks of the same shape (frames computed, Euler steps) run as
    one batch (:meth:`~cosyserve.models.causal_flow.ChunkFlow.run_chunks`: one estimator call per Euler step over
    every stream's rows, each at its own offset against its own kept frames, bounded or not; CosyVoice2's encoder
    runs per stream before it). A stream is live here from its first chunk until its finalizing call (or until
    it is dropped; or from when a caller :meth:`track` s it: not from ``new_stream``, which also makes the
    registered voices' kept states): a chunk waits for partners only while another live stream runs, so a lone
    stream never waits.
    Other calls (one-shot, an unbounded stream's last call with full attention, a stream on the cumulative path)
    run alone, as unbatched.
    Other attributes are the flow's (``streams``, ``new_stream``, ``prefill``, ...).

    Args: as :class:`FlowBatcher`'s.
    """

    NAME = "flow"

    @torch.inference_mode()
    def inference(
        self,
        token: Tensor,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        streaming: bool,
        finalize: bool,
        *,
        n_timesteps: int | None = None,
        should_stop: ShouldStop | None = None,
        stream: Any = None,
    ) -> Tensor:
        """Same arguments and result as the flow's ``inference``; a stream's chunk may run stacked with other
        streams' (a stacked run stops once every request in it asks to stop)."""
        flow = self.module
        try:
            if not flow.takes_chunk(stream, streaming, finalize):
                return flow.inference(  # type: ignore[no-any-return]
                    token, prompt_token, prompt_feat, embedding, streaming, finalize,
                    n_timesteps=n_timesteps, should_stop=should_stop, stream=stream,
                )  # fmt: skip
            chunk = flow.chunk(
                token, prompt_token, prompt_feat, embedding, stream=stream, finalize=finalize,
                n_timesteps=n_timesteps,
            )  # fmt: skip
            self.track(stream)
            return self._submit(  # type: ignore[no-any-return]
                (chunk,), "chunk", key=chunk.shape, should_stop=should_stop, stream=stream
            )
        finally:
            if stream is not None and finalize:
                self._forget(stream)

    def _run(self, calls: list[tuple[Any, ...]], should_stop: ShouldStop | None, *extra: Any) -> list[Any]:
        return self.module.run_chunks([chunk for (chunk,) in calls], should_stop)  # type: ignore[no-any-return]
