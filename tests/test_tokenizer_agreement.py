"""Our Qwen3 tokenizer agrees token for token with an independent native implementation."""

from __future__ import annotations

import random

from tml_renderers.tokenizers import Qwen3Tokenizer

SNIPPETS = [
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "The quick brown fox jumps over the lazy dog.",
    "It's we'll they'd I'M YOU'RE",
    "机器学习是人工智能的一个分支。",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 문장입니다.",
    "Привет, мир! Ёлка.",
    "emoji 🎲🃏🂡 and flags 🇫🇷 and family 👨‍👩‍👧",
    "numbers 1234567890 3.14159 -42 1e-9 0x1F",
    "   leading spaces\t\ttabs\n\n\nnewlines   trailing   ",
    "\r\n\r\nwindows\r\nline endings",
    '{"name": "hit", "arguments": {"a": true, "b": [1, 2, 3]}}',
    "<tool-call> </ tool_call> <|im_start",
    "Ünïcödé çömbïnïng: e\u0301 a\u0308 n\u0303",
    "mixed العربية and עברית text",
    "math: ∑_{i=1}^{n} x_i ≤ ∞ ∀ε>0",
    "URL https://example.com/a/b?c=d&e=f#g",
    "    \n    \n",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
]


def _texts(n: int) -> list[str]:
    rng = random.Random(1234)
    pool = "".join(SNIPPETS)
    texts = list(SNIPPETS)
    while len(texts) < n:
        k = rng.randint(1, 4)
        parts = rng.sample(SNIPPETS, k)
        text = rng.choice(["", " ", "\n", "  "]).join(parts)
        if rng.random() < 0.5:
            start = rng.randrange(len(pool))
            text += pool[start : start + rng.randint(1, 80)]
        if rng.random() < 0.2:
            text = " " * rng.randint(1, 9) + text + "\n" * rng.randint(0, 3)
        texts.append(text)
    return texts


def test_agrees_with_native_qwen3_tokenizer_on_1000_texts(qwen3_tokenizer):
    native = Qwen3Tokenizer()
    texts = _texts(1000)
    mismatches = []
    for text in texts:
        ours = qwen3_tokenizer.encode(text, add_special_tokens=False)
        theirs = native.encode_ordinary(text)
        if ours != list(theirs):
            mismatches.append(text)
    assert len(texts) >= 1000
    assert not mismatches, f"{len(mismatches)} texts disagree, first: {mismatches[0]!r}"


def test_round_trip_decode(qwen3_tokenizer):
    for text in _texts(200):
        ids = qwen3_tokenizer.encode(text, add_special_tokens=False)
        assert qwen3_tokenizer.decode(ids) == __import__("unicodedata").normalize("NFC", text)


def test_added_tokens_in_text_map_to_their_ids(qwen3_tokenizer):
    # Unlike `encode_ordinary`, a chat tokenizer matches added tokens inside text: the chat
    # template writes `<tool_call>` and `<think>` as text and must get the single ids back.
    ids = qwen3_tokenizer.encode("<tool_call>\n{}\n</tool_call><think>", add_special_tokens=False)
    assert ids[0] == 151657 and ids[-2:] == [151658, 151667]
