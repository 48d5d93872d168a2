"""The lite runtime's bundle part: ONNX graphs of every model computation, checked at conversion.

``cosyserve convert --runtime lite`` (on a machine with torch) writes ``lite/`` into a bundle: one ONNX graph per
computation (:data:`GRAPHS`, each with its weights in an external data file beside it), a small safetensors file
of tables the numpy code reads (:data:`TABLES_FILE`) and ``lite/manifest.json`` (the config numbers the runtime
needs, each file's size and sha256, and how far each graph was from its torch module). Importing this package
imports neither torch nor onnxruntime.
"""

from __future__ import annotations

__all__ = [
    "BATCH_STEP",
    "GRAPHS",
    "LITE_DIR",
    "LITE_PARTS",
    "LITE_FORMAT",
    "LITE_VERSION",
    "LITE_VERSIONS",
    "MAX_TEXT_POSITIONS",
    "POS_TABLE_ROWS",
    "TABLES_FILE",
    "qwen_cache_names",
]

LITE_DIR = "lite"
LITE_FORMAT = "cosyserve-lite"
LITE_VERSION = (
    3  # 2: CosyVoice2/3's one flow estimator graph, its stream caches as inputs and outputs; 3: CosyVoice2's
)
# flow encoder keeps its stream state too (flow_mu_stream)
# a voice's kept rows as inputs of their own (flow_estimator's kv_voice, CosyVoice2's flow_mu_stream's kv_*_voice: a
# fork reads them where they are) are added inputs: a bundle whose graphs lack them still serves, its forks copying
# the voice's rows (no version change); so is CosyVoice2's flow_mu_stream's `ahead` (0: a bounded stream's last call
# without lookahead; its config's encoder_state.ahead says it is there): a bundle without it serves exact streams
# the versions read: a version 2 bundle whose graphs version 3 did not change (no CosyVoice2 flow) is served as it is
LITE_VERSIONS = (2, 3)
TABLES_FILE = "tables.safetensors"
# the longest sequence a graph's relative-position table covers (text, prompt + speech tokens)
MAX_TEXT_POSITIONS = 4096
# LM positional projections stored in the tables for distances [0, POS_TABLE_ROWS) (58.7 MB at CosyVoice-300M's
# size); longer sequences compute the rest with the llm_pos graph
POS_TABLE_ROWS = 1024
INT8_STEP = (
    "llm_step.int8.onnx"  # the step graph with ORT's dynamic int8 matmuls (convert --quantize llm=int8)
)
# an LM's batched decode step (CosyVoice-300M's and the Qwen LM's): one token for each of B rows, each at its own
# position (a padded cache and a mask); its weights are the step graph's, read from the step graph's data file. A
# bundle converted before its LM had one lacks it and still serves, its rows stepping one after another (an added
# graph: no version change). The int8 step graph has none: ORT's dynamic int8 quantizes a run's activations with one
# scale per tensor, across its rows, so a row's tokens would depend on its neighbours; its rows step one by one
BATCH_STEP = "llm_batch"
# the parts a bundle's lite graphs cover: a bundle serves on the lite runtime with all of them (its manifest lists
# the ones it holds)
LITE_PARTS = ("llm", "flow", "hift")
# CosyVoice-300M's graphs (a manifest lists its own)
GRAPHS = {
    "llm_text": "llm_text.onnx",
    "llm_pos": "llm_pos.onnx",
    "llm_step": "llm_step.onnx",
    BATCH_STEP: "llm_batch.onnx",  # its weights in llm_step.onnx.data
    "flow_encoder": "flow_encoder.onnx",
    "flow_regulator": "flow_regulator.onnx",
    "flow_estimator": "flow_estimator.onnx",
    "hift_f0": "hift_f0.onnx",
    "hift_decode": "hift_decode.onnx",
}


def qwen_cache_names(layers: int, kv_heads: int) -> list[tuple[str, str]]:
    """The Qwen step graph's cache (input, output) names in their order: per layer, per KV head, keys then
    values (each a (positions, head_dim) matrix)."""
    return [
        (f"past_{kv}{i}_{h}", f"new_{kv}{i}_{h}")
        for i in range(layers)
        for h in range(kv_heads)
        for kv in "kv"
    ]
