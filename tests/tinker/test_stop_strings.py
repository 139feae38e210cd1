"""Stop strings on `asample`: a completion ends after the first token whose text completes
one, found by decoding each token once (linear), never by decoding every prefix again."""

from __future__ import annotations

import random
import time

import pytest

from plies.server._tinker._samplers import StopStrings


def first_stop(tokenizer, tokens: list[int], strings: list[str]) -> int | None:
    """The definition: the shortest prefix whose decoded text holds a stop string."""
    for n in range(1, len(tokens) + 1):
        if any(s in tokenizer.decode(tokens[:n]) for s in strings):
            return n
    return None


def test_the_cut_is_the_shortest_prefix_that_holds_a_stop_string(qwen3_tokenizer):
    rng = random.Random(7)
    text = "The answer is <answer>42</answer>, surely. Los niños comen 寿司 🍣 today.\n\n"
    base = qwen3_tokenizer.encode(text * 3, add_special_tokens=False)
    for _ in range(40):
        tokens = base[rng.randrange(len(base) // 2) :]
        start = rng.randrange(len(text) - 6)
        picked = text[start : start + rng.randint(1, 6)]
        strings = [picked, "never-there", "</answer>"][: rng.randint(1, 3)]
        got = StopStrings(tuple(strings)).cut(qwen3_tokenizer, tokens)
        assert got == first_stop(qwen3_tokenizer, tokens, strings), (strings, tokens[:20])
    assert StopStrings(()).cut(qwen3_tokenizer, base) is None


def test_cutting_a_long_completion_takes_linear_time(qwen3_tokenizer):
    """4,000 tokens with a stop string that never occurs: the issue measured 2.57 s a sample
    when every prefix was decoded again; one pass takes milliseconds."""
    rng = random.Random(3)
    tokens = [rng.randrange(150_000) for _ in range(4000)]
    stops = StopStrings(("</answer>", *tuple(f"<stop{i}>" for i in range(31))))
    started = time.perf_counter()
    assert stops.cut(qwen3_tokenizer, tokens) is None
    took = time.perf_counter() - started
    assert took < 0.5, f"{took:.2f} s for 4,000 tokens"


@pytest.mark.parametrize("strings", [("a",), ("ab", "abc")])
def test_a_stop_string_split_across_tokens_is_found_at_the_token_that_completes_it(
    qwen3_tokenizer, strings
):
    tokens = qwen3_tokenizer.encode("xx abc yy", add_special_tokens=False)
    assert StopStrings(strings).cut(qwen3_tokenizer, tokens) == first_stop(
        qwen3_tokenizer, tokens, list(strings)
    )
