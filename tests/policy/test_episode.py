"""A multi-turn episode rendered with ChatRenderer and sampled through the policy client."""

from __future__ import annotations

import pytest
from counting_episode import check_recorded, play_counting
from transformers import AutoTokenizer

from plies import PolicyRef
from plies.policy import SamplingParams, Timeout, VLLMClient

pytestmark = pytest.mark.anyio


async def test_every_turn_is_recorded_exactly_as_sampled(
    policy_server, tiny_model_dir, forward_logprobs
):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    async with VLLMClient(policy_server.url, policy_server.model, timeout=Timeout(read=60)) as c:

        async def params(turn: int, prompt: list[int]) -> SamplingParams:
            # Turn 2 stops on the token it samples first, so both finish reasons occur.
            stops = (im_end,)
            if turn == 2:
                probe = await c.sample(prompt, SamplingParams(max_tokens=1, temperature=0))
                stops += tuple(probe.ids)
            return SamplingParams(
                max_tokens=6, temperature=0 if turn == 2 else 0.9, seed=turn, stop_token_ids=stops
            )

        episode = await play_counting(c, tokenizer, 4, params)

    answers = episode.answers
    assert [a.finish_reason for a in answers] == ["length", "length", "stop", "length"]
    assert answers[2].ids[-1] in answers[2].ids[:1]  # the stop token is kept
    restored = check_recorded(episode, tiny_model_dir, forward_logprobs, [0.9, 0.9, 0, 0.9])
    v0 = PolicyRef.model_validate(policy_server.policy)
    assert all(turn.policy == v0 for turn in restored.turns)
    # Turn 2 stopped on an ordinary token, not the template's close token, so the renderer
    # re-renders turn 3 in full. Any other fallback (a sampled token sequence that is not
    # canonical, say) is reported too, and starts a new training segment.
    fell_back = {f.turn: f.reason.value for f in episode.conv.fallbacks}
    assert fell_back[3] == "completion_not_closed"
    assert restored.segments()[-1].tokens == episode.sent[-1] + answers[-1].ids
