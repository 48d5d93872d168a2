"""The lite graphs of CosyVoice2's and CosyVoice3's token2wav: the chunk flow and the 24 kHz vocoders.

Flow (:class:`~cosyserve.models.causal_flow.ChunkFlow`: CosyVoice2's conformer encoder and U-Net estimator,
CosyVoice3's lookahead layer and DiT): ``flow_mu`` (speech tokens, prompt then target -> ``mu`` at mel rate, the
utterance's end: no lookahead, full attention), ``flow_mu_stream`` (the same for a streamed chunk: the last
``pre_lookahead_len`` tokens are lookahead only, static chunk attention), ``flow_estimator`` and
``flow_estimator_stream`` (the velocity of the packed CFG batch, full or chunk attention). The two variants of a
graph are traced from the same module with the attention rule fixed (a Python branch in the module), and their
weights are stored once: :func:`share_weights` writes the flow graphs' tensors into one data file, each distinct
tensor once. What is cheap stays numpy: the token embedding lookup happens inside the graphs (a tiny table), the
speaker affine, the fixed noise (a table), the Euler loop and classifier-free guidance.

Vocoder: CosyVoice2's :class:`~cosyserve.models.hift.HiFTGenerator` as CosyVoice-300M's (``hift_f0``,
``hift_decode``: :mod:`cosyserve.bundle.lite.export_300m`); CosyVoice3's causal one as ``hift_f0`` (mel with its 3
lookahead frames -> f0 of the others, float32 where the module computes in float64: checked against it) and
``hift_decode`` (mel with conv_pre's lookahead frames and the source's STFT -> the spectrum before the iSTFT). The
finalizing calls' zero padding is numpy's; so are the sine source, the STFT and the iSTFT.

This first version serves the reference's streaming rule (each chunk re-runs the flow over every token so far);
the incremental caches of :mod:`cosyserve.models.flow_stream` as graph inputs and outputs are not exported yet.
"""

from __future__ import annotations

import copy
import hashlib
import math
from pathlib import Path
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


class EstimatorGraph(nn.Module):
    """the packed CFG batch h (2, C_in, T) and times t (2,) -> the velocity (2, 80, T)."""

    def __init__(self, flow: nn.Module, streaming: bool) -> None:
        super().__init__()
        self.estimator = flow.decoder.estimator
        self.streaming = streaming

    def forward(self, h: Tensor, t: Tensor) -> Tensor:
        return self.estimator.forward_packed(h, t, self.streaming)


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
    streaming and the whole-utterance variants of a graph hold the same weights (a full-size CosyVoice3
    estimator is 1.3 GB), and ORT maps what they share once."""
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


def export_flow(ex: Exporter, flow: nn.Module) -> None:
    """Export and check the chunk flow's graphs (see the module docstring) into ``ex``; its tables and config."""
    from cosyserve.bundle.lite import MAX_TEXT_POSITIONS
    from cosyserve.models.causal_flow import NOISE_SHAPE, fixed_noise

    encoder = getattr(flow, "encoder", None)
    # CosyVoice2: its relative-position table grown before tracing (a traced constant)
    if encoder is not None:
        encoder.embed.pos_enc._table(2 * MAX_TEXT_POSITIONS, torch.zeros(1))
    vocab = flow.input_embedding.num_embeddings
    look, chunk = flow.pre_lookahead_len, flow.granularity
    # lengths across attention chunks (chunk frames = chunk / ratio tokens), one shorter than a chunk
    short, long = 5 + look, 2 * chunk // flow.token_mel_ratio + look + 3
    for streaming, name in ((False, "flow_mu"), (True, "flow_mu_stream")):
        ex.step(f"lite: {name}")
        ex.graph(
            name, MuGraph(flow, streaming), (ex.ints(vocab, short + 4),), ["tokens"], ["mu"],
            {"tokens": {1: "n"}, "mu": {2: "m"}}, [(ex.ints(vocab, short),), (ex.ints(vocab, long),)],
        )  # fmt: skip
    cin = flow.decoder.estimator.in_channels

    def est_case(m: int) -> tuple[Tensor, Tensor]:
        return ex.randn(2, cin, m), torch.rand(2, generator=ex.gen)

    for streaming, name in ((False, "flow_estimator"), (True, "flow_estimator_stream")):
        ex.step(f"lite: {name}")
        ex.graph(
            name, EstimatorGraph(flow, streaming), est_case(16), ["h", "t"], ["v"],
            {"h": {0: "b", 2: "m"}, "t": {0: "b"}, "v": {0: "b", 2: "m"}}, [est_case(9), est_case(2 * chunk + 6)],
            optimize=True,
        )  # fmt: skip
    ex.step("lite: flow graphs' weights, stored once")
    names = ["flow_mu", "flow_mu_stream", "flow_estimator", "flow_estimator_stream"]
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
