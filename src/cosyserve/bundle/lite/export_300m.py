"""CosyVoice-300M's lite graphs (``Family.lite_export`` of :class:`~cosyserve.families.cosyvoice.CosyVoice`).

LM text encoder, LM positional projections, one LM step (T new positions against P cached ones), one LM decode
step of B rows each at its own position (``llm_batch``, its weights read from the step graph's data file; both LM
graphs checked against the model's own cached attention, :func:`references`), flow encoder,
length-regulator convolutions, flow estimator, f0 predictor, vocoder up to the iSTFT; numpy tables of what is a
lookup or an affine (sos/task rows, speaker affines, speech embedding, source merge, the LM's positional
projections for the first distances). See :mod:`cosyserve.bundle.lite.export`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from cosyserve.bundle.lite import BATCH_STEP, MAX_TEXT_POSITIONS, POS_TABLE_ROWS
from cosyserve.bundle.lite.export import BatchReference, Exporter, StepReference
from cosyserve.models.lite_dsp import distance_pe

__all__ = ["BatchGraph", "StepGraph", "export", "hift_config", "references"]


# --- graph wrappers (our modules' weights, one computation each) ---------------------------------------------


class TextEncoderGraph(nn.Module):
    """text ids (1, N) int64 -> the LM's encoded text (1, N, llm_input_size)."""

    def __init__(self, llm: nn.Module) -> None:
        super().__init__()
        self.llm = llm

    def forward(self, text: Tensor) -> Tensor:
        lm = self.llm
        lens = (text >= 0).sum(dim=1)  # (1,): the traced length, not a constant
        encoded, _ = lm.text_encoder(lm.text_embedding(text), lens, 1, -1)
        return lm.text_encoder_affine_layer(encoded)


class PosProjGraph(nn.Module):
    """positional rows pe (n, C) for distances -> every LM layer's ``linear_pos(pe)`` (L, n, H, D)."""

    def __init__(self, llm: nn.Module) -> None:
        super().__init__()
        self.layers = llm.llm.encoders

    def forward(self, pe: Tensor) -> Tensor:
        n = pe.shape[0]
        out = []
        for layer in self.layers:
            a = layer.self_attn
            out.append(a.linear_pos(pe).view(n, a.h, a.d_k))
        return torch.stack(out)


class StepGraph(nn.Module):
    """T new LM inputs against P cached positions -> the next token's log-probabilities and the new keys/values.

    Inputs: x (1, T, C); per layer past_k, past_v (1, P, H, D); per layer pos (P + T, H, D) = linear_pos of the
    distances 0 .. P+T-1. Outputs: logp (1, V); per layer new_k, new_v (1, T, H, D). The attention reads the
    cache and the new keys separately (no concatenation: the cache is only read).
    """

    def __init__(self, llm: nn.Module) -> None:
        super().__init__()
        self.stack = llm.llm
        self.decoder = llm.llm_decoder

    def _layers(self, x: Tensor, attend: Callable[[int, nn.Module, Tensor], Tensor]) -> Tensor:
        # the stack over x (B, T, C) -> (B, T, C): ``attend(i, attention, h)`` gives layer i's heads' output
        # (B, T, H*D) before linear_out (and keeps the new keys and values it made)
        stack = self.stack
        x, _ = stack.embed(x)
        for i, layer in enumerate(stack.encoders):
            a = layer.self_attn
            residual = x
            h = layer.norm_attn(x) if layer.normalize_before else x
            x = residual + a.linear_out(attend(i, a, h))
            if not layer.normalize_before:
                x = layer.norm_attn(x)
            residual = x
            h = layer.norm_ffn(x) if layer.normalize_before else x
            x = residual + layer.feed_forward(h)
            if not layer.normalize_before:
                x = layer.norm_ffn(x)
        if stack.cfg.normalize_before:
            x = stack.after_norm(x)
        return x

    def forward(self, x: Tensor, *caches: Tensor) -> tuple[Tensor, ...]:
        n_layers = len(self.stack.encoders)
        past_k, past_v, pos = caches[:n_layers], caches[n_layers : 2 * n_layers], caches[2 * n_layers :]
        p, t = past_k[0].shape[1], x.shape[1]
        positions = torch.arange(t) + p  # (T,)
        dist = positions.unsqueeze(1) - torch.arange(p + t).unsqueeze(0)  # (T, K)
        rel, masked = dist.clamp(min=0), dist < 0
        new_k: list[Tensor] = []
        new_v: list[Tensor] = []

        def attend(i: int, a: nn.Module, h: Tensor) -> Tensor:
            q, k, v = a._qkv(h)  # (1, T, H, D)
            q_u = (q + a.pos_bias_u).transpose(1, 2)  # (1, H, T, D)
            q_v = (q + a.pos_bias_v).transpose(1, 2)
            ac = torch.cat(
                [q_u @ past_k[i].permute(0, 2, 3, 1), q_u @ k.permute(0, 2, 3, 1)], dim=-1
            )  # (1, H, T, K)
            by_dist = q_v @ pos[i].permute(1, 2, 0)  # (1, H, T, K)
            bd = by_dist.gather(-1, rel.expand(1, a.h, t, p + t))
            scores = ((ac + bd) / math.sqrt(a.d_k)).masked_fill(masked, -float("inf"))
            attn = torch.softmax(scores, dim=-1)
            out = attn[..., :p] @ past_v[i].transpose(1, 2) + attn[..., p:] @ v.transpose(
                1, 2
            )  # (1, H, T, D)
            new_k.append(k)
            new_v.append(v)
            return out.transpose(1, 2).reshape(1, t, a.h * a.d_k)

        x = self._layers(x, attend)
        logp = self.decoder(x[:, -1]).float().log_softmax(dim=-1)
        return (logp, *new_k, *new_v)


class BatchGraph(StepGraph):
    """One decode step of B rows: x (B, 1, C), pos (B,) int64, per layer past_k, past_v (B, L, H, D) and per layer
    the projected distances (K, H, D), K >= L -> logp (B, V) and per layer new_k, new_v (B, H, D). Row b's token is
    at position pos[b] after the pos[b] positions its cache rows hold (L > every pos: a row's positions from
    pos[b] on are padding, masked out). The runtime binds the first B rows of its caches as they are (no copy) and
    writes the new keys and values into them after the run. The step graph's computation per row, the row's own
    position (distance 0) scored apart from its past, as the step graph scores its new positions."""

    def forward(self, x: Tensor, pos: Tensor, *caches: Tensor) -> tuple[Tensor, ...]:
        n_layers = len(self.stack.encoders)
        past_k, past_v, proj = caches[:n_layers], caches[n_layers : 2 * n_layers], caches[2 * n_layers :]
        length = past_k[0].shape[1]
        dist = pos.unsqueeze(1) - torch.arange(length)  # (B, L)
        rel = dist.clamp(min=0).unsqueeze(1).unsqueeze(1)  # (B, 1, 1, L)
        pad = (dist <= 0).unsqueeze(1).unsqueeze(1)  # (B, 1, 1, L): a row's positions from its own on
        new_k: list[Tensor] = []
        new_v: list[Tensor] = []

        def attend(i: int, a: nn.Module, h: Tensor) -> Tensor:
            q, k, v = a._qkv(h)  # (B, 1, H, D)
            q_u = (q + a.pos_bias_u).transpose(1, 2)  # (B, H, 1, D)
            q_v = (q + a.pos_bias_v).transpose(1, 2)
            by_dist = q_v @ proj[i].permute(1, 2, 0)  # (B, H, 1, K)
            bd = by_dist.gather(-1, rel.expand(-1, a.h, 1, length))  # (B, H, 1, L)
            s_past = ((q_u @ past_k[i].permute(0, 2, 3, 1) + bd) / math.sqrt(a.d_k)).masked_fill(
                pad, -float("inf")
            )
            k_t, v_t = k.transpose(1, 2), v.transpose(1, 2)  # (B, H, 1, D)
            s_new = ((q_u * k_t).sum(-1, keepdim=True) + by_dist[..., :1]) / math.sqrt(a.d_k)  # (B, H, 1, 1)
            attn = torch.softmax(torch.cat([s_past, s_new], dim=-1), dim=-1)  # (B, H, 1, L + 1)
            out = attn[..., :length] @ past_v[i].transpose(1, 2) + attn[..., length:] * v_t  # (B, H, 1, D)
            new_k.append(k[:, 0])
            new_v.append(v[:, 0])
            return out.transpose(1, 2).reshape(-1, 1, a.h * a.d_k)

        x = self._layers(x, attend)
        logp = self.decoder(x[:, -1]).float().log_softmax(dim=-1)  # (B, V)
        return (logp, *new_k, *new_v)


def references(llm: nn.Module) -> tuple[StepReference, BatchReference]:
    """The step and batch graphs' outputs computed by the model's own code (its KV caches (H, positions, D) per
    layer set from the graph's (1, P, H, D), then its extend; the projected distances are its own)."""
    n = len(llm.llm.encoders)

    def to_model(inputs: tuple[Tensor, ...]) -> list[Tensor]:
        # per layer: keys, values (H, P, D)
        return [inputs[i + kv * n][0].transpose(0, 1) for i in range(n) for kv in (0, 1)]

    def to_graph(per_row: bool) -> Callable[[list[Tensor]], list[Tensor]]:
        # the step graph's new keys, then values (1, T, H, D); a batch row's (T = 1, H, D)
        def out(new: list[Tensor]) -> list[Tensor]:
            t = [c.transpose(0, 1) for c in new[0::2] + new[1::2]]
            return t if per_row else [c.unsqueeze(0) for c in t]

        return out

    def row(inputs: tuple[Tensor, ...], b: int, p: int) -> list[Tensor]:
        return [c[b : b + 1, :p] for c in inputs[: 2 * n]]

    batch = BatchReference(StepReference(llm, to_model, to_graph(True)), row)
    return StepReference(llm, to_model, to_graph(False)), batch


class FlowEncoderGraph(nn.Module):
    """speech tokens (1, N) int64 (prompt then target) -> the flow encoder's projected output (1, N, 80)."""

    def __init__(self, flow: nn.Module) -> None:
        super().__init__()
        self.flow = flow

    def forward(self, tokens: Tensor) -> Tensor:
        f = self.flow
        lens = (tokens > -(2**31)).sum(dim=1)
        h, _ = f.encoder(f.input_embedding(tokens.clamp(min=0)), lens)
        return f.encoder_proj(h)


class RegulatorGraph(nn.Module):
    """the length regulator's convolutions over interpolated frames (1, 80, M) -> mu (1, 80, M)."""

    def __init__(self, flow: nn.Module) -> None:
        super().__init__()
        self.model = flow.length_regulator.model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


class EstimatorGraph(nn.Module):
    """the flow estimator: packed input cat([x, mu, spks, cond]) (2B, C_in, T) and times (2B,) -> (2B, 80, T)."""

    def __init__(self, flow: nn.Module) -> None:
        super().__init__()
        self.estimator = flow.decoder.estimator

    def forward(self, h: Tensor, t: Tensor) -> Tensor:
        return self.estimator.forward_packed(h, None, t)


class F0Graph(nn.Module):
    """mel (1, 80, T) -> f0 in Hz (1, T)."""

    def __init__(self, hift: nn.Module) -> None:
        super().__init__()
        self.f0_predictor = hift.f0_predictor

    def forward(self, mel: Tensor) -> Tensor:
        return self.f0_predictor(mel)


class VocoderGraph(nn.Module):
    """mel (1, 80, T) and the source's STFT (1, n_fft+2, N) -> the spectrum before the iSTFT (1, n_fft+2, N)."""

    def __init__(self, hift: nn.Module) -> None:
        super().__init__()
        self.hift = hift

    def forward(self, mel: Tensor, s_stft: Tensor) -> Tensor:
        return self.hift.decode_spectrum(mel, s_stft)


def _tables(llm: nn.Module, flow: nn.Module, hift: nn.Module) -> dict[str, np.ndarray]:
    def a(t: Tensor) -> np.ndarray:
        return np.ascontiguousarray(t.detach().float().numpy())

    return {
        "llm.sos": a(llm.llm_embedding.weight[llm.sos]),
        "llm.task": a(llm.llm_embedding.weight[llm.task_id]),
        "llm.spk_affine.weight": a(llm.spk_embed_affine_layer.weight),
        "llm.spk_affine.bias": a(llm.spk_embed_affine_layer.bias),
        "llm.speech_embedding": a(llm.speech_embedding.weight),
        "flow.spk_affine.weight": a(flow.spk_embed_affine_layer.weight),
        "flow.spk_affine.bias": a(flow.spk_embed_affine_layer.bias),
        "hift.source.weight": a(hift.m_source.l_linear.weight),
        "hift.source.bias": a(hift.m_source.l_linear.bias),
        # every LM layer's linear_pos(pe) for the first distances (L, rows, H, D): what the llm_pos graph gives
        "llm.pos_proj": a(
            PosProjGraph(llm)(torch.from_numpy(distance_pe(llm.cfg.llm_input_size, 0, POS_TABLE_ROWS)))
        ),
    }


def _config(llm: nn.Module, flow: nn.Module, hift: nn.Module) -> dict[str, Any]:
    a0 = llm.llm.encoders[0].self_attn
    cfm = flow.decoder
    return {
        "llm": {
            "arch": "transformer",
            "layers": len(llm.llm.encoders),
            "heads": a0.h,
            "head_dim": a0.d_k,
            "input_size": llm.cfg.llm_input_size,
            "eos_token": llm.eos_token,
            "speech_token_size": llm.cfg.speech_token_size,
            "spk_embed_dim": llm.cfg.spk_embed_dim,
            "sampling": dataclasses.asdict(llm.sampling),
        },
        "flow": {
            "input_frame_rate": flow.input_frame_rate,
            "output_size": flow.output_size,
            "in_channels": cfm.estimator.in_channels,
            "n_timesteps": flow.N_TIMESTEPS,
            "t_scheduler": cfm.t_scheduler,
            "inference_cfg_rate": cfm.inference_cfg_rate,
        },
        "hift": hift_config(hift),
    }


def hift_config(hift: nn.Module) -> dict[str, Any]:
    """The vocoder's config numbers the lite runtime reads (every HiFT's; CosyVoice3's causal one adds more)."""
    h = hift.cfg
    return {
        "sampling_rate": h.sampling_rate,
        "nb_harmonics": h.nb_harmonics,
        "upsample_factor": h.upsample_factor,
        "nsf_alpha": h.nsf_alpha,
        "nsf_sigma": h.nsf_sigma,
        "nsf_voiced_threshold": h.nsf_voiced_threshold,
        "n_fft": h.istft_params["n_fft"],
        "hop_len": h.istft_params["hop_len"],
        "audio_limit": h.audio_limit,
        "in_channels": h.in_channels,
    }


def export(ex: Exporter, modules: dict[str, nn.Module], parts: tuple[str, ...], int8: bool) -> None:
    """Export and check every CosyVoice-300M graph into ``ex`` (``parts``: all three; ``int8``: the int8 step
    graph too)."""
    llm, flow, hift = modules["llm"], modules["flow"], modules["hift"]
    # the relative-position tables are Python-side buffers: grown before tracing so the traced constant covers
    # every length a request can have
    for enc in (llm.text_encoder, flow.encoder, llm.llm):
        enc.embed.pos_enc._table(MAX_TEXT_POSITIONS, torch.zeros(1))
    _export_lm(ex, llm, int8)
    randn, ints, graph, step = ex.randn, ex.ints, ex.graph, ex.step

    step("lite: flow encoder")
    vocab = flow.input_embedding.num_embeddings
    graph(
        "flow_encoder", FlowEncoderGraph(flow), (ints(vocab, 11),), ["tokens"], ["h"],
        {"tokens": {1: "n"}, "h": {1: "n"}}, [(ints(vocab, 6),), (ints(vocab, 47),)],
    )  # fmt: skip

    step("lite: length regulator")
    ch = flow.output_size
    graph(
        "flow_regulator", RegulatorGraph(flow), (randn(1, ch, 13),), ["x"], ["mu"],
        {"x": {2: "m"}, "mu": {2: "m"}}, [(randn(1, ch, 7),), (randn(1, ch, 60),)],
    )  # fmt: skip

    step("lite: flow estimator")
    cin = flow.decoder.estimator.in_channels

    def est_case(m: int) -> tuple[Tensor, Tensor]:
        return randn(2, cin, m), torch.rand(2, generator=ex.gen)

    graph(
        "flow_estimator", EstimatorGraph(flow), est_case(16), ["h", "t"], ["v"],
        {"h": {0: "b", 2: "m"}, "t": {0: "b"}, "v": {0: "b", 2: "m"}}, [est_case(9), est_case(70)], optimize=True,
    )  # fmt: skip

    step("lite: vocoder")
    mels = hift.cfg.in_channels
    graph(
        "hift_f0", F0Graph(hift), (randn(1, mels, 10),), ["mel"], ["f0"], {"mel": {2: "t"}, "f0": {1: "t"}},
        [(randn(1, mels, 4),), (randn(1, mels, 37),)],
    )  # fmt: skip
    n_fft, hop = hift.cfg.istft_params["n_fft"], hift.cfg.istft_params["hop_len"]

    def voc_case(t: int) -> tuple[Tensor, Tensor]:
        return randn(1, mels, t), randn(1, n_fft + 2, t * hift.cfg.upsample_factor // hop + 1)

    graph(
        "hift_decode", VocoderGraph(hift), voc_case(6), ["mel", "s_stft"], ["spec"],
        {"mel": {2: "t"}, "s_stft": {2: "n"}, "spec": {2: "n"}}, [voc_case(3), voc_case(25)],
    )  # fmt: skip

    ex.tables.update(_tables(llm, flow, hift))
    ex.config.update(_config(llm, flow, hift))


def _export_lm(ex: Exporter, llm: nn.Module, int8: bool) -> None:
    # the LM's graphs: text encoder, positional projections, step, batch step (and the int8 step)
    n_layers = len(llm.llm.encoders)
    a0 = llm.llm.encoders[0].self_attn
    heads, head_dim, c = a0.h, a0.d_k, llm.cfg.llm_input_size
    randn, ints, graph, step = ex.randn, ex.ints, ex.graph, ex.step

    def pe_rows(n: int) -> Tensor:
        return torch.from_numpy(distance_pe(c, 0, n))

    step("lite: LM text encoder")
    graph(
        "llm_text", TextEncoderGraph(llm), (ints(100, 7),), ["text"], ["encoded"],
        {"text": {1: "n"}, "encoded": {1: "n"}}, [(ints(1000, 5),), (ints(1000, 23),)],
    )  # fmt: skip

    step("lite: LM positions")
    pp = PosProjGraph(llm)
    graph(
        "llm_pos", pp, (pe_rows(9),), ["pe"], ["proj"], {"pe": {0: "n"}, "proj": {1: "n"}},
        [(pe_rows(4),), (pe_rows(33),)],
    )  # fmt: skip

    step("lite: LM step")
    names = ["x"] + [f"past_k{i}" for i in range(n_layers)] + [f"past_v{i}" for i in range(n_layers)]
    names += [f"pos{i}" for i in range(n_layers)]
    outs = ["logp"] + [f"new_k{i}" for i in range(n_layers)] + [f"new_v{i}" for i in range(n_layers)]
    dyn: dict[str, dict[int, str]] = {"x": {1: "t"}}
    dyn.update({n: {1: "p"} for n in names if n.startswith("past")})
    dyn.update({n: {0: "k"} for n in names if n.startswith("pos")})
    dyn.update({n: {1: "t"} for n in outs if n.startswith("new")})

    def step_case(p: int, t: int) -> tuple[Tensor, ...]:
        proj = pp(pe_rows(p + t))
        return (
            randn(1, t, c),
            *[randn(1, p, heads, head_dim) for _ in range(2 * n_layers)],
            *[proj[i] for i in range(n_layers)],
        )

    step_reference, batch_reference = references(llm)
    graph(
        "llm_step", StepGraph(llm), step_case(5, 3), names, outs, dyn,
        [step_case(0, 9), step_case(9, 1), step_case(30, 1)], reference=step_reference,
    )  # fmt: skip

    def batch_case(length: int, *pos: int) -> tuple[Tensor, ...]:
        # the padding past each row's positions random too: the check sees it masked
        proj = pp(pe_rows(length))
        b = len(pos)
        return (
            randn(b, 1, c),
            torch.tensor(pos, dtype=torch.int64),
            *[randn(b, length, heads, head_dim) for _ in range(2 * n_layers)],
            *[proj[i] for i in range(n_layers)],
        )

    caches = names[1 : 1 + 2 * n_layers]
    batch_dyn = {"x": {0: "b"}, "pos": {0: "b"}, "logp": {0: "b"}, **{n: {0: "b", 1: "l"} for n in caches}}
    batch_dyn.update({n: {0: "k"} for n in names if n.startswith("pos")})
    batch_dyn.update({n: {0: "b"} for n in outs if n.startswith("new")})
    # the batched decode step, its weights read from the step graph's data file; no int8 one (BATCH_STEP says why)
    step("lite: LM batch step")
    graph(
        BATCH_STEP, BatchGraph(llm), batch_case(7, 5, 0, 6), ["x", "pos", *names[1:]], outs, batch_dyn,
        [batch_case(9, 8, 3), batch_case(30, 0, 29, 17, 1), batch_case(5, 2)], reference=batch_reference,
        shares="llm_step",
    )  # fmt: skip

    if int8:
        step("lite: LM step, int8")
        ex.quantize_step([step_case(0, 9), step_case(30, 1)], names)
