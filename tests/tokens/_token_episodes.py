"""Shared episode scripts for the token tests: messages a policy and an environment exchange."""

from __future__ import annotations

import json
from typing import Any

from plies.tokens import ParsedResponse

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name."}},
            "required": ["city"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the news.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["query"],
        },
    },
}
SYSTEM = {"role": "system", "content": "You are a careful assistant. Use tools when useful."}


def call(name: str, arguments: dict[str, Any], as_text: bool = False) -> dict[str, Any]:
    args: Any = json.dumps(arguments) if as_text else arguments
    return {"type": "function", "function": {"name": name, "arguments": args}}


def assistant(content: str = "", reasoning: str | None = None, calls=None) -> dict[str, Any]:
    return ParsedResponse(content, reasoning, calls or []).to_message()


def tool(name: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "name": name, "content": content}


def user(content: str) -> dict[str, Any]:
    return {"role": "user", "content": content}


def tool_episode(as_text: bool = False) -> dict[str, Any]:
    """Tool rounds, parallel calls, reasoning, a truncated turn, new users, tools changing."""
    c = lambda name, **kw: call(name, kw, as_text)  # noqa: E731
    return {
        "tools": [WEATHER, CLOCK],
        "start": [SYSTEM, user("What is the weather in Paris, and the time in Tokyo?")],
        "steps": [
            # (assistant turn, finish reason, new messages, tools for the next prompt)
            (
                assistant(calls=[c("get_weather", city="Paris")]),
                "stop",
                [tool("get_weather", "18C, cloudy")],
                None,
            ),
            (
                assistant(
                    "Checking Tokyo.",
                    "Paris done; Tokyo needs two calls.",
                    [c("get_weather", city="Tokyo"), c("get_time", city="Tokyo")],
                ),
                "stop",
                [tool("get_weather", "24C, sunny"), tool("get_time", "21:05")],
                None,
            ),
            (
                assistant("Paris: 18C. Tokyo: 24C at 21:05.", "All results are in."),
                "length",
                [user("Thanks! Any news there?")],
                None,
            ),
            (
                assistant("I can search if you give me tools."),
                "stop",
                [user("Now you have a search tool.")],
                [WEATHER, SEARCH],
            ),
            (
                assistant(calls=[c("search", query="Tokyo news", limit=3)]),
                "stop",
                [tool("search", "Festival tonight.")],
                None,
            ),
            (assistant("A festival is on tonight.", "Summarise."), "stop", [user("Bye.")], None),
        ],
    }


def chat_episode(system: bool = True) -> dict[str, Any]:
    """No tools: user turns, reasoning, a truncated turn."""
    return {
        "tools": None,
        "start": ([SYSTEM] if system else []) + [user("Tell me a fact about the moon.")],
        "steps": [
            (
                assistant("The moon is drifting away by 3.8 cm a year."),
                "stop",
                [user("Why?")],
                None,
            ),
            (
                assistant("Tidal friction moves energy outward.", "Think about tides."),
                "stop",
                [user("Shorter please.")],
                None,
            ),
            (assistant("Tides push it away."), "length", [user("And the sun?")], None),
            (assistant("The sun is a star.", "Easy."), "stop", [user("Thanks.")], None),
        ],
    }


class Outcome:
    """How one episode went on one template: counts of incremental turns and fallback reasons."""

    def __init__(self) -> None:
        self.turns = 0
        self.incremental = 0
        """Turns built on the incremental path: previous prompt + completion + a delta."""
        self.fallbacks: dict[str, int] = {}
        """Full renders after the first prompt, by reason (whether or not they extended)."""
        self.rendered_extends = 0
        """Full renders that started with the previous prompt + completion: same segment."""
        self.needless: dict[str, int] = {}
        """Full renders that started a new segment although they began with the previous
        prompt + completion: what the renderer must never do."""
        self.stopped: str | None = None

    def __repr__(self) -> str:
        return (
            f"turns={self.turns} incremental={self.incremental} fallbacks={self.fallbacks} "
            f"rendered_extends={self.rendered_extends} needless={self.needless} "
            f"stopped={self.stopped!r}"
        )


def full_render(
    tok: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    generation_prompt: bool = True,
    **template_kwargs: Any,
) -> list[int]:
    """The template's own render of the whole history, as ids: what a renderer's prompt (or,
    without the generation prompt, prompt plus completion) must equal."""
    return tok.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=generation_prompt,
        tokenize=True,
        return_dict=False,
        **template_kwargs,
    )


def play(
    tok: Any, renderer: Any, episode: dict[str, Any], template_kwargs: dict[str, Any], close_id: int
) -> Outcome:
    """Drive a conversation and assert, at every turn, prompt == full apply_chat_template render
    with the template the renderer uses (`renderer.chat_template`, maybe a TRL training variant).

    Completions are the template's own ids for each assistant message: what the full render of
    the history plus that message puts after the generation prompt, through the close token
    (`close_id`); a truncated turn drops the close token and finishes with "length". Where the
    template cannot render the history, the conversation must raise TokenizationError.
    """
    import pytest

    from plies import TokenizationError

    def full(messages, tools, generation_prompt=True):
        kwargs = {"chat_template": renderer.chat_template, **template_kwargs}
        return full_render(tok, messages, tools, generation_prompt, **kwargs)

    def template_render(turn: int) -> list[int] | None:
        """The template's render of the history so far; None where the template cannot
        render it, once the conversation was seen to refuse it too."""
        try:
            return full(history, tools)
        except Exception as err:
            with pytest.raises(TokenizationError):
                conv.render()
            out.stopped = f"turn {turn}: {type(err).__name__}"
            return None

    out = Outcome()
    tools = episode["tools"]
    history = list(episode["start"])
    conv = renderer.start(history, tools=tools)
    expected = template_render(0)
    if expected is None:
        return out
    assert conv.render() == expected
    assert conv.delta.extends is False and conv.delta.ids == expected
    prev = list(expected)
    for k, (message, finish, new, next_tools) in enumerate(episode["steps"], 1):
        try:
            rendered = full([*history, message], tools, generation_prompt=False)
            start = len(prev)
            end = (
                rendered.index(close_id, start) + 1
                if close_id in rendered[start:]
                else len(rendered)
            )
            completion = rendered[start:end]
        except Exception:
            completion = []
        if finish == "length" and completion and completion[-1] == close_id:
            completion = completion[:-1]
        conv.add_completion(completion, finish, message=message)
        conv.add_messages(new)
        if next_tools is not None:
            conv.set_tools(next_tools)
            tools = next_tools
        history += [message, *new]
        expected = template_render(k)
        if expected is None:
            return out
        got = conv.render()
        assert got == expected, f"turn {k}: silent divergence (delta {conv.delta})"
        delta = conv.delta
        out.turns += 1
        if delta.fallback is None:
            assert delta.extends and all(f.turn != k for f in conv.fallbacks)
            out.incremental += 1
        else:
            assert conv.fallbacks[-1] is delta.fallback and delta.fallback.turn == k
            reason = str(delta.fallback.reason)
            out.fallbacks[reason] = out.fallbacks.get(reason, 0) + 1
        if delta.extends:
            assert [*prev, *completion, *delta.ids] == got
            out.rendered_extends += delta.fallback is not None
        else:
            assert delta.fallback is not None and delta.ids == got
            if got[: len(prev) + len(completion)] == [*prev, *completion]:
                out.needless[reason] = out.needless.get(reason, 0) + 1
        prev = list(got)
    return out
