"""`plies.testing.ScriptedPolicy` and the long-context tiny model.

Scripted answers must come out as a model would sample them: ids the real parser reads back
as the scripted message, in the template's own format. The long-context model must be the
default model with more positions, nothing else, and the default must keep its bytes.
"""

from __future__ import annotations

import json

import anyio
import pytest

from plies import ConfigError, PolicyError, testing
from plies.policy import SamplingParams
from plies.testing._models import DEFAULT_MAX_POSITIONS, build_tiny_model
from plies.testing._scripted import SCRIPTED_POLICY, render_completion
from plies.tokens import ChatRenderer

PARAMS = SamplingParams(max_tokens=256)


def test_a_scripted_answer_parses_back_to_the_scripted_message(qwen3_tokenizer):
    step = {"content": "Listing.", "tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}]}
    ids = render_completion(qwen3_tokenizer, step)
    assert ids[-1] == qwen3_tokenizer.eos_token_id
    conversation = ChatRenderer(qwen3_tokenizer, template="model").start(
        [{"role": "user", "content": "go"}], tools=None
    )
    conversation.render()
    parsed = conversation.add_completion(ids, "stop")
    assert not parsed.ill_formed
    assert parsed.content.strip() == "Listing."
    [call] = parsed.tool_calls
    assert call["function"]["name"] == "bash"
    arguments = call["function"]["arguments"]
    assert (json.loads(arguments) if isinstance(arguments, str) else arguments) == {"command": "ls"}


def test_each_session_walks_the_script_and_an_exhausted_one_is_an_error(qwen3_tokenizer):
    seen: list[str] = []

    def echo(prompt: str) -> str:
        seen.append(prompt)
        return "second"

    policy = testing.ScriptedPolicy(qwen3_tokenizer, ["first", echo])

    async def main() -> None:
        a1 = await policy.sample([1, 2, 3], PARAMS, session="a")
        b1 = await policy.sample([4], PARAMS, session="b")
        a2 = await policy.sample([1, 2, 3, 9], PARAMS, session="a")
        assert a1.ids == b1.ids == render_completion(qwen3_tokenizer, "first")
        assert a2.ids == render_completion(qwen3_tokenizer, "second")
        assert seen == [qwen3_tokenizer.decode([1, 2, 3, 9])]
        assert a1.policy == SCRIPTED_POLICY and a1.finish_reason == "stop"
        assert len(a1.logprobs) == len(a1.ids)
        assert (policy.turns("a"), policy.turns("b")) == (2, 1)
        with pytest.raises(PolicyError, match="asked for another"):
            await policy.sample([1], PARAMS, session="a")
        cut = await policy.sample([5], SamplingParams(max_tokens=1), session="c")
        assert cut.finish_reason == "length" and len(cut.ids) == 1

    anyio.run(main)
    assert [p for _, p in policy.prompts] == [[1, 2, 3], [4], [1, 2, 3, 9], [5]]


def test_a_malformed_step_is_refused_up_front(qwen3_tokenizer):
    with pytest.raises(ConfigError, match="text or"):
        testing.ScriptedPolicy(qwen3_tokenizer, [{"text": "hi"}])
    with pytest.raises(ConfigError, match="needs a name"):
        testing.ScriptedPolicy(qwen3_tokenizer, [{"tool_calls": [{"arguments": {}}]}])


def test_the_long_context_model_is_the_default_with_more_positions(tiny_model_dir, tmp_path):
    default = json.loads((tiny_model_dir / "config.json").read_text())
    assert default["max_position_embeddings"] == DEFAULT_MAX_POSITIONS == 4096
    long_dir = build_tiny_model(tmp_path / "long", max_positions=testing.LONG_MAX_POSITIONS)
    long = json.loads((long_dir / "config.json").read_text())
    assert long.pop("max_position_embeddings") == testing.LONG_MAX_POSITIONS
    default.pop("max_position_embeddings")
    assert long == default
    weights = (long_dir / "model.safetensors").read_bytes()
    assert weights == (tiny_model_dir / "model.safetensors").read_bytes()
    with pytest.raises(ConfigError, match="positive"):
        testing.tiny_model_dir(max_positions=0)
