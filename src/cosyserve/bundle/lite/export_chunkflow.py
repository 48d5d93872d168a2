"""The lite graphs of CosyVoice2's and CosyVoice3's token2wav: the chunk flow and the 24 kHz vocoders.

Flow (:class:`~cosyserve.models.causal_flow.ChunkFlow`: CosyVoice2's conformer encoder and U-Net estimator,
CosyVoice3's lookahead layer and DiT): ``flow_mu`` (speech tokens, prompt then target -> ``mu`` at mel rate, the
utterance's end: no lookahead, full attention), ``flow_mu_stream`` (the same for a streamed chunk: the last
``pre_lookahead_len`` tokens are lookahead only, static chunk attention; the two traced from the same module with
the attention rule fixed) and ONE ``flow_estimator`` for every call (:class:`EstimatorGraph`: the velocity of the
packed CFG batch, the attention mask of the call's own frames an input, chunk attention or full, and a stream's
per-Euler-step state of :mod:`cosyserve.models.flow_stream` as inputs and outputs: the kept frames' keys and
values, the causal convs' tails, the position offset). A streamed chunk thus computes its own frames only, as the
torch flow's; the last call (full attention) passes no kept frames. The flow graphs' weights are stored once:
:func:`share_weights` writes their tensors into one data file, each distinct tensor once. What is cheap stays
numpy: the token embedding lookup happens inside the graphs (a tiny table), the speaker affine, the fixed noise
(a table), the Euler loop, classifier-free guidance and the stream's state (:mod:`cosyserve.runtime.lite.chunkflow`).
CosyVoice2's ``flow_mu_stream`` is its encoder against a stream's kept encoder state (:class:`EncoderGraph`: the
conformer's and the up layers' keys and values, the upsampling conv's tail, as inputs and outputs), so a chunk encodes
its own tokens only, as the torch flow's.

Vocoder: CosyVoice2's :class:`~cosyserve.models.hift.HiFTGenerator` as CosyVoice-300M's (``hift_f0``,
``hift_decode``: :mod:`cosyserve.bundle.lite.export_300m`); CosyVoice3's causal one as ``hift_f0`` (mel with its 3
lookahead frames -> f0 of the others, float32 where the module computes in float64: checked against it) and
``hift_decode`` (mel with conv_pre's lookahead frames and the source's STFT -> the spectrum before the iSTFT). The
finalizing calls' zero padding is numpy's; so are the sine source, the STFT and the iSTFT.
"""

from __future__ import annotations

import copy
import hashlib
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from cosyserve.bundle.lite.export import Exporter

__all__ = ["export_flow", "export_hift", "share_weights"]


class MuGraph(nn.Module):
    """speech tokens (1, N) int64, prompt then target -> mu (1, 80, ratio * (N - lookahead))."""

    def __init__(self, flow: nn.Module, streaming: bool) -> None:
        super().__init__()
        self.flow = flow
        self.streaming = streaming

    def forward(self, tokens: Tensor) -> Tensor:
        f = self.flow
        x = f.input_embedding(tokens.clamp(min=0))  # (1, N, C)
        return f._mu(x, f.pre_lookahead_len if self.streaming else 0, self.streaming, None, 0)


class _MultiHeadAttention(torch.autograd.Function):
    """Scaled dot-product attention of q (B, H, n, D) over k, v (B, H, T, D) with an additive ``bias`` (1, 1, n, T)
    or None, exported as ONNX Runtime's ``com.microsoft.MultiHeadAttention``: one kernel that computes each head's
    scores, softmax and weighted sum in turn. Why: the traced form (MatMul, Where over the mask, Softmax, the NaN
    guard's IsNaN and Where, MatMul) passes over every head's (n, T) scores six times; at CosyVoice3's zero-shot
    lengths it took half the full-size estimator's time besides its GEMMs (800 frames, 2-core Xeon: Where 1.09 s,
    IsNaN 0.24 s of a 6.1 s call against torch's 4.2 s). No row is all masked (a frame sees itself), so the bias
    masks as the bool mask did."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, heads: int) -> Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    @staticmethod
    def symbolic(g: Any, q: Any, k: Any, v: Any, bias: Any, heads: int) -> Any:
        from torch.onnx import symbolic_helper as sh

        shape = g.op("Constant", value_t=torch.tensor([0, 0, -1]))
        query = g.op("Reshape", g.op("Transpose", q, perm_i=[0, 2, 1, 3]), shape)  # (B, n, H * D)
        none = sh._optional_input_placeholder_tensor(g)
        bias = none if sh._is_none(bias) else bias
        out = g.op("com.microsoft::MultiHeadAttention", query, k, v, none, none, bias, num_heads_i=heads)
        back = g.op("Constant", value_t=torch.tensor([0, 0, heads, -1]))
        return g.op("Transpose", g.op("Reshape", out, back), perm_i=[0, 2, 1, 3])  # (B, H, n, D)


class GraphStepCache:
    """One Euler step's stream state as graph inputs and outputs, with the interface and the rule of
    :class:`~cosyserve.models.flow_stream.StepCache` that the estimator calls: in, the kept frames' keys and values
    as two segments, a registered voice's ``voice`` (V, layers, 2, B, H, D: its read-only rows, which a request's
    stream reads where they are; V = 0 for a stream of its own) then the stream's own ``kv`` (S, layers, 2, B, H,
    D: frames first, so that the runtime's buffer passes its first S rows as they are), each causal conv's left
    frames ``tails`` (B, C, kernel - 1), the first frame's position ``start`` and how many of the call's frames
    become final, ``commit``; out, those frames' keys and values (:meth:`kv_new`,
    (commit, layers, 2, B, H, D), the rows the runtime's buffer takes next) and each conv's tail at the new
    boundary (``new_tails``)."""

    def __init__(
        self, start: Tensor, commit: Tensor, kv: Tensor, tails: tuple[Tensor, ...], voice: Tensor
    ) -> None:
        self.start, self.commit, self.kv, self.tails, self.voice = start, commit, kv, tails, voice
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.new_tails: list[Tensor] = []

    def left(self, x: Tensor, n: int) -> Tensor:
        padded = torch.cat([self.tails[len(self.new_tails)].to(x.dtype), x], dim=2)
        self.new_tails.append(padded.index_select(2, self.commit + torch.arange(n)))
        return padded

    def segments(self, k: Tensor, v: Tensor, dim: int) -> tuple[list[Tensor], list[Tensor]]:
        i, rows = len(self.keys), torch.arange(self.commit)
        self.keys.append(k.movedim(dim, 0).index_select(0, rows))
        self.values.append(v.movedim(dim, 0).index_select(0, rows))
        kept = [(kv[:, i, 0].movedim(0, dim), kv[:, i, 1].movedim(0, dim)) for kv in (self.voice, self.kv)]
        return [*(kk for kk, _ in kept), k], [*(vv for _, vv in kept), v]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        from cosyserve.models.flow_stream import joined

        k, v, seen = joined(*self.segments(k, v, dim=2), mask)
        bias = None  # the mask as an additive bias (1, 1, n, kept + n), -inf = masked
        if seen is not None:
            bias = torch.zeros(seen.shape, dtype=q.dtype).masked_fill(~seen, -math.inf)[None, None]
        return _MultiHeadAttention.apply(q, k, v, bias, int(q.shape[1]))

    def extend(self, k: Tensor, v: Tensor, dim: int) -> tuple[Tensor, Tensor]:
        ks, vs = self.segments(k, v, dim)
        return torch.cat(ks, dim=dim), torch.cat(vs, dim=dim)

    def kv_new(self) -> Tensor:
        # (commit, layers, 2, B, H, D)
        return torch.stack([torch.stack(kv, dim=1) for kv in zip(self.keys, self.values, strict=True)], dim=1)


class EncoderGraph(nn.Module):
    """CosyVoice2's flow encoder for a streamed call against a stream's kept encoder state (the torch flow's
    ``stream.encoder``: a :class:`~cosyserve.models.flow_stream.StepCache` at token rate, one at mel rate), so that
    a chunk encodes its own tokens only: ``tokens`` (1, N) int64, ``lead`` tokens of left context for the lookahead
    layer, the call's own, then the last ``pre_lookahead_len`` (lookahead only); ``lead`` (L,): its length is the
    lead (a shape: the graph slices by it); ``commit`` (int64) own tokens whose frames become final; ``kv_tok`` (S,
    layers, 2, 1, H, D) the kept tokens' keys and values in the conformer layers, ``kv_mel`` (ratio * S, up layers,
    2, 1, H, D) the kept frames' in the up layers, ``tail`` (1, C, 2 * stride) the upsampling conv's input before the
    kept boundary, ``kv_tok_voice``, ``kv_mel_voice`` a registered voice's kept rows, read before the stream's own
    (0 rows: none), ``ahead`` (1,) float32: 1, or 0 for a bounded stream's last call (its lookahead tokens then
    count as none: their embeddings zeroed, as the torch encoder pads a call without lookahead) -> ``mu`` (1, 80,
    ratio * own tokens), ``kv_tok_new`` (commit, ...), ``kv_mel_new`` (ratio * commit, ...), ``new_tail``. No kept
    rows, no lead and commit 0: the whole sequence's streamed ``mu``."""

    def __init__(self, flow: nn.Module) -> None:
        super().__init__()
        self.flow = flow

    def forward(
        self, tokens: Tensor, lead: Tensor, commit: Tensor, kv_tok: Tensor, kv_mel: Tensor, tail: Tensor,
        kv_tok_voice: Tensor, kv_mel_voice: Tensor, ahead: Tensor,
    ) -> tuple[Tensor, ...]:  # fmt: skip
        ratio = self.flow.token_mel_ratio
        caches = [
            GraphStepCache(kv_tok_voice.shape[0] + kv_tok.shape[0], commit, kv_tok, (), kv_tok_voice),
            GraphStepCache(
                kv_mel_voice.shape[0] + kv_mel.shape[0], commit * ratio, kv_mel, (tail,), kv_mel_voice
            ),
        ]
        mu = self._mu(tokens, lead.shape[0], caches, ahead)
        return (mu, caches[0].kv_new(), caches[1].kv_new(), caches[1].new_tails[0])

    def _mu(self, tokens: Tensor, lead: Any, caches: list[Any], ahead: Tensor) -> Tensor:
        f = self.flow
        x = f.input_embedding(tokens.clamp(min=0))
        layer = f.encoder.pre_lookahead_layer
        f.encoder.pre_lookahead_layer = _ScaledContext(layer, ahead)
        try:
            return f._mu(x, f.pre_lookahead_len, True, SimpleNamespace(encoder=caches), lead)
        finally:
            f.encoder.pre_lookahead_layer = layer

    def reference(
        self, tokens: Tensor, lead: Tensor, commit: Tensor, kv_tok: Tensor, kv_mel: Tensor, tail: Tensor,
        kv_tok_voice: Tensor, kv_mel_voice: Tensor, ahead: Tensor,
    ) -> tuple[Tensor, ...]:  # fmt: skip
        """The same through the torch flow's own stream state: what the graph is checked against at conversion
        (``ahead`` 0: the torch flow's call without lookahead, the last tokens left out)."""
        ratio, caches = self.flow.token_mel_ratio, []
        for kv, voice, rows, tails in (
            (kv_tok, kv_tok_voice, int(commit), []),
            (kv_mel, kv_mel_voice, int(commit) * ratio, [tail]),
        ):
            cache = _step_cache(tails, (voice, kv), 1)
            cache.begin(int(voice.shape[0] + kv.shape[0]), rows)
            caches.append(cache)
        f = self.flow
        if float(ahead[0]):
            out = [self._mu(tokens, lead.shape[0], caches, ahead)]
        else:  # the torch flow's own rule for a call without lookahead
            x = f.input_embedding(tokens[:, : -f.pre_lookahead_len].clamp(min=0))
            out = [f._mu(x, 0, True, SimpleNamespace(encoder=caches), lead.shape[0])]
        for cache, kv in zip(caches, (kv_tok, kv_mel), strict=True):
            new = kv[:0]
            if cache.commit:
                pairs = zip(cache.keys, cache.values, strict=True)
                new = torch.stack(
                    [torch.stack([ks[-1].movedim(1, 0), vs[-1].movedim(1, 0)], dim=1) for ks, vs in pairs],
                    dim=1,
                )
            out.append(new)
        return (*out, caches[1].tails[0])


class _ScaledContext(nn.Module):
    # the lookahead layer with its context (the lookahead tokens' embeddings) scaled by `scale`: 0 gives the zeros
    # the layer pads with when it has none (a graph input, so that one graph serves both calls)
    def __init__(self, layer: nn.Module, scale: Tensor) -> None:
        super().__init__()
        self.layer, self.scale = layer, scale

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        return self.layer(x, None if context is None else context * self.scale)


class EstimatorGraph(nn.Module):
    """The one estimator graph, for every call: the packed CFG batch h (B, C_in, n), times t (B,), the attention
    mask of the call's own frames (n, n) bool (chunk attention or all True), the position ``offset`` (int64) of
    its first frame, ``commit`` (int64) and a stream's kept state (:class:`GraphStepCache`: a voice's rows
    ``kv_voice`` then its own ``kv``, each with 0 rows, zero ``tail{i}`` and commit 0 for a call that keeps
    nothing) -> the velocity (B, 80, n), ``kv_new`` and ``new_tail{i}``."""

    def __init__(self, flow: nn.Module) -> None:
        super().__init__()
        self.estimator = flow.decoder.estimator

    def forward(
        self, h: Tensor, t: Tensor, mask: Tensor, offset: Tensor, commit: Tensor, kv_voice: Tensor, kv: Tensor,
        *tails: Tensor,
    ) -> tuple[Tensor, ...]:  # fmt: skip
        cache = GraphStepCache(offset.to(torch.float32), commit, kv, tails, kv_voice)
        v = self.estimator.forward_masked(h, t, mask, None, cache)
        return (v, cache.kv_new(), *cache.new_tails)

    def reference(
        self, h: Tensor, t: Tensor, mask: Tensor, offset: Tensor, commit: Tensor, kv_voice: Tensor, kv: Tensor,
        *tails: Tensor,
    ) -> tuple[Tensor, ...]:  # fmt: skip
        """The same through the torch flow's own stream state (:class:`~cosyserve.models.flow_stream.StepCache`,
        the voice's rows and the stream's own as its two segments, as a forked torch stream's): what the graph is
        checked against at conversion."""
        cache = _step_cache(tails, (kv_voice, kv), 2)
        cache.begin(int(offset), int(commit))
        v = self.estimator.forward_masked(h, t, mask, None, cache)
        new = kv[:0]
        if int(commit):
            pairs = zip(cache.keys, cache.values, strict=True)
            new = torch.stack(
                [torch.stack([ks[-1].movedim(2, 0), vs[-1].movedim(2, 0)], dim=1) for ks, vs in pairs], dim=1
            )
        return (v, new, *cache.tails)


def _step_cache(tails: Any, kept: tuple[Tensor, ...], dim: int) -> Any:
    # the torch StepCache over kept rows given as segments, each (S, layers, 2, B, H, D) -> per layer, keys and
    # values along `dim` (the estimator's (B, H, S, D): 2; the encoder's (B, S, H, D): 1)
    from cosyserve.models.flow_stream import StepCache

    layers = range(kept[0].shape[1])
    return StepCache(
        list(tails),
        [[kv[:, i, 0].movedim(0, dim) for kv in kept] for i in layers],
        [[kv[:, i, 1].movedim(0, dim) for kv in kept] for i in layers],
    )


def _state_shapes(
    estimator: nn.Module, cin: int, chunk: int
) -> tuple[list[tuple[int, int]], tuple[int, ...]]:
    # ([(channels, kernel - 1) per causal conv], (layers, heads, head_dim)): the stream state the estimator keeps,
    # read off one call that keeps its frames (the torch StepCache)
    from cosyserve.models.flow_stream import StepCache

    cache = StepCache()
    cache.begin(0, chunk)
    estimator.forward_masked(torch.zeros(2, cin, chunk), torch.zeros(2), None, None, cache)
    tails = [(int(t.shape[1]), int(t.shape[2])) for t in cache.tails]
    _, heads, _, head_dim = cache.keys[0][0].shape
    return tails, (len(cache.keys), int(heads), int(head_dim))


class CausalF0Graph(nn.Module):
    """mel (1, 80, T) whose last 3 frames are lookahead -> f0 in Hz (1, T - 3), in float32."""

    def __init__(self, hift: nn.Module) -> None:
        super().__init__()
        self.f0_predictor = copy.deepcopy(hift.f0_predictor).float()

    def forward(self, mel: Tensor) -> Tensor:
        return self.f0_predictor(mel, False)


class CausalSpectrumGraph(nn.Module):
    """mel (1, 80, T) whose last ``conv_pre_look_right`` frames are context and the source's STFT rows
    (1, n_fft+2, N) -> the log-magnitude and phase rows (1, n_fft+2, N) the iSTFT takes."""

    def __init__(self, hift: nn.Module) -> None:
        super().__init__()
        self.hift = hift

    def forward(self, mel: Tensor, s_stft: Tensor) -> Tensor:
        return self.hift.causal_spectrum(mel, s_stft, False)


def share_weights(out: Path, graphs: list[str], data: str) -> None:
    """Rewrite the graph files ``graphs`` in ``out`` so that their weights live in one data file ``data``, each
    distinct tensor (by its bytes) once at a page-aligned offset; their own data files are removed. Why: the
    streaming and the whole-utterance variants of a graph hold the same weights, and ORT maps what they share
    once."""
    import onnx
    from onnx.external_data_helper import set_external_data

    stored: dict[bytes, tuple[int, int]] = {}
    with open(out / data, "wb") as f:
        for name in graphs:
            model = onnx.load(str(out / name), load_external_data=True)
            for init in model.graph.initializer:
                raw = init.raw_data
                if len(raw) < 1024:
                    continue  # small shape constants stay inline: ORT reads them there
                key = hashlib.sha256(raw).digest()
                if key not in stored:
                    f.write(b"\0" * (-f.tell() % 4096))
                    stored[key] = (f.tell(), len(raw))
                    f.write(raw)
                offset, length = stored[key]
                set_external_data(init, data, offset, length)
                init.ClearField("raw_data")
            onnx.save_model(model, str(out / name))
            old = out / (name + ".data")
            if old.exists() and old.name != data:
                old.unlink()
    (out / data).chmod(0o644)


def _export_encoder(ex: Exporter, flow: nn.Module, vocab: int, short: int) -> dict[str, Any]:
    # CosyVoice2's flow_mu_stream with the encoder's stream state (EncoderGraph); returns its state's shapes:
    # {"tokens": [layers, heads, head_dim], "frames": [up layers, heads, head_dim], "tail": [channels, frames]}
    enc, look, ratio = flow.encoder, flow.pre_lookahead_len, flow.token_mel_ratio
    heads = int(enc.cfg.attention_heads)
    head_dim = int(enc.cfg.output_size) // heads
    conv = enc.up_layer.conv
    shapes = {
        "tokens": [len(enc.encoders), heads, head_dim],
        "frames": [len(enc.up_encoders), heads, head_dim],
        "tail": [int(conv.in_channels), int(conv.kernel_size[0]) - 1],
    }
    chunk = max(int(enc.cfg.static_chunk_size), 1)  # tokens

    def case(
        voice: int, kept: int, lead: int, own: int, commit: int, ahead: bool = True
    ) -> tuple[Tensor, ...]:
        # `own` tokens after `voice` kept ones of a voice's and `kept` of the stream's (and `lead` of their left
        # context), `commit` of them final
        def rows(n: int, rate: str) -> Tensor:
            return ex.randn(n, shapes[rate][0], 2, 1, heads, head_dim)

        return (
            ex.ints(vocab, lead + own + look), torch.zeros(lead, dtype=torch.int64), torch.tensor(commit),
            rows(kept, "tokens"), rows(ratio * kept, "frames"), ex.randn(1, *shapes["tail"]),
            rows(voice, "tokens"), rows(ratio * voice, "frames"), torch.ones(1) if ahead else torch.zeros(1),
        )  # fmt: skip

    names = ["tokens", "lead", "commit", "kv_tok", "kv_mel", "tail0", "kv_tok_voice", "kv_mel_voice", "ahead"]
    outs = ["mu", "kv_tok_new", "kv_mel_new", "new_tail0"]
    dynamic = {
        "tokens": {1: "n"}, "lead": {0: "l"}, "kv_tok": {0: "s"}, "kv_mel": {0: "f"}, "kv_tok_voice": {0: "vs"},
        "kv_mel_voice": {0: "vf"}, "mu": {2: "m"}, "kv_tok_new": {0: "c"}, "kv_mel_new": {0: "cf"},
    }  # fmt: skip
    graph, lead = EncoderGraph(flow), flow.LEAD
    ex.graph(
        "flow_mu_stream", graph, case(chunk, chunk, lead, chunk + 5, chunk), names, outs, dynamic,
        [case(0, 0, 0, short, 0), case(0, 0, 0, 2 * chunk + 4, 2 * chunk),
         case(0, 2 * chunk, lead, chunk + 7, chunk), case(2 * chunk, 0, lead, chunk + 7, chunk),
         case(chunk, chunk, lead, chunk + 7, 0, ahead=False)],
        reference=graph.reference,
    )  # fmt: skip
    return {**shapes, "ahead": True}  # the graph takes `ahead` (a bounded stream's last call)


def export_flow(ex: Exporter, flow: nn.Module) -> None:
    """Export and check the chunk flow's graphs (see the module docstring) into ``ex``; its tables and config."""
    from cosyserve.bundle.lite import MAX_TEXT_POSITIONS
    from cosyserve.models.causal_flow import NOISE_SHAPE, fixed_noise

    encoder = getattr(flow, "encoder", None)
    # CosyVoice2: its relative-position table grown before tracing (a traced constant)
    if encoder is not None:
        encoder.embed.pos_enc._table(2 * MAX_TEXT_POSITIONS, torch.zeros(1))
    vocab = flow.input_embedding.num_embeddings
    encoder_state = None
    look, chunk = flow.pre_lookahead_len, flow.granularity
    # lengths across attention chunks (chunk frames = chunk / ratio tokens), one shorter than a chunk
    short, long = 5 + look, 2 * chunk // flow.token_mel_ratio + look + 3
    for streaming, name in ((False, "flow_mu"), (True, "flow_mu_stream")):
        ex.step(f"lite: {name}")
        if streaming and encoder is not None:
            encoder_state = _export_encoder(ex, flow, vocab, short)
            continue
        ex.graph(
            name, MuGraph(flow, streaming), (ex.ints(vocab, short + 4),), ["tokens"], ["mu"],
            {"tokens": {1: "n"}, "mu": {2: "m"}}, [(ex.ints(vocab, short),), (ex.ints(vocab, long),)],
        )  # fmt: skip
    estimator = flow.decoder.estimator
    cin, attention = estimator.in_channels, int(estimator.static_chunk_size)
    tails, (layers, heads, head_dim) = _state_shapes(estimator, cin, max(attention, 1))

    def est_case(m: int, voice: int, kept: int, commit: int, streaming: bool) -> tuple[Tensor, ...]:
        # m new frames after `voice` kept ones of a voice's and `kept` of the stream's, the first `commit` of them
        # final; chunk attention or whole (all True)
        from cosyserve.models.attention import subsequent_chunk_mask

        mask = torch.ones(m, m, dtype=torch.bool)
        if streaming and attention > 0:
            mask = subsequent_chunk_mask(m, attention)
        return (
            ex.randn(2, cin, m), torch.rand(2, generator=ex.gen), mask, torch.tensor(voice + kept),
            torch.tensor(commit), ex.randn(voice, layers, 2, 2, heads, head_dim),
            ex.randn(kept, layers, 2, 2, heads, head_dim), *(ex.randn(2, c, k) for c, k in tails),
        )  # fmt: skip

    ex.step("lite: flow_estimator")
    n_tails = range(len(tails))
    names = ["h", "t", "mask", "offset", "commit", "kv_voice", "kv", *(f"tail{i}" for i in n_tails)]
    outs = ["v", "kv_new", *(f"new_tail{i}" for i in n_tails)]
    dynamic = {
        "h": {0: "b", 2: "n"}, "t": {0: "b"}, "mask": {0: "n", 1: "n"}, "kv_voice": {0: "v", 3: "b"},
        "kv": {0: "s", 3: "b"}, "v": {0: "b", 2: "n"}, "kv_new": {0: "c", 3: "b"},
        **{f"tail{i}": {0: "b"} for i in n_tails}, **{f"new_tail{i}": {0: "b"} for i in n_tails},
    }  # fmt: skip
    graph = EstimatorGraph(flow)
    a = max(attention, 1)
    ex.graph(
        "flow_estimator", graph, est_case(2 * a + 5, a, a, a, True), names, outs, dynamic,
        [est_case(9, 0, 0, 0, False), est_case(2 * chunk + 6, 0, 0, 2 * chunk, True),
         est_case(a + 7, 0, 2 * a, a, True), est_case(a + 7, 2 * a, 0, a, True)],
        optimize=True, reference=graph.reference,
    )  # fmt: skip
    ex.step("lite: flow graphs' weights, stored once")
    names = ["flow_mu", "flow_mu_stream", "flow_estimator"]
    share_weights(ex.out, [ex.graphs[n] for n in names], "flow.onnx.data")
    w = flow.spk_embed_affine_layer
    ex.tables.update(
        {
            "flow.spk_affine.weight": w.weight.detach().float().contiguous().numpy(),
            "flow.spk_affine.bias": w.bias.detach().float().contiguous().numpy(),
            "flow.noise": fixed_noise(NOISE_SHAPE[2]).numpy()[0],  # (80, frames): the reference's fixed noise
        }
    )
    cfm = flow.decoder
    ex.config["flow"] = {
        "input_frame_rate": int(flow.cfg.input_frame_rate),
        "output_size": int(flow.output_size),
        "in_channels": int(cin),
        "token_mel_ratio": int(flow.token_mel_ratio),
        "pre_lookahead_len": int(look),
        "chunk_frames": int(chunk),
        # the estimator's attention chunk; a stream's state per Euler step (flow_estimator's kv and tails)
        "attention_chunk": attention,
        "kv_shape": [layers, heads, head_dim],
        "tails": [list(t) for t in tails],
        # whether a stream keeps its final frames (the torch flow's streams): its mu then needs the tokens from
        # `mu_lead` before its first new one; CosyVoice2's encoder keeps its own state too (`encoder_state`: the
        # shapes of flow_mu_stream's kept keys and values per rate and of the upsampling conv's tail)
        "streams": bool(flow.streams),
        "mu_lead": int(flow.LEAD),
        "encoder_state": encoder_state,
        "n_timesteps": int(flow.N_TIMESTEPS),
        "t_scheduler": cfm.t_scheduler,
        "inference_cfg_rate": float(cfm.inference_cfg_rate),
    }


def export_hift(ex: Exporter, hift: nn.Module) -> None:
    """Export and check the vocoder's graphs (CosyVoice2's HiFT or CosyVoice3's causal HiFT) into ``ex``."""
    from cosyserve.bundle.lite.export_300m import F0Graph, VocoderGraph, hift_config

    h = hift.cfg
    mels, n_fft, hop = h.in_channels, h.istft_params["n_fft"], h.istft_params["hop_len"]
    causal = hasattr(hift, "causal_spectrum")
    config: dict[str, Any] = {"causal": causal, **hift_config(hift)}
    if not causal:
        ex.step("lite: vocoder")
        ex.graph(
            "hift_f0", F0Graph(hift), (ex.randn(1, mels, 10),), ["mel"], ["f0"], {"mel": {2: "t"}, "f0": {1: "t"}},
            [(ex.randn(1, mels, 4),), (ex.randn(1, mels, 37),)],
        )  # fmt: skip

        def voc_case(t: int) -> tuple[Tensor, Tensor]:
            return ex.randn(1, mels, t), ex.randn(1, n_fft + 2, t * h.upsample_factor // hop + 1)

        ex.graph(
            "hift_decode", VocoderGraph(hift), voc_case(6), ["mel", "s_stft"], ["spec"],
            {"mel": {2: "t"}, "s_stft": {2: "n"}, "spec": {2: "n"}}, [voc_case(3), voc_case(25)],
        )  # fmt: skip
    else:
        from cosyserve.models.causal_hift import F0_LOOKAHEAD

        ex.step("lite: causal vocoder")
        ex.graph(
            "hift_f0", CausalF0Graph(hift), (ex.randn(1, mels, 12),), ["mel"], ["f0"],
            {"mel": {2: "t"}, "f0": {1: "t"}}, [(ex.randn(1, mels, 5),), (ex.randn(1, mels, 40),)],
            reference=lambda mel: hift._f0(mel, False),
        )  # fmt: skip
        right, stft = h.conv_pre_look_right, math.prod(h.upsample_rates)

        def voc_case(t: int) -> tuple[Tensor, Tensor]:
            # t mel frames, the last `right` of them context: (t - right) * stft + 1 source STFT frames
            return ex.randn(1, mels, t), ex.randn(1, n_fft + 2, (t - right) * stft + 1)

        ex.graph(
            "hift_decode", CausalSpectrumGraph(hift), voc_case(10), ["mel", "s_stft"], ["spec"],
            {"mel": {2: "t"}, "s_stft": {2: "n"}, "spec": {2: "n"}}, [voc_case(right + 2), voc_case(33)],
        )  # fmt: skip
        config.update(
            f0_lookahead=F0_LOOKAHEAD, conv_pre_look_right=right, lookahead=h.lookahead,
            stft_per_frame=stft, f0_context=int(hift.f0_context), context=int(hift.context),
        )  # fmt: skip
    ex.tables.update(
        {
            "hift.source.weight": hift.m_source.l_linear.weight.detach().float().contiguous().numpy(),
            "hift.source.bias": hift.m_source.l_linear.bias.detach().float().contiguous().numpy(),
        }
    )
    ex.config["hift"] = config
