"""CosyVoice2's and CosyVoice3's token2wav models on the lite graphs (:mod:`cosyserve.bundle.lite.export_chunkflow`),
driven by numpy; nothing here imports torch.

:class:`LiteChunkFlow` is :class:`cosyserve.models.causal_flow.ChunkFlow` in numpy: ``mu`` from the ``flow_mu``
graph (``flow_mu_stream`` for a streamed chunk), the speaker affine and the prompt condition, then the Euler steps
over the one ``flow_estimator`` graph from the fixed noise (a table). A request's :class:`LiteFlowStream` keeps,
per Euler step, the final frames' attention keys and values and the causal convs' tails (the torch
:class:`~cosyserve.models.flow_stream.FlowStream`'s), so that a streamed chunk computes its own frames only: the
graph takes the kept rows as an input (the first rows of a buffer, bound without a copy) and writes the new final
ones after them; CosyVoice2's encoder keeps its state the same way (its ``flow_mu_stream`` graph). A registered
voice's prompt frames go through the same steps once (:meth:`LiteChunkFlow.prefill`, kept by
:class:`~cosyserve.voices.voicestates.VoiceStates` as the torch flow's are); a request's stream forks them
(:meth:`LiteFlowStream.fork`: the graphs take the voice's read-only rows as an input of their own, ``kv*_voice``,
read before the stream's own kept rows, so a fork never copies them; an older bundle's graphs without that input
get them copied into the stream's buffer at its first call, as before). :class:`LiteCausalVocoder` is
:class:`cosyserve.models.causal_hift.CausalHiFTGenerator`: the f0 graph, the causal sine source in numpy (the
reference's SineGen2, the model's fixed noise buffers given), the STFT, the spectrum graph and the iSTFT; a
:class:`LiteVocoderStream` keeps the mel of its receptive field, the source's phase and its place in the noise, so
a chunk vocodes its new frames (plus that context) only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from cosyserve.core.sampling import ArrayOps
from cosyserve.core.stop import ShouldStop, check
from cosyserve.models import lite_dsp as dsp
from cosyserve.models.flow_window import kept_after, takes_chunk
from cosyserve.runtime.lite import terminate
from cosyserve.runtime.lite.flowstream import LiteFlowStream, StepState, empty_state
from cosyserve.runtime.lite.models import LiteVocoder

__all__ = ["LiteCausalVocoder", "LiteChunkFlow", "LiteFlowStream", "LiteVocoder2", "LiteVocoderStream"]


class LiteChunkFlow:
    """Speech tokens after a prompt -> mel over the ``flow_mu*`` graphs and the one ``flow_estimator`` graph."""

    def __init__(self, bundle: Any, tables: dict[str, np.ndarray], n_timesteps: int | None = None) -> None:
        c = bundle.config["flow"]
        self.bundle = bundle
        self.cfg = SimpleNamespace(**c)  # attributes, as the torch flow's config
        self.input_frame_rate = int(c["input_frame_rate"])
        self.output_size = int(c["output_size"])
        self.in_channels = int(c["in_channels"])
        self.token_mel_ratio = int(c["token_mel_ratio"])
        self.pre_lookahead_len = int(c["pre_lookahead_len"])
        self.n_timesteps = int(n_timesteps or c["n_timesteps"])
        self.scheduler = str(c["t_scheduler"])
        self.cfg_rate = np.float32(c["inference_cfg_rate"])
        self.granularity = int(c["chunk_frames"])
        self.attention = int(c["attention_chunk"])
        self.kv_shape = tuple(int(n) for n in c["kv_shape"])  # (layers, heads, head_dim)
        self.tails = [tuple(int(n) for n in t) for t in c["tails"]]  # (channels, frames) per causal conv
        self.streams = bool(c["streams"])  # whether a stream keeps its final frames (the torch flow's rule)
        self.mu_lead = int(c["mu_lead"])  # tokens of left context a chunk's mu needs
        # CosyVoice2: flow_mu_stream keeps the encoder's state too, per rate (its kept keys and values' (layers, heads,
        # head_dim) and its convs' tails: the upsampling conv's at mel rate); None: the flow has no encoder
        enc = c.get("encoder_state")
        self.encoder_state = None
        if enc is not None:
            self.encoder_state = [(tuple(enc["tokens"]), []), (tuple(enc["frames"]), [tuple(enc["tail"])])]
        self.spk_w, self.spk_b = tables["flow.spk_affine.weight"], tables["flow.spk_affine.bias"]
        self.noise = tables["flow.noise"]  # (80, frames): the reference's fixed noise
        self._reads: dict[str, set[str]] = {}  # each graph's inputs
        self.bounds = enc is None or bool(enc.get("ahead"))  # a stream may be bounded: see inference

    ops = ArrayOps(np)  # the array ops of the token2wav that drives it (numpy's)

    @property
    def N_TIMESTEPS(self) -> int:  # noqa: N802 - the torch ChunkFlow's name, which VoiceStates reads
        """The Euler steps a stream runs when none are named."""
        return self.n_timesteps

    @property
    def frame_rate(self) -> int:
        """Mel frames per second of speech."""
        return self.input_frame_rate * self.token_mel_ratio

    def state_frame_bytes(self, n_timesteps: int | None = None) -> float:
        """Bytes a stream keeps per final frame: every estimator layer's keys and values for both CFG rows at every
        Euler step, and CosyVoice2's encoder's once (its token rate's per token) in float32."""
        layers, heads, head_dim = self.kv_shape
        steps = self.n_timesteps if n_timesteps is None else n_timesteps
        encoder = [
            math.prod(kv) * 2 * 4 for kv, _ in self.encoder_state or ()
        ]  # per row: (layers, H, D) x k, v
        per_token = encoder[0] / self.token_mel_ratio if encoder else 0.0
        return steps * layers * 2 * 2 * heads * head_dim * 4 + per_token + sum(encoder[1:])

    def new_stream(self, n_timesteps: int | None = None) -> LiteFlowStream | None:
        """An empty :class:`LiteFlowStream` for a request's chunks (None when this flow cannot keep frames), as
        :meth:`cosyserve.models.causal_flow.ChunkFlow.new_stream`."""
        if not self.streams:
            return None
        steps = self.n_timesteps if n_timesteps is None else n_timesteps
        steps = [empty_state(self.kv_shape, self.tails, 2) for _ in range(steps)]
        return LiteFlowStream(self.granularity, len(steps), steps, self._empty_encoder())

    def _empty_encoder(self) -> list[StepState]:
        # CosyVoice2's encoder state at the start of a stream (its token rate's, its mel rate's); none for CosyVoice3
        return [empty_state(kv, tails, 1) for kv, tails in self.encoder_state or ()]

    def inference(
        self,
        token: np.ndarray,
        prompt_token: np.ndarray,
        prompt_feat: np.ndarray,
        embedding: np.ndarray,
        streaming: bool,
        finalize: bool,
        *,
        n_timesteps: int | None = None,
        should_stop: ShouldStop | None = None,
        stream: LiteFlowStream | None = None,
    ) -> np.ndarray:
        """The torch flow's ``inference`` (:meth:`cosyserve.models.causal_flow.ChunkFlow.inference`), the same
        shapes in numpy: mel (1, 80, M) float32 of ``token`` after the prompt.

        Args:
            token, prompt_token: (1, T), (1, P) speech token ids.
            prompt_feat: (1, F, 80) prompt mel.
            embedding: (1, 192) speaker x-vector.
            streaming, finalize: a streamed chunk (chunk attention, the last ``pre_lookahead_len`` tokens
                lookahead only) or the utterance's end (full attention, no lookahead): the two calls the
                reference's token2wav makes.
            stream: the request's :class:`LiteFlowStream` (:meth:`new_stream`), for a streamed chunk: only the
                frames after the ones it keeps are computed, and it keeps the new final ones; the last call
                ignores an unbounded one (computed whole) and goes through a bounded one (``stream.context``)
                as the torch flow's (:mod:`cosyserve.models.flow_window`).
        """
        if streaming == finalize and not (stream is not None and stream.context):
            raise ValueError(
                "the lite flow runs a streamed chunk (streaming, not finalize) or the utterance's end (finalize, "
                f"not streaming); got streaming={streaming}, finalize={finalize}"
            )
        steps = n_timesteps or self.n_timesteps
        look = 0 if finalize else self.pre_lookahead_len
        if token.shape[1] <= look:
            raise ValueError(
                f"a chunk that does not finalize needs more than {look} tokens (the last {look} are "
                f"lookahead), got {token.shape[1]}"
            )
        ids = np.concatenate([prompt_token, token], axis=1).astype(np.int64)
        f = prompt_feat.shape[1]
        frames = self.token_mel_ratio * (ids.shape[1] - look)
        if f > frames:
            raise ValueError(f"prompt_feat has {f} frames, more than the {frames} the tokens make")
        if stream is None or not takes_chunk(bool(stream.context), streaming, finalize):
            scratch = empty_state(self.kv_shape, self.tails, 2)  # a whole call keeps nothing: one state
            whole = LiteFlowStream(self.granularity, steps, [scratch] * steps, self._empty_encoder())
            mel = self._chunk(whole, 0, ids, prompt_feat[0], embedding, frames, streaming, should_stop, look)
            return mel[:, :, f:]
        if steps != stream.n_timesteps:
            raise ValueError(f"this stream runs {stream.n_timesteps} Euler steps, not {steps}")
        if finalize and not self.bounds:
            raise ValueError(
                "this bundle's CosyVoice2 encoder graph (flow_mu_stream) always reads its lookahead tokens: a "
                "bounded stream's last call (no lookahead) needs the bundle converted again"
            )
        stream.prompt = self.token_mel_ratio * prompt_token.shape[1]
        keep = kept_after(stream.frames, frames, stream.granularity, look)
        mel = self._chunk(stream, keep, ids, prompt_feat[0], embedding, frames, True, should_stop, look)
        stream.trim()
        return mel[:, :, f:]

    def prefill(
        self,
        stream: LiteFlowStream,
        prompt_token: np.ndarray,
        prompt_feat: np.ndarray,
        embedding: np.ndarray,
        should_stop: ShouldStop | None = None,
    ) -> LiteFlowStream:
        """Keep in the empty ``stream`` every frame that depends on the prompt alone (whole attention chunks of the
        frames of prompt tokens whose lookahead is prompt too), as the torch flow's
        :meth:`~cosyserve.models.causal_flow.ChunkFlow.prefill`: what a registered voice computes once. Its arrays
        are made read-only (a request forks them, :meth:`LiteFlowStream.fork`, and writes its own). Returns
        ``stream``."""
        if stream.frames:
            raise ValueError("prefill needs an empty stream")
        ratio, look = self.token_mel_ratio, self.pre_lookahead_len
        keep = stream.kept_until(ratio * (prompt_token.shape[1] - look))
        if keep > 0:
            ids = prompt_token[:, : keep // ratio + look].astype(np.int64)
            self._chunk(stream, keep, ids, prompt_feat[0], embedding, keep, True, should_stop, look)
        stream.freeze()
        return stream

    def stream_from_arrays(self, arrays: dict[str, np.ndarray], meta: dict[str, str]) -> LiteFlowStream:
        """A stream from what :meth:`LiteFlowStream.to_arrays` gave (a stored voice state, mapped read-only)."""
        steps = int(meta["n_timesteps"])
        stream = LiteFlowStream(
            int(meta["granularity"]), steps, [], frames=int(meta["frames"]), mel=arrays.get("mel")
        )
        shapes = [(self.kv_shape, self.tails, 2)] * steps + [(kv, t, 1) for kv, t in self.encoder_state or ()]
        if int(meta["encoder"]) != len(shapes) - steps:
            raise ValueError(
                f"the stored state has {meta['encoder']} encoder states, this flow {len(shapes) - steps}"
            )
        for n, (kv_shape, tail_shapes, batch) in enumerate(shapes):
            name = f"s{n}" if n < steps else f"e{n - steps}"
            kv = arrays[f"{name}.kv"]
            tails = [arrays[f"{name}.t{j}"] for j in range(len(tail_shapes))]
            if kv.shape[1:] != (kv_shape[0], 2, batch, *kv_shape[1:]) or any(
                t.shape != (batch, *s) for t, s in zip(tails, tail_shapes, strict=True)
            ):
                raise ValueError(f"state {name} is not this flow's (keys and values {kv.shape})")
            (stream.steps if n < steps else stream.encoder).append(StepState(kv, tails, int(kv.shape[0])))
        stream.freeze()
        return stream

    def _chunk(
        self,
        stream: LiteFlowStream,
        keep: int,
        ids: np.ndarray,
        prompt_feat: np.ndarray,
        embedding: np.ndarray,
        frames: int,
        streaming: bool,
        should_stop: ShouldStop | None,
        look: int,
    ) -> np.ndarray:
        # frames stream.frames .. frames-1 computed (ChunkFlow.run_chunks' rule), those before `keep` kept, the last
        # `look` tokens lookahead only; returns the mel (1, 80, frames) of every frame (the kept ones' as computed)
        start, ratio, n = stream.frames, self.token_mel_ratio, self.output_size
        if frames <= start:
            raise ValueError(f"a stream's call must add frames: it keeps {start}, this call makes {frames}")
        if frames > self.noise.shape[1]:
            raise ValueError(
                f"the flow's fixed noise has {self.noise.shape[1]} frames; {frames} were asked for"
            )
        first = start // ratio
        lead = min(first, self.mu_lead)
        if streaming and stream.encoder:  # CosyVoice2: its encoder runs the new tokens on its state
            mu = self._encode(
                stream.encoder, ids[:, first - lead :], lead, (keep - start) // ratio, should_stop, look
            )
        else:
            # CosyVoice3's mu reads no attention: flow_mu (no lookahead) serves a bounded stream's last call too
            suffix = "_stream" if look else ""
            (mu,) = terminate.run(
                self.bundle.session("flow_mu" + suffix), {"tokens": ids[:, first - lead :]}, should_stop
            )
            mu = mu[:, :, lead * ratio :]
        m = frames - start
        h = np.zeros((2, self.in_channels, m), np.float32)  # rows: conditioned, unconditioned
        h[0, n : 2 * n] = mu[0]
        h[0, 2 * n : 3 * n] = (dsp.normalize(embedding) @ self.spk_w.T + self.spk_b)[0][:, None]
        f = min(prompt_feat.shape[0], frames)  # a prompt's prefill stops before its last frames
        if f > start:
            h[0, 3 * n :, : f - start] = prompt_feat[start:f].T
        mask = np.ones((m, m), bool)  # full attention (the torch estimators' rule for a chunk size of 0 too)
        if streaming and self.attention > 0:
            i = np.arange(m)  # a call starts at a chunk boundary: its own frames' chunk mask is the same
            mask = i[None, :] < (i // self.attention + 1)[:, None] * self.attention
        x = self.noise[:, start:frames].astype(np.float32)
        rate, commit, offset = self.cfg_rate, keep - start, np.array(start, np.int64)
        for step, (t, dt) in zip(
            stream.steps, dsp.euler_schedule(stream.n_timesteps, self.scheduler), strict=True
        ):
            check(should_stop)
            h[:, :n] = x
            v = self._estimate(h, np.full(2, t, np.float32), mask, offset, step, commit, should_stop)
            x = x + dt * ((np.float32(1.0) + rate) * v[0] - rate * v[1])
        mel = x[None]
        if commit:
            stream.mel = (
                mel[:, :, :commit]
                if stream.mel is None
                else np.concatenate([stream.mel, mel[:, :, :commit]], axis=2)
            )
            stream.lent_mel = False
        whole = mel if start == 0 else np.concatenate([stream.mel[:, :, :start], mel], axis=2)
        stream.frames = keep
        return whole.astype(np.float32)

    def _estimate(
        self,
        h: np.ndarray,
        t: np.ndarray,
        mask: np.ndarray,
        offset: np.ndarray,
        step: StepState,
        commit: int,
        should_stop: ShouldStop | None,
    ) -> np.ndarray:
        # one estimator run over the call's frames after the ones the step keeps: its kept rows bound as the input,
        # the keys and values of the first `commit` frames written into the rows after them in the same buffer,
        # the convs' tails at the new boundary; -> v (2, 80, m)
        v = np.empty((2, self.output_size, h.shape[2]), np.float32)
        inputs = {"h": h, "t": t, "mask": mask, "offset": offset, "commit": np.array(commit, np.int64)}
        outputs: dict[str, np.ndarray | None] = {"v": v}
        self._bind_state("flow_estimator", step, "", commit, inputs, outputs)
        self._run_bound("flow_estimator", inputs, outputs, should_stop)
        self._keep_state(step, "", commit, outputs)
        return v

    def _encode(
        self,
        states: list[StepState],
        tokens: np.ndarray,
        lead: int,
        commit: int,
        should_stop: ShouldStop | None,
        look: int | None = None,
    ) -> np.ndarray:
        # CosyVoice2's flow_mu_stream: the call's own tokens (after `lead` of left context, before the lookahead; none
        # with `look` 0, a bounded stream's last call: placeholder tokens the graph zeroes by `ahead`)
        # against the encoder's kept state (its token rate's, its mel rate's), the first `commit` tokens' keys and
        # values (and their frames') written after the kept rows, the upsampling conv's tail at the new boundary;
        # -> mu (1, 80, ratio * own tokens)
        ratio, ahead = self.token_mel_ratio, look != 0
        if not ahead:
            tokens = np.concatenate([tokens, np.zeros((1, self.pre_lookahead_len), tokens.dtype)], axis=1)
        own = tokens.shape[1] - lead - self.pre_lookahead_len
        mu = np.empty((1, self.output_size, ratio * own), np.float32)
        inputs = {"tokens": tokens.astype(np.int64), "lead": np.zeros(lead, np.int64)}
        inputs["commit"], inputs["ahead"] = np.array(commit, np.int64), np.full(1, float(ahead), np.float32)
        outputs: dict[str, np.ndarray | None] = {"mu": mu}
        rates = (("_tok", commit), ("_mel", ratio * commit))
        for state, (name, rows) in zip(states, rates, strict=True):
            self._bind_state("flow_mu_stream", state, name, rows, inputs, outputs)
        self._run_bound("flow_mu_stream", inputs, outputs, should_stop)
        for state, (name, rows) in zip(states, rates, strict=True):
            self._keep_state(state, name, rows, outputs)
        return mu

    def _bind_state(
        self, graph: str, state: StepState, name: str, commit: int, inputs: dict[str, Any], outputs: dict[str, Any]
    ) -> None:  # fmt: skip
        # a kept state's arrays for `graph`: a voice's rows as the input kv{name}_voice (0 rows: none), the stream's
        # own kept rows as kv{name}, the rows after them (room made) for the first `commit` new ones as the output
        # kv{name}_new (None: no rows, ORT's own), its tails and new ones. A graph without kv{name}_voice (converted
        # before it) takes every kept row as kv{name}: the voice's are copied into the stream's buffer first
        state.reserve(commit, share=f"kv{name}_voice" in self._inputs(graph))
        own = state.own
        inputs[f"kv{name}_voice"] = state.kv[:0] if state.voice is None else state.voice
        inputs[f"kv{name}"] = state.kv[:own]
        outputs[f"kv{name}_new"] = state.kv[own : own + commit] if commit else None
        for j, tail in enumerate(state.tails):
            inputs[f"tail{j}"], outputs[f"new_tail{j}"] = tail, np.empty_like(tail)

    @staticmethod
    def _keep_state(state: StepState, name: str, commit: int, outputs: dict[str, Any]) -> None:
        # after the run: the new rows are kept, the tails at the new boundary
        state.keep(commit, [outputs[f"new_tail{j}"] for j in range(len(state.tails))])

    def _inputs(self, graph: str) -> set[str]:
        # the names of `graph`'s inputs
        reads = self._reads.get(graph)
        if reads is None:
            reads = self._reads[graph] = {i.name for i in self.bundle.session(graph).get_inputs()}
        return reads

    def _run_bound(
        self,
        graph: str,
        inputs: dict[str, np.ndarray],
        outputs: dict[str, np.ndarray | None],
        should_stop: ShouldStop | None,
    ) -> None:
        # one run of `graph` with its inputs and outputs bound to these arrays (ONNX Runtime's IO binding: nothing
        # copied; an output given as None is ORT's own); an input the graph does not read is not fed (CosyVoice2's
        # estimator reads no offset: no positions)
        import onnxruntime as ort

        sess, reads = self.bundle.session(graph), self._inputs(graph)
        io = sess.io_binding()
        keep = []  # the OrtValues over the arrays live until the run ends
        for name, arr in inputs.items():
            if name in reads:
                keep.append(ort.OrtValue.ortvalue_from_numpy(arr))
                io.bind_ortvalue_input(name, keep[-1])
        for name, out in outputs.items():
            if out is None:
                io.bind_output(name)
            else:
                keep.append(ort.OrtValue.ortvalue_from_numpy(out))
                io.bind_ortvalue_output(name, keep[-1])
        terminate.run_bound(sess, io, should_stop)


class LiteCausalVocoder:
    """CosyVoice3's causal vocoder: mel -> audio over the ``hift_f0`` and ``hift_decode`` graphs."""

    def __init__(self, bundle: Any, tables: dict[str, np.ndarray]) -> None:
        self.bundle = bundle
        self.cfg = SimpleNamespace(**bundle.config["hift"])  # attributes, as the torch vocoder's config
        c = self.cfg
        self.w, self.b = tables["hift.source.weight"], tables["hift.source.bias"]
        self.harmonics = int(c.nb_harmonics) + 1
        self.upsample = int(c.upsample_factor)
        self.lookahead = int(c.lookahead)

    def _f0(self, mel: np.ndarray, finalize: bool, should_stop: ShouldStop | None) -> np.ndarray:
        # mel (80, T) -> f0 (T,) finalizing (3 zero frames of lookahead), else (T - 3,)
        if finalize:
            mel = np.pad(mel, ((0, 0), (0, int(self.cfg.f0_lookahead))))
        (f0,) = terminate.run(
            self.bundle.session("hift_f0"), {"mel": mel[None].astype(np.float32)}, should_stop
        )
        return f0[0]

    def _source(
        self, f0: np.ndarray, rand_ini: np.ndarray, noise: np.ndarray, carry: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        # SineGen2 as the torch vocoder's _causal_source: f0 (T,) -> (excitation (T * 480,), the phase carry (H,)
        # float64); `noise` (>= T * 480, H) the noise of its samples; `carry` the sum of the earlier frames' phase
        # increments (None: these are the first frames, which take rand_ini)
        c, scale, H = self.cfg, self.upsample, self.harmonics
        f0 = np.repeat(f0.astype(np.float32), scale)[:, None]  # (L, 1) nearest
        L = f0.shape[0]
        if noise.shape[0] < L or noise.shape[1] != H or rand_ini.shape[-1] != H:
            raise ValueError(f"sine_waves must be (>= {L}, {H}) and rand_ini ({H},)")
        harmonics = np.arange(1, H + 1, dtype=np.float32)[None, :]
        rad = (f0 * harmonics / np.float32(c.sampling_rate)) % np.float32(1)  # (L, H)
        if carry is None:
            rad[0] = rad[0] + rand_ini.reshape(-1).astype(np.float32)
            carry = np.zeros(H, np.float64)
        rad = _frame_mean(rad, scale)  # (T, H): linear downsampling by `scale`
        # the float64 sum carried over from the earlier frames, as the torch vocoder's (the whole sequence's values)
        sums = np.cumsum(np.concatenate([carry[None], rad.astype(np.float64)]), axis=0)[1:]
        phase = sums.astype(np.float32) * np.float32(2 * math.pi)  # (T, H)
        phase = np.repeat(phase * np.float32(scale), scale, axis=0)  # (L, H)
        sine = np.sin(phase) * np.float32(c.nsf_alpha)
        uv = (f0 > np.float32(c.nsf_voiced_threshold)).astype(np.float32)
        noise_amp = uv * np.float32(c.nsf_sigma) + (np.float32(1) - uv) * np.float32(c.nsf_alpha / 3)
        sine = sine * uv + noise_amp * noise[:L].astype(np.float32)
        return np.tanh(sine @ self.w.reshape(-1) + self.b.reshape(-1)[0]).astype(np.float32), sums[-1]

    def new_stream(self, whole: bool = False) -> LiteVocoderStream:
        """A stream's state for :meth:`stream` (``whole``: keep every frame, the reference's re-run)."""
        return LiteVocoderStream(whole=whole)

    def stream(
        self,
        state: LiteVocoderStream,
        mel: np.ndarray,
        finalize: bool,
        *,
        rand_ini: np.ndarray,
        sine_waves: np.ndarray,
        should_stop: ShouldStop | None = None,
    ) -> np.ndarray:
        """The torch vocoder's ``stream`` (:meth:`cosyserve.models.causal_hift.CausalHiFTGenerator.stream_rows`
        for one stream): the samples that :meth:`inference` on every frame so far would give after those already
        emitted, from the frames ``state`` keeps (the decoder's and the f0 predictor's left context), the phase
        it carries and ``mel`` (1, 80, n more frames); returns (1, samples)."""
        scale = self.upsample
        mel = mel[0] if state.mel is None else np.concatenate([state.mel, mel[0]], axis=1)
        n = mel.shape[1]  # (80, n) from the stream's first kept frame
        if not finalize and state.start + n <= self.lookahead:
            raise ValueError(
                f"a vocoder call that does not finalize needs more than {self.lookahead} mel frames, got {n}"
            )
        known, emitted = state.f0_frames - state.start, state.emitted - state.start * scale
        until = n if finalize else n - int(self.cfg.f0_lookahead)  # frames whose excitation this call makes
        source, phase = state.source, state.phase
        if until > known:
            read = max(0, known - int(self.cfg.f0_context))  # the f0 predictor's context of the new frames
            f0 = self._f0(mel[:, read:], finalize, should_stop)[known - read :]
            at = (state.start + known) * scale  # the new frames' place in the noise
            new, phase = self._source(f0, rand_ini[0], sine_waves[0][at:], phase)
            source = new if source is None else np.concatenate([source, new])
        assert source is not None and phase is not None
        speech = self._decode(mel[:, :until], source, finalize, should_stop)[emitted:]
        # what the next call re-reads: the decoder's context before its first new frame, the f0 predictor's
        keep = 0
        if not state.whole:
            keep = max(
                0,
                min(
                    (emitted + speech.shape[0]) // scale - int(self.cfg.context),
                    until - int(self.cfg.f0_context),
                ),
            )
        state.f0_frames = state.start + max(until, known)
        state.emitted += speech.shape[0]
        state.mel, state.source, state.phase = mel[:, keep:], source[keep * scale :], phase
        state.start += keep
        return speech[None]

    def inference(
        self,
        mel: np.ndarray,
        finalize: bool,
        rand_ini: np.ndarray,
        sine_waves: np.ndarray,
        should_stop: ShouldStop | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The torch vocoder's ``inference``, the same shapes in numpy: mel (1, 80, T) -> (speech (1, T * 480)
        finalizing, else (1, (T - 8) * 480); the source excitation (1, 1, L)). ``rand_ini`` (1, H),
        ``sine_waves`` (1, >= L, H): the model's fixed noise buffers."""
        mel = mel[0]
        if not finalize and mel.shape[1] <= self.lookahead:
            raise ValueError(
                f"a vocoder call that does not finalize needs more than {self.lookahead} mel frames, "
                f"got {mel.shape[1]}"
            )
        source, _ = self._source(self._f0(mel, finalize, should_stop), rand_ini[0], sine_waves[0])
        if not finalize:
            mel = mel[:, : -int(self.cfg.f0_lookahead)]
        return self._decode(mel, source, finalize, should_stop)[None], source[None, None]

    def _decode(
        self, mel: np.ndarray, source: np.ndarray, finalize: bool, should_stop: ShouldStop | None
    ) -> np.ndarray:
        # the torch vocoder's _causal_decode: mel (80, T) of the frames with an excitation, source (T * 480,) ->
        # speech (T * 480,) finalizing, else ((T - 5) * 480,) (conv_pre's lookahead frames are context)
        c = self.cfg
        n_fft, hop, right = int(c.n_fft), int(c.hop_len), int(c.conv_pre_look_right)
        s_stft = dsp.source_stft(source, n_fft, hop)  # (n_fft + 2, N)
        if finalize:
            mel = np.pad(mel, ((0, 0), (0, right)))  # conv_pre's lookahead sees zeros
        else:
            s_stft = s_stft[:, : -int(c.stft_per_frame) * right]
        feeds = {"mel": mel[None].astype(np.float32), "s_stft": s_stft[None]}
        (x,) = terminate.run(self.bundle.session("hift_decode"), feeds, should_stop)
        speech = dsp.spectrum_wave(x[0], n_fft, hop)
        if not finalize:
            speech = speech[: -self.upsample]
        limit = np.float32(c.audio_limit)
        return np.clip(speech, -limit, limit).astype(np.float32)


@dataclass
class LiteVocoderStream:
    """What a stream's causal vocoder keeps between calls (:class:`~cosyserve.models.causal_hift.VocoderStream`'s,
    in numpy); ``whole`` keeps every frame instead (the reference's re-run, for comparisons)."""

    mel: np.ndarray | None = None  # (80, n) the kept mel frames, from frame `start` on
    source: np.ndarray | None = None  # ((f0_frames - start) * 480,) their excitation
    phase: np.ndarray | None = None  # (H,) float64: the phase increments summed over frames < f0_frames
    start: int = 0
    f0_frames: int = 0  # frames whose excitation is known (a call holds back the f0 predictor's lookahead)
    emitted: int = 0  # samples emitted
    whole: bool = False

    @property
    def frames(self) -> int:
        """Mel frames given so far."""
        return self.start + (0 if self.mel is None else int(self.mel.shape[1]))

    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.mel, self.source, self.phase) if a is not None)


class LiteVocoder2(LiteVocoder):
    """CosyVoice2's 24 kHz HiFT (the reference's SineGen2 source) with the torch vocoder's shapes, for the shared
    :class:`~cosyserve.families.cosyvoice2.token2wav.Token2Wav2`: its draws ``sine_phase`` (1, H) uniform in
    [0, 1) and ``sine_noise`` (1, L, H) standard normal."""

    def _draws(
        self, frames: int, generator: Any, sine_phase: np.ndarray | None, sine_noise: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        # its draws: sine_phase (1, H) uniform in [0, 1), sine_noise (1, L, H) standard normal, given or drawn in
        # that order -> the source's (phase (H,), noise (L, H))
        H, L = self.harmonics, frames * self.upsample
        if sine_phase is None:
            sine_phase = generator.random((1, H), dtype=np.float32)
        if sine_noise is None:
            sine_noise = generator.standard_normal((1, L, H), dtype=np.float32)
        return sine_phase.reshape(-1), sine_noise[0]

    def _source(self, f0: np.ndarray, phase: np.ndarray, noise: np.ndarray) -> np.ndarray:
        # SineGen2 as the torch vocoder's _source2: the phase increments averaged down to the frame rate,
        # integrated there and interpolated back up (linear); phase (H,) in cycles, noise (L, H)
        c, scale, H = self.cfg, self.upsample, self.harmonics
        f0 = np.repeat(f0.astype(np.float32), scale)[:, None]  # (L, 1) nearest
        rad = (
            f0 * np.arange(1, H + 1, dtype=np.float32)[None, :] / np.float32(c["sampling_rate"])
        ) % np.float32(1)
        rand_ini = phase.astype(np.float32).copy()
        rand_ini[0] = 0  # no random phase for the fundamental
        rad[0] = rad[0] + rand_ini
        rad = _frame_mean(rad, scale)  # (T, H)
        phase_t = (
            np.cumsum(rad, axis=0, dtype=np.float64).astype(np.float32) * np.float32(2) * np.float32(math.pi)
        )
        up = dsp.interp_linear(phase_t.T * np.float32(scale), phase_t.shape[0] * scale).T  # (L, H)
        sine = np.sin(up) * np.float32(c["nsf_alpha"])
        uv = (f0 > np.float32(c["nsf_voiced_threshold"])).astype(np.float32)
        noise_amp = uv * np.float32(c["nsf_sigma"]) + (np.float32(1) - uv) * np.float32(c["nsf_alpha"] / 3)
        sine = sine * uv + noise_amp * noise.astype(np.float32)
        return np.tanh(sine @ self.w.reshape(-1) + self.b.reshape(-1)[0]).astype(np.float32)


def _frame_mean(rad: np.ndarray, scale: int) -> np.ndarray:
    # (L, H) -> (L / scale, H): torch's linear interpolation by 1 / scale (align_corners False), which reads the
    # two samples about each frame's centre (the middle one for an odd scale)
    mid = scale // 2
    return (rad[mid - 1 :: scale] + rad[mid::scale]) * np.float32(0.5) if scale % 2 == 0 else rad[mid::scale]
