import json
import math

import pytest
import torch
from safetensors.torch import load_file

from cosyserve.models.llm import LLMConfig, SamplingConfig, TransformerLM
from cosyserve.models.transformer import (
    ConformerEncoder,
    ConformerEncoderConfig,
    TransformerEncoder,
    TransformerEncoderConfig,
)
from lm_util import sample, tf


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # On 2-vCPU VMs, tiny ops with 2 OpenMP threads run 10-20x slower than with 1; only speed is affected.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _fixture_config() -> LLMConfig:
    # The fixture yaml's llm section, written out so these tests do not depend on the yaml reader.
    return LLMConfig(
        text_encoder_input_size=64,
        llm_input_size=256,
        llm_output_size=256,
        text_token_size=51866,
        speech_token_size=4096,
        text_encoder=ConformerEncoderConfig(
            input_size=64,
            output_size=256,
            attention_heads=4,
            linear_units=512,
            num_blocks=2,
            input_layer="linear",
            pos_enc_layer_type="rel_pos_espnet",
            selfattention_layer_type="rel_selfattn",
            use_cnn_module=False,
            macaron_style=False,
            static_chunk_size=1,
        ),
        llm=TransformerEncoderConfig(
            input_size=256,
            output_size=256,
            attention_heads=4,
            linear_units=512,
            num_blocks=2,
            input_layer="linear_legacy",
            pos_enc_layer_type="rel_pos_espnet",
            selfattention_layer_type="rel_selfattn",
            static_chunk_size=1,
        ),
        sampling=SamplingConfig(top_p=0.8, top_k=25, win_size=10, tau_r=0.1),
    )


def _tiny_config(seed: int = 0) -> LLMConfig:
    g = torch.Generator().manual_seed(seed)
    heads = int(torch.randint(1, 4, (1,), generator=g))
    return LLMConfig(
        text_encoder_input_size=24,
        llm_input_size=16 * heads,
        llm_output_size=16 * heads,
        text_token_size=50,
        speech_token_size=40,
        spk_embed_dim=12,
        text_encoder=ConformerEncoderConfig(
            input_size=24,
            output_size=8 * heads,
            attention_heads=heads,
            linear_units=32,
            num_blocks=1,
            input_layer="linear",
            pos_enc_layer_type="rel_pos_espnet",
            use_cnn_module=False,
            macaron_style=False,
            static_chunk_size=1,
        ),
        llm=TransformerEncoderConfig(
            input_size=16 * heads,
            output_size=16 * heads,
            attention_heads=heads,
            linear_units=48,
            num_blocks=3,
            input_layer="linear_legacy",
            pos_enc_layer_type="rel_pos_espnet",
            selfattention_layer_type="rel_selfattn",
            activation_type="gelu",
            static_chunk_size=1,
        ),
        sampling=SamplingConfig(),
    )


@pytest.fixture(scope="module")
def fixture_llm(fixture_set_dir):
    model = TransformerLM(_fixture_config())
    sd = torch.load(fixture_set_dir / "model" / "llm.pt", weights_only=True)
    model.load_state_dict(sd, strict=True)
    return model.eval(), sd


@pytest.fixture(scope="module")
def llm_cases(fixture_set_dir):
    cases = json.loads((fixture_set_dir / "cases.json").read_text())["cases"]
    tensors = load_file(str(fixture_set_dir / "tensors.safetensors"))
    out = []
    for case in cases:
        if case["kind"] != "llm_logprobs":
            continue
        inputs = {k: tensors[v["tensor"]] for k, v in case["inputs"].items()}
        out.append((case, inputs, tensors[case["outputs"]["logprobs"]["tensor"]]))
    assert len(out) == 4, "the fixture set should hold the sft, zero_shot, instruct and cross_lingual cases"
    return out


def _length(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor([x.shape[1]], dtype=torch.int32)


def _args(inputs: dict) -> tuple:
    return (
        inputs["text"],
        _length(inputs["text"]),
        inputs["prompt_text"],
        _length(inputs["prompt_text"]),
        inputs["prompt_speech_token"],
        _length(inputs["prompt_speech_token"]),
        inputs["embedding"],
    )


def _random_args(cfg: LLMConfig, g: torch.Generator, t: int = 5, p: int = 3, s: int = 4, spk: bool = True):
    text = torch.randint(0, cfg.text_token_size, (1, t), generator=g, dtype=torch.int32)
    prompt_text = torch.randint(0, cfg.text_token_size, (1, p), generator=g, dtype=torch.int32)
    prompt_speech = torch.randint(0, cfg.speech_token_size, (1, s), generator=g, dtype=torch.int32)
    emb = torch.randn(1 if spk else 0, cfg.spk_embed_dim, generator=g)
    return (
        text,
        _length(text),
        prompt_text,
        _length(prompt_text),
        prompt_speech,
        _length(prompt_speech),
        emb,
    )


def test_state_dict_keys_are_official(fixture_llm):
    model, sd = fixture_llm
    # A mismatch means a renamed/missing module or a derived buffer leaking into checkpoints.
    assert set(model.state_dict()) == set(sd)


def test_fixture_cases(fixture_llm, llm_cases):
    model, _ = fixture_llm
    for case, inputs, expected in llm_cases:
        logprobs, min_len, max_len = tf(model, _args(inputs), inputs["teacher_tokens"])
        assert logprobs.shape == expected.shape, case["name"]
        err = (logprobs - expected).abs()
        # Beyond tolerance: input assembly, encoder masking or cached attention differs from the reference.
        assert (err <= case["atol"] + case["rtol"] * expected.abs()).all(), (case["name"], err.max().item())
        assert (min_len, max_len) == (case["outputs"]["min_len"], case["outputs"]["max_len"]), case["name"]


def _full_forward_logprobs(model: TransformerLM, args: tuple, teacher: torch.Tensor) -> torch.Tensor:
    lm_input = model.embed_inputs(*args)
    seq = torch.cat([lm_input, model.speech_embedding(teacher[:-1].long()).unsqueeze(0)], dim=1)
    out, _ = model.llm(seq, torch.tensor([seq.size(1)]))  # static_chunk_size 1: a causal full forward
    t0 = lm_input.size(1)
    return model.llm_decoder(out[0, t0 - 1 :]).log_softmax(-1)


@torch.inference_mode()
def test_incremental_decode_matches_full_causal_forward(fixture_llm, llm_cases):
    model, _ = fixture_llm
    _, inputs, _ = llm_cases[1]  # zero_shot: prompt text, prompt speech and speaker embedding
    teacher = inputs["teacher_tokens"]
    cached, _, _ = tf(model, _args(inputs), teacher)
    full = _full_forward_logprobs(model, _args(inputs), teacher)
    # A difference means the KV cache, the per-distance position projection or the step masks are wrong.
    torch.testing.assert_close(cached, full, atol=2e-5, rtol=1e-5)


@torch.inference_mode()
def test_batched_rows_match_unbatched():
    torch.manual_seed(0)
    model = TransformerLM(_tiny_config(1)).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [model.embed_inputs(*_random_args(model.cfg, g, t=t, p=p)) for t, p in ((6, 2), (3, 0))]
    steps = 6
    tokens = torch.randint(0, model.cfg.speech_token_size, (2, steps), generator=g)

    singles = []
    for b, prompt in enumerate(prompts):
        model.setup_caches(1, 64)
        rows = [model.extend(prompt, 0, 0)]
        t0 = prompt.size(1)
        for i in range(steps):
            rows.append(model.decode(tokens[b, i : i + 1], torch.tensor([t0 + i]), t0 + i + 1))
        singles.append(torch.cat(rows))

    # each row's prompt into its own cache row, then steps of both rows at their own positions
    model.setup_caches(2, 64)
    first = torch.cat([model.extend(prompt, b, 0) for b, prompt in enumerate(prompts)])
    batched = [first]
    pos = torch.tensor([p.size(1) for p in prompts])
    for i in range(steps):
        batched.append(model.decode(tokens[:, i], pos, int(pos.max()) + 1))
        pos += 1
    batched = torch.stack(batched, dim=1)
    # Rows at different positions must not see each other's padding or positions.
    for b in range(2):
        torch.testing.assert_close(batched[b], singles[b], atol=1e-5, rtol=1e-5)


def test_inference_is_seeded_and_respects_min_len(fixture_llm, llm_cases):
    model, _ = fixture_llm
    _, inputs, _ = llm_cases[0]
    args = _args(inputs)
    runs = [list(sample(model, args, s, max_token_text_ratio=3.0)) for s in (7, 7, 8)]
    # Same seed must give the same tokens; a different seed (random weights, flat-ish distribution) must not.
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert all(0 <= t < model.cfg.speech_token_size for t in runs[0])
    assert len(runs[0]) <= int(inputs["text"].shape[1] * 3.0)


@torch.inference_mode()
def test_eos_never_before_min_len():
    torch.manual_seed(0)
    model = TransformerLM(_tiny_config(2)).eval()
    model.llm_decoder.bias[model.eos_token] = 50.0  # EOS would win every unmasked step
    g = torch.Generator().manual_seed(3)
    args = _random_args(model.cfg, g, t=4)
    for seed in range(3):
        out = list(sample(model, args, seed, min_token_text_ratio=2.0))
        # min_len = 8: EOS masked for steps 0..7, then drawn at step 8.
        assert len(out) == 8, out


@torch.inference_mode()
def test_random_tiny_config_cached_equals_full():
    for seed in range(3):
        torch.manual_seed(seed)
        model = TransformerLM(_tiny_config(seed)).eval()
        g = torch.Generator().manual_seed(seed)
        args = _random_args(model.cfg, g, spk=seed != 1, p=0 if seed == 2 else 3, s=0 if seed == 2 else 4)
        teacher = torch.randint(0, model.cfg.speech_token_size, (20,), generator=g)
        cached, min_len, max_len = tf(model, args, teacher)
        assert (min_len, max_len) == (10, 100)
        torch.testing.assert_close(cached, _full_forward_logprobs(model, args, teacher), atol=1e-5, rtol=1e-5)
        tokens = list(sample(model, args, 0))
        assert min_len <= len(tokens) <= max_len  # EOS is masked before min_len


@torch.inference_mode()
def test_reloading_weights_refreshes_position_projection():
    torch.manual_seed(0)
    model = TransformerLM(_tiny_config(0)).eval()
    g = torch.Generator().manual_seed(0)
    args = _random_args(model.cfg, g)
    teacher = torch.randint(0, model.cfg.speech_token_size, (8,), generator=g)
    tf(model, args, teacher)  # fills the projected-distance table
    other = TransformerLM(_tiny_config(0))
    model.load_state_dict(other.state_dict())
    cached, _, _ = tf(model, args, teacher)
    # A stale linear_pos projection after load_state_dict would show up here.
    torch.testing.assert_close(cached, _full_forward_logprobs(model, args, teacher), atol=1e-5, rtol=1e-5)


def _naive_rel_attention_encoder(enc, xs: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    # Straight from the formula: score[i, j] = ((q_i + u) k_j + (q_i + v) W_pos pe(i - j)) / sqrt(d_k).
    pe_enc = enc.embed.pos_enc
    x = enc.embed.out(xs) * pe_enc.xscale
    t = x.size(1)
    table = pe_enc.position_encoding(0, t, x)[0]  # rows: distances t-1 .. -(t-1)
    for layer in enc.encoders:
        a = layer.self_attn
        h, dk = a.h, a.d_k
        y = layer.norm_attn(x)
        q = a.linear_q(y).view(1, t, h, dk)
        k = a.linear_k(y).view(1, t, h, dk)
        v = a.linear_v(y).view(1, t, h, dk)
        p = a.linear_pos(table).view(-1, h, dk)
        scores = torch.empty(h, t, t)
        for i in range(t):
            for j in range(t):
                pij = p[t - 1 - (i - j)]
                scores[:, i, j] = (
                    ((q[0, i] + a.pos_bias_u) * k[0, j]).sum(-1) + ((q[0, i] + a.pos_bias_v) * pij).sum(-1)
                ) / math.sqrt(dk)
        scores = scores.masked_fill(~allowed, -float("inf")).softmax(-1)
        o = torch.einsum("hij,jhd->ihd", scores, v[0]).reshape(1, t, h * dk)
        x = x + a.linear_out(o)
        x = x + layer.feed_forward(layer.norm_ffn(x))
    return enc.after_norm(x)


@torch.inference_mode()
def test_encoder_full_context_and_padding():
    torch.manual_seed(0)
    cfg = ConformerEncoderConfig(
        input_size=10,
        output_size=12,
        attention_heads=3,
        linear_units=20,
        num_blocks=2,
        input_layer="linear",
        pos_enc_layer_type="rel_pos_espnet",
        use_cnn_module=False,
        macaron_style=False,
    )
    enc = ConformerEncoder(cfg).eval()
    xs = torch.randn(2, 7, 10)
    out, masks = enc(xs, torch.tensor([7, 4]))
    assert masks.shape == (2, 1, 7) and masks[1, 0].tolist() == [True] * 4 + [False] * 3
    # Non-causal relative attention (the flow encoder's case) against the formula.
    torch.testing.assert_close(
        out[:1], _naive_rel_attention_encoder(enc, xs[:1], torch.ones(7, 7, dtype=torch.bool))
    )
    # A padded row must equal the same row run alone.
    alone, _ = enc(xs[1:, :4], torch.tensor([4]))
    torch.testing.assert_close(out[1:, :4], alone, atol=1e-5, rtol=1e-5)

    causal = TransformerEncoder(
        TransformerEncoderConfig(
            input_size=10,
            output_size=12,
            attention_heads=3,
            linear_units=20,
            num_blocks=2,
            input_layer="linear_legacy",
            pos_enc_layer_type="rel_pos_espnet",
            selfattention_layer_type="rel_selfattn",
            static_chunk_size=2,
        )
    ).eval()
    out, _ = causal(xs[:1], torch.tensor([7]))
    chunk2 = torch.tensor([[j < (i // 2 + 1) * 2 for j in range(7)] for i in range(7)])
    torch.testing.assert_close(out, _naive_rel_attention_encoder(causal, xs[:1], chunk2))


def test_unsupported_options_are_rejected():
    base = dict(
        input_size=8,
        output_size=8,
        attention_heads=2,
        input_layer="linear",
        pos_enc_layer_type="rel_pos_espnet",
    )
    with pytest.raises(ValueError, match="use_cnn_module"):
        ConformerEncoder(ConformerEncoderConfig(**base, macaron_style=False))
    with pytest.raises(ValueError, match="macaron_style"):
        ConformerEncoder(ConformerEncoderConfig(**base, use_cnn_module=False))
    with pytest.raises(ValueError, match="pos_enc_layer_type"):
        TransformerEncoder(
            TransformerEncoderConfig(input_size=8, output_size=8, attention_heads=2, input_layer="linear")
        )


@torch.inference_mode()
def test_half_precision_weights_attend_in_float32_on_cpu():
    torch.manual_seed(4)
    model = TransformerLM(_tiny_config(0)).eval()
    g = torch.Generator().manual_seed(4)
    args = _random_args(model.cfg, g, p=3, s=4)
    teacher = torch.randint(0, model.cfg.speech_token_size, (12,), generator=g)
    ref, _, _ = tf(model, args, teacher)
    model.to(torch.bfloat16)
    got, _, _ = tf(model, args, teacher)
    cache = model.llm.encoders[0].self_attn.kv_cache
    # bf16 caches would send every decode step's attention through oneDNN, which keeps a kernel per key length
    # (~0.7 MB of memory per step at CosyVoice-300M's size); the caches and the attention stay float32 on CPU.
    assert (
        cache.k_cache.dtype == torch.float32
        and model.llm.encoders[0].self_attn.pos_proj.dtype == torch.float32
    )
    assert got.dtype == torch.float32
    # bf16 weights round the activations (~3 significant digits): close to float32, not equal
    assert (got - ref).abs().max() < 0.25, (got - ref).abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75
    assert list(sample(model, args, 0, max_token_text_ratio=2.0))
