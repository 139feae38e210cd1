"""Tokenizing only a render's tail gives the ids the whole render has, or is not done.

The incremental step and the full renders of a probed key tokenize only what follows the last
cut (`plies.tokens._probe.Split`) they share with the probe's context; these tests hold that
to `apply_chat_template` on the offline Qwen3 tokenizer, with content that tries to break the
cut (control-token text, whitespace around the markers, text that is not NFC), and check that
a vocabulary whose added tokens could overlap the marker gets no cut there.
"""

from __future__ import annotations

from pathlib import Path

import _token_episodes
import pytest
import trl
from _token_episodes import SEARCH, SYSTEM, WEATHER, assistant, call, play, tool, tool_episode, user
from transformers import AutoTokenizer

from plies.tokens import ChatRenderer

TEMPLATES = Path(trl.__file__).parent / "chat_templates"
IM_END = 151645

TRICKY = [
    "plain",
    "<|im_end|>\n<|im_start|>assistant\n",  # control tokens' text inside a tool result
    "  leading and trailing  \n\n",
    "e\u0301 ca\u0301fe\u0301 \u212b",  # decomposed accents and the angstrom sign: not NFC
    "<tool_call>\n{}\n</tool_call>",
    "\n",
    "assistant",
    "\U0001f600 emoji, tabs\tand CRLF\r\n",
]


def _tok(qwen3_tokenizer_dir: Path, *added: str):
    t = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    t.chat_template = (TEMPLATES / "qwen3_training.jinja").read_text(encoding="utf-8")
    if added:
        t.add_tokens(list(added))
    return t


def _full(tok, messages, tools=None, generation_prompt=True):
    """The whole render, control-token text in content encoded as plain text (docs/tito.md)."""
    return _token_episodes.full_render(
        tok, messages, tools, generation_prompt, sanitize_control_tokens=True
    )


def _sample(tok, history, message, tools=None) -> list[int]:
    """What a model trained on the template samples for `message`: through the close token."""
    prompt = _full(tok, history, tools)
    rendered = _full(tok, [*history, message], tools, generation_prompt=False)
    return rendered[len(prompt) : rendered.index(IM_END, len(prompt)) + 1]


def _probed(renderer: ChatRenderer, opening, tools):
    """A conversation one tool round in: its key has been probed."""
    conv = renderer.start(opening, tools=tools)
    message = assistant(calls=[call("get_weather", {"city": "Oslo"})])
    conv.add_completion(_sample(renderer.tokenizer, opening, message, tools), message=message)
    conv.add_messages([tool("get_weather", "4C")])
    conv.render()
    profile = renderer.probed(conv._template)
    assert profile is not None
    return conv, profile


@pytest.fixture(scope="module")
def tok(qwen3_tokenizer_dir):
    return _tok(qwen3_tokenizer_dir)


def test_the_cut_follows_the_system_message(tok):
    """The last cut is the context's generation prompt: a turn never tokenizes the system
    message or the tool schemas again, however long they are."""
    long_system = {"role": "system", "content": "Rules. " * 2000}
    renderer = ChatRenderer(tok)
    _, profile = _probed(renderer, [long_system, user("Weather in Oslo?")], [WEATHER, SEARCH])
    last = profile.splits[0]
    assert last.prefix.endswith("<|im_start|>")
    assert len(profile.context_text) - last.at < 40 < len(long_system["content"]) < last.at
    assert (
        list(profile.context_prompt[: last.ids_before])
        == _full(tok, [long_system, user("Plies probe question.")], [WEATHER, SEARCH])[
            : last.ids_before
        ]
    )


@pytest.mark.parametrize("content", TRICKY, ids=range(len(TRICKY)))
def test_tail_ids_equal_the_whole_render(tok, content):
    renderer = ChatRenderer(tok)
    conv, profile = _probed(renderer, [SYSTEM, user("Weather in Oslo?")], [WEATHER])
    # A render of this key, cut where it shares the context's text, tokenizes as a whole.
    template = conv._template
    for messages in (
        [SYSTEM, user(content)],
        [SYSTEM, user("q"), assistant(content), tool("get_weather", content)],
        [*profile.context, assistant(content), user(content)],
    ):
        text = template.text_of(messages, generation_prompt=True)
        assert profile.encode_render(template, text) == _full(tok, messages, [WEATHER])
    # The incremental step with that content, every turn checked against the full render.
    for k in range(3):
        message = assistant(content, calls=[call("get_weather", {"city": content})])
        ids = _sample(tok, conv.messages, message, [WEATHER])
        conv.add_completion(ids, message=message)
        conv.add_messages([tool("get_weather", content), user(content)][: 1 + k % 2])
        assert conv.prompt_ids == _full(tok, conv.messages, [WEATHER]), (k, conv.delta)
    # A new conversation of the probed key: its first render reuses the context's ids.
    fresh = renderer.start([SYSTEM, user(content)], tools=[WEATHER])
    assert fresh.render() == _full(tok, [SYSTEM, user(content)], [WEATHER])


def test_no_cut_where_an_added_token_could_overlap_the_marker(qwen3_tokenizer_dir):
    """An added token that contains `<|im_start|>` (or ends where it begins) could match
    across a cut there, so no cut is made at that marker; with every marker of the context
    overlapped there is no cut at all and every render is tokenized whole, still exact."""
    partly = _tok(qwen3_tokenizer_dir, "\n<|im_start|>")
    renderer = ChatRenderer(partly)
    _, profile = _probed(renderer, [SYSTEM, user("Weather in Oslo?")], [WEATHER])
    assert profile.splits and not any(s.prefix.endswith("<|im_start|>") for s in profile.splits)
    out = play(partly, renderer, tool_episode(), {}, IM_END)
    assert out.stopped is None and out.needless == {} and out.incremental > 0

    overlapped = _tok(qwen3_tokenizer_dir, "\n<|im_start|>", "!<|im_end|>")
    renderer = ChatRenderer(overlapped)
    conv = renderer.start([user("hi")])
    for k in range(3):
        message = assistant(f"answer {k}")
        conv.add_completion(_sample(overlapped, conv.messages, message), message=message)
        conv.add_messages([user(f"more {k}!")])
        assert conv.prompt_ids == _full(overlapped, conv.messages)
        assert conv.delta.extends and conv.delta.fallback is None
    profile = renderer.probed(conv._template)
    assert profile is not None and profile.splits == ()


def test_truncation_left_on_the_shared_tokenizer_does_not_cut_a_prompt(qwen3_tokenizer_dir):
    """Calling the tokenizer with truncation (or padding) leaves that set on its backend until
    the next call; the renderer's own tokenizing must not inherit it."""
    t = _tok(qwen3_tokenizer_dir)
    renderer = ChatRenderer(t)
    conv, _ = _probed(renderer, [SYSTEM, user("Weather in Oslo?")], [WEATHER])
    settings = ({"truncation": True, "max_length": 2}, {"padding": "max_length", "max_length": 64})
    for k, setting in enumerate(settings):
        message = assistant(calls=[call("get_weather", {"city": f"city {k}"})])
        ids = _sample(t, conv.messages, message, [WEATHER])
        t("elsewhere in the program", **setting)  # after _sample: a full render resets it
        assert t.backend_tokenizer.truncation is not None or t.backend_tokenizer.padding
        conv.add_completion(ids, message=message)
        conv.add_messages([tool("get_weather", "a long result that truncation would cut " * 4)])
        got = list(conv.prompt_ids)
        assert conv.delta.fallback is None
        assert got == _full(t, conv.messages, [WEATHER])
