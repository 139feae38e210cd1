"""The offline model kit builds a correct Qwen3 tokenizer and a deterministic tiny model."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from plies.testing._models import QWEN3_ADDED_TOKENS, build_tiny_model, tree_digest


def test_qwen3_tokenizer_encodes_chatml_exactly(qwen3_tokenizer):
    ids = qwen3_tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False)
    assert ids == [151644, 872, 198, 6023, 151645, 198]


def test_qwen3_added_tokens_and_special_flags(qwen3_tokenizer):
    added = qwen3_tokenizer.added_tokens_decoder
    assert len(added) == 26
    for offset, (text, special) in enumerate(QWEN3_ADDED_TOKENS):
        tok = added[151643 + offset]
        assert tok.content == text
        assert tok.special is special, text
    assert qwen3_tokenizer.eos_token == "<|im_end|>"
    assert qwen3_tokenizer.pad_token == "<|endoftext|>"
    assert qwen3_tokenizer.bos_token is None


def test_single_digit_pretokenization(qwen3_tokenizer):
    # Qwen splits every digit on its own; the converter's default pattern groups up to three.
    ids = qwen3_tokenizer.encode("12345", add_special_tokens=False)
    assert len(ids) == 5


def test_tiny_model_is_deterministic(tmp_path: Path, qwen3_tokenizer_dir: Path):
    a = build_tiny_model(tmp_path / "a", tokenizer_dir=qwen3_tokenizer_dir)
    b = build_tiny_model(tmp_path / "b", tokenizer_dir=qwen3_tokenizer_dir)
    assert tree_digest(a) == tree_digest(b)
    config = AutoConfig.from_pretrained(a)
    assert config.tie_word_embeddings is False
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (32, 2, 151936)
    tok = AutoTokenizer.from_pretrained(a)
    assert tok.chat_template == AutoTokenizer.from_pretrained(qwen3_tokenizer_dir).chat_template
