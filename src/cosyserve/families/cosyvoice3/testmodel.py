"""Random-weight CosyVoice3 directories in the official layout (``cosyvoice3.yaml``), for tests.

The layout of the Fun-CosyVoice3-0.5B release: ``cosyvoice3.yaml`` (our own template, the official tags and keys),
``llm.pt`` / ``flow.pt`` / ``hift.pt`` under the official key names, ``spk2info.pt``, optionally ``campplus.onnx``
and ``speech_tokenizer_v3.onnx``, and ``CosyVoice-BlankEN/`` with the Qwen config and tokenizer files (the same as
CosyVoice2's: :func:`cosyserve.families.cosyvoice2.testmodel.write_qwen_files`). ``full`` has the release's
dimensions (Qwen2 0.5B;
DiT 1024 wide, 22 blocks, 16 heads of 64; HiFT 512 channels); ``tiny`` is for tests. The speech tokenizer written
is the CosyVoice2 stand-in (the same interface: 128-bin log-mel in, 25 Hz ids below 6561 out) under the v3 name.
Random weights make noise, not speech.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cosyserve.families.cosyvoice2 import testmodel as cosyvoice2

__all__ = ["SIZES", "render_yaml", "write_model"]

SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden=cosyvoice2.SIZES["tiny"]["hidden"], lookahead=64, dim=64, depth=2, heads=4, dim_head=16,
                 hift_channels=32, f0_channels=32),
    "full": dict(hidden=cosyvoice2.SIZES["full"]["hidden"], lookahead=1024, dim=1024, depth=22, heads=16, dim_head=64,
                 hift_channels=512, f0_channels=512),
}  # fmt: skip

_TEMPLATE = """\
# CosyVoice3 layout, written by cosyserve make-test-model ({size}): RANDOM WEIGHTS, it makes noise.
__set_seed1: !apply:random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]

sample_rate: 24000
llm_input_size: {hidden}
llm_output_size: {hidden}
spk_embed_dim: 192
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: 2
chunk_size: 25
num_decoding_left_chunks: -1

llm: !new:cosyvoice.llm.llm.CosyVoice3LM
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

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
    input_size: 80
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 6561
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: 80
        channels: {lookahead}
        pre_lookahead_len: 3
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
        estimator: !new:cosyvoice.flow.DiT.dit.DiT
            dim: {dim}
            depth: {depth}
            heads: {heads}
            dim_head: {dim_head}
            ff_mult: 2
            mel_dim: 80
            mu_dim: 80
            spk_dim: 80
            out_channels: 80
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
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
    conv_pre_look_right: 4
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {f0_channels}

get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
    version: cosyvoice3
allowed_special: 'all'
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: null
    center: False
"""


def render_yaml(size: str) -> str:
    """The ``cosyvoice3.yaml`` text for a CosyVoice3 test model of ``size`` (tiny or full)."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    return _TEMPLATE.format(size=size, **SIZES[size])


def write_model(tmp: Path, size: str, seed: int, onnx: bool) -> dict[str, tuple[int, int]]:
    """Write a CosyVoice3 test model's files into the (staging) directory ``tmp``.

    Returns:
        component -> (parameter count, file size in bytes).
    """
    import torch

    from cosyserve.families.modelconfig import load_model_config
    from cosyserve.families.testmodel import SPEAKERS, voice_f0_head

    (tmp / "cosyvoice3.yaml").write_text(render_yaml(size), encoding="utf-8")
    cosyvoice2.write_qwen_files(tmp / "CosyVoice-BlankEN", size)
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
        # float32 as the release stores them (the vocoder's f0 predictor computes in float64 after loading)
        sd = {
            k: (v.float() if v.is_floating_point() else v).contiguous()
            for k, v in module.state_dict().items()
        }
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
        (tmp / "speech_tokenizer_v2.onnx").rename(tmp / "speech_tokenizer_v3.onnx")
    return info
