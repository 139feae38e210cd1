"""A multi-turn episode rendered with ChatRenderer and sampled through the policy client."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from plies import PolicyRef, Trajectory, Turn
from plies.policy import SamplingParams, Timeout, VLLMClient
from plies.tokens import ChatRenderer

pytestmark = pytest.mark.anyio


async def test_every_turn_is_recorded_exactly_as_sampled(
    policy_server, tiny_model_dir, forward_logprobs
):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    renderer = ChatRenderer(tokenizer)
    conv = renderer.start([{"role": "user", "content": "Let us count: 1"}])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    trajectory = Trajectory(task_id="count")
    sent: list[list[int]] = []
    answers = []
    async with VLLMClient(policy_server.url, policy_server.model, timeout=Timeout(read=60)) as c:
        for turn in range(4):
            prompt = list(await conv.arender())  # the conversation extends its own list
            delta = conv.delta
            # Turn 2 stops on the token it samples first, so both finish reasons occur.
            stops = (im_end,)
            if turn == 2:
                probe = await c.sample(prompt, SamplingParams(max_tokens=1, temperature=0))
                stops += tuple(probe.ids)
            params = SamplingParams(
                max_tokens=6, temperature=0 if turn == 2 else 0.9, seed=turn, stop_token_ids=stops
            )
            answer = await c.sample(prompt, params, session=trajectory.id)
            sent.append(prompt)
            answers.append(answer)
            trajectory.turns.append(Turn.from_completion(delta, answer))
            conv.add_completion(answer.ids, answer.finish_reason)
            conv.add_messages([{"role": "user", "content": str(turn + 2)}])

    assert [a.finish_reason for a in answers] == ["length", "length", "stop", "length"]
    assert answers[2].ids[-1] in answers[2].ids[:1]  # the stop token is kept
    v0 = PolicyRef.model_validate(policy_server.policy)
    restored = Trajectory.model_validate_json(trajectory.model_dump_json())
    for k, (prompt, answer) in enumerate(zip(sent, answers, strict=True)):
        assert restored.turns[k].policy == v0
        assert restored.prompt_ids(k) == prompt
        assert restored.turns[k].completion_ids == answer.ids
        assert restored.turns[k].logprobs == answer.logprobs
        temperature = 0 if k == 2 else 0.9
        expected = forward_logprobs(tiny_model_dir, prompt, answer.ids, temperature)
        assert max(abs(a - b) for a, b in zip(answer.logprobs, expected, strict=True)) < 1e-4
    # Turn 2 stopped on an ordinary token, not the template's close token, so the renderer
    # re-renders turn 3 in full. Any other fallback (a sampled token sequence that is not
    # canonical, say) is reported too. A turn extends the previous one unless it fell back,
    # and each fallback starts a new training segment; every sampled number is kept.
    fell_back = {f.turn: f.reason.value for f in conv.fallbacks}
    assert fell_back[3] == "completion_not_closed"
    assert [t.extends for t in restored.turns] == [k > 0 and k not in fell_back for k in range(4)]
    segments = restored.segments()
    assert len(segments) == 1 + len(fell_back)
    sampled = [lp for s in segments for lp, m in zip(s.logprobs, s.mask, strict=True) if m]
    assert sampled == [lp for a in answers for lp in a.logprobs]
    assert segments[-1].tokens == sent[-1] + answers[-1].ids
