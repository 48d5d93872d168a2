"""Flow model (speech tokens -> mel): official weights load 1:1, the reference's recorded cases reproduce, and the
CFG / noise / length plumbing behaves as the reference's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cosyserve.families.modelconfig import build_config, read_yaml
from cosyserve.models.flow import (
    CFMParams,
    ConditionalCFM,
    ConditionalCFMConfig,
    FlowConfig,
    InterpolateRegulatorConfig,
    MaskedDiffWithXvec,
    mel_length,
)
from cosyserve.models.flow_decoder import ConditionalDecoder, ConditionalDecoderConfig
from cosyserve.models.transformer import ConformerEncoderConfig

CASES = ["flow_no_prompt", "flow_prompt", "flow_cache"]


def tiny_config(channels: list[int] | None = None) -> FlowConfig:
    return FlowConfig(
        input_size=16,
        output_size=80,
        spk_embed_dim=24,
        vocab_size=50,
        input_frame_rate=50,
        encoder=ConformerEncoderConfig(
            input_size=16,
            output_size=16,
            attention_heads=2,
            linear_units=32,
            num_blocks=1,
            input_layer="linear",
            pos_enc_layer_type="rel_pos_espnet",
            selfattention_layer_type="rel_selfattn",
            use_cnn_module=False,
            macaron_style=False,
        ),
        length_regulator=InterpolateRegulatorConfig(channels=80, sampling_ratios=[1]),
        decoder=ConditionalCFMConfig(
            in_channels=240,
            n_spks=1,
            spk_emb_dim=80,
            cfm_params=CFMParams(),
            estimator=ConditionalDecoderConfig(
                in_channels=320,
                out_channels=80,
                channels=channels or [32, 32],
                dropout=0.0,
                attention_head_dim=8,
                n_blocks=1,
                num_mid_blocks=1,
                num_heads=2,
                act_fn="gelu",
            ),
        ),
    )


def randomize_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return module.eval()


def tiny_flow(channels: list[int] | None = None) -> MaskedDiffWithXvec:
    return randomize_(MaskedDiffWithXvec(tiny_config(channels)))


def synth(flow, t: int, *, p: int = 0, f: int = 0, cache=None, **kw):
    g = torch.Generator().manual_seed(t * 7 + p)
    return flow.inference(
        torch.randint(0, flow.cfg.vocab_size, (1, t), generator=g),
        torch.tensor([t]),
        torch.randint(0, flow.cfg.vocab_size, (1, p), generator=g),
        torch.tensor([p]),
        torch.randn(1, f, 80, generator=g),
        torch.tensor([f]),
        torch.randn(1, flow.cfg.spk_embed_dim, generator=g),
        torch.zeros(1, 80, 0, 2) if cache is None else cache,
        **kw,
    )


@pytest.fixture(scope="module")
def fixture_flow(fixture_set_dir: Path) -> MaskedDiffWithXvec:
    model_dir = fixture_set_dir / "model"
    cfg = build_config(FlowConfig, read_yaml(model_dir / "cosyvoice.yaml")["flow"], where="flow")
    flow = MaskedDiffWithXvec(cfg).eval()
    flow.load_state_dict(torch.load(model_dir / "flow.pt", weights_only=True), strict=True)
    return flow


def test_state_dict_keys_match_official(fixture_set_dir: Path) -> None:
    # A mismatch means a module is named or shaped differently from cosyvoice's flow, so official weights cannot load.
    model_dir = fixture_set_dir / "model"
    cfg = build_config(FlowConfig, read_yaml(model_dir / "cosyvoice.yaml")["flow"], where="flow")
    ours = MaskedDiffWithXvec(cfg).state_dict()
    official = torch.load(model_dir / "flow.pt", weights_only=True)
    assert sorted(ours) == sorted(official)
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in official.items()}


@pytest.mark.parametrize("name", CASES)
def test_fixture_case(fixture_set_dir: Path, fixture_flow: MaskedDiffWithXvec, name: str) -> None:
    # A failure means our mel or cache differs from what the reference computed from the same tokens and noise.
    from safetensors.torch import load_file

    doc = json.loads((fixture_set_dir / "cases.json").read_text())
    (case,) = [c for c in doc["cases"] if c["name"] == name]
    tensors = load_file(str(fixture_set_dir / "tensors.safetensors"))
    inp = {k: tensors[v["tensor"]] for k, v in case["inputs"].items() if isinstance(v, dict)}
    mel, cache = fixture_flow.inference(
        inp["token"].long(),
        torch.tensor([inp["token"].shape[1]]),
        inp["prompt_token"].long(),
        torch.tensor([inp["prompt_token"].shape[1]]),
        inp["prompt_feat"],
        torch.tensor([inp["prompt_feat"].shape[1]]),
        inp["embedding"],
        inp["flow_cache"],
        noise=inp["flow_noise"],
    )
    for out_name, got in (("mel", mel), ("flow_cache", cache)):
        exp = tensors[case["outputs"][out_name]["tensor"]]
        torch.testing.assert_close(got, exp, atol=case["atol"], rtol=case["rtol"], msg=f"{name}: {out_name}")


def test_seeded_noise_is_reproducible() -> None:
    # Same seed must give the same mel; the generator path must equal passing the same draw as `noise`.
    flow = tiny_flow()
    m1, _ = synth(flow, 30, generator=torch.Generator().manual_seed(3))
    m2, _ = synth(flow, 30, generator=torch.Generator().manual_seed(3))
    m3, _ = synth(flow, 30, generator=torch.Generator().manual_seed(4))
    noise = torch.randn(1, 80, mel_length(30, 50), generator=torch.Generator().manual_seed(3))
    m4, _ = synth(flow, 30, noise=noise)
    assert torch.equal(m1, m2)
    assert not torch.equal(m1, m3)
    assert torch.equal(m1, m4)


def test_noise_or_generator_required() -> None:
    # Drawing from the global RNG silently would make audio irreproducible.
    with pytest.raises(ValueError, match="generator"):
        synth(tiny_flow(), 10)


@pytest.mark.parametrize(("t", "p", "f"), [(1, 0, 0), (25, 0, 0), (41, 0, 0), (57, 9, 17), (83, 4, 7)])
def test_mel_length_and_cache_shape(t: int, p: int, f: int) -> None:
    # Wrong lengths break the streaming hop/overlap arithmetic the token2wav path relies on.
    flow = tiny_flow()
    m = mel_length(t, 50)
    assert m == int(t / 50 * 22050 / 256)
    mel, cache = synth(flow, t, p=p, f=f, generator=torch.Generator().manual_seed(0))
    assert mel.shape == (1, 80, m) and mel.dtype == torch.float32
    assert cache.shape == (1, 80, f + min(34, f + m), 2)
    assert torch.isfinite(mel).all()


def test_cache_replaces_leading_noise_and_mu() -> None:
    # The incoming cache must overwrite the first C frames of z (and mu), as the reference's streaming relies on.
    flow = tiny_flow()
    _, cache = synth(flow, 60, p=5, f=9, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(1, 80, 9 + mel_length(60, 50), generator=torch.Generator().manual_seed(1))
    _, cache2 = synth(flow, 60, p=5, f=9, cache=cache, noise=noise)
    assert torch.equal(cache2[:, :, :9], cache[:, :, :9])
    assert torch.equal(cache2[:, :, 9:, 0], noise[:, :, -34:])


@pytest.mark.parametrize("channels", [[32], [32, 32], [16, 24, 32]])
def test_estimator_mask_none_equals_all_ones_mask(channels: list[int]) -> None:
    # mask=None is our fast path; it must equal the reference's all-ones mask exactly, at odd lengths too.
    cfg = tiny_config(channels).decoder.estimator
    est = randomize_(ConditionalDecoder(cfg))
    g = torch.Generator().manual_seed(0)
    x, mu, cond = (torch.randn(2, 80, 37, generator=g) for _ in range(3))
    spks, t = torch.randn(2, 80, generator=g), torch.rand(2, generator=g)
    with torch.inference_mode():
        a = est(x, None, mu, t, spks, cond)
        b = est(x, torch.ones(2, 1, 37), mu, t, spks, cond)
    assert a.shape == (2, 80, 37)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_padding_mask_zeroes_padded_frames() -> None:
    est = randomize_(ConditionalDecoder(tiny_config().decoder.estimator))
    g = torch.Generator().manual_seed(0)
    x, mu = torch.randn(1, 80, 20, generator=g), torch.randn(1, 80, 20, generator=g)
    mask = torch.ones(1, 1, 20)
    mask[..., 15:] = 0
    with torch.inference_mode():
        out = est(
            x, mask, mu, torch.rand(1, generator=g), torch.randn(1, 80, generator=g), torch.zeros(1, 80, 20)
        )
    assert torch.all(out[..., 15:] == 0) and torch.isfinite(out).all()


def test_cfg_pair_matches_separate_passes() -> None:
    # The batched CFG pair must equal two separate estimator calls: row 0 conditioned, row 1 with zero mu/spks/cond,
    # combined as (1 + r) * v_cond - r * v_uncond, on the reference's t schedule.
    cfm = randomize_(ConditionalCFM(tiny_config().decoder))
    g = torch.Generator().manual_seed(0)
    T = 29
    mu, cond, z = (torch.randn(1, 80, T, generator=g) for _ in range(3))
    spks = torch.randn(1, 80, generator=g)
    got, _ = cfm.inference(mu, spks, cond, z, n_timesteps=4)

    t_span = 1 - torch.cos(torch.linspace(0, 1, 5) * 0.5 * torch.pi)
    x, zeros = z.clone(), torch.zeros_like(mu)
    with torch.inference_mode():
        for i in range(4):
            t = t_span[i].reshape(1)
            v_c = cfm.estimator(x, None, mu, t, spks, cond)
            v_u = cfm.estimator(x, None, zeros, t, torch.zeros_like(spks), zeros)
            x = x + (t_span[i + 1] - t_span[i]) * (1.7 * v_c - 0.7 * v_u)
    torch.testing.assert_close(got, x, atol=1e-5, rtol=1e-5)


def test_random_tiny_config_runs_deterministically() -> None:
    flow = tiny_flow([16, 24])
    a, ca = synth(flow, 45, p=3, f=5, generator=torch.Generator().manual_seed(9))
    b, cb = synth(flow, 45, p=3, f=5, generator=torch.Generator().manual_seed(9))
    assert a.shape == (1, 80, mel_length(45, 50)) and torch.isfinite(a).all()
    assert torch.equal(a, b) and torch.equal(ca, cb)
    assert flow.input_frame_rate == 50


def test_rejects_padded_batches_and_bad_noise() -> None:
    flow = tiny_flow()
    with pytest.raises(ValueError, match="noise has shape"):
        synth(flow, 10, noise=torch.zeros(1, 80, 3))
    with pytest.raises(ValueError, match="give both"):
        synth(flow, 10, p=3, f=0, generator=torch.Generator())
    with pytest.raises(ValueError, match="noise given"):  # a batch's noise: one draw per utterance, given
        flow.inference(
            torch.zeros(2, 5, dtype=torch.long),
            torch.tensor([5, 5]),
            torch.zeros(2, 0, dtype=torch.long),
            torch.tensor([0, 0]),
            torch.zeros(2, 0, 80),
            torch.tensor([0, 0]),
            torch.zeros(2, 24),
            torch.zeros(1, 80, 0, 2),
            generator=torch.Generator(),
        )
    with pytest.raises(ValueError, match="equal lengths"):  # padding is not supported: batches are stacked
        flow.inference(
            torch.zeros(2, 5, dtype=torch.long),
            torch.tensor([5, 4]),
            torch.zeros(2, 0, dtype=torch.long),
            torch.tensor([0, 0]),
            torch.zeros(2, 0, 80),
            torch.tensor([0, 0]),
            torch.zeros(2, 24),
            torch.zeros(2, 80, 0, 2),
            noise=torch.zeros(2, 80, mel_length(5, 50)),
        )
