"""``cosyserve make-test-model --family cosyvoice2``: random-weight CosyVoice2 directories in the official layout.

The layout of the CosyVoice2-0.5B release: ``cosyvoice2.yaml`` (our own template, the official tags and keys),
``llm.pt`` / ``flow.pt`` / ``hift.pt`` under the official key names, ``spk2info.pt``, ``campplus.onnx``,
``speech_tokenizer_v2.onnx`` and ``CosyVoice-BlankEN/`` with the Qwen config and tokenizer files. ``full`` has
the release's dimensions (Qwen2 0.5B: 896 wide, 24 layers, 14 heads, 2 KV heads); ``tiny`` is for tests. The
tokenizer is the real Qwen vocabulary (``assets/qwen.tiktoken``, from the dashscope package, Apache-2.0),
written as Qwen2's ``vocab.json`` and ``merges.txt``; the release's ~1 GB ``CosyVoice-BlankEN/model.safetensors``
is not written (nothing reads it: ``llm.pt`` holds every LM weight). Random weights make noise, not speech.
"""

from __future__ import annotations

import base64
import functools
import json
from pathlib import Path
from typing import Any

__all__ = ["SIZES", "render_yaml", "write_qwen_files"]

SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128,
        enc_heads=2, enc_units=64, enc_blocks=1,
        dec_channels=[64], dec_head_dim=32, dec_blocks=1, dec_mid_blocks=1, dec_heads=2,
        hift_channels=32, f0_channels=32,
    ),
    "full": dict(
        hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864,
        enc_heads=8, enc_units=2048, enc_blocks=6,
        dec_channels=[256], dec_head_dim=64, dec_blocks=4, dec_mid_blocks=12, dec_heads=8,
        hift_channels=512, f0_channels=512,
    ),
}  # fmt: skip

QWEN_VOCAB = 151936  # the embedding rows of the release (the BPE has 151643 tokens + specials)
_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_TEMPLATE = """\
# CosyVoice2 layout, written by cosyserve make-test-model ({size}): RANDOM WEIGHTS, it makes noise.
__set_seed1: !apply:random.seed [1986]
__set_seed2: !apply:numpy.random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]
__set_seed4: !apply:torch.cuda.manual_seed_all [1986]

sample_rate: 24000
llm_input_size: {hidden}
llm_output_size: {hidden}
spk_embed_dim: 192
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: 2
chunk_size: 25
num_decoding_left_chunks: -1

llm: !new:cosyvoice.llm.llm.Qwen2LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: 6561
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
        win_size: 10
        tau_r: 0.1

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec
    input_size: 512
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 6561
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder
        output_size: 512
        attention_heads: {enc_heads}
        linear_units: {enc_units}
        num_blocks: {enc_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: 512
        use_cnn_module: False
        macaron_style: False
        static_chunk_size: !ref <chunk_size>
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: 80
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: 0.7
                reg_loss_type: 'l1'
        estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder
            in_channels: 320
            out_channels: 80
            channels: {dec_channels}
            dropout: 0.0
            attention_head_dim: {dec_head_dim}
            n_blocks: {dec_blocks}
            num_mid_blocks: {dec_mid_blocks}
            num_heads: {dec_heads}
            act_fn: 'gelu'
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.HiFTGenerator
    in_channels: 80
    base_channels: {hift_channels}
    nb_harmonics: 8
    sampling_rate: !ref <sample_rate>
    nsf_alpha: 0.1
    nsf_sigma: 0.003
    nsf_voiced_threshold: 10
    upsample_rates: [8, 5, 3]
    upsample_kernel_sizes: [16, 11, 7]
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_kernel_sizes: [3, 7, 11]
    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    source_resblock_kernel_sizes: [7, 7, 11]
    source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    lrelu_slope: 0.1
    audio_limit: 0.99
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {f0_channels}

get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
allowed_special: 'all'
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: 8000
    center: False
"""


def render_yaml(size: str) -> str:
    """The ``cosyvoice2.yaml`` text for a CosyVoice2 test model of ``size`` (tiny or full)."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    return _TEMPLATE.format(size=size, **SIZES[size])


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's printable stand-in for every byte (what byte-level BPE vocabularies are written in)
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _qwen_ranks() -> dict[bytes, int]:
    path = Path(__file__).parent / "assets" / "qwen.tiktoken"
    ranks = {}
    for line in path.read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _merge_of(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The merge that made ``token``: BPE of its bytes with only the merges ranked before it leaves two parts."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best, at = rank, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1], rank)
            if r < best:
                best, at = r, i
        if at < 0:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} (rank {rank}) is not one merge of two earlier tokens")
    return parts[0], parts[1]


def write_qwen_files(qwen_dir: Path, size: str) -> None:
    """Write ``config.json``, ``generation_config.json``, ``tokenizer_config.json``, ``vocab.json`` and
    ``merges.txt`` (Qwen2 format, the real Qwen vocabulary) into ``qwen_dir``."""
    s = SIZES[size]
    qwen_dir.mkdir(parents=True, exist_ok=True)
    ranks = _qwen_ranks()
    u = _bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(u[x] for x in b)

    ordered = sorted(ranks.items(), key=lambda kv: kv[1])
    vocab = {text(b): r for b, r in ordered}
    merges = ["#version: 0.2"]
    for b, r in ordered:
        if len(b) > 1:
            left, right = _merge_of(b, r, ranks)
            merges.append(f"{text(left)} {text(right)}")
    (qwen_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (qwen_dir / "merges.txt").write_text("\n".join(merges) + "\n", encoding="utf-8")
    first = len(ranks)
    special = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    tokenizer_config = {
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(first + i): {"content": t, **special} for i, t in enumerate(_QWEN_SPECIALS)
        },
        "additional_special_tokens": list(_QWEN_SPECIALS[1:]),
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": _QWEN_SPECIALS[0],
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": _QWEN_SPECIALS[0],
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": first,
        "eos_token_id": first,
        "hidden_act": "silu",
        "hidden_size": s["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": s["intermediate"],
        "max_position_embeddings": 32768,
        "max_window_layers": s["layers"],
        "model_type": "qwen2",
        "num_attention_heads": s["heads"],
        "num_hidden_layers": s["layers"],
        "num_key_value_heads": s["kv_heads"],
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": QWEN_VOCAB,
    }
    generation = {"bos_token_id": first, "eos_token_id": first}
    for name, doc in (
        ("tokenizer_config.json", tokenizer_config),
        ("config.json", config),
        ("generation_config.json", generation),
    ):
        (qwen_dir / name).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def write_model(tmp: Path, size: str, seed: int, onnx: bool) -> dict[str, tuple[int, int]]:
    """Write a CosyVoice2 test model's files into the (staging) directory ``tmp``.

    Returns:
        component -> (parameter count, file size in bytes).
    """
    import torch

    from cosyserve.families.modelconfig import load_model_config
    from cosyserve.families.testmodel import SPEAKERS, voice_f0_head

    (tmp / "cosyvoice2.yaml").write_text(render_yaml(size), encoding="utf-8")
    write_qwen_files(tmp / "CosyVoice-BlankEN", size)
    cfg = load_model_config(tmp)
    gen = torch.Generator().manual_seed(seed)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        parts = {
            name: cfg.family_spec.module_class(name)(getattr(cfg, name)) for name in ("llm", "flow", "hift")
        }
    voice_f0_head(parts["hift"], gen)
    info: dict[str, tuple[int, int]] = {}
    for name, module in parts.items():
        sd = {k: v.contiguous() for k, v in module.state_dict().items()}
        if name == "llm":
            # the release's tied Qwen text head: the embedding's tensor under a second key (stored once)
            sd["llm.model.lm_head.weight"] = sd["llm.model.model.embed_tokens.weight"]
        path = tmp / f"{name}.pt"
        torch.save(sd, path)
        unique = {v.data_ptr(): v.numel() for v in sd.values()}  # the tied text head counted once
        info[name] = (sum(unique.values()), path.stat().st_size)
    spk2info = {spk: {"embedding": torch.randn(1, 192, generator=gen)} for spk in SPEAKERS}
    torch.save(spk2info, tmp / "spk2info.pt")
    if onnx:
        from cosyserve.frontend.onnx_testmodels import write_test_onnx_models

        write_test_onnx_models(tmp, seed=seed, speech_tokenizer=2)
    return info
