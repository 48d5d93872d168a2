"""Tiny random-weight stand-ins for ``campplus.onnx`` and ``speech_tokenizer_v1.onnx`` (tests, make-test-model).

They have the official models' input and output names, dtypes and shapes (ONNX IR 8, opset 17, as the
official exports), so the zero-shot frontend runs on them unchanged; the weights are random and the files
are a few tens of KB:

- ``campplus.onnx``: ``input`` float32 [B, T, 80] -> ``output`` float32 [B, 192]
  (per-frame Linear + ReLU, mean over time, Linear).
- ``speech_tokenizer_v1.onnx``: ``feats`` float32 [B, 128, T], ``feats_length`` int32 [B] -> ``indices``
  int64 [B, ceil(T / 2)] in [0, 4096): frames past ``feats_length`` are zeroed, a stride-2 Conv1d halves the
  100 Hz mel rate to 50 Hz, and two 64-way argmaxes form the id ``64 * a + b`` (a product codebook covering
  all 4096 ids with 2 x 64 code vectors).

Built with ``onnx.helper`` directly; needs the ``onnx`` package (a test/dev dependency).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["SPEECH_TOKEN_VOCAB", "write_test_onnx_models"]

SPEECH_TOKEN_VOCAB = 4096
_HALF_VOCAB = 64  # 64 * 64 = 4096
_IR_VERSION = 8
_OPSET = 17


def _campplus(rng: np.random.Generator, hidden: int = 32, embed_dim: int = 192):  # -> onnx.ModelProto
    from onnx import TensorProto, helper, numpy_helper

    def init(name: str, array: np.ndarray):
        return numpy_helper.from_array(array.astype(np.float32), name)

    initializers = [
        init("w1", rng.standard_normal((80, hidden)) / np.sqrt(80)),
        init("b1", rng.standard_normal(hidden) * 0.1),
        init("w2", rng.standard_normal((hidden, embed_dim)) / np.sqrt(hidden)),
        init("b2", rng.standard_normal(embed_dim) * 0.1),
    ]
    nodes = [
        helper.make_node("MatMul", ["input", "w1"], ["h0"]),  # [B, T, H]
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("ReduceMean", ["h2"], ["pooled"], axes=[1], keepdims=0),  # [B, H]
        helper.make_node("MatMul", ["pooled", "w2"], ["e0"]),  # [B, 192]
        helper.make_node("Add", ["e0", "b2"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes,
        "campplus_test",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["B", "T", 80])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["B", embed_dim])],
        initializers,
    )
    return helper.make_model(
        graph,
        ir_version=_IR_VERSION,
        opset_imports=[helper.make_opsetid("", _OPSET)],
        producer_name="cosyserve-testmodel",
    )


def _speech_tokenizer(rng: np.random.Generator, channels: int = 16):  # -> onnx.ModelProto
    from onnx import TensorProto, helper, numpy_helper

    def init(name: str, array: np.ndarray, dtype: type = np.float32):
        return numpy_helper.from_array(np.asarray(array).astype(dtype), name)

    initializers = [
        init("conv_w", rng.standard_normal((channels, 128, 3)) / np.sqrt(128 * 3)),
        init("conv_b", rng.standard_normal(channels) * 0.1),
        init("code_a", rng.standard_normal((channels, _HALF_VOCAB))),
        init("code_b", rng.standard_normal((channels, _HALF_VOCAB))),
        init("half_vocab", np.array(_HALF_VOCAB), np.int64),
        init("zero", np.array(0), np.int64),
        init("one", np.array(1), np.int64),
        init("axis1", np.array([1]), np.int64),
    ]
    nodes = [
        # mask frames at or past feats_length: [B, 1, T]
        helper.make_node("Shape", ["feats"], ["t_1d"], start=2, end=3),  # [1]
        helper.make_node("Squeeze", ["t_1d"], ["t"]),  # scalar
        helper.make_node("Range", ["zero", "t", "one"], ["pos"]),  # [T]
        helper.make_node("Cast", ["feats_length"], ["len64"], to=TensorProto.INT64),  # [B]
        helper.make_node("Unsqueeze", ["len64", "axis1"], ["len_col"]),  # [B, 1]
        helper.make_node("Less", ["pos", "len_col"], ["valid"]),  # [B, T]
        helper.make_node("Cast", ["valid"], ["valid_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["valid_f", "axis1"], ["mask"]),  # [B, 1, T]
        helper.make_node("Mul", ["feats", "mask"], ["x0"]),  # [B, 128, T]
        # 100 Hz -> 50 Hz: [B, C, ceil(T / 2)]
        helper.make_node(
            "Conv", ["x0", "conv_w", "conv_b"], ["x1"], kernel_shape=[3], strides=[2], pads=[1, 1]
        ),
        helper.make_node("Tanh", ["x1"], ["x2"]),
        helper.make_node("Transpose", ["x2"], ["x3"], perm=[0, 2, 1]),  # [B, T2, C]
        # product codebook: id = 64 * argmax(x @ A) + argmax(x @ B)
        helper.make_node("MatMul", ["x3", "code_a"], ["score_a"]),  # [B, T2, 64]
        helper.make_node("MatMul", ["x3", "code_b"], ["score_b"]),
        helper.make_node("ArgMax", ["score_a"], ["ia"], axis=-1, keepdims=0),  # [B, T2] int64
        helper.make_node("ArgMax", ["score_b"], ["ib"], axis=-1, keepdims=0),
        helper.make_node("Mul", ["ia", "half_vocab"], ["ia64"]),
        helper.make_node("Add", ["ia64", "ib"], ["indices"]),
    ]
    graph = helper.make_graph(
        nodes,
        "speech_tokenizer_v1_test",
        [
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, ["B", 128, "T"]),
            helper.make_tensor_value_info("feats_length", TensorProto.INT32, ["B"]),
        ],
        [helper.make_tensor_value_info("indices", TensorProto.INT64, ["B", "T2"])],
        initializers,
    )
    return helper.make_model(
        graph,
        ir_version=_IR_VERSION,
        opset_imports=[helper.make_opsetid("", _OPSET)],
        producer_name="cosyserve-testmodel",
    )


def write_test_onnx_models(out_dir: Path, seed: int = 0) -> None:
    """Write random-weight ``campplus.onnx`` and ``speech_tokenizer_v1.onnx`` into ``out_dir``.

    Args:
        out_dir: an existing directory (the test model dir); existing files of these names are replaced.
        seed: seeds the weights; the same seed writes byte-identical files.
    """
    try:
        import onnx
    except ImportError as e:
        raise RuntimeError("writing the test ONNX models needs the 'onnx' package (pip install onnx)") from e

    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise FileNotFoundError(f"output directory {out_dir} does not exist")
    rng = np.random.default_rng(seed)
    for name, model in (
        ("campplus.onnx", _campplus(rng)),
        ("speech_tokenizer_v1.onnx", _speech_tokenizer(rng)),
    ):
        onnx.checker.check_model(model, full_check=True)
        (out_dir / name).write_bytes(model.SerializeToString())
