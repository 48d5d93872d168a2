"""Export a bundle's torch modules as the lite runtime's ONNX graphs (``cosyserve convert --runtime lite``).

Needs torch and onnx (a machine that converts); the lite runtime that reads the result needs neither. Every model
computation becomes one graph (see :data:`cosyserve.lite.GRAPHS`); what is cheap, stateful or random stays in numpy
in :mod:`cosyserve.lite.dsp` and :mod:`cosyserve.runtime.lite` (sampling, the Euler loop, the sine source, STFT and
iSTFT, the length regulator's interpolation, prompt assembly from small tables). Each graph keeps its weights in
one external data file beside it, which ONNX Runtime maps; each is checked against the torch module on random
inputs of two lengths (a length baked in by tracing shows up as a mismatch at the other) and a bundle whose graph
does not match is not written.

The LM decode step takes the KV cache as inputs and returns only the new positions' keys and values: the caller
keeps one buffer per layer, (1, max_len, H, D), whose prefix is a contiguous array it binds as the input, and
binds the output to the next rows of the same buffer, so no cache is copied between steps.
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from cosyserve.errors import ConvertError
from cosyserve.lite import (
    GRAPHS,
    INT8_STEP,
    LITE_DIR,
    LITE_FORMAT,
    LITE_VERSION,
    MAX_TEXT_POSITIONS,
    POS_TABLE_ROWS,
    TABLES_FILE,
)
from cosyserve.lite.dsp import distance_pe

logger = logging.getLogger(__name__)

__all__ = ["export_lite"]

OPSET = 17


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

    def forward(self, x: Tensor, *caches: Tensor) -> tuple[Tensor, ...]:
        stack = self.stack
        n_layers = len(stack.encoders)
        past_k, past_v, pos = caches[:n_layers], caches[n_layers : 2 * n_layers], caches[2 * n_layers :]
        p, t = past_k[0].shape[1], x.shape[1]
        x, _ = stack.embed(x)
        positions = torch.arange(t) + p  # (T,)
        dist = positions.unsqueeze(1) - torch.arange(p + t).unsqueeze(0)  # (T, K)
        rel, masked = dist.clamp(min=0), dist < 0
        new: list[Tensor] = []
        for i, layer in enumerate(stack.encoders):
            a = layer.self_attn
            residual = x
            h = layer.norm_attn(x) if layer.normalize_before else x
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
            out = a.linear_out(out.transpose(1, 2).reshape(1, t, a.h * a.d_k))
            x = residual + out
            if not layer.normalize_before:
                x = layer.norm_attn(x)
            residual = x
            h = layer.norm_ffn(x) if layer.normalize_before else x
            x = residual + layer.feed_forward(h)
            if not layer.normalize_before:
                x = layer.norm_ffn(x)
            new += [k, v]
        if stack.cfg.normalize_before:
            x = stack.after_norm(x)
        logp = self.decoder(x[:, -1]).float().log_softmax(dim=-1)
        return (logp, *new[0::2], *new[1::2])


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


# --- export --------------------------------------------------------------------------------------------------


def _export(
    module: nn.Module,
    args: tuple[Tensor, ...],
    path: Path,
    inputs: list[str],
    outputs: list[str],
    dynamic: dict[str, dict[int, str]],
) -> None:
    import tempfile

    import onnx

    # the exporter writes into a folder of its own (a graph past 2 GB would put its tensors beside it), removed after
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".export-") as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
        tmp = Path(d) / "graph.onnx"
        torch.onnx.export(
            module,
            args,
            str(tmp),
            dynamo=False,
            input_names=inputs,
            output_names=outputs,
            dynamic_axes=dynamic,
            opset_version=OPSET,
            do_constant_folding=True,
        )
        model = onnx.load(str(tmp), load_external_data=True)
    _constants_to_initializers(model)
    data = path.name + ".data"
    # every initializer in one data file beside the graph, each at a page-aligned offset (ORT maps it)
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=data,
        size_threshold=0,
        convert_attribute=False,
    )
    (path.parent / data).chmod(0o644)


def _optimize_offline(path: Path) -> None:
    """Replace the graph at ``path`` by ONNX Runtime's own rewrite of it (extended level: constant folding, shape
    arithmetic folded, CPU fusions), weights again in one data file beside it. Why: ORT's Python binding holds the
    GIL while a session opens, and the flow estimator's 5900 traced nodes took 1.3-1.8 s to open (every thread of
    the process stalled meanwhile, a first request included); the rewritten graph has half the nodes and opens in
    about 1 s. The rewrite is checked against the torch module like the traced graph was."""
    import onnxruntime as ort

    tmp = path.with_name(path.stem + ".opt.onnx")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(tmp)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", tmp.name + ".data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "64")
    so.add_session_config_entry("session.disable_prepacking", "1")
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    import onnx

    model = onnx.load(str(tmp), load_external_data=True)
    data = path.name + ".data"
    (path.parent / data).unlink()
    onnx.save_model(
        model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data,
        size_threshold=1024, convert_attribute=False,  # small shape constants stay inline: ORT reads them there
    )  # fmt: skip
    (path.parent / data).chmod(0o644)
    tmp.unlink()
    (tmp.parent / (tmp.name + ".data")).unlink()


def _constants_to_initializers(model: Any) -> None:
    """Large traced constants (the relative-position tables) become initializers, so they go to the external
    data file with the weights instead of into the graph (ORT reads small attribute tensors only inline)."""
    from onnx import numpy_helper

    keep = []
    for node in model.graph.node:
        if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
            t = node.attribute[0].t
            if numpy_helper.to_array(t).size >= 1024:
                t.name = node.output[0]
                model.graph.initializer.append(t)
                continue
        keep.append(node)
    del model.graph.node[:]
    model.graph.node.extend(keep)


def _session(path: Path) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _check(
    name: str, path: Path, module: nn.Module, cases: list[tuple[Tensor, ...]], inputs: list[str], atol: float
) -> float:
    """Run the graph and the module on each case; refuse (ConvertError) a graph whose outputs differ."""
    sess = _session(path)
    worst = 0.0
    for case in cases:
        with torch.inference_mode():
            want = module(*case)
        want = want if isinstance(want, tuple) else (want,)
        got = sess.run(None, {n: c.numpy() for n, c in zip(inputs, case, strict=True)})
        for w, g in zip(want, got, strict=True):
            w = w.float().numpy()
            if w.shape != g.shape:
                raise ConvertError(f"lite export: graph {name} gives shape {g.shape}, the module {w.shape}")
            finite = np.isfinite(w)
            if not np.array_equal(finite, np.isfinite(g)):
                raise ConvertError(f"lite export: graph {name} differs from the module in where it is finite")
            err = float(np.max(np.abs(w[finite] - g[finite]) / (1.0 + np.abs(w[finite])))) if w.size else 0.0
            worst = max(worst, err)
    if worst > atol:
        raise ConvertError(
            f"lite export: graph {name} differs from the torch module by {worst:.2e} (relative to 1 + |x|; "
            f"allowed {atol:.0e}); the bundle is not written"
        )
    return worst


def _quantize_step(out: Path, cases: list[tuple[Tensor, ...]], names: list[str]) -> dict[str, float]:
    """``llm_step.int8.onnx``: ORT's dynamic quantization (int8 weights per tensor, activations quantized per
    call) of the step graph's matrix products; returns how far its log-probabilities are from the float graph's
    on ``cases`` (max |difference|, mean KL divergence in nats, top-1 agreement)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    src, dst = out / GRAPHS["llm_step"], out / INT8_STEP
    tmp = out / "int8.tmp.onnx"
    model = onnx.load(str(src), load_external_data=True)
    onnx.save_model(
        model, str(tmp)
    )  # inline weights: the quantizer reads them from the graph (< 2 GB at 300M)
    del model
    root = logging.getLogger()
    level = root.level
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        root.setLevel(logging.ERROR)  # the quantizer's "consider pre-processing" goes to the root logger
        try:
            quantize_dynamic(
                str(tmp), str(tmp.with_suffix(".q.onnx")), weight_type=QuantType.QInt8,
                op_types_to_quantize=["MatMul"], extra_options={"MatMulConstBOnly": True},
            )  # fmt: skip
        finally:
            root.setLevel(level)
    tmp.unlink()
    quantized = onnx.load(str(tmp.with_suffix(".q.onnx")))
    tmp.with_suffix(".q.onnx").unlink()
    _constants_to_initializers(quantized)
    onnx.save_model(
        quantized, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
        location=dst.name + ".data", size_threshold=0,
    )  # fmt: skip
    (out / (dst.name + ".data")).chmod(0o644)
    base, q = _session(src), _session(dst)
    worst, kls, agree = 0.0, [], []
    for case in cases:
        feeds = {n: c.numpy() for n, c in zip(names, case, strict=True)}
        a, b = base.run(["logp"], feeds)[0][0], q.run(["logp"], feeds)[0][0]
        worst = max(worst, float(np.abs(a - b).max()))
        kls.append(float(np.sum(np.exp(a) * (a - b))))
        agree.append(float(np.argmax(a) == np.argmax(b)))
    return {"max_abs_logp": worst, "mean_kl": float(np.mean(kls)), "top1_agree": float(np.mean(agree))}


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


def _config(cfg: Any, llm: nn.Module, flow: nn.Module, hift: nn.Module) -> dict[str, Any]:
    a0 = llm.llm.encoders[0].self_attn
    h = hift.cfg
    cfm = flow.decoder
    return {
        "family": cfg.family,
        "sample_rate": cfg.sample_rate,
        "llm": {
            "layers": len(llm.llm.encoders),
            "heads": a0.h,
            "head_dim": a0.d_k,
            "input_size": llm.cfg.llm_input_size,
            "eos_token": llm.eos_token,
            "speech_token_size": llm.cfg.speech_token_size,
            "spk_embed_dim": llm.cfg.spk_embed_dim,
            "sampling": {
                "top_p": llm.cfg.sampling.top_p,
                "top_k": llm.cfg.sampling.top_k,
                "win_size": llm.cfg.sampling.win_size,
                "tau_r": llm.cfg.sampling.tau_r,
            },
        },
        "flow": {
            "input_frame_rate": flow.input_frame_rate,
            "output_size": flow.output_size,
            "in_channels": cfm.estimator.in_channels,
            "n_timesteps": flow.N_TIMESTEPS,
            "t_scheduler": cfm.t_scheduler,
            "inference_cfg_rate": cfm.inference_cfg_rate,
        },
        "hift": {
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
        },
    }


@torch.no_grad()
def export_lite(
    bundle_dir: Path,
    step: Callable[[str], None] = lambda msg: None,
    *,
    model_dir: Path | None = None,
    int8: bool = False,
) -> dict[str, Any]:
    """Write ``bundle_dir/lite/`` from the bundle's weights and check every graph; returns its manifest.

    Args:
        bundle_dir: the bundle (its float components are exported).
        step: reports progress.
        model_dir: the official model dir the bundle came from: its float LLM is exported when the bundle stores
            the LLM as int8 (torch's int8 is not ONNX's).
        int8: also write ``llm_step.int8.onnx``, the step graph with ONNX Runtime's dynamic int8 quantization of
            its matrix products (what ``llm_quantize=int8`` serves); its distance from the float graph is recorded.

    Raises:
        ConvertError: a family or storage the lite runtime does not serve, or a graph that differs from its module.
    """
    from safetensors.numpy import save_file

    from cosyserve.bundle.convert import sha256_file
    from cosyserve.bundle.loader import LoadOptions, open_bundle

    bundle = open_bundle(bundle_dir)
    cfg = bundle.config
    if not cfg.family_spec.lite:
        raise ConvertError(
            f"--runtime lite serves the CosyVoice-300M family; this is a {cfg.family_spec.title} model (use the "
            "torch runtime)"
        )
    parts = bundle.load(LoadOptions(strategy="lazy", verify="none"))
    if bundle.quantized("llm") != "none":
        if model_dir is None:
            raise ConvertError("--runtime lite exports float weights; this bundle stores the LLM as int8")
        from cosyserve.bundle.official import load_component

        parts.modules["llm"] = load_component(model_dir, "llm", cfg.llm, cfg.family)
    llm, flow, hift = (parts.modules[n].float().eval() for n in ("llm", "flow", "hift"))
    # the relative-position tables are Python-side buffers: grown before tracing so the traced constant covers
    # every length a request can have
    for enc in (llm.text_encoder, flow.encoder, llm.llm):
        enc.embed.pos_enc._table(MAX_TEXT_POSITIONS, torch.zeros(1))
    out = bundle_dir / LITE_DIR
    out.mkdir(exist_ok=True)
    gen = torch.Generator().manual_seed(1234)
    n_layers = len(llm.llm.encoders)
    a0 = llm.llm.encoders[0].self_attn
    heads, head_dim, c = a0.h, a0.d_k, llm.cfg.llm_input_size
    errors: dict[str, float] = {}

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen)

    def ints(hi: int, n: int) -> Tensor:
        return torch.randint(0, hi, (1, n), generator=gen, dtype=torch.int64)

    def pe_rows(n: int) -> Tensor:
        return torch.from_numpy(distance_pe(c, 0, n))

    def graph(
        name: str,
        module: nn.Module,
        example: tuple[Tensor, ...],
        inputs: list[str],
        outputs: list[str],
        dynamic: dict[str, dict[int, str]],
        cases: list[tuple[Tensor, ...]],
        optimize: bool = False,
    ) -> None:
        """Export ``module`` as graph ``name`` (traced on ``example``) and check it on ``cases``."""
        path = out / GRAPHS[name]
        _export(module, example, path, inputs, outputs, dynamic)
        if optimize:
            _optimize_offline(path)
        errors[name] = _check(name, path, module, cases, inputs, 1e-4)

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

    graph(
        "llm_step", StepGraph(llm), step_case(5, 3), names, outs, dyn,
        [step_case(0, 9), step_case(9, 1), step_case(30, 1)],
    )  # fmt: skip

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
        return randn(2, cin, m), torch.rand(2, generator=gen)

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

    int8_delta: dict[str, float] = {}
    if int8:
        step("lite: LM step, int8")
        int8_delta = _quantize_step(out, [step_case(0, 9), step_case(30, 1)], names)
    step("lite: tables")
    save_file(_tables(llm, flow, hift), str(out / TABLES_FILE), metadata={"format": LITE_FORMAT})
    (out / TABLES_FILE).chmod(0o644)
    files = {}
    for f in sorted(out.iterdir()):
        files[f.name] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
    manifest = {
        "format": LITE_FORMAT,
        "version": LITE_VERSION,
        "opset": OPSET,
        "config": _config(cfg, llm, flow, hift),
        "graphs": GRAPHS,
        "files": files,
        "checked": {k: float(f"{v:.3g}") for k, v in errors.items()},
        **({"int8": int8_delta} if int8 else {}),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    logger.info("lite graphs checked against the modules: %s", errors)
    return manifest
