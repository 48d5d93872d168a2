"""Speech tokens -> audio, one-shot or streaming, with the reference's chunking, overlap and fade rules.

Streaming works on windows of tokens: while at least ``hop + overlap`` tokens are buffered, the first
``hop + overlap`` go through the flow, the mel's first frames are cross-faded with the tail the previous call
kept, the vocoder runs with the previous call's last mel frames and source samples prepended, its first samples
are cross-faded with the previous speech tail, and the window slides by ``hop``. Whatever is left at the end
goes through one finalizing call. All per-request state lives in a :class:`_StreamState` owned by the generator.

It computes on the arrays of its flow's :class:`~cosyserve.core.sampling.ArrayOps`: torch tensors (the torch
modules, on their device) or numpy arrays (the lite runtime's graphs, :mod:`cosyserve.runtime.lite.models`, whose
flow has its own ``ops``); importing it imports no torch.

The hops are the :class:`StreamPolicy`'s: ``reference`` (the reference's rule: a constant 2 s hop, so the first
audio needs 120 tokens) or ``low-latency`` (a short first hop that doubles per chunk up to the reference's
longest); the overlap, the fades and the caches are the same for both.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from cosyserve.core.sampling import ArrayOps
from cosyserve.core.stop import ShouldStop
from cosyserve.families.base import CachedVocoder, WindowedFlow
from cosyserve.families.cosyvoice.streampolicy import StreamPolicy
from cosyserve.system.device import module_device

if TYPE_CHECKING:  # torch is imported where a torch flow runs: the lite runtime's process has none
    import torch

__all__ = ["CallDraws", "StreamPolicy", "Token2Wav", "crossfade", "fade_in_out", "hamming", "stretch"]


@dataclass
class CallDraws:
    """Random draws for one token2wav call, injected (fixtures, reproducible audio) instead of drawn: arrays of the
    token2wav's namespace in the torch modules' shapes (flow_noise (1, 80, F + M), sine_phase (1, H, 1),
    sine_noise (1, H, L))."""

    flow_noise: Any = None
    sine_phase: Any = None
    sine_noise: Any = None


@dataclass
class _StreamState:
    flow_cache: Any  # (1, 80, C, 2) what the next window's flow call continues
    mel_overlap: Any = None  # last mel frames of the previous call, faded into the next
    cache_mel: Any = None  # vocoder context: last mel frames ...
    cache_source: Any = None  # ... their source excitation ...
    cache_speech: Any = None  # ... and their audio, cross-faded into the next chunk


@lru_cache(maxsize=8)
def hamming(n: int) -> torch.Tensor:
    """The reference's cross-fade window (``np.hamming``, float64), ``n`` samples or frames, as a tensor."""
    import torch

    return torch.from_numpy(np.hamming(n))  # float64, as the reference multiplies


def fade_in_out(fade_in: torch.Tensor, fade_out: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """The reference's ``fade_in_out``: the first half of ``window`` fades ``fade_in``'s start in over the second
    half fading ``fade_out``'s end out (CosyVoice2's token2wav uses it too)."""
    # The reference multiplies float32 audio by a float64 numpy window: products and sum in float64, stored
    # back into the float32 tensor.
    n = window.shape[0] // 2
    window = window.to(fade_in.device)
    out = fade_in.clone()
    mixed = fade_in[..., :n].double() * window[:n] + fade_out[..., -n:].double() * window[n:]
    out[..., :n] = mixed.to(out.dtype)
    return out


def crossfade(fade_in: Any, fade_out: Any, n: int) -> Any:
    """:func:`fade_in_out` over a Hamming window of ``n``, on tensors or the lite runtime's numpy arrays."""
    if isinstance(fade_in, np.ndarray):
        from cosyserve.models import lite_dsp

        return lite_dsp.fade_in_out(fade_in, fade_out, lite_dsp.hamming(n))
    return fade_in_out(fade_in, fade_out, hamming(n))


def stretch(mel: Any, size: int) -> Any:
    """``mel`` (1, 80, T) linearly resampled to ``size`` frames (a speed change): a tensor, or a numpy array."""
    if isinstance(mel, np.ndarray):
        from cosyserve.models.lite_dsp import interp_linear

        return interp_linear(mel[0], size)[None]
    import torch.nn.functional as F

    return F.interpolate(mel, size=size, mode="linear")


class Token2Wav:
    """Turns speech tokens into audio with a flow model and a HiFT vocoder.

    Args:
        flow: a :class:`cosyserve.models.flow.MaskedDiffWithXvec` (or its stacked stand-in), or the lite
            runtime's :class:`~cosyserve.runtime.lite.models.LiteFlow`; its ``ops`` when it computes on numpy,
            else torch's are used.
        hift: a :class:`cosyserve.models.hift.HiFTGenerator` (or its stacked stand-in), or the lite runtime's
            :class:`~cosyserve.runtime.lite.models.LiteVocoder`.
        policy: the streaming rules; defaults follow the reference.
        flow_steps: the flow's Euler steps (None: the model's own count).
    """

    def __init__(
        self,
        flow: WindowedFlow,
        hift: CachedVocoder,
        policy: StreamPolicy | None = None,
        flow_steps: int | None = None,
    ) -> None:
        self.flow = flow
        self.hift = hift
        self.policy = policy or StreamPolicy(input_frame_rate=int(flow.input_frame_rate))
        self.flow_steps = flow_steps
        # the arrays the pipeline gives it and gets from it: torch's on the modules' device, or the lite flow's
        # (numpy's)
        ops = getattr(flow, "ops", None)
        if ops is None:
            import torch

            ops = ArrayOps(torch, module_device(flow))
        self.ops: ArrayOps = ops
        self.device = ops.device  # None: host memory (numpy)

    def _call(
        self,
        tokens: list[int],
        state: _StreamState,
        prompt_token: Any,
        prompt_feat: Any,
        embedding: Any,
        finalize: bool,
        speed: float,
        draws: CallDraws,
        generator: Any,
        should_stop: ShouldStop | None,
    ) -> Any:
        p, ops = self.policy, self.ops
        token = ops.ints([tokens])  # (1, T)
        mel, state.flow_cache = self.flow.inference(
            token,
            ops.asarray([token.shape[1]], "int32"),
            prompt_token,
            ops.asarray([prompt_token.shape[1]], "int32"),
            prompt_feat,
            ops.asarray([prompt_feat.shape[1]], "int32"),
            embedding,
            state.flow_cache,
            noise=draws.flow_noise,
            generator=generator,
            n_timesteps=self.flow_steps,
            should_stop=should_stop,
        )
        if state.mel_overlap is not None:
            mel = crossfade(mel, state.mel_overlap, 2 * p.mel_overlap_len)
        if not finalize:
            state.mel_overlap = mel[:, :, -p.mel_overlap_len :]
            mel = mel[:, :, : -p.mel_overlap_len]
        if speed != 1.0:
            # the reference stretches the one-shot mel before the vocoder; a long piece's windows (see
            # StreamPolicy.windows) each stretch their new frames. At least one frame: a very short piece at a high
            # speed would otherwise stretch to nothing
            mel = stretch(mel, max(1, int(mel.shape[2] / speed)))
        if state.cache_mel is not None:
            mel = ops.cat([state.cache_mel, mel], dim=2)
            cache_source = state.cache_source
        else:
            cache_source = ops.zeros((1, 1, 0), "float32")
        speech, source = self.hift.inference(
            mel,
            cache_source,
            generator=generator,
            sine_phase=draws.sine_phase,
            sine_noise=draws.sine_noise,
            should_stop=should_stop,
        )
        if state.cache_speech is not None:
            speech = crossfade(speech, state.cache_speech, 2 * p.source_cache_len)
        if not finalize:
            state.cache_mel = mel[:, :, -p.mel_cache_len :]
            state.cache_source = source[:, :, -p.source_cache_len :]
            state.cache_speech = speech[:, -p.source_cache_len :]
            speech = speech[:, : -p.source_cache_len]
        return speech

    def __call__(
        self,
        tokens: Iterable[int],
        *,
        embedding: Any,
        prompt_token: Any = None,
        prompt_feat: Any = None,
        stream: bool = False,
        speed: float = 1.0,
        generator: Any = None,
        draws: Iterator[CallDraws] | None = None,
        should_stop: ShouldStop | None = None,
    ) -> Iterator[Any]:
        """Yield audio chunks ``[1, samples]`` (float32) for a stream of speech token ids: the Token2Wav
        protocol's call.

        Each window's flow and vocoder call runs without autograd, in the array ops' ``no_grad`` (torch's
        inference mode; nothing for numpy), entered per call and left before the chunk is yielded (as
        :class:`~cosyserve.families.cosyvoice2.token2wav.Token2Wav2` does).

        Args:
            tokens: speech token ids; may be a generator (the LLM's), consumed as it produces.
            embedding: flow speaker embedding ``[1, 192]``.
            prompt_token: ``[1, P]`` prompt speech tokens (zero-shot), default none.
            prompt_feat: ``[1, F, 80]`` prompt mel, default none.
            stream: chunk as tokens arrive (True) or synthesize once at the end (False).
            speed: tempo factor, one-shot mode only (the reference's rule).
            generator: source of random draws not injected through ``draws`` (torch's, or numpy's for numpy
                arrays).
            draws: per-call injected draws, in call order.
            should_stop: asked between the flow's Euler steps and the vocoder's stages of every call
                (:class:`cosyserve.core.stop.Stopped` once it says True).
        """
        if speed <= 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        if stream and speed != 1.0:
            raise ValueError("speed change is only supported in one-shot (non-streaming) synthesis")
        p, ops = self.policy, self.ops
        prompt_token = ops.zeros((1, 0), "int32") if prompt_token is None else prompt_token
        prompt_feat = ops.zeros((1, 0, 80), "float32") if prompt_feat is None else prompt_feat
        state = _StreamState(ops.zeros((1, 80, 0, 2), "float32"))
        draws = draws if draws is not None else iter(())

        def run(window: list[int], finalize: bool, speed: float = 1.0) -> Any:
            return self._call(
                window,
                state,
                prompt_token,
                prompt_feat,
                embedding,
                finalize,
                speed,
                next(draws, CallDraws()),
                generator,
                should_stop,
            )

        for window, final in p.windows(tokens, stream):
            with ops.no_grad():
                speech = run(window, final, speed)
            yield speech
