"""The renderer's and the parser's memos: reused only where the inputs are equal plain data.

Real template (TRL's qwen3_training, where every tool round extends), real tokenizer; every
prompt is checked against a full `apply_chat_template` render by `play`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trl
from _token_episodes import SEARCH, SYSTEM, WEATHER, assistant, call, play, tool, tool_episode, user
from transformers import AutoTokenizer

from plies.tokens import ChatRenderer, FallbackReason
from plies.tokens._memo import Memo, copy_plain, plain_key

IM_END = 151645
TEMPLATE = Path(trl.__file__).parent / "chat_templates" / "qwen3_training.jinja"


@pytest.fixture(scope="module")
def tok(qwen3_tokenizer_dir):
    t = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    t.chat_template = TEMPLATE.read_text(encoding="utf-8")
    return t


def test_plain_keys_tell_apart_what_a_template_can_see():
    keys = [
        plain_key(v)
        for v in (1, 1.0, True, "1", None, [1], (1,), {"a": 1, "b": 2}, {"b": 2, "a": 1})
    ]
    assert None not in keys and len(set(keys)) == len(keys)
    assert plain_key({"a": [1, {"b": (2.5, None)}]}) == plain_key({"a": [1, {"b": (2.5, None)}]})

    class Text(str):
        pass

    for not_plain in (object(), Text("x"), {"a": Text("x")}, {1: "int key"}, {"s": {1, 2}}):
        assert plain_key(not_plain) is None


def test_copies_of_plain_data_share_nothing_mutable():
    value = {"a": [1, {"b": [2]}], "t": ([3],)}
    copy = copy_plain(value)
    assert copy == value
    copy["a"][1]["b"].append(9)
    copy["t"][0].append(9)
    assert value == {"a": [1, {"b": [2]}], "t": ([3],)}


def test_a_memo_keeps_its_most_recently_used_entries():
    memo: Memo[int] = Memo(2)
    memo.put("a", 1)
    memo.put("b", 2)
    assert memo.get("a") == 1  # "a" is now the most recent
    memo.put("c", 3)
    assert (memo.get("b"), memo.get("a"), memo.get("c")) == (None, 1, 3)
    stats = memo.statistics()
    assert (stats.hits, stats.misses, stats.size) == (3, 1, 2)
    with pytest.raises(ValueError):
        Memo(0)


def test_a_replayed_episode_reuses_every_step_and_stays_exact(tok):
    renderer = ChatRenderer(tok, template="model")
    first = play(tok, renderer, tool_episode(), {}, IM_END)
    after_first = renderer.statistics().deltas
    assert first.incremental > 0 and after_first.hits == 0
    assert after_first.misses == after_first.size == first.incremental

    second = play(tok, renderer, tool_episode(), {}, IM_END)  # every prompt checked again
    after_second = renderer.statistics().deltas
    assert (second.incremental, second.fallbacks) == (first.incremental, first.fallbacks)
    assert after_second.hits == first.incremental
    assert after_second.size == after_first.size


def _completion(tok, history, message, tools) -> list[int]:
    """The ids the template puts after the generation prompt for `message`, close included."""
    kw = {"tools": tools, "tokenize": True, "return_dict": False}
    prompt = tok.apply_chat_template(history, add_generation_prompt=True, **kw)
    ids = tok.apply_chat_template([*history, message], **kw)
    return ids[len(prompt) : ids.index(IM_END, len(prompt)) + 1]


def test_steps_differing_only_in_a_value_type_are_not_shared(tok):
    """The sampled ids spell `"limit": 3`; an assistant message saying 3.0 or True renders
    otherwise, so its step must fall back rather than reuse the step of the message with 3."""
    renderer = ChatRenderer(tok, template="model")
    history = [SYSTEM, user("News from Tokyo?")]
    message = assistant(calls=[call("search", {"query": "Tokyo", "limit": 3})])
    ids = _completion(tok, history, message, [SEARCH])
    outcomes = {}
    for limit in (3, 3.0, True, 3):
        conv = renderer.start(history, tools=[SEARCH])
        conv.render()
        said = assistant(calls=[call("search", {"query": "Tokyo", "limit": limit})])
        conv.add_completion(ids, "stop", message=said)
        conv.add_messages([tool("search", "Festival tonight.")])
        conv.render()
        fallback = conv.delta.fallback
        outcomes[repr(limit)] = None if fallback is None else fallback.reason
    assert outcomes == {
        "3": None,
        "3.0": FallbackReason.NONCANONICAL,
        "True": FallbackReason.NONCANONICAL,
    }
    stats = renderer.statistics().deltas
    assert (stats.hits, stats.misses) == (1, 3)


def test_messages_that_are_not_plain_data_are_never_remembered(tok):
    class Text(str):
        pass

    renderer = ChatRenderer(tok, template="model")
    history = [SYSTEM, user("Weather in Paris?")]
    message = assistant(calls=[call("get_weather", {"city": "Paris"})])
    ids = _completion(tok, history, message, [WEATHER])
    for _ in range(2):
        conv = renderer.start(history, tools=[WEATHER])
        conv.render()
        conv.add_completion(ids, "stop", message=message)
        conv.add_messages([tool("get_weather", Text("18C"))])
        got = conv.render()
        expected = tok.apply_chat_template(
            [*history, message, tool("get_weather", "18C")],
            tools=[WEATHER],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        assert got == expected and conv.delta.fallback is None
    stats = renderer.statistics().deltas
    assert (stats.hits, stats.misses, stats.size) == (0, 0, 0)


def test_a_remembered_parse_hands_each_caller_its_own_tool_calls(tok):
    renderer = ChatRenderer(tok, template="model")
    parser = renderer.parser([WEATHER])
    history = [SYSTEM, user("Weather in Paris?")]
    message = assistant(calls=[call("get_weather", {"city": "Paris"})])
    ids = _completion(tok, history, message, [WEATHER])
    prompt = tok.apply_chat_template(
        history, tools=[WEATHER], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    first = parser.parse(ids, prompt_ids=prompt)
    assert not first.ill_formed and first.tool_calls == message["tool_calls"]
    first.tool_calls[0]["function"]["arguments"]["city"] = "Lyon"
    second = parser.parse(ids, prompt_ids=prompt)
    assert second.tool_calls == message["tool_calls"]
    assert (parser.statistics().hits, parser.statistics().misses) == (1, 1)
    assert renderer.statistics().parses.hits == 1


def test_long_inputs_are_never_remembered(tok):
    """A long observation, or a long completion, is worked out every time: memory stays bounded."""
    renderer = ChatRenderer(tok, template="model")
    history = [SYSTEM, user("Weather in Paris?")]
    message = assistant(calls=[call("get_weather", {"city": "Paris"})])
    ids = _completion(tok, history, message, [WEATHER])
    long_result = tool("get_weather", "cloudy " * 400)
    for _ in range(2):
        conv = renderer.start(history, tools=[WEATHER])
        conv.render()
        conv.add_completion(ids, "stop", message=message)
        conv.add_messages([long_result])
        conv.render()
        assert conv.delta.extends and conv.delta.fallback is None
    stats = renderer.statistics().deltas
    assert (stats.hits, stats.misses, stats.size) == (0, 0, 0)

    parser = renderer.parser(None)
    text = tok.encode("word " * 300)
    assert parser.parse(text) == parser.parse(text)
    parses = parser.statistics()
    assert (parses.hits, parses.misses, parses.size) == (0, 0, 0)
    short = tok.encode("word " * 3)  # the same parser remembers a short one
    assert parser.parse(short) == parser.parse(short)
    parses = parser.statistics()
    assert (parses.hits, parses.misses, parses.size) == (1, 1, 1)
