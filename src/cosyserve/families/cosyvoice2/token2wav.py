"""CosyVoice2 speech tokens -> audio, one-shot or streaming, with the reference's CosyVoice2 rules.

CosyVoice2 streams differently from CosyVoice-300M (:mod:`cosyserve.families.cosyvoice.token2wav`): the reference
re-runs the causal flow on **all** tokens so far at every chunk (there is no flow cache and no mel cross-fade), with
static chunk attention masks and ``pre_lookahead_len`` (3) tokens of lookahead, and drops the frames of tokens
already spoken. Here a request's :class:`StreamState` keeps the flow's final frames instead
(:class:`~cosyserve.models.flow_stream.FlowStream`: per Euler step, the attention keys and values and the causal
convs' tails of every whole attention chunk), so a chunk computes its own frames only, with the same result; the
prompt's part of it comes from a registered voice's precomputed state when ``voices`` holds one. The vocoder keeps
the last 8 mel frames, their source excitation and their audio between calls; the audio is cross-faded over 3840
samples (a Hamming window of 7680).

Hops: the first chunk advances by ``hop + pad`` tokens, where ``pad`` tops the prompt's tokens up to a whole
chunk (``ceil(P / 25) * 25 - P``), so that chunk boundaries line up with the flow's 25-token attention chunks;
each chunk needs ``pre_lookahead_len`` more tokens than its hop. After each chunk the hop doubles up to 100
tokens (4 s), moved to end on a whole chunk where a shorter first hop (the low-latency policy) left it
mid-chunk (:meth:`StreamPolicy2.aligned_hop`). The last call runs on every token with full attention
(``streaming=False``), unless ``flow_context`` bounds the flow's attention (opt-in): then it goes through the
stream, chunk-causal, as the chunks before it. The reference keeps the doubled hop on the model object, so its second streaming request
starts at 50 or 100 tokens: here every request starts afresh (the hop is the generator's own state).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cosyserve.core.sampling import ArrayOps
from cosyserve.core.stop import ShouldStop
from cosyserve.families.base import CachedVocoder, ChunkedFlow, Vocoder
from cosyserve.families.cosyvoice.token2wav import crossfade, stretch
from cosyserve.system.device import module_device

if TYPE_CHECKING:  # torch is imported where a torch flow runs: the lite runtime's process has none
    import torch

    from cosyserve.models.flow_stream import FlowStream

logger = logging.getLogger(__name__)

__all__ = ["StreamPolicy2", "StreamState", "Token2Wav2"]


@dataclass(frozen=True)
class StreamPolicy2:
    """CosyVoice2's chunking, in tokens; the defaults are the reference CosyVoice2Model's.

    ``first_hop_len`` (None: ``token_hop_len``) makes the first chunk shorter (the low-latency policy); the
    prompt pad is added to it either way.
    """

    token_hop_len: int = 25  # the yaml's chunk_size
    token_max_hop_len: int = 100
    stream_scale_factor: int = 2
    pre_lookahead_len: int = 3
    token_mel_ratio: int = 2
    mel_cache_len: int = 8
    samples_per_frame: int = 480
    first_hop_len: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.first_hop <= self.token_max_hop_len:
            raise ValueError(
                f"first_hop_len must be in [1, {self.token_max_hop_len}] tokens, got {self.first_hop}"
            )
        # the first chunk's audio must hold the vocoder's cache (8 frames = 4 tokens of mel)
        if self.first_hop * self.token_mel_ratio < self.mel_cache_len:
            raise ValueError(
                f"first_hop_len must be >= {math.ceil(self.mel_cache_len / self.token_mel_ratio)} tokens "
                f"(its mel must fill the vocoder's {self.mel_cache_len}-frame cache), got {self.first_hop}"
            )

    @classmethod
    def named(cls, name: str, first_hop: int | None = None, **kwargs: Any) -> StreamPolicy2:
        """``reference`` (hops 25, 50, 100, ...) or ``low-latency`` (``first_hop`` tokens at 25 Hz, then
        doubling up to 100)."""
        if name == "reference":
            return cls(**kwargs)
        if name == "low-latency":
            if first_hop is None:
                raise ValueError("the low-latency chunk policy needs its first hop (tokens)")
            return cls(first_hop_len=first_hop, **kwargs)
        raise ValueError(f"unknown chunk policy {name!r}; expected reference or low-latency")

    @property
    def first_hop(self) -> int:
        return self.token_hop_len if self.first_hop_len is None else self.first_hop_len

    @property
    def source_cache_len(self) -> int:
        return self.mel_cache_len * self.samples_per_frame

    def next_hop(self, hop: int) -> int:
        return min(self.token_max_hop_len, hop * self.stream_scale_factor)

    def aligned_hop(self, hop: int, spoken: int) -> int:
        """The hop after one of ``hop`` tokens that ended ``spoken`` tokens past the padded prompt: doubled (up
        to ``token_max_hop_len``), then moved to the nearest end on a whole attention chunk that does not shrink
        the hop (shrinking it only where the largest would be passed): the flow keeps whole chunks only and computes a partial chunk's frames
        again at the next call, so a hop that ends mid-chunk costs up to 24 tokens of flow twice. The reference's
        hops (25 + pad, 50, 100) always end on a chunk: unchanged."""
        c = self.token_hop_len
        want = self.next_hop(hop)
        lower = want - (spoken + want) % c
        upper = lower + c
        return lower if lower >= hop or upper > self.token_max_hop_len else upper

    def prompt_pad(self, prompt_tokens: int) -> int:
        """Tokens that top the prompt up to a whole attention chunk (added to the first hop)."""
        c = self.token_hop_len
        return math.ceil(prompt_tokens / c) * c - prompt_tokens


@dataclass
class _Cache:
    mel: torch.Tensor
    source: torch.Tensor
    speech: torch.Tensor


@dataclass
class StreamState:
    """A request's token2wav state between chunks, apart from the modules: its prompt, the flow's kept frames
    (None: the flow re-runs on every token, as the reference's), the vocoder's state (the family's: CosyVoice2's
    cached frames, source and audio tail; CosyVoice3's :class:`~cosyserve.models.causal_hift.VocoderStream`), the
    tokens already spoken and the next hop; ``shared`` is what its flow state shares with its voice's (bytes
    counted there) and ``charged`` what its own part holds (accounted by
    :meth:`~cosyserve.voices.voicestates.VoiceStates.hold`)."""

    prompt_token: torch.Tensor
    prompt_feat: torch.Tensor
    embedding: torch.Tensor
    flow: FlowStream | None = None
    vocoder: Any = None
    offset: int = 0
    hop: int = 0
    shared: int = 0
    charged: int = 0

    def nbytes(self) -> int:
        flow = self.flow.nbytes() if self.flow is not None else 0
        vocoder = getattr(self.vocoder, "nbytes", None)
        return flow + (vocoder() if vocoder is not None else 0)


class Token2Wav2:
    """Turns speech tokens into audio with a CosyVoice2 causal flow and a 24 kHz HiFT vocoder.

    Args:
        flow: the causal flow (:class:`~cosyserve.models.causal_flow.ChunkFlow`, the lite runtime's graphs); its
            ``ops`` (:class:`~cosyserve.core.sampling.ArrayOps`) when it computes on numpy, else torch's are used.
        hift: the vocoder (:class:`~cosyserve.models.hift.HiFTGenerator`, its stacked stand-in, the lite
            runtime's graphs; a subclass's may be another kind).
        policy: the streaming rules; default the reference's.
        flow_steps: the flow's Euler steps (None: the model's own count).
        incremental: streamed chunks keep the flow's (and the vocoder's) state and compute their own frames; False
            re-runs them on everything so far at every chunk, as the reference does (for comparisons).
        voices: the registered voices' precomputed flow states
            (:class:`~cosyserve.voices.voicestates.VoiceStates`), asked for each streamed request's prompt; None: none.
        flow_context: seconds of generated speech a streamed request's flow attends to beyond its prompt (a
            bounded :class:`~cosyserve.models.flow_stream.FlowStream`: each chunk's cost and the state's memory stop
            growing, and the last call goes through the stream too, chunk-causal); 0: every frame, the
            reference's result. Only where the flow keeps frames (incremental, ``flow.streams``).
    """

    flow: ChunkedFlow
    hift: CachedVocoder

    def __init__(
        self,
        flow: ChunkedFlow,
        hift: Vocoder,
        policy: StreamPolicy2 | None = None,
        flow_steps: int | None = None,
        *,
        incremental: bool = True,
        voices: Any = None,
        flow_context: float = 0.0,
    ) -> None:
        if not (isinstance(flow_context, int | float) and 0 <= flow_context < math.inf):
            raise ValueError(f"flow_context must be a number of seconds >= 0, got {flow_context!r}")
        self.flow = flow
        self.hift = hift
        self.policy = policy or StreamPolicy2()
        self.flow_steps = flow_steps
        self.incremental = incremental
        self.voices = voices
        self.flow_context = flow_context
        # where the modules compute: the request's tensors are made there, with the flow's array ops (torch's, or
        # numpy's for the lite runtime's flow, which has its own)
        ops = getattr(flow, "ops", None)
        if ops is None:
            import torch

            ops = ArrayOps(torch, module_device(flow))
        self.ops: ArrayOps = ops
        self.device = ops.device  # None: host memory (numpy)

    def _vocoder_stream(self) -> Any:
        # a streamed request's vocoder state at its start (CosyVoice2's cache starts with its first chunk)
        return None

    def new_stream(
        self,
        prompt_token: torch.Tensor,
        prompt_feat: torch.Tensor,
        embedding: torch.Tensor,
        should_stop: ShouldStop | None = None,
    ) -> StreamState:
        """A streamed request's state: its flow state starts from its prompt's (a registered voice's, or computed
        now by the same code), when the flow can keep frames."""
        state = StreamState(
            prompt_token, prompt_feat, embedding, vocoder=self._vocoder_stream(), hop=self.policy.first_hop
        )
        if not (self.incremental and getattr(self.flow, "streams", False)):
            return state
        if self.keeps_voices and prompt_token.shape[1]:
            state.flow = self.voices.stream(
                self.flow, prompt_token, prompt_feat, embedding, self.flow_steps, should_stop
            )
            state.shared = state.flow.nbytes()
        else:
            state.flow = self.flow.new_stream(self.flow_steps)
        if self.flow_context and state.flow is not None:
            state.flow.context = math.ceil(self.flow_context * self.flow.frame_rate)
        return state

    @property
    def keeps_voices(self) -> bool:
        """Whether a voice's flow state is computed once and forked by its requests (``voices`` given and a flow
        that computes a prompt's frames alone: ``prefill``, torch's ``ChunkFlow`` and the lite ``LiteChunkFlow``)."""
        return self.voices is not None and self.incremental and hasattr(self.flow, "prefill")

    def keep_voice(self, features: Mapping[str, Any]) -> Any:
        """Have ``voices`` compute a registered voice's flow state (``features``: its registry entry, torch tensors
        or numpy arrays) and keep it; returns the future state (see
        :meth:`cosyserve.voices.voicestates.VoiceStates.keep`)."""
        names = ("flow_prompt_speech_token", "prompt_speech_feat", "flow_embedding")
        if self.ops.torch:
            import torch

            arrays = [torch.as_tensor(features[n]).to(self.device) for n in names]
        else:  # the lite flow's numpy (its registry's entries are numpy arrays)
            import numpy as np

            arrays = [np.asarray(features[n]) for n in names]
        return self.voices.keep(self.flow, *arrays, self.flow_steps)

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
        # one flow and vocoder call on `tokens` (all of them so far), after the state's `offset` already spoken
        p = self.policy
        mel = self._flow(tokens, state, streaming, finalize, should_stop)
        cache: _Cache | None = state.vocoder
        if cache is not None:
            mel = self.ops.cat([cache.mel, mel], dim=2)
            cache_source = cache.source
        else:
            cache_source = self.ops.zeros((1, 1, 0), "float32")
        if finalize and speed != 1.0:
            if cache is not None:
                raise ValueError("speed change is only supported in one-shot (non-streaming) synthesis")
            mel = stretch(mel, max(1, int(mel.shape[2] / speed)))
        speech, source = self.hift.inference(
            mel, cache_source, generator=generator, should_stop=should_stop, **draws
        )
        if cache is not None:
            speech = crossfade(speech, cache.speech, 2 * p.source_cache_len)
        if finalize:
            state.vocoder = None
            return speech
        n = p.source_cache_len
        state.vocoder = _Cache(mel[:, :, -p.mel_cache_len :], source[:, :, -n:], speech[:, -n:])
        return speech[:, :-n]

    def _flow(
        self,
        tokens: list[int],
        state: StreamState,
        streaming: bool,
        finalize: bool,
        should_stop: ShouldStop | None,
    ) -> torch.Tensor:
        # the mel of the tokens after the `offset` already spoken
        token = self.ops.ints([tokens])  # (1, n)
        mel = self.flow.inference(
            token, state.prompt_token, state.prompt_feat, state.embedding, streaming=streaming, finalize=finalize,
            n_timesteps=self.flow_steps, should_stop=should_stop,
            **({"stream": state.flow} if state.flow is not None else {}),
        )  # fmt: skip
        if finalize:
            state.flow = None  # the last call: nothing kept serves again
            if self.voices is not None:
                self.voices.release(state)
        elif state.flow is not None and self.voices is not None:
            over = self.voices.hold(state, state.flow.nbytes() - state.shared)
            if over is not None:
                logger.info(
                    "a stream's flow state would pass %s after %d tokens (%.0f MB of its own, %.0f MB held by the "
                    "model's streams): its next chunks re-run the flow on every token",
                    over,
                    len(tokens),
                    (state.flow.nbytes() - state.shared) / 2**20,
                    self.voices.stream_bytes / 2**20,
                )
                state.flow = None
        return mel[:, :, state.offset * self.policy.token_mel_ratio :]

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
        draws: Iterator[dict[str, torch.Tensor]] | None = None,
        should_stop: ShouldStop | None = None,
    ) -> Iterator[Any]:
        """Yield audio chunks ``[1, samples]`` (float32) for a stream of speech token ids: the Token2Wav
        protocol's call.

        Each step's work (a flow and vocoder call, a stream's prompt state) runs without autograd, in the flow's
        array ops' ``no_grad`` (torch's inference mode; nothing for the lite runtime's numpy), entered per step
        and left before the chunk is yielded: the consumer's code and the LM's steps that feed ``tokens`` keep
        their own mode.

        Args:
            tokens: speech token ids; may be a generator (the LM's), consumed as it produces.
            embedding: the flow's speaker embedding ``[1, 192]``.
            prompt_token: ``[1, P]`` prompt speech tokens, default none.
            prompt_feat: ``[1, F, 80]`` prompt mel, default none. Usually F = 2P; vc passes the prompt's whole
                mel (F = 2P - d): the flow's output then starts d frames early and, as in the reference, each
                chunk still drops 2 frames per token already spoken, so its first d frames repeat the previous
                chunk's last ones.
            stream: chunk as tokens arrive (True) or synthesize once at the end (False).
            speed: tempo factor, one-shot mode only (the reference's rule).
            generator: source of the vocoder's random draws not injected through ``draws``.
            draws: per-call injected vocoder draws (keyword arguments of its ``inference``), in call order.
            should_stop: asked between the flow's Euler steps and the vocoder's stages of every call
                (:class:`cosyserve.core.stop.Stopped` once it says True).
        """
        if speed <= 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        if stream and speed != 1.0:
            raise ValueError("speed change is only supported in one-shot (non-streaming) synthesis")
        p = self.policy
        prompt_token = self.ops.zeros((1, 0), "int32") if prompt_token is None else prompt_token
        prompt_feat = self.ops.zeros((1, 0, 80), "float32") if prompt_feat is None else prompt_feat
        draws = draws if draws is not None else iter(())
        no_grad = self.ops.no_grad
        if not stream:
            all_tokens = list(tokens)
            if all_tokens:
                with no_grad():
                    speech = self._call(
                        all_tokens, StreamState(prompt_token, prompt_feat, embedding),
                        streaming=False, finalize=True, speed=speed, draws=next(draws, {}), generator=generator,
                        should_stop=should_stop,
                    )  # fmt: skip
                yield speech
            return
        buffer: list[int] = []
        state: StreamState | None = None
        pad = p.prompt_pad(prompt_token.shape[1])
        try:
            for tok in tokens:
                buffer.append(tok)
                while True:
                    offset, hop = (0, p.first_hop) if state is None else (state.offset, state.hop)
                    this_hop = hop + pad if offset == 0 else hop
                    if len(buffer) - offset < this_hop + p.pre_lookahead_len:
                        break
                    if state is None:
                        # made when its first call is due: the LM's first hop runs before the prompt's flow
                        # states (a first request after READY decodes while the flow's session opens), and a
                        # request that speaks nothing computes none
                        with no_grad():
                            state = self.new_stream(prompt_token, prompt_feat, embedding, should_stop)
                    with no_grad():
                        speech = self._call(
                            buffer[: state.offset + this_hop + p.pre_lookahead_len], state, streaming=True,
                            finalize=False, speed=1.0, draws=next(draws, {}), generator=generator,
                            should_stop=should_stop,
                        )  # fmt: skip
                    state.offset += this_hop
                    state.hop = p.aligned_hop(state.hop, state.offset - pad)
                    yield speech
            if buffer:
                with no_grad():
                    if state is None:  # an utterance shorter than the first hop: its one call
                        state = self.new_stream(prompt_token, prompt_feat, embedding, should_stop)
                    speech = self._call(
                        buffer, state, streaming=False, finalize=True, speed=1.0, draws=next(draws, {}),
                        generator=generator, should_stop=should_stop,
                    )  # fmt: skip
                yield speech
        finally:
            # ended, stopped or closed: its bytes leave the model's streams' account
            if state is not None and self.voices is not None:
                self.voices.release(state)
