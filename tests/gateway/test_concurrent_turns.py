"""Turns of one session served at once: sub-agents on their own branches, and siblings.

The recording engine holds each completion for a while and notes when each request arrived
and when its answer left, so overlap is measured on the sampler's side. Requests come from
the official `anthropic` SDK with `x-plies-branch` naming the sub-agent, as a harness
would set it.
"""

from __future__ import annotations

import anyio
import pytest
from conftest import gateway_stack
from test_anthropic import client_for

pytestmark = pytest.mark.anyio

HOLD_S = 0.5


def assert_recorded_by_answer(trajectory, engine) -> dict[int, int]:
    """Each turn holds one engine answer exactly, prompted with that request's prompt;
    returns turn index -> exchange index (turns commit in the order replies go out)."""
    assert len(trajectory.turns) == len(engine.exchanges)
    found = {}
    for k, turn in enumerate(trajectory.turns):
        (n,) = [i for i, x in enumerate(engine.exchanges) if x.ids == turn.completion_ids]
        assert turn.logprobs == engine.exchanges[n].logprobs
        assert trajectory.prompt_ids(k) == engine.exchanges[n].prompt
        found[k] = n
    assert sorted(found.values()) == list(range(len(engine.exchanges)))
    return found


def overlap(engine, rounds: list[int]) -> float:
    """Seconds during which all of these exchanges were being sampled at once."""
    spans = [engine.exchanges[i] for i in rounds]
    return min(x.left for x in spans) - max(x.arrived for x in spans)


async def test_two_branches_sample_at_once_and_both_records_are_exact(
    policy_server, qwen3_tokenizer
):
    async with gateway_stack(policy_server, qwen3_tokenizer) as stack:
        key = await stack.gateway.create_session("parallel")
        client = client_for(stack, key)
        convs = {
            "main": [{"role": "user", "content": "Plan the work."}],
            "task-1": [{"role": "user", "content": "Sub-agent: read the logs."}],
        }
        n = 0

        async def ask(branch: str, messages: list[dict]) -> None:
            nonlocal n
            n += 1
            text = f"reply {n}<|im_end|>"
            stack.engine.queue(qwen3_tokenizer.encode(text, add_special_tokens=False), delay=HOLD_S)
            reply = await client.messages.create(
                model="m",
                max_tokens=20,
                messages=messages,
                extra_headers={"x-plies-branch": branch},
            )
            messages.append({"role": "assistant", "content": reply.content[-1].text})

        async def round_of(asks: list[tuple[str, list[dict]]]) -> None:
            async with anyio.create_task_group() as tg:
                for branch, messages in asks:
                    tg.start_soon(ask, branch, messages)

        await round_of(list(convs.items()))  # two new branches
        for conv in convs.values():
            conv.append({"role": "user", "content": "Go on."})
        await round_of(list(convs.items()))  # each extends its own tip
        # Two siblings of one tip at once: one takes the tip, the other is restored from
        # the stored ids of the same turn.
        main = convs["main"]
        siblings = [[*main, {"role": "user", "content": f"Option {c}."}] for c in "AB"]
        await round_of([("main", s) for s in siblings])
        trajectory = await stack.gateway.finish_session(key, reward=1.0)

    engine = stack.engine
    for i in range(0, 6, 2):
        assert overlap(engine, [i, i + 1]) > HOLD_S / 2, f"round {i // 2} was not concurrent"
    at = assert_recorded_by_answer(trajectory, engine)
    turns = trajectory.turns
    by_round = {r: sorted(k for k in at if at[k] // 2 == r) for r in range(3)}
    for k in by_round[0]:
        assert not turns[k].extends and turns[k].fallback is None
    for k in by_round[1]:
        (parent,) = [j for j in by_round[0] if turns[j].branch == turns[k].branch]
        assert turns[k].extends and turns[k].parent == parent
    (main_tip,) = [k for k in by_round[1] if turns[k].branch == "main"]
    for k in by_round[2]:
        assert turns[k].extends and turns[k].parent == main_tip
    trained = sorted(
        t for s in trajectory.segments() for t, m in zip(s.tokens, s.mask, strict=True) if m
    )
    assert trained == sorted(t for turn in turns for t in turn.completion_ids)
