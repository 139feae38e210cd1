"""Every branch kept: scripted traffic where the history forks, each sampled token trained once."""

from __future__ import annotations

import pytest
from gateway_kit import gateway_stack
from test_anthropic import client_for

pytestmark = pytest.mark.anyio


async def test_subagents_retry_auxiliary_and_compaction_each_token_trained_once(
    policy_server, qwen3_tokenizer
):
    async with gateway_stack(policy_server, qwen3_tokenizer) as stack:
        key = await stack.gateway.create_session("tree")
        client = client_for(stack, key)

        async def ask(messages, **extra):
            text = f"r{len(stack.engine.answers)}<|im_end|>"  # no reasoning: Qwen3 keeps history
            stack.engine.queue(qwen3_tokenizer.encode(text, add_special_tokens=False))
            reply = await client.messages.create(
                model="m", max_tokens=20, messages=messages, **extra
            )
            return reply.content[-1].text

        # An auxiliary title call first (structured output), then the main agent.
        fmt = {"format": {"type": "json_schema", "schema": {"type": "object"}}}
        await ask([{"role": "user", "content": "title?"}], extra_body={"output_config": fmt})
        main = [{"role": "user", "content": "main task"}]
        subs = [[{"role": "user", "content": f"sub-agent {i}"}] for i in range(3)]
        for conv in [main, *subs]:  # four branches, interleaved turn by turn
            conv += [{"role": "assistant", "content": await ask(conv)}]
        for conv in subs:
            conv += [{"role": "user", "content": "go on"}]
            conv += [{"role": "assistant", "content": await ask(conv)}]
        main += [{"role": "user", "content": "finish"}]
        await ask(main)
        await ask(main)  # the final call retried: a sibling
        await ask([{"role": "user", "content": "summary of it all"}])  # compaction
        trajectory = await stack.gateway.finish_session(key, reward=1.0)

    turns = trajectory.turns
    assert len(turns) == 11
    assert turns[0].auxiliary and not any(t.auxiliary for t in turns[1:])
    assert turns[9].fallback == "retried" and not turns[9].extends
    assert turns[10].fallback == "history_edited"
    # Sub-agent turns 5-7 extend their own branch's turns 2-4, not the turn before them.
    assert [t.parent for t in turns[5:8]] == [2, 3, 4]
    assert turns[8].parent == 1
    segments = trajectory.segments()
    trained = sorted(tok for s in segments for tok, m in zip(s.tokens, s.mask, strict=True) if m)
    sampled = sorted(tok for t in turns[1:] for tok in t.completion_ids)
    assert trained == sampled  # every non-auxiliary sampled token exactly once
    for k in range(len(turns)):
        assert trajectory.prompt_ids(k) == stack.engine.requests[k]["prompt"]
