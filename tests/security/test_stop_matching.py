"""Stop strings matched on a tail window (issue 32) are still found when their characters
are several ids each.

Both places that cut completions by stop string keep only a window of the completion:
`plies serve`'s Tinker `asample` keeps characters (`_samplers.StopStrings`), the gateway
keeps ids (`_stops.StopMatcher`). A window too short fails quietly: the stop string is never
seen and the completion runs on, so only a comparison with the definition (the shortest
prefix whose decoded text holds a stop string) shows it. Byte-level BPE spells a rare
character as up to four ids, so a window of as many ids as the string has characters can be
too short. Common text is covered by tests/tinker/test_stop_strings.py and the gateway tests.
"""

from __future__ import annotations

import pytest

from plies.gateway._stops import StopStrings as GatewayStops
from plies.server._tinker._samplers import StopStrings as ServerStops

TEXT = "The answer is <answer>42</answer>, surely. 寿司 🍣 hoy. 𓀀𓀁𓀂 ꙮꙮ!\n\n" * 3
"""Ends in rare characters (Egyptian hieroglyphs, U+A66E) that Qwen3's tokenizer spells as
two or three byte ids each."""

MULTI_ID_STOPS = ["𓀀𓀁", "𓀀𓀁𓀂", ". 𓀀𓀁", " 𓀀𓀁𓀂"]
"""Stop strings of more ids than characters + 2 (two hieroglyphs are six ids)."""


def first_stop(tokenizer, tokens: list[int], strings: list[str]) -> int | None:
    """The definition: the length of the shortest prefix whose text holds a stop string."""
    for n in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:n], skip_special_tokens=False)
        if any(s in text for s in strings):
            return n
    return None


@pytest.fixture(scope="module")
def tokens(qwen3_tokenizer) -> list[int]:
    return qwen3_tokenizer.encode(TEXT, add_special_tokens=False)


def test_the_stops_are_longer_in_ids_than_in_characters(qwen3_tokenizer, tokens):
    for s in MULTI_ID_STOPS:
        assert len(qwen3_tokenizer.encode(s, add_special_tokens=False)) > len(s) + 2, s
        assert first_stop(qwen3_tokenizer, tokens, [s]) is not None, s


def test_the_servers_cut_finds_stops_of_multi_id_characters(qwen3_tokenizer, tokens):
    for s in MULTI_ID_STOPS:
        got = ServerStops((s,)).cut(qwen3_tokenizer, tokens)
        assert got == first_stop(qwen3_tokenizer, tokens, [s]), s


def test_the_gateways_cut_finds_stops_of_multi_id_characters(qwen3_tokenizer, tokens):
    for s in MULTI_ID_STOPS:
        matcher = GatewayStops.compile(qwen3_tokenizer, [s]).matcher(qwen3_tokenizer)
        assert matcher is not None, s  # matched on the ids, not a one-id stop for the engine
        found = matcher.first_match(tokens)
        assert found == (first_stop(qwen3_tokenizer, tokens, [s]), s), s


def test_the_servers_cut_counts_a_stop_that_ends_where_a_character_begins(qwen3_tokenizer, tokens):
    """`"司 "` ends in the token that also begins `🍣`'s bytes: the prefix's own decoding holds
    the stop at that token, so the cut is there, not where the character completes."""
    for s in ("司 ", ". 𓀀", "ꙮ!"):
        got = ServerStops((s,)).cut(qwen3_tokenizer, tokens)
        assert got == first_stop(qwen3_tokenizer, tokens, [s]), s
