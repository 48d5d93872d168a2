from pathlib import Path

import pytest

from cosyserve.core.errors import ModelConfigError
from cosyserve.families.cosyvoice.testmodel import render_yaml
from cosyserve.families.modelconfig import Tagged, load_model_config, read_yaml


def _write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "cosyvoice.yaml").write_text(text, encoding="utf-8")
    return tmp_path


def test_fixture_yaml_maps_to_configs(fixture_set_dir: Path) -> None:
    cfg = load_model_config(fixture_set_dir / "model")
    # !ref resolved: llm_input_size is a reference to a top-level key
    assert cfg.llm.llm_input_size == 256 and cfg.llm.text_encoder.input_size == 64
    assert cfg.llm.sampling.top_k == 25 and cfg.llm.sampling.tau_r == pytest.approx(0.1)
    # omegaconf.DictConfig wrapper unwrapped; "1e-06" (a string in YAML 1.1) read as a float
    assert cfg.flow.decoder.cfm_params.sigma_min == pytest.approx(1e-6)
    assert cfg.flow.decoder.cfm_params.inference_cfg_rate == pytest.approx(0.7)
    assert cfg.hift.istft_params == {"n_fft": 16, "hop_len": 4}
    assert cfg.sample_rate == 22050


def test_tags_are_data_and_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    text = render_yaml("tiny") + f"__set_seed9: !apply:os.system ['touch {marker}']\n"
    doc = read_yaml(_write(tmp_path, text) / "cosyvoice.yaml")
    assert isinstance(doc["__set_seed9"], Tagged) and doc["__set_seed9"].target == "os.system"
    load_model_config(tmp_path)
    assert not marker.exists(), "a yaml tag was executed"


def test_python_object_tags_are_refused(tmp_path: Path) -> None:
    _write(tmp_path, "x: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ModelConfigError, match="not valid YAML"):
        read_yaml(tmp_path / "cosyvoice.yaml")


def test_unknown_key_is_named(tmp_path: Path) -> None:
    text = render_yaml("tiny").replace(
        "        num_class: 1\n", "        num_class: 1\n        bogus_key: 3\n"
    )
    _write(tmp_path, text)
    with pytest.raises(ModelConfigError, match=r"hift\.f0_predictor\.bogus_key") as e:
        load_model_config(tmp_path)
    assert "cosyvoice.yaml" in str(e.value)


def test_missing_required_key_is_named(tmp_path: Path) -> None:
    text = render_yaml("tiny").replace("    speech_token_size: 4096\n", "")
    _write(tmp_path, text)
    with pytest.raises(ModelConfigError, match=r"missing required key 'llm\.speech_token_size'"):
        load_model_config(tmp_path)


def test_wrong_class_is_refused(tmp_path: Path) -> None:
    text = render_yaml("tiny").replace("cosyvoice.llm.llm.TransformerLM", "cosyvoice.llm.llm.Qwen2LM")
    _write(tmp_path, text)
    with pytest.raises(ModelConfigError, match="Qwen2LM.*supports only cosyvoice.llm.llm.TransformerLM"):
        load_model_config(tmp_path)


def test_bad_value_type_is_named(tmp_path: Path) -> None:
    text = render_yaml("tiny").replace("    base_channels: 32\n", "    base_channels: many\n")
    _write(tmp_path, text)
    with pytest.raises(ModelConfigError, match=r"'hift\.base_channels' should be int"):
        load_model_config(tmp_path)


def test_dangling_ref_is_named(tmp_path: Path) -> None:
    text = render_yaml("tiny").replace("!ref <spk_embed_dim>", "!ref <no_such_key>", 1)
    _write(tmp_path, text)
    with pytest.raises(ModelConfigError, match="no_such_key"):
        load_model_config(tmp_path)


def test_missing_yaml(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="cosyvoice.yaml"):
        load_model_config(tmp_path)
