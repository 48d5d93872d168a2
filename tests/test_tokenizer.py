import json
from pathlib import Path

from safetensors.torch import load_file

from cosyserve.frontend.text import normalize_and_split, split_paragraph
from cosyserve.frontend.tokenizer import get_tokenizer


def test_vocabulary_size_matches_llm_text_token_size() -> None:
    # CosyVoice-300M's text embedding has 51866 rows: 50257 BPE ranks + whisper's 1609 special tokens
    assert get_tokenizer().vocab_size == 51866


def test_special_tokens_become_single_ids() -> None:
    tok = get_tokenizer()
    assert tok.encode("<|endoftext|>") == [50257]
    assert tok.encode("<|en|>") == [50259] and tok.encode("<|zh|>") == [50260]
    assert tok.encode("<|yue|>") == [50358]  # the 100th language


def test_roundtrip() -> None:
    tok = get_tokenizer()
    text = "CosyVoice 是一个 text-to-speech 模型 😀"
    assert tok.decode(tok.encode(text)) == text


def test_fixture_tokenize_cases(fixture_set_dir: Path) -> None:
    doc = json.loads((fixture_set_dir / "cases.json").read_text())
    tensors = load_file(str(fixture_set_dir / "tensors.safetensors"))
    cases = [c for c in doc["cases"] if c["kind"] == "tokenize"]
    assert cases
    for c in cases:
        expected = tensors[c["outputs"]["ids"]["tensor"]].tolist()
        assert get_tokenizer().encode(c["inputs"]["text"]) == expected, c["name"]


def test_split_merges_short_tail_and_keeps_pieces_bounded() -> None:
    tok = get_tokenizer()
    sentence = "This sentence has a handful of words in it. "
    text = (sentence * 20).strip()
    pieces = split_paragraph(text, tok.encode, "en")
    assert len(pieces) > 1
    assert "".join(pieces) == text
    assert all(len(tok.encode(p)) <= 80 + len(tok.encode(sentence)) for p in pieces)
    # a short final sentence joins the previous piece instead of standing alone
    assert split_paragraph("A long first sentence that is here. Hi.", tok.encode, "en") == [
        "A long first sentence that is here. Hi."
    ]


def test_normalize_and_split_rules() -> None:
    enc = get_tokenizer().encode
    assert normalize_and_split("<|en|>Hello <|endoftext|> world", enc) == ["<|en|>Hello <|endoftext|> world"]
    assert normalize_and_split("   ", enc) == []
    assert normalize_and_split("!!!...???", enc) == []
    assert normalize_and_split("Hello world", enc) == ["Hello world."]
    assert normalize_and_split("你好 世界，", enc) == ["你好世界。"]
