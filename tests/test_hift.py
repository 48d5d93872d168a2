import json

import pytest
import torch
from safetensors.torch import load_file

from cosyserve.families.modelconfig import build_config, read_yaml
from cosyserve.models.hift import F0PredictorConfig, HiFTConfig, HiFTGenerator

CASES = ("hift_no_cache", "hift_cache")


def _tiny_cfg() -> HiFTConfig:
    return HiFTConfig(
        base_channels=16,
        upsample_rates=[4, 2],
        upsample_kernel_sizes=[8, 4],
        istft_params={"n_fft": 8, "hop_len": 2},
        resblock_kernel_sizes=[3, 5],
        resblock_dilation_sizes=[[1, 3], [1, 2]],
        source_resblock_kernel_sizes=[3, 3],
        source_resblock_dilation_sizes=[[1], [1, 3]],
        f0_predictor=F0PredictorConfig(cond_channels=8),
    )


@pytest.fixture(scope="module")
def fixture_hift(fixture_set_dir):
    path = fixture_set_dir / "model" / "cosyvoice.yaml"
    cfg = build_config(HiFTConfig, read_yaml(path)["hift"], source=path, where="hift")
    state = torch.load(fixture_set_dir / "model" / "hift.pt", weights_only=True)
    return cfg, state


@pytest.fixture(scope="module")
def cases(fixture_set_dir):
    doc = json.loads((fixture_set_dir / "cases.json").read_text())
    tensors = load_file(fixture_set_dir / "tensors.safetensors")

    def value(v):
        return tensors[v["tensor"]] if isinstance(v, dict) and "tensor" in v else v

    return {
        c["name"]: (
            {k: value(v) for k, v in c["inputs"].items()},
            {k: value(v) for k, v in c["outputs"].items()},
            c["atol"],
            c["rtol"],
        )
        for c in doc["cases"]
        if c["kind"] == "hift_inference"
    }


def _loaded(cfg, state, fold: bool) -> HiFTGenerator:
    model = HiFTGenerator(cfg)
    model.load_state_dict(state, strict=True)
    return (model.remove_weight_norm() if fold else model).eval()


def _old_style(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        k = k.replace(".parametrizations.weight.original0", ".weight_g")
        out[k.replace(".parametrizations.weight.original1", ".weight_v")] = v
    return out


def test_fresh_state_dict_has_official_keys(fixture_hift):
    # Otherwise a test-model generator could not write official-layout hift.pt files from our module.
    cfg, state = fixture_hift
    fresh = HiFTGenerator(cfg).state_dict()
    assert sorted(fresh) == sorted(state)
    assert all(fresh[k].shape == state[k].shape for k in state)


@pytest.mark.parametrize("fold", [False, True], ids=["parametrized", "folded"])
def test_old_weight_g_v_checkpoint_matches_new_style(fixture_hift, fold):
    # Released checkpoints saved by older torch use weight_g/weight_v; they must load strictly to the same model.
    cfg, state = fixture_hift
    old = _old_style(state)
    assert any(k.endswith(".weight_g") for k in old)
    a, b = _loaded(cfg, state, fold), _loaded(cfg, old, fold)
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("fold", [False, True], ids=["parametrized", "folded"])
def test_fixture_case(fixture_hift, cases, name, fold):
    # A failure means the vocoder no longer computes what the reference HiFTGenerator.inference computes.
    inputs, expected, atol, rtol = cases[name]
    model = _loaded(*fixture_hift, fold)
    speech, source = model.inference(
        inputs["speech_feat"],
        inputs["cache_source"],
        sine_phase=inputs["sine_phase"],
        sine_noise=inputs["sine_noise"],
    )
    for got, exp in ((speech, expected["speech"]), (source, expected["source"])):
        assert got.shape == exp.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, exp, atol=atol, rtol=rtol)


def test_generator_draws_follow_reference_order(fixture_hift):
    # The draws from a generator must be the reference's: Uniform(-pi, pi) phase (B, H, 1), then randn (B, H, L).
    cfg, state = fixture_hift
    model = _loaded(cfg, state, fold=True)
    mel = torch.randn(1, 80, 12, generator=torch.Generator().manual_seed(1))
    a = model.inference(mel, generator=torch.Generator().manual_seed(7))
    b = model.inference(mel, generator=torch.Generator().manual_seed(7))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    g = torch.Generator().manual_seed(7)
    H, L = cfg.nb_harmonics + 1, 12 * cfg.upsample_factor
    low, high = torch.tensor(-torch.pi), torch.tensor(torch.pi)
    phase = low + torch.rand(1, H, 1, generator=g) * (high - low)
    noise = torch.randn(1, H, L, generator=g)
    c = model.inference(mel, sine_phase=phase, sine_noise=noise)
    assert all(torch.equal(x, y) for x, y in zip(a, c, strict=True))

    d = model.inference(mel, generator=torch.Generator().manual_seed(8))
    assert not torch.equal(a[0], d[0])


def test_draws_need_generator_or_tensors(fixture_hift):
    # Drawing from the global RNG would make audio irreproducible; the call must refuse instead.
    model = _loaded(*fixture_hift, fold=True)
    with pytest.raises(ValueError, match="generator"):
        model.inference(torch.zeros(1, 80, 4))


def test_output_length_and_audio_limit(fixture_hift):
    # Each mel frame must give exactly upsample_factor samples, and audio must be clamped to audio_limit.
    cfg, state = fixture_hift
    model = _loaded(cfg, state, fold=True)
    assert cfg.upsample_factor == 256
    for T in (1, 7, 33):
        mel = 3 * torch.randn(1, 80, T, generator=torch.Generator().manual_seed(T))
        speech, source = model.inference(mel, generator=torch.Generator().manual_seed(0))
        assert speech.shape == (1, T * 256) and source.shape == (1, 1, T * 256)
        assert speech.abs().max() <= cfg.audio_limit
        assert torch.isfinite(speech).all()


def test_random_tiny_config(fixture_hift):
    # Every dimension must come from the config (no hard-coded 256, 16-point FFT or channel counts).
    cfg = _tiny_cfg()
    assert cfg.upsample_factor == 16
    model = HiFTGenerator(cfg).eval()
    model.load_state_dict(_old_style(model.state_dict()), strict=True)
    mel = torch.randn(1, 80, 10, generator=torch.Generator().manual_seed(0))
    a = model.inference(mel, generator=torch.Generator().manual_seed(3))
    cache = a[1][:, :, -32:]
    b = model.remove_weight_norm().inference(mel, cache, generator=torch.Generator().manual_seed(3))
    assert a[0].shape == (1, 160) and torch.isfinite(a[0]).all()
    assert torch.equal(b[1][:, :, :32], cache)
    # Folding is bit-identical to the parametrized weights.
    assert torch.equal(a[1][:, :, 32:], b[1][:, :, 32:])


def test_conformance_kind_uses_recorded_draws(fixture_hift, cases):
    # The runner's kind function must pass the recorded draws through and name the outputs as cases.json does.
    from types import SimpleNamespace

    from cosyserve.families.cosyvoice.conformance import KINDS

    model = _loaded(*fixture_hift, fold=True)
    inputs, expected, atol, rtol = cases["hift_cache"]
    out = KINDS["hift_inference"](SimpleNamespace(hift=lambda: model), inputs)
    assert sorted(out) == sorted(expected)
    for key in expected:
        torch.testing.assert_close(out[key], expected[key], atol=atol, rtol=rtol)
