"""CosyVoice3's modules on a tiny random-weight model in the official layout
(cosyserve.families.cosyvoice3.testmodel): strict loads of the official key names (also from bfloat16 checkpoints), the causal vocoder's streaming property, the streaming
token2wav rules, the silent-token filter, the tokenizer's special tokens, the LM's prompt rule and its streaming
text input. Equality with the reference is the conformance fixtures' job (tests/test_conformance.py runs the
CosyVoice3 set)."""

from __future__ import annotations

import itertools
import math
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cosyserve.bundle.official import COMPONENT_FILES, load_component, module_class
from cosyserve.core.errors import ModelConfigError
from cosyserve.families.modelconfig import load_model_config
from lm_util import tf


@pytest.fixture(scope="module")
def cfg(cv3_model_dir: Path) -> Any:
    return load_model_config(cv3_model_dir)


@pytest.fixture(scope="module")
def parts(cv3_model_dir: Path, cfg: Any) -> dict[str, Any]:
    return {
        name: load_component(cv3_model_dir, name, getattr(cfg, name), cfg.family) for name in COMPONENT_FILES
    }


def noise(samples: int, seed: int = 0) -> dict[str, torch.Tensor]:
    from cosyserve.models.causal_hift import source_noise

    rand_ini, sine_waves = source_noise(samples, torch.Generator().manual_seed(seed))
    return {"rand_ini": rand_ini, "sine_waves": sine_waves}


# --- config and loading -------------------------------------------------------------------------------------------


def test_a_cosyvoice3_dir_is_read_as_cosyvoice3(cv3_model_dir: Path, cfg: Any) -> None:
    """The family comes from the yaml the directory holds: read as another family, the runtime would build the
    wrong modules and rules."""
    assert cfg.family == "cosyvoice3" and cfg.family_spec.name == "cosyvoice3" and cfg.chunk_size == 25
    assert cfg.feat_extractor.fmax is None and cfg.feat_extractor.hop_size == 480  # CosyVoice3's prompt mel
    assert cfg.flow.decoder.estimator.static_chunk_size == 50  # <chunk_size> * <token_mel_ratio>


def test_a_flow_wider_than_80_is_refused_by_name(cv3_model_dir: Path, tmp_path: Path) -> None:
    """The reference's Euler loop is 80 channels wide: a yaml saying otherwise would build a different model."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(cv3_model_dir, bad)
    path = bad / "cosyvoice3.yaml"
    path.write_text(path.read_text().replace("    input_size: 80\n", "    input_size: 96\n", 1))
    with pytest.raises(ModelConfigError, match="input_size=96"):
        load_model_config(bad)


def test_checkpoints_load_strictly_under_the_official_names(
    cv3_model_dir: Path, cfg: Any, parts: dict
) -> None:
    """Every key of llm.pt / flow.pt / hift.pt is a parameter (or the rotary buffer) of our modules and the
    reverse; and the fast load (meta device, assign, weight norm folded) computes what a plain module with the
    parametrized weights computes. If not, official checkpoints would not load, or would load into other roles."""
    for name in COMPONENT_FILES:
        stored = set(torch.load(cv3_model_dir / COMPONENT_FILES[name], weights_only=True))
        plain = module_class(name, cfg.family)(getattr(cfg, name))
        expected = set(plain.state_dict()) | ({"llm.model.lm_head.weight"} if name == "llm" else set())
        assert stored == expected, name
    assert "decoder.estimator.rotary_embed.inv_freq" in stored_keys(cv3_model_dir, "flow")

    plain_hift = module_class("hift", cfg.family)(cfg.hift)  # weight norm as parametrizations, loaded by copy
    plain_hift.load_state_dict(torch.load(cv3_model_dir / "hift.pt", weights_only=True))
    mel = torch.randn(1, 80, 30, generator=torch.Generator().manual_seed(1))
    a, _ = parts["hift"].inference(mel, True, **noise(30 * 480))
    b, _ = plain_hift.inference(mel, True, **noise(30 * 480))
    assert torch.allclose(a, b, atol=1e-5)
    assert parts["hift"].f0_predictor.condnet[0].weight.dtype == torch.float64  # pitch runs in float64


def stored_keys(model_dir: Path, name: str) -> set[str]:
    return set(torch.load(model_dir / COMPONENT_FILES[name], weights_only=True))


def test_bfloat16_checkpoints_are_cast_to_the_model_dtype(
    cv3_model_dir: Path, cfg: Any, tmp_path: Path
) -> None:
    """Some releases store bfloat16: each tensor must become the module's dtype (float32, the f0 predictor
    float64) with the stored values, not stay bfloat16 (which would change every result)."""
    import shutil

    shutil.copytree(cv3_model_dir, tmp_path / "bf16")
    for file in COMPONENT_FILES.values():
        sd = torch.load(cv3_model_dir / file, weights_only=True)
        torch.save(
            {k: v.bfloat16() if v.is_floating_point() else v for k, v in sd.items()}, tmp_path / "bf16" / file
        )
    flow = load_component(tmp_path / "bf16", "flow", cfg.flow, cfg.family)
    stored = torch.load(tmp_path / "bf16" / "flow.pt", weights_only=True)
    w = flow.decoder.estimator.transformer_blocks[0].attn.to_q.weight
    assert w.dtype == torch.float32
    assert torch.equal(w, stored["decoder.estimator.transformer_blocks.0.attn.to_q.weight"].float())
    hift = load_component(tmp_path / "bf16", "hift", cfg.hift, cfg.family)
    assert hift.f0_predictor.classifier.weight.dtype == torch.float64
    assert hift.conv_pre.weight.dtype == torch.float32
    llm = load_component(tmp_path / "bf16", "llm", cfg.llm, cfg.family)
    assert llm.speech_embedding.weight.dtype == torch.float32


# --- vocoder and token2wav ------------------------------------------------------------------------------------------


def test_the_vocoder_is_causal(parts: dict) -> None:
    """A non-final call on a mel prefix gives exactly the samples the final call gives for them ((T - 8) x 480):
    the basis of CosyVoice3's streaming, which emits each sample once and never revises it."""
    hift = parts["hift"]
    mel = torch.randn(1, 80, 40, generator=torch.Generator().manual_seed(2))
    full, full_source = hift.inference(mel, True, **noise(40 * 480))
    for t in (9, 23, 40):
        part, source = hift.inference(mel[:, :, :t], False, **noise(40 * 480))
        assert part.shape == (1, (t - 8) * 480) and source.shape == (1, 1, (t - 3) * 480)
        assert torch.allclose(part, full[:, : part.shape[1]], atol=1e-5), t
        assert torch.allclose(source, full_source[:, :, : source.shape[2]], atol=1e-6), t
    with pytest.raises(ValueError, match="more than 8 mel frames"):
        hift.inference(mel[:, :, :8], False, **noise(40 * 480))


def test_streaming_token2wav_is_the_reference_per_call_computation(parts: dict) -> None:
    """Stream chunks equal the reference's calls restated here: hops 25 + prompt pad, 50, 100 (3 lookahead
    tokens), each call's new mel frames appended to the request's mel, the vocoder re-run on all of it and only the
    samples after the last chunk emitted; the last call finalizes with full attention. One-shot is one call. (The
    cumulative path, incremental=False: tests/test_flow_stream.py holds the incremental one to it.)"""
    from cosyserve.families.cosyvoice3.token2wav import Token2Wav3

    flow, hift = parts["flow"], parts["hift"]
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 6561, (150,), generator=g).tolist()
    prompt = torch.randint(0, 6561, (1, 7), generator=g, dtype=torch.int64).to(torch.int32)
    feat = torch.randn(1, 14, 80, generator=g)
    emb = torch.randn(1, 192, generator=g)
    buffers = noise(400 * 480)

    t2w = Token2Wav3(flow, hift, incremental=False)
    kw = dict(embedding=emb, prompt_token=prompt, prompt_feat=feat, draws=itertools.repeat(buffers))
    chunks = list(t2w(iter(tokens), stream=True, **kw))

    pad = math.ceil(7 / 25) * 25 - 7  # 18
    calls = [(43 + 3, 0, False), (43 + 50 + 3, 43, False), (150, 93, True)]  # (tokens, offset, finalize)
    mel, emitted, expected = torch.zeros(1, 80, 0), 0, []
    for n, offset, final in calls:
        token = torch.tensor([tokens[:n]], dtype=torch.int32)
        new = flow.inference(token, prompt, feat, emb, streaming=not final, finalize=final)
        mel = torch.cat([mel, new[:, :, offset * 2 :]], dim=2)
        speech, _ = hift.inference(mel, final, **buffers)
        expected.append(speech[:, emitted:])
        emitted = speech.shape[1]
    assert pad + 25 == 43 and len(chunks) == len(expected) == 3
    for got, want in zip(chunks, expected, strict=True):
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6)
    # emitted samples are never revised: the chunks are the final mel's one-shot vocoding
    whole, _ = hift.inference(mel, True, **buffers)
    assert torch.allclose(torch.cat(chunks, dim=1), whole, atol=1e-5)

    (one_shot,) = t2w(iter(tokens), stream=False, **kw)
    all_mel = flow.inference(torch.tensor([tokens], dtype=torch.int32), prompt, feat, emb, False, True)
    assert torch.allclose(one_shot, hift.inference(all_mel, True, **buffers)[0], atol=1e-6)


def test_silent_token_runs_are_cut_to_five() -> None:
    """The reference vocodes at most 5 silence/breath tokens in a row; other tokens pass and reset the count."""
    from cosyserve.families.cosyvoice3.token2wav import SILENT_TOKENS, filter_silent_tokens

    assert {1, 2, 2323} <= SILENT_TOKENS
    tokens = [7, 1, 1, 2, 28, 29, 55, 248, 494, 9, 2241, 2242, 2322, 2323, 1, 2, 3]
    assert list(filter_silent_tokens(tokens)) == [7, 1, 1, 2, 28, 29, 9, 2241, 2242, 2322, 2323, 1, 3]
    lazy = filter_silent_tokens(itertools.repeat(1))  # endless input: tokens come out as they go in
    assert list(itertools.islice(lazy, 5)) == [1] * 5


def test_vc_flow_accepts_an_untrimmed_prompt(parts: dict) -> None:
    """Voice conversion passes the prompt's whole mel (F = 2P - 1 here): the output is the last 2(P+T) - F
    frames, as in the reference; more prompt frames than the tokens make is refused."""
    flow = parts["flow"]
    prompt = torch.zeros(1, 10, dtype=torch.int32)
    token = torch.ones(1, 20, dtype=torch.int32)
    mel = flow.inference(token, prompt, torch.zeros(1, 19, 80), torch.ones(1, 192), False, True)
    assert mel.shape == (1, 80, 2 * 30 - 19)
    with pytest.raises(ValueError, match="61 frames, more than the 60"):
        flow.inference(token, prompt, torch.zeros(1, 61, 80), torch.ones(1, 192), False, True)


# --- tokenizer and LM -----------------------------------------------------------------------------------------------


def test_tokenizer_special_tokens(cv3_model_dir: Path) -> None:
    """CosyVoice3's 278 added tokens take ids 151646..151923 in the reference's order and match before NFC; the
    CosyVoice2 tokenizer of the same files keeps its 17 (a phone tag is plain text there)."""
    from cosyserve.families.cosyvoice2 import SPECIALS as COSYVOICE2_SPECIALS
    from cosyserve.families.cosyvoice3 import SPECIALS as COSYVOICE3_SPECIALS
    from cosyserve.families.cosyvoice3.frontend import build_tokenizer
    from cosyserve.frontend.qwen_tokenizer import QwenTokenizer

    tok = build_tokenizer(cv3_model_dir)
    ids = [tok.encode(t) for t in COSYVOICE3_SPECIALS]
    assert ids == [[151646 + i] for i in range(278)]
    assert tok.encode("<|endofsystem|>[AA][a][ǜ]") == [151663, 151664, 151748, 151923]
    decomposed = unicodedata.normalize("NFD", "[ǐ]")
    assert decomposed != "[ǐ]" and tok.encode(decomposed) == tok.encode("[") + tok.encode("ǐ") + tok.encode(
        "]"
    )
    assert len(tok.encode("[foo] [Breath] <|en|>")) > 3  # unknown tags are plain text
    cv2 = QwenTokenizer.from_dir(cv3_model_dir / "CosyVoice-BlankEN", COSYVOICE2_SPECIALS)
    assert cv2.encode("[breath]") == [151647] and len(cv2.encode("[AA0]")) > 1


def test_the_lm_refuses_text_without_endofprompt(parts: dict) -> None:
    """The reference asserts <|endofprompt|> in prompt text + text; without it the model was never trained."""
    from cosyserve.models.cosyvoice3_lm import ENDOFPROMPT, PromptRuleError
    from cosyserve.runtime.lm import Streamed
    from cosyserve.runtime.oneoff import generate

    lm = parts["llm"]
    text, empty = torch.tensor([[10, 11, 12]], dtype=torch.int32), torch.zeros(1, 0, dtype=torch.int32)
    n = torch.tensor([3], dtype=torch.int32)
    zero = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(PromptRuleError, match="<\\|endofprompt\\|>"):
        tf(lm, (text, n, empty, zero, empty, zero, torch.zeros(1, 192)), [1])
    with pytest.raises(PromptRuleError):
        list(generate(lm, Streamed([[10, 11, 12]], [10, 11, 12], []), 0))
    ok = torch.tensor([[ENDOFPROMPT, 10, 11]], dtype=torch.int32)
    logp, min_len, max_len = tf(lm, (ok, n, empty, zero, empty, zero, torch.zeros(1, 192)), [5, 6])
    assert logp.shape == (2, 6761) and (min_len, max_len) == (6, 60)


def test_bistream_forces_a_fill_every_15_speech_tokens_and_outgrows_its_cache(parts: dict) -> None:
    """Without prompt speech the LM decodes at once (no text in its input yet), a fill is forced after 15 tokens
    and then every 16 steps, and each later run starts from 5 more text tokens; after the text, decoding runs to
    EOS (6562). 200 text tokens make ~900 LM positions, more than the 256 the cache starts with."""
    from cosyserve.models.cosyvoice3_lm import ENDOFPROMPT
    from cosyserve.runtime.lm import Streamed
    from cosyserve.runtime.oneoff import teacher_forced

    lm = parts["llm"]
    text = list(range(100, 300))
    # 42 at every sampled step (forced fills take none: 1 + 200 // 5 of them), EOS once 700 ids were decoded
    teacher = [42] * (700 - (1 + 200 // 5)) + [6562]
    spec = Streamed(([t] for t in text), [5, 6, ENDOFPROMPT], [], ratio=None)
    run = teacher_forced(lm, spec, teacher)
    steps, tokens = run.step_tokens, run.tokens
    assert len(steps) == 701 and run.logprobs.shape == (701, 6761)
    fills = [i for i, t in enumerate(steps) if t == 6564]
    assert fills[:3] == [15, 31, 47] and all(b - a == 16 for a, b in zip(fills, fills[1:], strict=False))
    assert len(fills) == 1 + 200 // 5 and steps[-1] == 6562
    assert all(t == 42 for t in tokens) and len(tokens) == len(steps) - len(fills) - 1


def test_bistream_sampling_repeats_with_a_seed(parts: dict) -> None:
    from cosyserve.core.sampling import row_key
    from cosyserve.models.cosyvoice3_lm import ENDOFPROMPT
    from cosyserve.runtime.lm import Streamed
    from cosyserve.runtime.oneoff import generate

    lm = parts["llm"]
    text = [torch.tensor([[100, 101, 102]], dtype=torch.int32)] * 4

    def run(seed: int) -> list[int]:
        return list(generate(lm, Streamed(iter(text), [5, ENDOFPROMPT, 7], [], max_len=12), row_key(seed)))

    first = run(11)
    assert first and first == run(11) and len(first) <= 12
    assert first != run(12), "another seed should draw other tokens"


def test_the_numpy_noise_replay_is_the_references_buffers(cv3_set_dir: Path) -> None:
    """The vocoder's fixed noise, replayed in numpy without torch (both runtimes read it; a lite bundle carries
    only the shapes it is counted from), equals the buffers the reference recorded in the fixture set, bit for
    bit. A difference: the count of the generator's draws before them, or torch's uniform conversion, is wrong,
    and a served model's audio is not the reference's."""
    from safetensors.numpy import load_file

    from cosyserve.families import family_named
    from cosyserve.families.cosyvoice3.noise import VocoderNoise

    fixtures = cv3_set_dir
    recorded = load_file(str(fixtures / "tensors.safetensors"))
    rand_ini, sine_waves = (
        recorded["token2wav_full.hift_rand_ini"],
        recorded["token2wav_full.hift_sine_waves"],
    )
    noise = VocoderNoise(family_named("cosyvoice3").read_config(fixtures / "model")).draws(
        sine_waves.shape[1]
    )
    assert np.array_equal(noise["rand_ini"], rand_ini)
    assert np.array_equal(noise["sine_waves"][:, : sine_waves.shape[1]], sine_waves)


def test_the_noise_grown_in_steps_equals_the_noise_drawn_at_once(cv3_set_dir: Path) -> None:
    """A longer prefix of the vocoder noise draws only what it adds, from where the generator stopped. If this
    fails, a stream that outgrows the first 10 s reads noise that is not the reference's past that point (the
    generator restarted or skipped), or a prefix handed out earlier changed under a request reading it."""
    from cosyserve.families import family_named
    from cosyserve.families.cosyvoice3.noise import INITIAL_SAMPLES, VocoderNoise

    config = family_named("cosyvoice3").read_config(cv3_set_dir / "model")
    grown = VocoderNoise(config)
    first = grown.draws(1)
    kept = first["sine_waves"].copy()
    assert first["sine_waves"].shape[1] == INITIAL_SAMPLES
    longer = grown.draws(INITIAL_SAMPLES + 7)
    assert longer["sine_waves"].shape[1] == 2 * INITIAL_SAMPLES  # doubling, not one more sample at a time
    assert np.array_equal(first["sine_waves"], kept)
    at_once = VocoderNoise(config).draws(2 * INITIAL_SAMPLES)
    assert np.array_equal(longer["rand_ini"], at_once["rand_ini"])
    assert np.array_equal(longer["sine_waves"], at_once["sine_waves"])
