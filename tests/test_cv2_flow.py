"""CosyVoice2 flow (models/causal_flow.py, causal_flow_decoder.py, upsample_encoder.py): official weights load
strictly, the fixed noise is the reference's, streaming chunks are causal, and building or running the flow leaves the global RNG alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cosyserve.models.causal_flow import (
    NOISE_SHAPE,
    CausalConditionalCFMConfig,
    CausalFlowConfig,
    CausalMaskedDiffWithXvec,
    fixed_noise,
)
from cosyserve.models.causal_flow_decoder import CausalConditionalDecoderConfig
from cosyserve.models.flow import CFMParams
from cosyserve.models.upsample_encoder import UpsampleConformerEncoderConfig, attention_mask


def load_cv2_flow(model_dir: Path) -> CausalMaskedDiffWithXvec:
    from cosyserve.bundle.official import load_component
    from cosyserve.families.modelconfig import load_model_config

    return load_component(model_dir, "flow", load_model_config(model_dir).flow, "cosyvoice2")


def _encoder_cfg(**kw) -> UpsampleConformerEncoderConfig:
    args = dict(
        input_size=512,
        output_size=512,
        attention_heads=2,
        linear_units=8,
        num_blocks=1,
        input_layer="linear",
        pos_enc_layer_type="rel_pos_espnet",
        selfattention_layer_type="rel_selfattn",
        use_cnn_module=False,
        macaron_style=False,
        static_chunk_size=25,
    )
    return UpsampleConformerEncoderConfig(**(args | kw))


def _small_cfg() -> CausalFlowConfig:
    estimator = CausalConditionalDecoderConfig(
        in_channels=320,
        out_channels=80,
        channels=[16],
        attention_head_dim=8,
        n_blocks=1,
        num_mid_blocks=1,
        num_heads=2,
        act_fn="gelu",
        static_chunk_size=50,
    )
    decoder = CausalConditionalCFMConfig(
        in_channels=240, cfm_params=CFMParams(), spk_emb_dim=80, estimator=estimator
    )
    return CausalFlowConfig(vocab_size=64, input_frame_rate=25, encoder=_encoder_cfg(), decoder=decoder)


def _small_flow() -> CausalMaskedDiffWithXvec:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return CausalMaskedDiffWithXvec(_small_cfg()).eval()


def test_official_flow_round_trips_strictly(cv2_set_dir: Path) -> None:
    """flow.pt loads with strict=True and state_dict() gives back exactly its keys and values. A failure means
    a module or attribute name differs from the official checkpoint (a key missing or unexpected) or a size is
    not taken from cosyvoice2.yaml."""
    from cosyserve.bundle.official import read_state_dict

    path = cv2_set_dir / "model" / "flow.pt"
    flow = load_cv2_flow(cv2_set_dir / "model")
    want = read_state_dict(path)
    got = flow.state_dict()
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_fixed_noise_is_the_references(cv2_set_dir: Path) -> None:
    """Every case's recorded `flow_noise` is a prefix of our fixed noise. A failure means the noise is not
    `set_all_random_seed(0); torch.randn([1, 80, 15000])`, and every flow output would differ from the reference."""
    from safetensors import safe_open

    with safe_open(str(cv2_set_dir / "tensors.safetensors"), framework="pt") as f:
        names = [k for k in f.keys() if k.endswith(".flow_noise")]
        assert names, "the set records no flow_noise"
        for name in names:
            recorded = f.get_tensor(name)
            assert torch.equal(fixed_noise(recorded.shape[2]), recorded), name


def test_fixed_noise_bounds_and_copies() -> None:
    """The noise covers 15000 frames and each call returns its own tensor. A failure means a longer request
    would silently get short noise, or a caller writing into its noise would corrupt every later request's."""
    a = fixed_noise(4)
    a.zero_()
    assert fixed_noise(4).abs().sum() > 0
    assert fixed_noise(NOISE_SHAPE[2]).shape == NOISE_SHAPE
    with pytest.raises(ValueError, match="15000"):
        fixed_noise(NOISE_SHAPE[2] + 1)


def test_streaming_attention_masks_follow_the_chunk_rule() -> None:
    """Streaming masks let frame i see frame j exactly when j < (i // c + 1) * c; c <= 0 is full attention.
    A failure means streaming chunks would see the future (or not all of their past) and differ from the
    reference's chunked output."""
    for length, chunk in ((60, 25), (100, 50), (7, 25)):
        mask = attention_mask(length, chunk, torch.device("cpu"))
        assert mask.shape == (1, length, length)
        i = torch.arange(length).unsqueeze(1)
        j = torch.arange(length).unsqueeze(0)
        assert torch.equal(mask[0], j < (i // chunk + 1) * chunk)
    full = attention_mask(9, 0, torch.device("cpu"))
    assert full.shape == (1, 1, 9) and bool(full.all())


def test_streaming_chunk_frames_do_not_change_when_later_tokens_arrive() -> None:
    """With streaming=True and finalize=False, the first chunk's mel is the same whether the flow runs on the
    first chunk (25 tokens + 3 lookahead) or on two chunks (25 + 50 + 3): the encoder (chunks of 25, then 50),
    the lookahead and the estimator (chunks of 50, causal convs) never let a frame see past its chunk. Without
    streaming the first frames do change. A failure means re-running the flow from the start every chunk (what
    token2wav does) would rewrite audio that was already sent."""
    flow = _small_flow()
    tokens = torch.randint(0, 64, (1, 78), generator=torch.Generator().manual_seed(1))
    emb = torch.randn(1, 192, generator=torch.Generator().manual_seed(2))
    empty_tok, empty_feat = torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, 80)
    first = flow.inference(tokens[:, :28], empty_tok, empty_feat, emb, streaming=True, finalize=False)
    both = flow.inference(tokens, empty_tok, empty_feat, emb, streaming=True, finalize=False)
    assert first.shape == (1, 80, 50) and both.shape == (1, 80, 150)
    torch.testing.assert_close(both[:, :, :50], first, rtol=1e-5, atol=1e-5)
    full = flow.inference(tokens, empty_tok, empty_feat, emb, streaming=False, finalize=False)
    assert (full[:, :, :50] - first).abs().max() > 1e-3


def test_building_and_running_the_flow_leaves_the_global_rng_alone() -> None:
    """The reference re-seeds torch with 0 when it builds the flow (to draw its fixed noise); we must not.
    Built the way the loader builds it (no random init), loaded, and run, the flow leaves the global torch RNG
    where it was. A failure means constructing or running a flow changes every later torch random draw in the
    process (e.g. the LM's sampling)."""
    from cosyserve.bundle.construct import empty_modules
    from cosyserve.models import causal_flow

    weights = _small_flow().state_dict()
    causal_flow._noise_table.cache_clear()  # so that the noise is drawn inside this test
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    with empty_modules():
        flow = CausalMaskedDiffWithXvec(_small_cfg())
    flow.load_state_dict(weights, strict=True, assign=True)
    tokens = torch.zeros(1, 5, dtype=torch.long)
    flow.eval().inference(
        tokens, tokens[:, :2], torch.zeros(1, 4, 80), torch.ones(1, 192), streaming=True, finalize=True
    )
    assert torch.equal(torch.get_rng_state(), before)


def test_encoder_width_must_be_512() -> None:
    """The reference hard-codes 512-wide lookahead and upsampling layers; another width must be refused with a
    message saying so. A failure means a bad yaml would build a model that cannot load flow.pt (or runs wrong)."""
    with pytest.raises(ValueError, match="512"):
        _encoder_cfg(input_size=256, output_size=256)
