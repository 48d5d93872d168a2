"""CosyVoice2 flow model: speech tokens (+ prompt) -> 80-bin mel, causal and chunk-streamable.

``CausalMaskedDiffWithXvec`` = token embedding -> :class:`UpsampleConformerEncoder` (x2 to mel rate, 3-token
lookahead) -> ``encoder_proj`` -> ``CausalConditionalCFM`` (10 Euler steps of the
:class:`CausalConditionalDecoder` velocity with classifier-free guidance). Unlike CosyVoice-300M there is no length
regulator and no flow cache in the reference: a streaming caller re-runs the flow on every token so far, and the
starting noise is always the same fixed tensor (:func:`fixed_noise`), so the frames of earlier chunks come out the
same again. Here a stream can instead keep its final frames' states (:class:`~cosyserve.models.flow_stream.FlowStream`)
and compute only the frames after them: :class:`ChunkFlow`, the inference both CosyVoice2's flow and CosyVoice3's
(:mod:`cosyserve.models.dit`) share. Attribute names follow the official ``flow.pt`` keys.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.core.stop import ShouldStop, check
from cosyserve.models.causal_flow_decoder import CausalConditionalDecoder, CausalConditionalDecoderConfig
from cosyserve.models.flow import CFMParams, _euler_schedule
from cosyserve.models.flow_stream import FlowStream, StepRows, StepState
from cosyserve.models.flow_window import kept_after, takes_chunk
from cosyserve.models.upsample_encoder import (
    PRE_LOOKAHEAD_LEN,
    UPSAMPLE_STRIDE,
    UpsampleConformerEncoder,
    UpsampleConformerEncoderConfig,
)

__all__ = [
    "NOISE_SHAPE",
    "CausalConditionalCFM",
    "CausalConditionalCFMConfig",
    "CausalFlowConfig",
    "CausalMaskedDiffWithXvec",
    "Chunk",
    "ChunkFlow",
    "fixed_noise",
]

# The reference's CausalConditionalCFM draws this once at construction, right after seeding torch with 0.
NOISE_SHAPE = (1, 80, 50 * 300)
NOISE_SEED = 0


@functools.cache
def _noise_table() -> Tensor:
    generator = torch.Generator(device="cpu").manual_seed(NOISE_SEED)
    return torch.randn(NOISE_SHAPE, generator=generator)


def fixed_noise(
    frames: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32, start: int = 0
) -> Tensor:
    """Columns ``start .. frames-1`` of the reference's fixed flow noise, as a fresh (1, 80, frames - start)
    tensor.

    Equals ``set_all_random_seed(0); torch.randn([1, 80, 15000])[:, :, start:frames]`` but draws from a private
    generator (the global torch RNG is left alone) once per process.
    """
    if not 0 <= frames <= NOISE_SHAPE[2]:
        raise ValueError(
            f"the flow's fixed noise has {NOISE_SHAPE[2]} frames (10 minutes of mel); {frames} were asked for"
        )
    return _noise_table()[:, :, start:frames].to(device=device, dtype=dtype, copy=True)


@dataclass(kw_only=True)
class CausalConditionalCFMConfig:
    TARGET: ClassVar[str] = "cosyvoice.flow.flow_matching.CausalConditionalCFM"

    in_channels: int
    cfm_params: CFMParams
    n_spks: int = 1
    spk_emb_dim: int = 64
    estimator: CausalConditionalDecoderConfig


@dataclass(kw_only=True)
class CausalFlowConfig:
    TARGET: ClassVar[str] = "cosyvoice.flow.flow.CausalMaskedDiffWithXvec"

    input_size: int = 512
    output_size: int = 80
    spk_embed_dim: int = 192
    output_type: str = "mel"
    vocab_size: int = 4096
    input_frame_rate: int = 50
    only_mask_loss: bool = True
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    encoder: UpsampleConformerEncoderConfig
    decoder: CausalConditionalCFMConfig
    # Training-time default estimator description in the reference; the yaml's `decoder` is what is built.
    decoder_conf: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.output_type != "mel":
            raise ValueError(f"flow output_type={self.output_type!r} is not supported; expected 'mel'")
        if self.output_size != NOISE_SHAPE[1]:
            raise ValueError(
                f"flow output_size={self.output_size}: the reference's fixed noise and guidance buffers are "
                f"{NOISE_SHAPE[1]}-channel mels"
            )
        if self.input_size != self.encoder.input_size:
            raise ValueError(
                f"flow input_size={self.input_size} differs from encoder.input_size={self.encoder.input_size}"
            )
        if self.token_mel_ratio != UPSAMPLE_STRIDE:
            raise ValueError(
                f"flow token_mel_ratio={self.token_mel_ratio}: the encoder's upsampling is fixed at x{UPSAMPLE_STRIDE}"
            )
        if self.pre_lookahead_len != PRE_LOOKAHEAD_LEN:
            raise ValueError(
                f"flow pre_lookahead_len={self.pre_lookahead_len}: the encoder's lookahead layer is fixed at "
                f"{PRE_LOOKAHEAD_LEN} tokens"
            )
        need = 2 * self.output_size + self.decoder.spk_emb_dim + self.output_size  # x, mu, spks, cond
        if self.decoder.estimator.in_channels != need or self.decoder.spk_emb_dim != self.output_size:
            raise ValueError(
                f"flow decoder: estimator.in_channels={self.decoder.estimator.in_channels} and "
                f"spk_emb_dim={self.decoder.spk_emb_dim} do not fit x, mu, spks and cond of {self.output_size} "
                f"channels each (expected {4 * self.output_size} and {self.output_size})"
            )


class CausalConditionalCFM(nn.Module):
    def __init__(self, cfg: CausalConditionalCFMConfig):
        super().__init__()
        self.cfg = cfg
        self.t_scheduler = cfg.cfm_params.t_scheduler
        self.inference_cfg_rate = cfg.cfm_params.inference_cfg_rate
        self.estimator = CausalConditionalDecoder(cfg.estimator)

    def forward(
        self,
        mu: Tensor,
        spks: Tensor,
        cond: Tensor,
        noise: Tensor,
        n_timesteps: int,
        streaming: bool,
        should_stop: ShouldStop | None = None,
        caches: Sequence[StepState] | None = None,
    ) -> Tensor:
        """Integrate from ``noise`` to a mel: fixed-step Euler, classifier-free guidance as one batch of 2B.

        Args:
            mu: (B, n, T) encoder condition.
            spks: (B, s) projected speaker embedding.
            cond: (B, n, T) prompt mel in the first frames, zeros after.
            noise: (B or 1, n, T) the starting sample.
            n_timesteps: Euler steps.
            streaming: chunk attention masks in the estimator.
            should_stop: asked before each Euler step (:class:`cosyserve.core.stop.Stopped` once it says True).
            caches: a stream's state per Euler step (see :class:`ChunkFlow`), or several streams' (rows :B/B: stream
                by stream, :class:`~cosyserve.models.flow_stream.StepRows`): the frames here follow the kept ones.
        Returns:
            (B, n, T) float32 mel.
        """
        B, n, T = mu.shape
        s, dtype = spks.shape[1], spks.dtype
        x = noise.to(dtype).expand(B, n, T)
        # Rows :B conditioned, rows B: unconditioned (zero mu, spks, cond); only x changes per step.
        h = torch.zeros(2 * B, self.estimator.in_channels, T, device=mu.device, dtype=dtype)  # (2B, C_in, T)
        h[:B, n : 2 * n] = mu
        h[:B, 2 * n : 2 * n + s] = spks.unsqueeze(-1)
        h[:B, 2 * n + s :] = cond
        t_in = torch.zeros(2 * B, device=mu.device, dtype=dtype)
        rate = self.inference_cfg_rate
        for i, (t, dt) in enumerate(_euler_schedule(n_timesteps, self.t_scheduler, dtype, mu.device)):
            check(should_stop)
            h.unflatten(0, (2, B))[:, :, :n] = x
            t_in.copy_(t.expand(2 * B))
            cache = None if caches is None else caches[i]
            v = self.estimator.forward_packed(h, t_in, streaming, should_stop, cache)  # (2B, n, T)
            x = x + dt * ((1.0 + rate) * v[:B] - rate * v[B:])
        return x.float()


@dataclass(frozen=True, eq=False)
class Chunk:
    """A stream's streamed call over the frames after those it keeps (:meth:`ChunkFlow.chunk`), run alone or
    stacked with other streams' (:meth:`ChunkFlow.run_chunks`)."""

    stream: FlowStream
    tokens: Tensor  # (1, P + T) the prompt's and the utterance's so far, the last `lookahead` context only
    prompt_feat: Tensor  # (1, F, n_mels)
    embedding: Tensor  # (1, spk_embed_dim)
    frames: int  # the frames the tokens make, the kept ones included
    skip: int  # the leading frames left out of the result (the prompt's)
    lookahead: int  # context-only last tokens: pre_lookahead_len, 0 for a bounded stream's last call

    @property
    def shape(self) -> tuple[int, int]:
        """What must match for chunks of several streams to run as one batch: the frames computed and the Euler
        steps (each stream keeps its own start, kept frames, context, caches, prompt, tokens and lookahead: a
        bounded stream's last call stacks with other streams' chunks)."""
        return self.frames - self.stream.frames, self.stream.n_timesteps

    @property
    def keep(self) -> int:
        """The frames final once the call is done (before it runs): its whole attention chunks, or with no
        lookahead (a bounded stream's last call) none of its own."""
        s = self.stream
        return kept_after(s.frames, self.frames, s.granularity, self.lookahead)


class ChunkFlow(nn.Module):
    """What CosyVoice2's and CosyVoice3's flows share: tokens (after a prompt) -> ``mu`` at mel rate (the
    subclass's :meth:`_mu`) -> the CFM from the fixed noise, with the prompt mel as condition; and streams that
    keep their final frames (:class:`~cosyserve.models.flow_stream.FlowStream`).

    A stream's call computes the frames after the ``stream.frames`` it keeps: ``mu`` of those frames from the tokens
    from ``stream.frames // ratio - lead`` on (``lead`` tokens of left context for the lookahead layer's causal
    conv, :attr:`LEAD`), then every Euler step over them against the kept states. Its output equals the whole
    sequence's (:meth:`inference` without a stream) within float rounding, because streaming attention is
    chunk-causal and every conv causal; the frames of a chunk still incomplete are computed again next time.
    Concurrent streams' calls that compute as many frames run as one batch (:meth:`chunk`, :meth:`run_chunks`; the
    torch runtime's :class:`~cosyserve.runtime.stacking.ChunkFlowBatcher` gathers them).
    """

    N_TIMESTEPS = 10  # Euler steps of the reference's flow inference (fixed there; the yaml has no count)
    LEAD = 2  # tokens before a stream's new ones that the lookahead layer's causal conv (kernel 3) reads
    cfg: Any
    decoder: CausalConditionalCFM

    def _mu(self, x: Tensor, lookahead: int, streaming: bool, stream: FlowStream | None, lead: int) -> Tensor:
        """(B, 80, frames) ``mu`` of token embeddings ``x`` (B, n, C), the last ``lookahead`` of them context only;
        with a stream, the first ``lead`` are left context (no frames) and the rest follow its kept frames."""
        raise NotImplementedError

    def _encoder_caches(self) -> int:
        return 0

    def _begin_encoder(self, stream: FlowStream, start: int, keep: int) -> None:
        """Set the encoder's caches for a call over frames ``start ..`` of which those before ``keep`` are kept."""

    @property
    def streams(self) -> bool:
        """Whether streamed chunks can keep their final frames (static chunk attention, a causal estimator)."""
        return bool(getattr(self.decoder.estimator, "streams", False))

    @property
    def granularity(self) -> int:
        """Frames a stream keeps at a time: the estimator's attention chunk (and the encoder's, at mel rate)."""
        return int(self.decoder.estimator.static_chunk_size)

    @property
    def frame_rate(self) -> int:
        """Mel frames per second of speech."""
        return int(self.cfg.input_frame_rate) * self.token_mel_ratio

    def new_stream(self, n_timesteps: int | None = None) -> FlowStream | None:
        """An empty :class:`FlowStream` for a request's chunks (None when this flow cannot keep frames)."""
        if not self.streams:
            return None
        steps = self.N_TIMESTEPS if n_timesteps is None else n_timesteps
        return FlowStream.empty(self.granularity, steps, self._encoder_caches())

    @torch.inference_mode()
    def warm_up(self, n_tokens: int = 2) -> Tensor:
        """One Euler step over dummy tokens through one layer of each stack, streaming and not (every kernel the
        flow runs, once; :func:`cosyserve.models.one_layer_per_stack`); returns the mel. Leaves the module as it
        was, so it may run while requests use the flow."""
        from cosyserve.models import one_layer_per_stack

        trimmed = one_layer_per_stack(self)
        tokens = torch.zeros(1, max(n_tokens, 1) + self.pre_lookahead_len, dtype=torch.int32)
        empty = torch.zeros(1, 0, dtype=torch.int32)
        feat, emb = torch.zeros(1, 0, self.output_size), torch.zeros(1, self.cfg.spk_embed_dim)
        trimmed.inference(tokens, empty, feat, emb, streaming=True, finalize=False, n_timesteps=1)
        return trimmed.inference(tokens, empty, feat, emb, streaming=False, finalize=True, n_timesteps=1)

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
        stream: FlowStream | None = None,
    ) -> Tensor:
        """Speech tokens -> mel after a prompt, the whole utterance so far (the reference's flow inference).

        A batch of B > 1 must have equal lengths (no padding); every row starts from the same fixed noise.

        Args:
            token: (B, T) speech token ids to synthesise.
            prompt_token: (B, P) prompt speech tokens (P may be 0).
            prompt_feat: (B, F, n_mels) prompt mel. Usually F = 2P (the zero-shot frontend trims to it); voice
                conversion passes the prompt's whole mel, and the output then starts with the d = 2P - F frames of
                the last prompt tokens, as in the reference.
            embedding: (B, spk_embed_dim) speaker x-vector (L2-normalised here).
            streaming: static chunk attention (what a streaming chunk uses).
            finalize: the utterance ends here; otherwise the last 3 tokens are lookahead context only and get no
                frames.
            n_timesteps: Euler steps (>= 1; None: :attr:`N_TIMESTEPS`).
            should_stop: asked before each Euler step (:class:`cosyserve.core.stop.Stopped` once it says True).
            stream: the request's :class:`FlowStream` (:meth:`new_stream`), for a chunk that streams and does not
                finalize: only the frames after the ones it keeps are computed, and it keeps the new final ones.
                The same prompt, embedding and steps at every call. An unbounded stream ignores other calls (the
                last call's full attention changes every frame: it is computed whole, as the reference does); a
                bounded one (``stream.context``) takes the last call too, whatever ``streaming`` says: its frames
                after the kept ones, chunk-causal, no lookahead (it no longer holds every frame to attend to).
        Returns:
            (B, n_mels, M) float32 mel with M = 2(P + T) - F (finalize) or 2(P + T - 3) - F.
        """
        if self.takes_chunk(stream, streaming, finalize):
            assert stream is not None
            chunk = self.chunk(
                token, prompt_token, prompt_feat, embedding, stream=stream, finalize=finalize,
                n_timesteps=n_timesteps,
            )  # fmt: skip
            return self.run_chunks([chunk], should_stop)[0]
        n_timesteps, tokens, frames = self._plan(token, prompt_token, prompt_feat, finalize, n_timesteps)
        spks, cond = self._conditions(embedding, prompt_feat, 0, frames)
        device = spks.device
        x = self.input_embedding(tokens.to(device).clamp(min=0))  # (B, P+T, C)
        lookahead = 0 if finalize else self.pre_lookahead_len
        mu = self._mu(x, lookahead, streaming, None, 0)  # (B, n_mels, N), N = frames
        noise = fixed_noise(frames, device, spks.dtype)
        mel = self.decoder(mu, spks, cond, noise, n_timesteps, streaming, should_stop)
        return mel[:, :, prompt_feat.shape[1] :]

    @staticmethod
    def takes_chunk(stream: FlowStream | None, streaming: bool, finalize: bool) -> bool:
        """Whether :meth:`inference` runs a call through its ``stream`` (a :class:`Chunk`): a streamed call that
        does not finalize, or any call of a bounded stream (``stream.context``: its last call too, chunk-causal)."""
        return stream is not None and takes_chunk(bool(stream.context), streaming, finalize)

    def _plan(
        self,
        token: Tensor,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        finalize: bool,
        n_timesteps: int | None,
    ) -> tuple[int, Tensor, int]:
        # a call's checked Euler steps, its prompt and utterance tokens (B, P+T) and the frames they make
        n_timesteps = self.N_TIMESTEPS if n_timesteps is None else n_timesteps
        if n_timesteps < 1:
            raise ValueError(f"n_timesteps must be >= 1, got {n_timesteps}")
        tokens = torch.cat([prompt_token, token], dim=1)
        lookahead = 0 if finalize else self.pre_lookahead_len
        if token.shape[1] <= lookahead:
            raise ValueError(
                f"a chunk that does not finalize needs more than {lookahead} tokens (the last {lookahead} are "
                f"lookahead), got {token.shape[1]}"
            )
        f = prompt_feat.shape[1]
        frames = self.token_mel_ratio * (tokens.shape[1] - lookahead)
        if f > frames:
            raise ValueError(f"prompt_feat has {f} frames, more than the {frames} the tokens make")
        return n_timesteps, tokens, frames

    def _conditions(
        self, embedding: Tensor, prompt_feat: Tensor, start: int, frames: int
    ) -> tuple[Tensor, Tensor]:
        # the projected speaker embedding (B, 80) and the prompt-mel condition of frames start..frames-1
        weight = self.spk_embed_affine_layer.weight
        spks = self.spk_embed_affine_layer(
            F.normalize(embedding.to(device=weight.device, dtype=weight.dtype), dim=1)
        )
        cond = torch.zeros(
            spks.shape[0], self.output_size, frames - start, device=weight.device, dtype=weight.dtype
        )
        f = min(prompt_feat.shape[1], frames)  # a prompt's prefill stops before its last frames
        if f > start:
            cond[:, :, : f - start] = (
                prompt_feat[:, start:f].to(device=weight.device, dtype=weight.dtype).transpose(1, 2)
            )
        return spks, cond

    def chunk(
        self,
        token: Tensor,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        *,
        stream: FlowStream,
        finalize: bool = False,
        n_timesteps: int | None = None,
    ) -> Chunk:
        """A stream's call (:meth:`inference`'s arguments for one row, checked; :meth:`takes_chunk`), for
        :meth:`run_chunks`: alone, or stacked with other streams' chunks of the same :attr:`Chunk.shape`. Only a
        bounded stream's call may finalize (chunk-causal, no lookahead)."""
        if finalize and not stream.context:
            raise ValueError(
                "an unbounded stream's last call is computed whole: inference without the stream"
            )
        n_timesteps, tokens, frames = self._plan(token, prompt_token, prompt_feat, finalize, n_timesteps)
        stream.prompt = self.token_mel_ratio * prompt_token.shape[1]
        lookahead = 0 if finalize else self.pre_lookahead_len
        return self._new_chunk(
            stream, tokens, prompt_feat, embedding, frames, prompt_feat.shape[1], n_timesteps, lookahead
        )

    def _new_chunk(
        self,
        stream: FlowStream,
        tokens: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        frames: int,
        skip: int,
        n_timesteps: int,
        lookahead: int,
    ) -> Chunk:
        if n_timesteps != stream.n_timesteps:
            raise ValueError(f"this stream runs {stream.n_timesteps} Euler steps, not {n_timesteps}")
        if frames <= stream.frames:
            raise ValueError(
                f"a stream's call must add frames: it keeps {stream.frames}, this call makes {frames}"
            )
        if tokens.shape[0] != 1:
            raise ValueError(f"a stream's call is one row, got {tokens.shape[0]}")
        return Chunk(stream, tokens, prompt_feat, embedding, frames, skip, lookahead)

    @torch.inference_mode()
    def run_chunks(self, chunks: Sequence[Chunk], should_stop: ShouldStop | None = None) -> list[Tensor]:
        """Run streams' chunks (:meth:`chunk`) as one batch: one estimator call per Euler step over every
        stream's rows (both CFG rows of each), each row at its own offset (rotary positions, convolution tails)
        against its own kept frames (bounded streams' included: each keeps what its context leaves, the rows
        right-aligned and masked). A chunk computes the frames after those its stream keeps, keeps the new whole
        attention chunks (none by a bounded stream's last call) and trims a bounded stream's oldest.

        Args:
            chunks: of distinct streams, all of the same :attr:`Chunk.shape` (one chunk: exactly the unstacked call).
            should_stop: asked before each Euler step (:class:`cosyserve.core.stop.Stopped` once it says True).
        Returns:
            each chunk's (1, n_mels, M) float32 mel after its prompt (the kept frames' as they were computed): what
            :meth:`inference` gives for it alone, within float rounding.
        """
        shape = chunks[0].shape
        if any(c.shape != shape for c in chunks) or len({id(c.stream) for c in chunks}) < len(chunks):
            raise ValueError(
                f"run_chunks takes chunks of distinct streams and equal shapes, got {len(chunks)}"
            )
        parts = [self._chunk_inputs(c) for c in chunks]  # each: mu (1, n_mels, n), spks, cond, noise
        steps = shape[1]
        caches: Sequence[StepState]
        if len(chunks) == 1:
            (mu, spks, cond, noise), caches = parts[0], chunks[0].stream.steps
        else:
            mu, spks, cond, noise = (torch.cat(xs) for xs in zip(*parts, strict=True))  # (B, ...)
            caches = [StepRows([c.stream.steps[i] for c in chunks]) for i in range(steps)]
        mel = self.decoder(mu, spks, cond, noise, steps, True, should_stop, caches)  # (B, n_mels, n)
        rows = [mel] if len(chunks) == 1 else [m.clone() for m in mel.split(1)]
        return [self._chunk_done(c, m) for c, m in zip(chunks, rows, strict=True)]

    def _chunk_inputs(self, c: Chunk) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        # a chunk's mu, spks, cond and noise of frames stream.frames .. c.frames-1; the stream's caches set for
        # the call (its encoder's run here, per stream)
        stream, ratio = c.stream, self.token_mel_ratio
        start, keep = stream.frames, c.keep
        spks, cond = self._conditions(c.embedding, c.prompt_feat, start, c.frames)
        device = spks.device
        first = start // ratio
        lead = min(first, self.LEAD)
        x = self.input_embedding(c.tokens[:, first - lead :].to(device).clamp(min=0))
        self._begin_encoder(stream, start, keep)
        mu = self._mu(x, c.lookahead, True, stream, lead)
        for cache in stream.steps:
            cache.begin(start, keep - start, stream.split)
        return mu, spks, cond, fixed_noise(c.frames, device, spks.dtype, start)

    def _chunk_done(self, c: Chunk, mel: Tensor) -> Tensor:
        # keep the whole attention chunks of a chunk's new frames (mel: (1, n_mels, n)) and trim a bounded stream;
        # every frame's mel after the prompt (the kept ones' as they were computed)
        stream = c.stream
        start, keep = stream.frames, c.keep
        kept = mel[:, :, : keep - start]
        stream.mel = kept if stream.mel is None else torch.cat([stream.mel, kept], dim=2)
        whole = mel if start == 0 else torch.cat([stream.mel[:, :, :start], mel], dim=2)
        stream.frames = keep
        stream.trim()
        return whole[:, :, c.skip :]

    @torch.inference_mode()
    def prefill(
        self,
        stream: FlowStream,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        should_stop: ShouldStop | None = None,
    ) -> FlowStream:
        """Keep in the empty ``stream`` every frame that depends on the prompt alone (whole attention chunks of
        the frames of prompt tokens whose lookahead is prompt too): what a registered voice computes once. A
        request's stream forked from it (:meth:`FlowStream.fork`) continues with the same prompt, embedding and
        steps. Returns ``stream``."""
        if stream.frames:
            raise ValueError("prefill needs an empty stream")
        ratio, lookahead = self.token_mel_ratio, self.pre_lookahead_len
        keep = stream.kept_until(ratio * (prompt_token.shape[1] - lookahead))
        if keep > 0:
            tokens = prompt_token[:, : keep // ratio + lookahead]
            chunk = self._new_chunk(
                stream, tokens, prompt_feat, embedding, keep, 0, stream.n_timesteps, lookahead
            )
            self.run_chunks([chunk], should_stop)
        return stream

    def stream_from_arrays(self, tensors: dict[str, Tensor], meta: dict[str, str]) -> FlowStream:
        """A stream from what :meth:`FlowStream.to_arrays` gave (a stored voice state), on this flow's device."""
        device = self.spk_embed_affine_layer.weight.device
        return FlowStream.from_arrays({k: t.to(device) for k, t in tensors.items()}, meta)


class CausalMaskedDiffWithXvec(ChunkFlow):
    REPEATED_STACKS = ("encoder.encoders", "encoder.up_encoders", "decoder.estimator.mid_blocks")
    ROW_TABLES = ("input_embedding.weight",)

    def __init__(self, cfg: CausalFlowConfig):
        super().__init__()
        self.cfg = cfg
        self.input_size = cfg.input_size
        self.output_size = cfg.output_size
        self.pre_lookahead_len = cfg.pre_lookahead_len
        self.token_mel_ratio = cfg.token_mel_ratio
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.encoder = UpsampleConformerEncoder(cfg.encoder)
        self.encoder_proj = nn.Linear(cfg.encoder.output_size, cfg.output_size)
        self.decoder = CausalConditionalCFM(cfg.decoder)

    @property
    def streams(self) -> bool:
        return super().streams and self.encoder.cfg.static_chunk_size > 0

    @property
    def granularity(self) -> int:
        return math.lcm(super().granularity, self.encoder.cfg.static_chunk_size * self.token_mel_ratio)

    def _encoder_caches(self) -> int:
        return 2  # token rate (the conformer layers), mel rate (upsampling conv, up layers)

    def _begin_encoder(self, stream: FlowStream, start: int, keep: int) -> None:
        ratio = self.token_mel_ratio
        tokens, frames = stream.encoder
        tokens.begin(start // ratio, (keep - start) // ratio)
        frames.begin(start, keep - start)

    def _mu(self, x: Tensor, lookahead: int, streaming: bool, stream: FlowStream | None, lead: int) -> Tensor:
        context = x[:, -lookahead:] if lookahead else None
        caches = stream.encoder if stream is not None else None
        h = self.encoder(
            x[:, : x.shape[1] - lookahead], context, streaming=streaming, caches=caches, lead=lead
        )
        return self.encoder_proj(h).transpose(1, 2).contiguous()  # (B, n_mels, N)
