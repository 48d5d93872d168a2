"""Speech tokens -> audio, one-shot or streaming, with the reference's chunking, overlap and fade rules.

Streaming works on windows of tokens: while at least ``hop + overlap`` tokens are buffered, the first
``hop + overlap`` go through the flow, the mel's first frames are cross-faded with the tail the previous call
kept, the vocoder runs with the previous call's last mel frames and source samples prepended, its first samples
are cross-faded with the previous speech tail, and the window slides by ``hop``. Whatever is left at the end
goes through one finalizing call. All per-request state lives in a :class:`_StreamState` owned by the generator.

The hops are the :class:`StreamPolicy`'s: ``reference`` (the reference's rule: a constant 2 s hop, so the first
audio needs 120 tokens) or ``low-latency`` (a short first hop that doubles per chunk up to the reference's
longest); the overlap, the fades and the caches are the same for both.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from cosyserve.core.sampling import ArrayOps
from cosyserve.core.stop import ShouldStop
from cosyserve.families.base import CachedVocoder, WindowedFlow
from cosyserve.families.cosyvoice.streampolicy import StreamPolicy
from cosyserve.system.device import module_device

__all__ = ["CallDraws", "StreamPolicy", "Token2Wav", "fade_in_out", "hamming"]


@dataclass
class CallDraws:
    """Random draws for one token2wav call, injected (fixtures, reproducible audio) instead of drawn."""

    flow_noise: torch.Tensor | None = None
    sine_phase: torch.Tensor | None = None
    sine_noise: torch.Tensor | None = None


@dataclass
class _StreamState:
    flow_cache: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 80, 0, 2))
    mel_overlap: torch.Tensor | None = None  # last mel frames of the previous call, faded into the next
    cache_mel: torch.Tensor | None = None  # vocoder context: last mel frames ...
    cache_source: torch.Tensor | None = None  # ... their source excitation ...
    cache_speech: torch.Tensor | None = None  # ... and their audio, cross-faded into the next chunk


@lru_cache(maxsize=8)
def hamming(n: int) -> torch.Tensor:
    """The reference's cross-fade window (``np.hamming``, float64), ``n`` samples or frames."""
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


class Token2Wav:
    """Turns speech tokens into audio with a flow model and a HiFT vocoder.

    Args:
        flow: a :class:`cosyserve.models.flow.MaskedDiffWithXvec` (or its stacked stand-in).
        hift: a :class:`cosyserve.models.hift.HiFTGenerator` (or its stacked stand-in).
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
        # where the modules compute: the request's tensors are made there
        self.device = module_device(flow)
        self.ops = ArrayOps(torch, self.device)  # the arrays the pipeline gives it and gets from it

    def _call(
        self,
        tokens: list[int],
        state: _StreamState,
        prompt_token: torch.Tensor,
        prompt_feat: torch.Tensor,
        embedding: torch.Tensor,
        finalize: bool,
        speed: float,
        draws: CallDraws,
        generator: torch.Generator | None,
        should_stop: ShouldStop | None,
    ) -> torch.Tensor:
        p = self.policy
        token = torch.tensor(tokens, dtype=torch.int32, device=self.device).unsqueeze(0)
        mel, state.flow_cache = self.flow.inference(
            token,
            torch.tensor([token.shape[1]], dtype=torch.int32),
            prompt_token,
            torch.tensor([prompt_token.shape[1]], dtype=torch.int32),
            prompt_feat,
            torch.tensor([prompt_feat.shape[1]], dtype=torch.int32),
            embedding,
            state.flow_cache,
            noise=draws.flow_noise,
            generator=generator,
            n_timesteps=self.flow_steps,
            should_stop=should_stop,
        )
        if state.mel_overlap is not None:
            mel = fade_in_out(mel, state.mel_overlap, hamming(2 * p.mel_overlap_len))
        if not finalize:
            state.mel_overlap = mel[:, :, -p.mel_overlap_len :]
            mel = mel[:, :, : -p.mel_overlap_len]
        if speed != 1.0:
            # the reference stretches the one-shot mel before the vocoder; a long piece's windows (see
            # StreamPolicy.windows) each stretch their new frames. At least one frame: a very short piece at a high
            # speed would otherwise stretch to nothing
            mel = F.interpolate(mel, size=max(1, int(mel.shape[2] / speed)), mode="linear")
        if state.cache_mel is not None:
            mel = torch.cat([state.cache_mel, mel], dim=2)
            cache_source = state.cache_source
        else:
            cache_source = torch.zeros(1, 1, 0, device=self.device)
        speech, source = self.hift.inference(
            mel,
            cache_source,
            generator=generator,
            sine_phase=draws.sine_phase,
            sine_noise=draws.sine_noise,
            should_stop=should_stop,
        )
        if state.cache_speech is not None:
            speech = fade_in_out(speech, state.cache_speech, hamming(2 * p.source_cache_len))
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
        embedding: torch.Tensor,
        prompt_token: torch.Tensor | None = None,
        prompt_feat: torch.Tensor | None = None,
        stream: bool = False,
        speed: float = 1.0,
        generator: torch.Generator | None = None,
        draws: Iterator[CallDraws] | None = None,
        should_stop: ShouldStop | None = None,
    ) -> Iterator[torch.Tensor]:
        """Yield audio chunks ``[1, samples]`` (float32) for a stream of speech token ids: the Token2Wav
        protocol's call.

        Each window's flow and vocoder call runs in torch's inference mode, entered per call and left before the
        chunk is yielded (as :class:`~cosyserve.families.cosyvoice2.token2wav.Token2Wav2` does).

        Args:
            tokens: speech token ids; may be a generator (the LLM's), consumed as it produces.
            embedding: flow speaker embedding ``[1, 192]``.
            prompt_token: ``[1, P]`` prompt speech tokens (zero-shot), default none.
            prompt_feat: ``[1, F, 80]`` prompt mel, default none.
            stream: chunk as tokens arrive (True) or synthesize once at the end (False).
            speed: tempo factor, one-shot mode only (the reference's rule).
            generator: source of random draws not injected through ``draws``.
            draws: per-call injected draws, in call order.
            should_stop: asked between the flow's Euler steps and the vocoder's stages of every call
                (:class:`cosyserve.core.stop.Stopped` once it says True).
        """
        if speed <= 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        if stream and speed != 1.0:
            raise ValueError("speed change is only supported in one-shot (non-streaming) synthesis")
        p = self.policy
        d = self.device
        prompt_token = (
            torch.zeros(1, 0, dtype=torch.int32, device=d) if prompt_token is None else prompt_token
        )
        prompt_feat = torch.zeros(1, 0, 80, device=d) if prompt_feat is None else prompt_feat
        state = _StreamState()
        draws = draws if draws is not None else iter(())

        def run(window: list[int], finalize: bool, speed: float = 1.0) -> torch.Tensor:
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
            with torch.inference_mode():
                speech = run(window, final, speed)
            yield speech
