"""Every chat template TRL ships, on the offline Qwen3 tokenizer: zero silent divergences.

At every turn the renderer's prompt must equal `apply_chat_template(full history)`, reached
either incrementally or through a recorded fallback; templates that cannot render a feature
must fail with TokenizationError, and the episode adapts to what they can render.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trl
from _token_episodes import chat_episode, play, tool_episode
from transformers import AutoTokenizer

from plies.tokens import ChatRenderer

TEMPLATES = sorted((Path(trl.__file__).parent / "chat_templates").glob("*.jinja"))

# Templates whose turn close is <|im_end|>, one added token of this vocabulary: the incremental
# path must actually be taken on them somewhere in the sweep, or the test proves nothing.
MUST_EXTEND = {
    "qwen2_5",
    "qwen2_5_training",
    "qwen3",
    "qwen3_training",
    "qwen3_instruct_2507",
    "qwen3_5_think_training",
    "qwen3_6_training",
    "lfm2",
    "lfm2_v2",
    "nemotron_3_nano_training",
}


def test_trl_ships_72_templates():
    assert len(TEMPLATES) == 72


@pytest.fixture(scope="module")
def tok(qwen3_tokenizer_dir):
    # A private copy: the sweep sets chat_template on it, which must not leak into other tests.
    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.stem)
def test_template_sweep(tok, path: Path):
    tok.chat_template = path.read_text(encoding="utf-8")
    renderer = ChatRenderer(tok)
    close_id = tok.convert_tokens_to_ids("<|im_end|>")
    outcomes = {}
    tools = play(tok, renderer, tool_episode(), {}, close_id)
    outcomes["tools"] = tools
    if tools.stopped:  # some templates only take JSON-string tool arguments
        outcomes["tools_text_args"] = play(tok, renderer, tool_episode(as_text=True), {}, close_id)
    chat = play(tok, renderer, chat_episode(), {}, close_id)
    outcomes["chat"] = chat
    if chat.stopped and chat.stopped.startswith("turn 0"):  # e.g. no system role
        outcomes["chat_no_system"] = play(tok, renderer, chat_episode(system=False), {}, close_id)
    print(path.stem, outcomes)
    rendered_turns = sum(o.turns for o in outcomes.values())
    if path.stem in MUST_EXTEND:
        assert sum(o.incremental for o in outcomes.values()) > 0, outcomes
    if rendered_turns == 0:
        # Nothing past the first prompt renders: every attempt must have failed cleanly.
        assert all(o.stopped for o in outcomes.values()), outcomes
