"""ChatRenderer and ResponseParser on the offline Qwen3 tokenizer: real templates, no mocks."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import trl
from _token_episodes import (
    SEARCH,
    SYSTEM,
    WEATHER,
    assistant,
    call,
    chat_episode,
    full_render,
    play,
    tool,
    tool_episode,
    user,
)
from transformers import AutoTokenizer

from plies import ConfigError, PolicyRef, TokenizationError, Trajectory, Turn
from plies.tokens import ChatRenderer, FallbackReason, ParsedResponse, ResponseParser

TEMPLATES = Path(trl.__file__).parent / "chat_templates"
IM_END = 151645


def full(tok, messages, tools=None, **kwargs):
    return tok.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **kwargs,
    )


@pytest.fixture(scope="module")
def tok(qwen3_tokenizer_dir):
    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)


@pytest.fixture(scope="module")
def training_tok(qwen3_tokenizer_dir):
    t = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    t.chat_template = (TEMPLATES / "qwen3_training.jinja").read_text(encoding="utf-8")
    return t


@pytest.mark.parametrize("mode", ["model", "auto"])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}], ids=["default", "nothink"])
def test_qwen3_episodes_match_full_render(tok, kwargs, mode):
    renderer = ChatRenderer(tok, template_kwargs=kwargs, template=mode)
    for episode in (tool_episode(), chat_episode()):
        out = play(tok, renderer, episode, kwargs, IM_END)
        assert out.stopped is None and out.turns == len(episode["steps"])
        assert out.needless == {}
    if mode == "model" and kwargs:  # the non-thinking prefill is dropped from history
        assert set(out.fallbacks) == {"prefill_dropped"} and out.incremental == 0
    if mode == "auto" and not kwargs:  # TRL's variant keeps every think block: all incremental
        assert out.fallbacks == {} and out.incremental == out.turns


BLACKJACK_TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"{name} the hand."}}
    for name in ("hit", "stand")
]


def _blackjack_like(renderer, tok, hands: int) -> list[list]:
    """Hands of hit/stand tool rounds sampled as Qwen3 without thinking samples them (after
    the `<think>\n\n</think>\n\n` prefill): each later turn's delta, parsed, not given."""
    deltas = []
    for hand in range(hands):
        conv = renderer.start(
            [SYSTEM, user(f"Hand {hand}: you hold 12, the dealer shows 7.")], tools=BLACKJACK_TOOLS
        )
        conv.render()
        per_hand = []
        for k in range(1 + hand % 4):
            name = "stand" if k == hand % 4 else "hit"
            text = f'<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call><|im_end|>'
            parsed = conv.add_completion(tok.encode(text, add_special_tokens=False))
            assert [c["function"]["name"] for c in parsed.tool_calls] == [name]
            conv.add_messages([tool(name, f"you drew a {k + 2}; total {14 + k}")])
            template = {"chat_template": renderer.chat_template, "enable_thinking": False}
            expected = full_render(tok, conv.messages, BLACKJACK_TOOLS, **template)
            assert conv.render() == expected  # against the template in use
            per_hand.append(conv.delta)
        deltas.append(per_hand)
    return deltas


def test_qwen3_nothink_tool_episodes_extend_under_auto(tok, caplog):
    """The main job's setting: Qwen3's template, enable_thinking=False, tool rounds."""
    nothink = {"enable_thinking": False}
    with caplog.at_level("INFO", logger="plies.tokens"):
        auto = ChatRenderer(tok, tools=BLACKJACK_TOOLS, template_kwargs=nothink)
    assert (auto.choice.source, auto.choice.name) == ("trl", "qwen3_training")
    assert [r.getMessage() for r in caplog.records if "qwen3_training" in r.getMessage()] == [
        f"rendering with TRL's qwen3_training chat template (sha256:{auto.choice.sha256[:12]}): "
        "the model's template is not prefix-preserving (TRL's check)"
    ]
    later = [d for hand in _blackjack_like(auto, tok, 12) for d in hand]
    assert len(later) == 30 and all(d.extends and d.fallback is None for d in later)

    model = ChatRenderer(tok, tools=BLACKJACK_TOOLS, template_kwargs=nothink, template="model")
    later = [d for hand in _blackjack_like(model, tok, 12) for d in hand]
    assert {(d.extends, d.fallback.reason) for d in later} == {
        (False, FallbackReason.PREFILL_DROPPED)
    }


def test_template_modes_are_checked(tok):
    assert ChatRenderer(tok, template="training").choice.name == "qwen3_training"
    model = ChatRenderer(tok, template="model")
    assert model.chat_template == tok.chat_template and model.choice.name == "qwen3"
    with pytest.raises(ConfigError, match="template='newest' is not one of"):
        ChatRenderer(tok, template="newest")
    gemma4 = AutoTokenizer.from_pretrained(tok.name_or_path)
    gemma4.chat_template = (TEMPLATES / "gemma4.jinja").read_text(encoding="utf-8")
    with pytest.raises(ConfigError, match=r"no training variant .*\(gemma4\).*template='model'"):
        ChatRenderer(gemma4, template="training")
    assert ChatRenderer(gemma4).choice.source == "model"


def test_a_full_render_that_extends_keeps_the_segment(qwen3_tokenizer_dir):
    """Qwen2.5-VL's template never renders tools: a changed key re-renders, yet extends."""
    t = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    t.chat_template = (TEMPLATES / "qwen2_5_vl.jinja").read_text(encoding="utf-8")
    renderer = ChatRenderer(t, tools=[WEATHER])
    conv = renderer.start([user("hi")])
    first = list(conv.prompt_ids)
    ids = t.encode("hello<|im_end|>", add_special_tokens=False)
    conv.add_completion(ids, message=assistant("hello"))
    conv.set_tools([WEATHER, SEARCH])
    conv.add_messages([user("more")])
    assert conv.prompt_ids == full(t, conv.messages, [WEATHER, SEARCH])
    assert conv.prompt_ids[: len(first) + len(ids)] == first + ids
    d = conv.delta
    assert d.extends and d.fallback is not None and d.fallback.reason is FallbackReason.KEY_CHANGED
    assert conv.fallbacks == [d.fallback]
    assert d.ids == conv.prompt_ids[len(first) + len(ids) :]


def test_qwen3_reasoning_stripping_is_a_recorded_fallback(tok):
    renderer = ChatRenderer(tok, template="model")
    conv = renderer.start([user("q")])
    prompt = list(conv.prompt_ids)
    message = assistant("answer", "some reasoning")
    rendered = tok.apply_chat_template([user("q"), message], tokenize=True, return_dict=False)
    conv.add_completion(rendered[len(prompt) : rendered.index(IM_END, len(prompt)) + 1])
    assert conv.messages[-1]["reasoning_content"] == "some reasoning"  # parsed, not given
    conv.add_messages([user("next")])
    assert conv.prompt_ids == full(tok, conv.messages)
    assert [f.reason for f in conv.fallbacks] == [FallbackReason.REASONING_STRIPPED]
    assert conv.delta.extends is False


def _sample(tok, history, message, tools=None, **kwargs):
    """The template's own ids for `message` after `history`'s prompt."""
    prompt = full(tok, history, tools, **kwargs)
    rendered = tok.apply_chat_template(
        [*history, message], tools=tools, tokenize=True, return_dict=False, **kwargs
    )
    assert rendered[: len(prompt)] == prompt
    return rendered[len(prompt) : rendered.index(IM_END, len(prompt)) + 1]


def test_tool_loop_is_incremental_and_records_compactly(training_tok):
    tok = training_tok
    renderer = ChatRenderer(tok, tools=[WEATHER])
    conv = renderer.start([SYSTEM, user("Weather in Paris, Rome, Oslo?")])
    policy = PolicyRef(uri="file:///p", version=0)
    turns, prompts = [], []
    for k, city in enumerate(["Paris", "Rome", "Oslo"]):
        prompts.append(list(conv.prompt_ids))
        d = conv.delta
        message = assistant(
            reasoning=f"Look up {city}.", calls=[call("get_weather", {"city": city})]
        )
        ids = _sample(tok, conv.messages, message, [WEATHER])
        parsed = conv.add_completion(ids)  # parsed with TRL's Qwen3 response template
        assert parsed.tool_calls == message["tool_calls"] and parsed.reasoning == f"Look up {city}."
        turns.append(
            Turn(
                prompt_ids=d.ids,
                extends=d.extends,
                completion_ids=ids,
                logprobs=[0.0] * len(ids),
                finish_reason="stop",
                policy=policy,
            )
        )
        conv.add_messages([tool("get_weather", f"{10 + k}C")])
        assert conv.delta.extends is True and len(conv.delta.ids) < 30
    assert conv.prompt_ids == full(tok, conv.messages, [WEATHER])
    assert conv.fallbacks == []
    trajectory = Trajectory(task_id="t", turns=turns)
    assert [trajectory.prompt_ids(k) for k in range(3)] == prompts
    assert len(trajectory.segments()) == 1


def test_truncated_completion_gets_close_token_as_prompt(training_tok):
    tok = training_tok
    conv = ChatRenderer(tok).start([user("Count to three.")])
    ids = _sample(tok, conv.messages, assistant("One, two, three.", ""))
    conv.add_completion(ids[:-1], "length", message=assistant("One, two, three.", ""))
    conv.add_messages([user("Again.")])
    assert conv.delta.extends and conv.delta.ids[0] == IM_END
    assert conv.prompt_ids == full(tok, conv.messages)


def test_fallback_reasons(training_tok):
    tok = training_tok
    renderer = ChatRenderer(tok, tools=[WEATHER])

    def after_one_turn(**completion_kwargs):
        conv = renderer.start([user("hi")])
        message = assistant("hello")
        ids = completion_kwargs.pop("ids", None) or _sample(tok, conv.messages, message, [WEATHER])
        conv.add_completion(ids, message=message, **completion_kwargs)
        return conv

    conv = after_one_turn()
    conv.set_tools([WEATHER, SEARCH])
    conv.add_messages([user("now search")])
    assert conv.prompt_ids == full(tok, conv.messages, [WEATHER, SEARCH])
    assert conv.fallbacks[-1].reason is FallbackReason.KEY_CHANGED and conv.fallbacks[-1].turn == 1

    conv = after_one_turn()
    conv.add_messages(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]
    )
    assert conv.prompt_ids == full(tok, conv.messages, [WEATHER])
    assert conv.fallbacks[-1].reason is FallbackReason.MULTIMODAL

    conv = after_one_turn()
    conv.add_messages([{"role": "system", "content": "new rules"}])
    assert conv.prompt_ids == full(tok, conv.messages, [WEATHER])
    assert conv.fallbacks[-1].reason is FallbackReason.UNPROBED

    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    ids = _sample(tok, [user("hi")], assistant("hello"), [WEATHER])
    conv = after_one_turn(ids=[*ids[:-1], endoftext])
    conv.add_messages([user("more")])
    assert conv.prompt_ids == full(tok, conv.messages, [WEATHER])
    assert conv.fallbacks[-1].reason is FallbackReason.NOT_CLOSED

    # Sampled JSON with other spacing than the template writes: never re-tokenized silently.
    message = assistant(calls=[call("get_weather", {"city": "Paris"})])
    text = (
        '<think>\n\n</think>\n\n<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}'
        "\n</tool_call><|im_end|>"
    )
    conv = renderer.start([user("hi")])
    parsed = conv.add_completion(tok.encode(text, add_special_tokens=False))
    assert parsed.tool_calls == message["tool_calls"]
    conv.add_messages([tool("get_weather", "18C")])
    assert conv.prompt_ids == full(tok, conv.messages, [WEATHER])
    assert conv.fallbacks[-1].reason is FallbackReason.NONCANONICAL

    # Messages arriving twice before sampling: one delta over both, one prompt.
    conv = after_one_turn()
    conv.add_messages([user("a")])
    first = list(conv.prompt_ids)
    conv.add_messages([user("b")])
    assert conv.prompt_ids == full(tok, conv.messages, [WEATHER]) != first
    assert conv.delta.extends and conv.fallbacks == []


def test_bad_input_is_a_clear_error(tok, training_tok):
    renderer = ChatRenderer(training_tok)
    with pytest.raises(ConfigError, match="at least one message"):
        renderer.start([])
    with pytest.raises(ConfigError, match="role"):
        renderer.start([{"content": "no role"}])
    conv = renderer.start([user("hi")])
    with pytest.raises(ConfigError, match="finish_reason"):
        conv.add_completion([IM_END], "eos")
    with pytest.raises(ConfigError, match="add_completion"):
        conv.add_messages([assistant("forged")])
    llama = AutoTokenizer.from_pretrained(tok.name_or_path)
    llama.chat_template = (TEMPLATES / "llama3.jinja").read_text(encoding="utf-8")
    with pytest.raises(TokenizationError, match="bos_token"):
        ChatRenderer(llama).start([user("hi")]).render()
    llama.chat_template = None
    with pytest.raises(ConfigError, match="chat template"):
        ChatRenderer(llama)


@pytest.mark.anyio
async def test_async_render_runs_off_the_loop(training_tok):
    tok = training_tok
    renderer = ChatRenderer(tok, tools=[WEATHER])
    long_text = "lorem ipsum dolor sit amet " * 4000
    conv = renderer.start([user(long_text)])
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        prompt = await conv.arender()
        tg.cancel_scope.cancel()
    assert prompt == full(tok, [user(long_text)], [WEATHER])
    assert ticks > 0  # the loop kept running while the render was in its thread


def test_parser_round_trip_qwen3(tok):
    parser = ResponseParser.for_tokenizer(tok, tools=[WEATHER])
    assert parser.source == "trl" and parser.has_schema
    assert getattr(tok, "response_template", None) is None  # the caller's tokenizer is untouched
    history = [user("Paris and Rome?")]
    for message in (
        assistant("Both are mild.", "Compare them."),
        assistant(
            reasoning="Two calls.",
            calls=[call("get_weather", {"city": "Paris"}), call("get_weather", {"city": "Rome"})],
        ),
        assistant("Let me check.", "One call.", [call("get_weather", {"city": "Oslo"})]),
    ):
        ids = _sample(tok, history, message, [WEATHER])
        parsed = parser.parse(ids, prompt_ids=full(tok, history, [WEATHER]))
        assert not parsed.ill_formed
        # The parsed message renders back to exactly the sampled ids.
        assert _sample(tok, history, parsed.to_message(), [WEATHER]) == ids


def test_parser_prefill_and_ill_formed(tok):
    nothink = ResponseParser.for_tokenizer(tok, template_kwargs={"enable_thinking": False})
    ids = tok.encode("Just the answer.<|im_end|>", add_special_tokens=False)
    prompt = full(tok, [user("q")], enable_thinking=False)
    assert nothink.parse(ids, prompt_ids=prompt) == ParsedResponse(content="Just the answer.")
    assert nothink.parse(ids) == ParsedResponse(content="Just the answer.")
    bad = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call><|im_end|>'
    )
    parsed = ResponseParser.for_tokenizer(tok).parse(tok.encode(bad, add_special_tokens=False))
    assert parsed.ill_formed and parsed.error and "get_weather" in parsed.content
    assert parsed.to_message() == {"role": "assistant", "content": parsed.content}


def test_unknown_template_with_tools_is_a_config_error(qwen3_tokenizer_dir):
    t = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    t.chat_template = (TEMPLATES / "phi3.jinja").read_text(encoding="utf-8")
    with pytest.raises(ConfigError, match="sha256:"):
        ResponseParser.for_tokenizer(t, tools=[WEATHER])
    plain = ResponseParser.for_tokenizer(t)
    assert (
        not plain.has_schema
        and plain.parse(t.encode("hi there", add_special_tokens=False)).content == "hi there"
    )
