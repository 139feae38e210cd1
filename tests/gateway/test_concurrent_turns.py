"""Turns of one session served at once: sub-agents on their own branches, and siblings.

The recording engine holds each completion for a while and notes when each request arrived
and when its answer left, so overlap is measured on the sampler's side. Requests come from
the official `anthropic` SDK with `x-plies-branch` naming the sub-agent, as a harness
would set it.
"""

from __future__ import annotations

import anthropic
import anyio
import pytest
from gateway_kit import gateway_stack
from test_anthropic import client_for

from plies.gateway._session import MAX_TURNS_IN_FLIGHT

pytestmark = pytest.mark.anyio

HOLD_S = 1.0


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


async def test_branches_sample_at_once_and_every_record_is_exact(policy_server, qwen3_tokenizer):
    async with gateway_stack(policy_server, qwen3_tokenizer) as stack:
        key = await stack.gateway.create_session("parallel")
        client = client_for(stack, key)
        convs = {
            "main": [{"role": "user", "content": "Plan the work."}],
            "task-1": [{"role": "user", "content": "Sub-agent: read the logs."}],
            "task-2": [{"role": "user", "content": "Sub-agent: read the tests."}],
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

        await round_of(list(convs.items()))  # three new branches
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
    rounds = [[0, 1, 2], [3, 4, 5], [6, 7]]  # exchange indices: each round ends before the next
    for r, exchanges in enumerate(rounds):
        assert overlap(engine, exchanges) > HOLD_S / 2, f"round {r} was not concurrent"
    at = assert_recorded_by_answer(trajectory, engine)
    turns = trajectory.turns
    by_round = {r: sorted(k for k in at if at[k] in x) for r, x in enumerate(rounds)}
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


async def test_finishing_a_session_settles_or_cuts_off_every_turn_in_flight(
    policy_server, qwen3_tokenizer
):
    async with gateway_stack(policy_server, qwen3_tokenizer) as stack:
        errors: list[Exception] = []

        async def ask(client, text: str) -> None:
            try:
                await client.messages.create(
                    model="m", max_tokens=20, messages=[{"role": "user", "content": text}]
                )
            except Exception as exc:  # what each agent got, checked below
                errors.append(exc)

        async def two_turns_then_finish(hold_s: float):
            key = await stack.gateway.create_session(f"hold-{hold_s}")
            client = client_for(stack, key)
            async with anyio.create_task_group() as tg:
                for text in ("sub-agent 1", "sub-agent 2"):
                    ids = qwen3_tokenizer.encode(f"{text} done<|im_end|>", add_special_tokens=False)
                    stack.engine.queue(ids, delay=hold_s)
                    tg.start_soon(ask, client, text)
                while len(stack.gateway.session(key).in_flight) < 2:
                    await anyio.sleep(0.01)
                started = anyio.current_time()
                trajectory = await stack.gateway.finish_session(key)
                return trajectory, anyio.current_time() - started

        # Both finish inside settle_timeout (5 s): both are sent and recorded.
        settled, waited = await two_turns_then_finish(1.0)
        assert len(settled.turns) == 2 and not errors and waited < 4
        # Both outlast it: both are cut off, neither is recorded, each agent gets a 401.
        cut, waited = await two_turns_then_finish(8.0)
        assert cut.turns == [] and 4.5 < waited < 7.5
        assert len(errors) == 2
        assert all(isinstance(e, anthropic.AuthenticationError) for e in errors), errors


async def test_turns_in_flight_per_session_are_bounded(policy_server, qwen3_tokenizer):
    n = MAX_TURNS_IN_FLIGHT + 2
    async with gateway_stack(policy_server, qwen3_tokenizer) as stack:
        key = await stack.gateway.create_session("flood")
        client = client_for(stack, key)
        async with anyio.create_task_group() as tg:
            for i in range(n):
                ids = qwen3_tokenizer.encode(f"answer {i}<|im_end|>", add_special_tokens=False)
                stack.engine.queue(ids, delay=2.0)
                messages = [{"role": "user", "content": f"agent {i}"}]
                tg.start_soon(
                    lambda m=messages: client.messages.create(model="m", max_tokens=8, messages=m)
                )
        trajectory = await stack.gateway.finish_session(key)
    spans = stack.engine.exchanges
    most = max(sum(1 for y in spans if y.arrived <= x.arrived < y.left) for x in spans)
    assert most == MAX_TURNS_IN_FLIGHT  # the rest waited for a slot, and were then served
    assert len(trajectory.turns) == n
    assert_recorded_by_answer(trajectory, stack.engine)
