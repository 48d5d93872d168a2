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
- ``speech_tokenizer_v2.onnx`` (CosyVoice2): the same inputs -> ``indices`` int64 [B, ceil(ceil(T / 2) / 2)] in
  [0, 6561): a second stride-2 conv to 25 Hz and an 81 x 81 product codebook.

The files are written with a few lines of protobuf wire format below, not with the ``onnx`` package: the demo
model (``cosyserve serve`` without ``--model``) makes them on a plain install, where ``onnx`` is not present.
The writer emits the fields in field-number order, as protobuf's own serializer does, so the bytes equal
``onnx.helper``'s for the same graph (the tests check this and run the graphs through ``onnx.checker``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cosyserve.frontend.prompt import CAMPPLUS_FILE, SPEECH_TOKENIZER_FILE

__all__ = ["SPEECH_TOKEN_VOCAB", "write_test_onnx_models"]

SPEECH_TOKEN_VOCAB = 4096
_HALF_VOCAB = 64  # 64 * 64 = 4096
_HALF_VOCAB_V2 = 81  # 81 * 81 = 6561 (CosyVoice2's FSQ codes)
_IR_VERSION = 8
_OPSET = 17

# onnx.proto: TensorProto.DataType and AttributeProto.AttributeType values used here
FLOAT, INT32, INT64 = 1, 6, 7
_ATTR_INT, _ATTR_INTS = 2, 7
_DTYPES = {np.dtype(np.float32): FLOAT, np.dtype(np.int32): INT32, np.dtype(np.int64): INT64}


# ---------------------------------------------------------------------------------------------------------------------
# protobuf wire format (proto2: a set optional field is written even when it is zero; repeated scalars unpacked)


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int64 -> two's complement, ten bytes
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _int(field: int, n: int) -> bytes:
    return _varint(field << 3) + _varint(n)


def _bytes(field: int, data: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(data)) + data


def _str(field: int, s: str) -> bytes:
    return _bytes(field, s.encode("utf-8"))


def _node(op_type: str, inputs: list[str], outputs: list[str], **attrs: int | list[int]) -> bytes:
    """NodeProto: input 1, output 2, op_type 4, attribute 5 (AttributeProto: name 1, i 3, ints 8, type 20)."""
    msg = b"".join(_str(1, i) for i in inputs) + b"".join(_str(2, o) for o in outputs) + _str(4, op_type)
    for name, value in sorted(attrs.items()):  # onnx.helper.make_node sorts them too
        if isinstance(value, list):
            attr = _str(1, name) + b"".join(_int(8, v) for v in value) + _int(20, _ATTR_INTS)
        else:
            attr = _str(1, name) + _int(3, value) + _int(20, _ATTR_INT)
        msg += _bytes(5, attr)
    return msg


def _tensor(name: str, array: np.ndarray) -> bytes:
    """TensorProto: dims 1, data_type 2, name 8, raw_data 9 (little-endian, as numpy_helper.from_array)."""
    array = np.asarray(array)
    dims = b"".join(_int(1, d) for d in array.shape)
    raw = array.astype(array.dtype.newbyteorder("<")).tobytes()
    return dims + _int(2, _DTYPES[array.dtype]) + _str(8, name) + _bytes(9, raw)


def _value_info(name: str, elem_type: int, shape: list[int | str]) -> bytes:
    """ValueInfoProto name 1, type 2 -> TypeProto tensor_type 1 -> elem_type 1, shape 2 -> dim 1 (value 1, param 2)."""
    dims = b"".join(_bytes(1, _int(1, d) if isinstance(d, int) else _str(2, d)) for d in shape)
    tensor_type = _int(1, elem_type) + _bytes(2, dims)
    return _str(1, name) + _bytes(2, _bytes(1, tensor_type))


def _model(
    name: str, nodes: list[bytes], inputs: list[bytes], outputs: list[bytes], initializers: list[bytes]
) -> bytes:
    """ModelProto: ir_version 1, producer_name 2, graph 7, opset_import 8 (domain 1, version 2).

    GraphProto: node 1, name 2, initializer 5, input 11, output 12.
    """
    graph = (
        b"".join(_bytes(1, n) for n in nodes)
        + _str(2, name)
        + b"".join(_bytes(5, t) for t in initializers)
        + b"".join(_bytes(11, v) for v in inputs)
        + b"".join(_bytes(12, v) for v in outputs)
    )
    opset = _str(1, "") + _int(2, _OPSET)
    return _int(1, _IR_VERSION) + _str(2, "cosyserve-testmodel") + _bytes(7, graph) + _bytes(8, opset)


# ---------------------------------------------------------------------------------------------------------------------
# the two graphs


def _campplus(rng: np.random.Generator, hidden: int = 32, embed_dim: int = 192) -> bytes:
    def init(name: str, array: np.ndarray) -> bytes:
        return _tensor(name, array.astype(np.float32))

    initializers = [
        init("w1", rng.standard_normal((80, hidden)) / np.sqrt(80)),
        init("b1", rng.standard_normal(hidden) * 0.1),
        init("w2", rng.standard_normal((hidden, embed_dim)) / np.sqrt(hidden)),
        init("b2", rng.standard_normal(embed_dim) * 0.1),
    ]
    nodes = [
        _node("MatMul", ["input", "w1"], ["h0"]),  # [B, T, H]
        _node("Add", ["h0", "b1"], ["h1"]),
        _node("Relu", ["h1"], ["h2"]),
        _node("ReduceMean", ["h2"], ["pooled"], axes=[1], keepdims=0),  # [B, H]
        _node("MatMul", ["pooled", "w2"], ["e0"]),  # [B, 192]
        _node("Add", ["e0", "b2"], ["output"]),
    ]
    return _model(
        "campplus_test",
        nodes,
        [_value_info("input", FLOAT, ["B", "T", 80])],
        [_value_info("output", FLOAT, ["B", embed_dim])],
        initializers,
    )


def _speech_tokenizer(rng: np.random.Generator, channels: int = 16, version: int = 1) -> bytes:
    def init(name: str, array: np.ndarray, dtype: type = np.float32) -> bytes:
        return _tensor(name, np.asarray(array).astype(dtype))

    half = _HALF_VOCAB if version == 1 else _HALF_VOCAB_V2
    initializers = [
        init("conv_w", rng.standard_normal((channels, 128, 3)) / np.sqrt(128 * 3)),
        init("conv_b", rng.standard_normal(channels) * 0.1),
        *(
            [
                init("conv2_w", rng.standard_normal((channels, channels, 3)) / np.sqrt(channels * 3)),
                init("conv2_b", rng.standard_normal(channels) * 0.1),
            ]
            if version == 2
            else []
        ),
        init("code_a", rng.standard_normal((channels, half))),
        init("code_b", rng.standard_normal((channels, half))),
        init("half_vocab", np.array(half), np.int64),
        init("zero", np.array(0), np.int64),
        init("one", np.array(1), np.int64),
        init("axis1", np.array([1]), np.int64),
    ]
    nodes = [
        # mask frames at or past feats_length: [B, 1, T]
        _node("Shape", ["feats"], ["t_1d"], start=2, end=3),  # [1]
        _node("Squeeze", ["t_1d"], ["t"]),  # scalar
        _node("Range", ["zero", "t", "one"], ["pos"]),  # [T]
        _node("Cast", ["feats_length"], ["len64"], to=INT64),  # [B]
        _node("Unsqueeze", ["len64", "axis1"], ["len_col"]),  # [B, 1]
        _node("Less", ["pos", "len_col"], ["valid"]),  # [B, T]
        _node("Cast", ["valid"], ["valid_f"], to=FLOAT),
        _node("Unsqueeze", ["valid_f", "axis1"], ["mask"]),  # [B, 1, T]
        _node("Mul", ["feats", "mask"], ["x0"]),  # [B, 128, T]
        # 100 Hz -> 50 Hz: [B, C, ceil(T / 2)]
        _node("Conv", ["x0", "conv_w", "conv_b"], ["x1"], kernel_shape=[3], strides=[2], pads=[1, 1]),
        *(
            # v2: 50 Hz -> 25 Hz, [B, C, ceil(ceil(T / 2) / 2)]
            [
                _node("Tanh", ["x1"], ["x1a"]),
                _node(
                    "Conv", ["x1a", "conv2_w", "conv2_b"], ["x1b"], kernel_shape=[3], strides=[2], pads=[1, 1]
                ),
                _node("Tanh", ["x1b"], ["x2"]),
            ]
            if version == 2
            else [_node("Tanh", ["x1"], ["x2"])]
        ),
        _node("Transpose", ["x2"], ["x3"], perm=[0, 2, 1]),  # [B, T2, C]
        # product codebook: id = 64 * argmax(x @ A) + argmax(x @ B)
        _node("MatMul", ["x3", "code_a"], ["score_a"]),  # [B, T2, 64]
        _node("MatMul", ["x3", "code_b"], ["score_b"]),
        _node("ArgMax", ["score_a"], ["ia"], axis=-1, keepdims=0),  # [B, T2] int64
        _node("ArgMax", ["score_b"], ["ib"], axis=-1, keepdims=0),
        _node("Mul", ["ia", "half_vocab"], ["ia64"]),
        _node("Add", ["ia64", "ib"], ["indices"]),
    ]
    return _model(
        f"speech_tokenizer_v{version}_test",
        nodes,
        [_value_info("feats", FLOAT, ["B", 128, "T"]), _value_info("feats_length", INT32, ["B"])],
        [_value_info("indices", INT64, ["B", "T2"])],
        initializers,
    )


def write_test_onnx_models(out_dir: Path, seed: int = 0, speech_tokenizer: int = 1) -> None:
    """Write random-weight ``campplus.onnx`` and ``speech_tokenizer_v1.onnx`` into ``out_dir``.

    Needs neither the ``onnx`` package nor onnxruntime.

    Args:
        out_dir: an existing directory (the test model dir); existing files of these names are replaced.
        seed: seeds the weights; the same seed writes byte-identical files.
        speech_tokenizer: 1 (CosyVoice-300M: ``speech_tokenizer_v1.onnx``, 4096 ids at 50 Hz) or 2 (CosyVoice2:
            ``speech_tokenizer_v2.onnx``, a second stride-2 conv, 6561 ids at 25 Hz).
    """
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise FileNotFoundError(f"output directory {out_dir} does not exist")
    rng = np.random.default_rng(seed)
    for name, model in (
        (CAMPPLUS_FILE, _campplus(rng)),
        (
            SPEECH_TOKENIZER_FILE if speech_tokenizer == 1 else "speech_tokenizer_v2.onnx",
            _speech_tokenizer(rng, version=speech_tokenizer),
        ),
    ):
        (out_dir / name).write_bytes(model)
