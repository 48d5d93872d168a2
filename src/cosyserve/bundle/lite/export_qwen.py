"""The lite graphs of CosyVoice2's and CosyVoice3's Qwen2 LM (``Family.lite_export`` of both families).

One graph, ``llm_step``: T new input embeddings against the P positions a cache row holds -> the next token's
log-probabilities and the new positions' keys and values. The caches are one (positions, head_dim) matrix per
layer, KV head and keys/values (:func:`cosyserve.bundle.lite.qwen_cache_names`): the past is bound as a graph input,
the new rows are graph outputs bound to the next rows of the same buffer by the runtime, and the attention reads
each as a plain matrix (``q @ past_k.T`` is one Gemm with ``transB``, ``attn @ past_v`` one MatMul), so nothing
of the cache is copied or transposed per step. The rotary positions are computed inside the graph from P.

What is a lookup stays a numpy table the runtime maps (:mod:`cosyserve.runtime.lite.lm`): the Qwen text embedding
(151936 rows; a request reads a few, a graph would have to be opened and its table mapped all the same), the
speech embedding and the sos/task rows. So a bundle holds no text-encoder graph and the step graph's session is
the only one the LM opens.

The graph is checked against the model's own code (:meth:`~cosyserve.models.llm.SpeechLM.extend` over its KV
caches, filled with the case's past), not against the wrapper it was traced from. The flow and vocoder graphs of
these families are :mod:`cosyserve.bundle.lite.export_chunkflow`'s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.bundle.lite import BATCH_STEP, qwen_cache_names
from cosyserve.bundle.lite.export import BatchReference, Exporter, StepReference
from cosyserve.models.qwen2lm import Qwen2LM

__all__ = ["QwenBatchGraph", "QwenStepGraph", "export", "references"]


class QwenStepGraph(nn.Module):
    """x (1, T, C) and every cache's past (P, D), in :func:`~cosyserve.bundle.lite.qwen_cache_names` order -> logp
    (1, V) and every cache's new rows (T, D) in the same order.

    The model's computation op for op where rounding could differ, written for few graph nodes (a session's open
    time and a step's overhead grow with them): reshapes by -1 (no traced shape arithmetic), the half rotation as
    a product with a signed permutation matrix (exact: one nonzero term per output), the RMSNorm without its
    float32 casts (the graph is float32), the KV heads' new-key scores as one batched product."""

    def __init__(self, lm: Qwen2LM) -> None:
        super().__init__()
        self.stack = lm.stack
        self.decoder = lm.llm_decoder
        a = self.stack.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = a.n_heads, a.n_kv, a.head_dim
        d, half = self.head_dim, self.head_dim // 2
        rot = torch.zeros(d, d)  # x @ rot == cat(-x[half:], x[:half]), transformers' rotate_half
        rot[torch.arange(half) + half, torch.arange(half)] = -1.0
        rot[torch.arange(half), torch.arange(half) + half] = 1.0
        self.register_buffer("rot", rot, persistent=False)

    @staticmethod
    def _norm(norm: nn.Module, x: Tensor) -> Tensor:
        # Qwen2RMSNorm in float32: the statistics, then the weight
        return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))

    def _qkv(self, layer: nn.Module, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # (N, H, D) q, scaled, and (N, n_kv, D) k, both rotated, and v of the N inputs h (1, N, C) or (N, 1, C); q is
        # scaled before its products, not the scores after: the same bits where sqrt(D) is a power of two (Qwen2's 64)
        a, d = layer.self_attn, self.head_dim
        hn = self._norm(layer.input_layernorm, h)
        q = a.q_proj(hn).view(-1, self.heads, d)
        k = a.k_proj(hn).view(-1, self.kv_heads, d)
        v = a.v_proj(hn).view(-1, self.kv_heads, d)
        q = (q * cos + (q @ self.rot) * sin) * (1.0 / math.sqrt(d))
        k = k * cos + (k @ self.rot) * sin
        return q, k, v

    def forward(self, x: Tensor, *past: Tensor) -> tuple[Tensor, ...]:
        stack, n_kv, d, heads = self.stack, self.kv_heads, self.head_dim, self.heads
        groups = heads // n_kv
        t, p = x.shape[1], past[0].shape[0]
        cos, sin = stack._rotary(torch.arange(t) + p)  # (T, D)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        # a new position attends to the new positions up to itself; rows are (group, position)
        ahead = (torch.arange(t).unsqueeze(0) > torch.arange(t).unsqueeze(1)).repeat(groups, 1)  # (G*T, T)
        no_bias = torch.zeros(
            p
        )  # linear() with a bias exports as one Gemm(transB): the cache is not transposed
        h = x  # (1, T, C): the projections stay 3-D (MatMul, which int8 quantizes; a 2-D one would be Gemm)
        new: list[Tensor] = []
        for i, layer in enumerate(stack.layers):
            a = layer.self_attn
            q, k, v = self._qkv(layer, h, cos, sin)  # (T, H, D), (T, n_kv, D) twice
            # each KV head's group of query heads as rows (group, position): (n_kv, G*T, D)
            qg = q.view(-1, n_kv, groups, d).permute(1, 2, 0, 3).reshape(n_kv, -1, d)
            s_new = (qg @ k.permute(1, 2, 0)).masked_fill(ahead, -math.inf)  # (n_kv, G*T, T)
            k_new, v_new = [k[:, g] for g in range(n_kv)], [v[:, g] for g in range(n_kv)]  # (T, D) each
            caches = [(past[2 * (i * n_kv + g)], past[2 * (i * n_kv + g) + 1]) for g in range(n_kv)]
            s_past = torch.stack([F.linear(qg[g], pk, no_bias) for g, (pk, _) in enumerate(caches)])
            attn = torch.cat([s_past, s_new], dim=-1).softmax(dim=-1)  # (n_kv, G*T, P + T)
            a_past, a_new = attn.split([p, t], dim=-1)
            out = torch.stack([a_past[g] @ pv for g, (_, pv) in enumerate(caches)]) + a_new @ v.transpose(
                0, 1
            )
            out = out.view(n_kv, groups, -1, d).permute(2, 0, 1, 3).reshape(1, -1, heads * d)  # head g*G + j
            h = h + a.o_proj(out)
            h = h + layer.mlp(self._norm(layer.post_attention_layernorm, h))
            for g in range(n_kv):
                new += [k_new[g], v_new[g]]
        h = self._norm(stack.norm, h)
        logp = self.decoder(h[:, -1:]).float().log_softmax(dim=-1).reshape(1, -1)  # (1, V)
        return (logp, *new)


class QwenBatchGraph(QwenStepGraph):
    """x (B, 1, C), pos (B,) int64 and every cache's past (B, L, D) -> logp (B, V) and every cache's new row (B, D):
    one decode step of B rows, row b's token at position pos[b] after the pos[b] positions its cache rows hold
    (L >= every pos: a row's positions from pos[b] on are padding, masked out). The runtime binds the first B rows
    of its caches as they are (no copy) and writes the new rows into them after the run.

    The step graph's computation per row; the past's scores as ``past_k @ q.T`` (B, L, G) and the output as
    ``attn.T @ past_v``, so only q and the scores are transposed, never a cache."""

    def forward(self, x: Tensor, pos: Tensor, *past: Tensor) -> tuple[Tensor, ...]:
        stack, n_kv, d, heads = self.stack, self.kv_heads, self.head_dim, self.heads
        groups = heads // n_kv
        cos, sin = stack._rotary(pos)  # (B, D)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        # (B, L, 1): a row's positions past its own are padding
        pad = (torch.arange(past[0].shape[1]).unsqueeze(0) >= pos.unsqueeze(1)).unsqueeze(-1)
        h = x  # (B, 1, C)
        new: list[Tensor] = []
        for i, layer in enumerate(stack.layers):
            a = layer.self_attn
            q, k, v = self._qkv(layer, h, cos, sin)  # (B, H, D), (B, n_kv, D) twice
            qg = q.view(-1, n_kv, groups, d)  # (B, n_kv, G, D): query head g*G + j
            s_new = (qg * k.unsqueeze(2)).sum(-1, keepdim=True)  # (B, n_kv, G, 1)
            outs = []
            for g in range(n_kv):
                pk, pv = past[2 * (i * n_kv + g)], past[2 * (i * n_kv + g) + 1]  # (B, L, D)
                s_past = (pk @ qg[:, g].transpose(1, 2)).masked_fill(pad, -math.inf)  # (B, L, G)
                attn = torch.cat([s_past, s_new[:, g].transpose(1, 2)], dim=1).softmax(dim=1)  # (B, L + 1, G)
                a_past, a_new = attn[:, :-1], attn[:, -1:]
                outs.append(
                    a_past.transpose(1, 2) @ pv + a_new.transpose(1, 2) * v[:, g].unsqueeze(1)
                )  # (B, G, D)
                new += [k[:, g], v[:, g]]
            out = torch.stack(outs, dim=1).reshape(-1, 1, heads * d)  # (B, 1, H*D)
            h = h + a.o_proj(out)
            h = h + layer.mlp(self._norm(layer.post_attention_layernorm, h))
        h = self._norm(stack.norm, h)
        logp = (
            self.decoder(h).float().log_softmax(dim=-1).flatten(1)
        )  # (B, V): squeeze() of a traced dim exports an If
        return (logp, *new)


def references(lm: Qwen2LM) -> tuple[StepReference, BatchReference]:
    """The step and batch graphs' outputs computed by the model's own code (its KV caches, one (n_kv, positions,
    head_dim) pair per layer, set from the graph's (positions, head_dim) matrices, then its extend)."""
    n_kv, layers = lm.stack.layers[0].self_attn.n_kv, len(lm.stack.layers)

    def to_model(past: tuple[Tensor, ...]) -> list[Tensor]:
        # per layer: its KV heads' keys (n_kv, P, D), then their values
        return [
            torch.stack([past[2 * (i * n_kv + g) + kv] for g in range(n_kv)])
            for i in range(layers)
            for kv in (0, 1)
        ]

    def to_graph(new: list[Tensor]) -> list[Tensor]:
        # qwen_cache_names' order: per layer, per KV head, keys then values (T, D)
        return [new[2 * i + kv][g] for i in range(layers) for g in range(n_kv) for kv in (0, 1)]

    step = StepReference(lm, to_model, to_graph)
    return step, BatchReference(step, lambda past, b, p: [c[b, :p] for c in past])


def _config(lm: Qwen2LM) -> dict[str, Any]:
    a = lm.stack.layers[0].self_attn
    r = lm.rules
    return {
        "llm": {
            "arch": "qwen2",
            "layers": len(lm.stack.layers),
            "heads": a.n_heads,
            "kv_heads": a.n_kv,
            "head_dim": a.head_dim,
            "input_size": lm.cfg.llm_input_size,
            "speech_token_size": lm.cfg.speech_token_size,
            "rules": {**dataclasses.asdict(r), "mix_ratio": list(r.mix_ratio)},
            "sampling": dataclasses.asdict(lm.sampling),
        }
    }


def _tables(lm: Qwen2LM) -> dict[str, Any]:
    def a(t: Tensor) -> Any:
        return t.detach().float().contiguous().numpy()

    return {
        "llm.text_embedding": a(lm.stack.embed_tokens.weight),
        "llm.speech_embedding": a(lm.speech_embedding.weight),
        "llm.sos": a(lm._row(lm.sos).reshape(-1)),
        "llm.task": a(lm._row(lm.task_id).reshape(-1)),
    }


def export(ex: Exporter, modules: dict[str, nn.Module], parts: tuple[str, ...], int8: bool) -> None:
    """Export and check the graphs of ``parts`` into ``ex``: the Qwen LM's step graph (``int8``: its int8 variant
    too), the chunk flow's and the vocoder's (:mod:`cosyserve.bundle.lite.export_chunkflow`)."""
    from cosyserve.bundle.lite.export_chunkflow import export_flow, export_hift

    if "flow" in parts:
        export_flow(ex, modules["flow"])
    if "hift" in parts:
        export_hift(ex, modules["hift"])
    if "llm" in parts:
        _export_lm(ex, modules, int8)


def _export_lm(ex: Exporter, modules: dict[str, nn.Module], int8: bool) -> None:
    lm = modules["llm"]
    assert isinstance(lm, Qwen2LM)
    a = lm.stack.layers[0].self_attn
    layers, n_kv, d, c = len(lm.stack.layers), a.n_kv, a.head_dim, lm.cfg.llm_input_size
    names = qwen_cache_names(layers, n_kv)
    inputs = ["x"] + [past for past, _ in names]
    outputs = ["logp"] + [new for _, new in names]
    dynamic: dict[str, dict[int, str]] = {"x": {1: "t"}}
    dynamic.update({past: {0: "p"} for past, _ in names})
    dynamic.update({new: {0: "t"} for _, new in names})

    def case(p: int, t: int) -> tuple[Tensor, ...]:
        return (ex.randn(1, t, c), *[ex.randn(p, d) for _ in names])

    step_reference, batch_reference = references(lm)
    ex.step("lite: LM step")
    ex.graph(
        "llm_step", QwenStepGraph(lm), case(5, 3), inputs, outputs, dynamic,
        [case(0, 9), case(9, 1), case(30, 1), case(17, 4)], reference=step_reference,
    )  # fmt: skip
    if int8:
        ex.step("lite: LM step, int8")
        ex.quantize_step([case(0, 9), case(30, 1)], inputs)
    ex.step("lite: LM step, rewritten by ONNX Runtime")
    ex.optimize(
        "llm_step"
    )  # after the quantizer read the traced graph (the int8 one is rewritten by the quantizer's step)
    _export_batch(ex, lm, batch_reference)
    ex.tables.update(_tables(lm))
    ex.config.update(_config(lm))


def _export_batch(ex: Exporter, lm: Qwen2LM, reference: BatchReference) -> None:
    # the batched decode step, its weights read from the step graph's data file; no int8 one (BATCH_STEP says why)
    a = lm.stack.layers[0].self_attn
    layers, n_kv, d, c = len(lm.stack.layers), a.n_kv, a.head_dim, lm.cfg.llm_input_size
    names = qwen_cache_names(layers, n_kv)
    inputs = ["x", "pos"] + [past for past, _ in names]
    outputs = ["logp"] + [new for _, new in names]
    dynamic: dict[str, dict[int, str]] = {"x": {0: "b"}, "pos": {0: "b"}, "logp": {0: "b"}}
    dynamic.update({past: {0: "b", 1: "l"} for past, _ in names})
    dynamic.update({new: {0: "b"} for _, new in names})

    def case(length: int, *pos: int) -> tuple[Tensor, ...]:
        # the padding past each row's positions random too: the check sees it masked
        b = len(pos)
        return (
            ex.randn(b, 1, c),
            torch.tensor(pos, dtype=torch.int64),
            *[ex.randn(b, length, d) for _ in names],
        )

    cases = [case(9, 9, 3), case(30, 0, 30, 17, 1), case(5, 2)]
    ex.step("lite: LM batch step")
    ex.graph(
        BATCH_STEP, QwenBatchGraph(lm), case(7, 5, 0, 7), inputs, outputs, dynamic, cases,
        optimize=True, reference=reference, shares="llm_step",
    )  # fmt: skip
