"""CosyVoice3 speech tokens -> audio, one-shot or streaming, with the reference's CosyVoice3 rules.

The chunk schedule and the flow calls are CosyVoice2's
(:class:`~cosyserve.families.cosyvoice2.token2wav.Token2Wav2`: the first hop tops the prompt up to a whole 25-token chunk, hops double up to 100, 3 lookahead tokens, the last call
with full attention; the flow's kept frames likewise). The vocoder side differs (``CosyVoice3Model.token2wav``): in
the reference each call appends its new mel frames to the request's mel, the causal vocoder re-runs on **all** of
it, and the chunk is the audio from the request's ``speech_offset`` on. No source cache, no cross-fade, no mel fade:
the vocoder is causal, so what a non-final call emitted (everything up to 8 frames before the end of its mel) does
not change later. Here the vocoder keeps its state instead
(:class:`~cosyserve.models.causal_hift.VocoderStream`: the mel of its receptive field, the source's phase and
place in the fixed noise) and vocodes the new frames only, with the same samples.

Before vocoding, runs of the "silent" tokens (FSQ silence and breath codes) that the LM emits are cut to 5
(:func:`filter_silent_tokens`); the LM itself still consumes every token it sampled.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from cosyserve.core.stop import ShouldStop
from cosyserve.families.base import ChunkedFlow, StreamVocoder
from cosyserve.families.cosyvoice.token2wav import stretch
from cosyserve.families.cosyvoice2.token2wav import StreamPolicy2, StreamState, Token2Wav2

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_SILENT_RUN", "SILENT_TOKENS", "Token2Wav3", "filter_silent_tokens"]

# CosyVoice3Model.silent_tokens ("FSQ silent and breath token") and the longest run of them kept
SILENT_TOKENS = frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323})
MAX_SILENT_RUN = 5


def filter_silent_tokens(
    tokens: Iterable[int], silent: Iterable[int] = SILENT_TOKENS, max_run: int = MAX_SILENT_RUN
) -> Iterator[int]:
    """The tokens to vocode: every run of consecutive ``silent`` tokens cut to its first ``max_run`` (the
    reference's ``llm_job``). Lazy: a token is yielded as soon as it arrives."""
    silent = frozenset(silent)
    run = 0
    for token in tokens:
        if token in silent:
            run += 1
            if run > max_run:
                continue
        else:
            run = 0
        yield token


class Token2Wav3(Token2Wav2):
    """Turns speech tokens into audio with a CosyVoice3 flow and causal vocoder.

    Args:
        flow: :class:`~cosyserve.models.dit.CausalMaskedDiffWithDiT`.
        hift: :class:`~cosyserve.models.causal_hift.CausalHiFTGenerator`.
        policy: the chunking (CosyVoice2's rules); default the reference's.
        flow_steps: the flow's Euler steps (None: the model's own count).
        noise: the model's fixed vocoder noise, for calls given no ``draws`` (see below).
        incremental, voices, flow_context: as :class:`~cosyserve.families.cosyvoice2.token2wav.Token2Wav2`
            (incremental False also re-runs the vocoder on the whole mel at each chunk, as the reference does).

    Calling it (see :meth:`Token2Wav2.__call__`) takes the vocoder's noise buffers as ``draws``: an iterator of
    ``{"rand_ini": ..., "sine_waves": ...}`` per call, which must be the same buffers for every call of a request
    (``itertools.repeat``), as the reference's are fixed; without ``draws`` each call takes them from ``noise``
    (the model's own, :class:`~cosyserve.families.cosyvoice3.noise.VocoderNoise`).
    """

    hift: StreamVocoder  # type: ignore[assignment]

    def __init__(
        self,
        flow: ChunkedFlow,
        hift: StreamVocoder,
        policy: StreamPolicy2 | None = None,
        flow_steps: int | None = None,
        noise: Any = None,
        *,
        incremental: bool = True,
        voices: Any = None,
        flow_context: float = 0.0,
    ) -> None:
        super().__init__(
            flow, hift, policy, flow_steps, incremental=incremental, voices=voices, flow_context=flow_context
        )
        self.noise = noise  # the model's fixed vocoder noise (.noise.VocoderNoise), for calls given no draws
        p, need = self.policy, hift.cfg.lookahead
        if p.first_hop * p.token_mel_ratio <= need:
            raise ValueError(
                f"first_hop_len must exceed {need // p.token_mel_ratio} tokens (a streaming vocoder call holds "
                f"back {need} mel frames), got {p.first_hop}"
            )

    def _vocoder_stream(self) -> Any:
        # made at the stream's first token: a vocoder that stacks streams' calls
        # (cosyserve.runtime.stacking.VocoderBatcher) knows every live stream from then on
        return self.hift.new_stream(whole=not self.incremental)

    def _call(
        self,
        tokens: list[int],
        state: StreamState,
        *,
        streaming: bool,
        finalize: bool,
        speed: float,
        draws: dict[str, torch.Tensor],
        generator: torch.Generator | None,
        should_stop: ShouldStop | None = None,
    ) -> torch.Tensor:
        # generator: unused, CosyVoice3's vocoder draws nothing
        mel = self._flow(tokens, state, streaming, finalize, should_stop)
        if speed != 1.0:
            if state.offset != 0 or not finalize:
                raise ValueError("speed change is only supported in one-shot (non-streaming) synthesis")
            mel = stretch(mel, max(1, int(mel.shape[2] / speed)))
        if state.vocoder is None:  # one-shot
            state.vocoder = self._vocoder_stream()
        vocoder = state.vocoder
        if not draws:
            if self.noise is None:
                raise ValueError(
                    "CosyVoice3's vocoder needs its noise buffers: pass draws, or build with noise="
                )
            frames = vocoder.frames + mel.shape[2]
            noise = self.noise.draws(frames * self.hift.cfg.upsample_factor)  # numpy: shared, not copied
            draws = {k: self.ops.from_host(v) for k, v in noise.items()}
        return self.hift.stream(vocoder, mel, finalize, should_stop=should_stop, **draws)
