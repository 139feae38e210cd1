"""Canonical messages: client reformatting matches, real edits do not."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from plies.gateway._canonical import canonical_arguments, canonicalise, template_messages
from plies.gateway._schemas import ChatCompletionRequest, RequestMessage


def msgs(*raw: dict) -> list[RequestMessage]:
    return [RequestMessage.model_validate(m) for m in raw]


REORDERED = '{"side":"left","amount":3}'
EDITED = '{"amount": 4, "side": "left"}'

SERVED = msgs(
    {"role": "user", "content": "deal"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "hit", "arguments": "{}"}},
            {
                "id": "call_b",
                "type": "function",
                "function": {"name": "bet", "arguments": '{"amount": 3, "side": "left"}'},
            },
        ],
        "reasoning_content": "think",
    },
    {"role": "tool", "tool_call_id": "call_b", "content": "ok"},
)


def test_reformatted_history_matches_what_was_served():
    echoed = msgs(
        {
            "role": "user",
            "content": [{"type": "text", "text": "de"}, {"type": "text", "text": "al"}],
        },
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "x1", "function": {"name": "hit", "arguments": {}}},
                {
                    "id": "x2",
                    "function": {"name": "bet", "arguments": '{"side":"left","amount":3}'},
                },
            ],
            "refusal": None,
        },
        {"role": "tool", "tool_call_id": "x2", "content": "ok"},
    )
    served = canonicalise(SERVED)
    for asked, given in zip(canonicalise(echoed), served, strict=True):
        assert asked.matches_served(given), (asked, given)


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m[0].__setattr__("content", "deal!"),
        lambda m: (
            m[1].tool_calls[1].function.__setattr__("arguments", '{"amount": 4, "side": "left"}')
        ),
        lambda m: m[1].tool_calls.reverse(),
        lambda m: m[1].__setattr__("reasoning_content", "other thoughts"),
        lambda m: m[2].__setattr__("tool_call_id", "call_a"),
    ],
    ids=["user-text", "arguments", "call-order", "reasoning", "tool-result-target"],
)
def test_edits_do_not_match(change):
    edited = [m.model_copy(deep=True) for m in SERVED]
    change(edited)
    served = canonicalise(SERVED)
    assert not all(a.matches_served(s) for a, s in zip(canonicalise(edited), served, strict=True))


def test_dropped_reasoning_still_matches():
    echoed = [m.model_copy(deep=True) for m in SERVED]
    echoed[1].reasoning_content = None
    served = canonicalise(SERVED)
    assert all(a.matches_served(s) for a, s in zip(canonicalise(echoed), served, strict=True))


def test_argument_json_is_canonical():
    assert canonical_arguments('{ "b": [1, 2], "a": "é" }') == '{"a":"é","b":[1,2]}'
    assert canonical_arguments({"b": 1, "a": 2}) == '{"a":2,"b":1}'
    assert canonical_arguments(" not json ") == "not json"


def test_template_messages_have_object_arguments_and_system_role():
    out = template_messages(msgs({"role": "developer", "content": None}, *SERVED))
    assert out[0] == {"role": "system", "content": ""}
    assert out[2]["tool_calls"][1]["function"]["arguments"] == {"amount": 3, "side": "left"}
    assert out[2]["reasoning_content"] == "think"
    assert out[3]["tool_call_id"] == "call_b"


def test_requests_are_validated_with_a_named_field():
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
        )
    assert "text only" in str(err.value)
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": []})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "robot", "content": "x"}]})


def test_a_turn_sent_without_its_thinking_drops_it_a_missing_field_does_not():
    served = canonicalise(SERVED)[1]
    calls = SERVED[1].model_dump()["tool_calls"]
    left_out, without, edited = canonicalise(
        msgs(
            {"role": "assistant", "content": None, "tool_calls": calls},  # a chat client
            {"role": "assistant", "content": None, "tool_calls": calls, "reasoning_content": ""},
            {"role": "assistant", "content": None, "tool_calls": calls, "reasoning": "other"},
        )
    )
    assert left_out.matches_served(served) and not left_out.drops_reasoning_of(served)
    assert not without.matches_served(served) and without.drops_reasoning_of(served)
    assert not edited.matches_served(served) and not edited.drops_reasoning_of(served)
    plain = canonicalise(msgs({"role": "assistant", "content": "hi", "reasoning_content": ""}))
    served_plain = canonicalise(msgs({"role": "assistant", "content": "hi"}))
    assert plain[0].matches_served(served_plain[0])  # no thinking was served: nothing dropped
