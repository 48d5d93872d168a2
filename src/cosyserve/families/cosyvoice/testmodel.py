"""Random-weight CosyVoice-300M directories in the official layout (``cosyvoice.yaml``), for ``make-test-model``.

``tiny`` is small enough for unit tests (a few MB); ``full`` has the release's dimensions, so its files have the
release's sizes and its compute the release's cost. The yaml is written in the official hyperpyyaml form (our
own template, same tags and keys), the weights with ``torch.save`` under the official key names, and
``spk2info.pt`` holds the release's seven speaker ids with random embeddings. Random weights make noise, not
speech; the vocoder's f0 head is rescaled (as in the conformance fixtures) so the noise is voiced.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

__all__ = ["SIZES", "model_config", "render_yaml", "write_model"]

SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        text_encoder_input_size=64, llm_size=128, te_heads=2, te_units=256, te_blocks=1,
        lm_heads=2, lm_units=256, lm_blocks=2,
        flow_size=64, flow_heads=2, flow_units=128, flow_blocks=1,
        dec_channels=[64], dec_head_dim=32, dec_blocks=1, dec_mid_blocks=1, dec_heads=2,
        hift_channels=32, f0_channels=32,
    ),
    "full": dict(
        text_encoder_input_size=512, llm_size=1024, te_heads=16, te_units=4096, te_blocks=6,
        lm_heads=16, lm_units=4096, lm_blocks=14,
        flow_size=512, flow_heads=8, flow_units=2048, flow_blocks=6,
        dec_channels=[256, 256], dec_head_dim=64, dec_blocks=4, dec_mid_blocks=12, dec_heads=8,
        hift_channels=512, f0_channels=512,
    ),
}  # fmt: skip

_TEMPLATE = """\
# CosyVoice-300M layout, written by cosyserve make-test-model ({size}): RANDOM WEIGHTS, it makes noise.
__set_seed1: !apply:random.seed [1986]
__set_seed2: !apply:numpy.random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]
__set_seed4: !apply:torch.cuda.manual_seed_all [1986]

sample_rate: 22050
text_encoder_input_size: {text_encoder_input_size}
llm_input_size: {llm_size}
llm_output_size: {llm_size}
spk_embed_dim: 192

llm: !new:cosyvoice.llm.llm.TransformerLM
    text_encoder_input_size: !ref <text_encoder_input_size>
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    text_token_size: 51866
    speech_token_size: 4096
    length_normalized_loss: True
    lsm_weight: 0
    spk_embed_dim: !ref <spk_embed_dim>
    text_encoder: !new:cosyvoice.transformer.encoder.ConformerEncoder
        input_size: !ref <text_encoder_input_size>
        output_size: {llm_size}
        attention_heads: {te_heads}
        linear_units: {te_units}
        num_blocks: {te_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.0
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        use_cnn_module: False
        macaron_style: False
        use_dynamic_chunk: False
        use_dynamic_left_chunk: False
        static_chunk_size: 1
    llm: !new:cosyvoice.transformer.encoder.TransformerEncoder
        input_size: !ref <llm_input_size>
        output_size: !ref <llm_output_size>
        attention_heads: {lm_heads}
        linear_units: {lm_units}
        num_blocks: {lm_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.0
        input_layer: 'linear_legacy'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        static_chunk_size: 1
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
        win_size: 10
        tau_r: 0.1

flow: !new:cosyvoice.flow.flow.MaskedDiffWithXvec
    input_size: {flow_size}
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 4096
    input_frame_rate: 50
    only_mask_loss: True
    encoder: !new:cosyvoice.transformer.encoder.ConformerEncoder
        output_size: {flow_size}
        attention_heads: {flow_heads}
        linear_units: {flow_units}
        num_blocks: {flow_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: {flow_size}
        use_cnn_module: False
        macaron_style: False
    length_regulator: !new:cosyvoice.flow.length_regulator.InterpolateRegulator
        channels: 80
        sampling_ratios: [1, 1, 1, 1]
    decoder: !new:cosyvoice.flow.flow_matching.ConditionalCFM
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
        estimator: !new:cosyvoice.flow.decoder.ConditionalDecoder
            in_channels: 320
            out_channels: 80
            channels: {dec_channels}
            dropout: 0.0
            attention_head_dim: {dec_head_dim}
            n_blocks: {dec_blocks}
            num_mid_blocks: {dec_mid_blocks}
            num_heads: {dec_heads}
            act_fn: 'gelu'

hift: !new:cosyvoice.hifigan.generator.HiFTGenerator
    in_channels: 80
    base_channels: {hift_channels}
    nb_harmonics: 8
    sampling_rate: !ref <sample_rate>
    nsf_alpha: 0.1
    nsf_sigma: 0.003
    nsf_voiced_threshold: 10
    upsample_rates: [8, 8]
    upsample_kernel_sizes: [16, 16]
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_kernel_sizes: [3, 7, 11]
    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    source_resblock_kernel_sizes: [7, 11]
    source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5]]
    lrelu_slope: 0.1
    audio_limit: 0.99
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {f0_channels}

get_tokenizer: !name:whisper.tokenizer.get_tokenizer
    multilingual: True
    num_languages: 100
    language: 'en'
    task: 'transcribe'
allowed_special: 'all'
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1024
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 256
    win_size: 1024
    fmin: 0
    fmax: 8000
    center: False
"""


def render_yaml(size: str) -> str:
    """The ``cosyvoice.yaml`` text for a test model of ``size`` (tiny or full)."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    return _TEMPLATE.format(size=size, **SIZES[size])


def model_config(size: str) -> Any:
    """The parsed :class:`cosyserve.families.modelconfig.ModelConfig` of a test model of ``size`` (no weights written)."""
    from cosyserve.families.modelconfig import load_model_config

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "cosyvoice.yaml").write_text(render_yaml(size), encoding="utf-8")
        return load_model_config(d)


def write_model(tmp: Path, size: str, seed: int, onnx: bool) -> dict[str, tuple[int, int]]:
    """Write a random-weight CosyVoice-300M model of ``size`` into the empty directory ``tmp``."""
    import torch

    from cosyserve.families.modelconfig import load_model_config
    from cosyserve.families.testmodel import SPEAKERS, voice_f0_head
    from cosyserve.models.flow import MaskedDiffWithXvec
    from cosyserve.models.hift import HiFTGenerator
    from cosyserve.models.llm import TransformerLM

    info: dict[str, tuple[int, int]] = {}
    (tmp / "cosyvoice.yaml").write_text(render_yaml(size), encoding="utf-8")
    cfg = load_model_config(tmp)
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        parts = {
            "llm": TransformerLM(cfg.llm),
            "flow": MaskedDiffWithXvec(cfg.flow),
            "hift": HiFTGenerator(cfg.hift),
        }
    voice_f0_head(parts["hift"], gen)
    for name, module in parts.items():
        sd = {k: v.contiguous() for k, v in module.state_dict().items()}
        path = tmp / f"{name}.pt"
        torch.save(sd, path)
        info[name] = (sum(v.numel() for v in sd.values()), path.stat().st_size)
    spk2info = {spk: {"embedding": torch.randn(1, 192, generator=gen)} for spk in SPEAKERS}
    torch.save(spk2info, tmp / "spk2info.pt")
    if onnx:
        from cosyserve.frontend.onnx_testmodels import write_test_onnx_models

        write_test_onnx_models(tmp, seed=seed)
    return info
