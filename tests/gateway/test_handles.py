"""Thinking handles read back: a replayed signature or reasoning item restores that turn's ids.

A request that branches off an earlier turn (no live tip matches) and replays that turn's
thinking with the handle the gateway minted goes on from the stored prompt and sampled ids
(`Turn.extends`, `Turn.parent`), with no full render; a handle the session did not mint, or
one on an altered turn, is a new branch with its reason; a turn replayed without its thinking
is a new branch too (`thinking_dropped`). Requests come from the official `anthropic` and
`openai` SDKs, shaped as Claude Code and Codex send them.
"""

from __future__ import annotations

import pytest
from gateway_kit import gateway_stack
from test_anthropic import BASH, client_for, think_ids
from test_gateway_http import assert_recorded_exactly
from test_responses import CODEX, TOOLS

pytestmark = pytest.mark.anyio


def thinking_call(tokenizer, thought: str, name: str, arguments: str) -> list[int]:
    """A thought, then a tool call, as the Qwen3 template writes them."""
    text = (
        f"<think>\n{thought}\n</think>\n\n<tool_call>\n"
        f'{{"name": "{name}", "arguments": {arguments}}}\n</tool_call><|im_end|>'
    )
    return tokenizer.encode(text, add_special_tokens=False)


def result(use_id: str, content: str) -> dict:
    return {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": use_id, "content": content}],
    }


def contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


async def test_a_replayed_signature_restores_the_sampled_ids_of_an_earlier_turn(
    policy_server, qwen3_tokenizer
):
    async with gateway_stack(policy_server, qwen3_tokenizer, max_tokens=64) as stack:
        key = await stack.gateway.create_session("replay")
        client = client_for(stack, key)

        async def ask(messages):
            return await client.messages.create(
                model="m", max_tokens=64, messages=messages, tools=[BASH], system="Be brief."
            )

        task = [{"role": "user", "content": "List the files."}]
        stack.engine.queue(
            thinking_call(qwen3_tokenizer, "look first", "Bash", '{"command": "ls"}')
        )
        first = await ask(task)
        thinking, use = first.content
        assert thinking.signature.startswith("plies-turn-")
        replay = {"role": "assistant", "content": [b.model_dump() for b in first.content]}

        stack.engine.queue(think_ids(qwen3_tokenizer, "ok", "a.txt"))
        await ask([*task, replay, result(use.id, "a.txt")])
        # The agent goes back to the first turn (a retry of the tool, a sub-agent forked
        # there): no live tip matches, the signature names turn 0, its ids are restored.
        forked = [*task, replay, result(use.id, "b.txt")]
        counted = await client.messages.count_tokens(
            model="m", messages=forked, tools=[BASH], system="Be brief."
        )
        stack.engine.queue(think_ids(qwen3_tokenizer, "ok", "b.txt"))
        third = await ask(forked)
        # Forked there again, but the user speaks: Qwen3's template drops the turn's
        # thinking, so the restored turn is rendered as the model will see it.
        stack.engine.queue(think_ids(qwen3_tokenizer, "ok", "stopped"))
        await ask([*task, replay, {"role": "user", "content": "Stop."}])
        trajectory = await stack.gateway.finish_session(key)

    first_prompt, sampled = stack.engine.requests[0]["prompt"], stack.engine.sampled(0)[0]
    prompt = stack.engine.requests[2]["prompt"]
    assert prompt[: len(first_prompt) + len(sampled)] == first_prompt + sampled
    assert counted.input_tokens == len(prompt)
    assert third.usage.cache_read_input_tokens == len(first_prompt) + len(sampled)
    turn = trajectory.turns[2]
    assert turn.extends and turn.parent == 0 and turn.fallback is None
    assert [t.fallback for t in trajectory.turns] == [None, None, None, "reasoning_stripped"]
    assert_recorded_exactly(trajectory, stack.engine)
    assert "look first" not in qwen3_tokenizer.decode(trajectory.prompt_ids(3))
    # Both siblings train turn 0's tokens once: in the first segment only.
    trained = [t for s in trajectory.segments() for t, m in zip(s.tokens, s.mask, strict=True) if m]
    assert sorted(trained) == sorted(t for turn in trajectory.turns for t in turn.completion_ids)


async def test_forged_tampered_and_foreign_handles_start_recorded_branches(
    policy_server, qwen3_tokenizer
):
    async with gateway_stack(policy_server, qwen3_tokenizer, max_tokens=64) as stack:
        key = await stack.gateway.create_session("main")
        other = await stack.gateway.create_session("other")
        client, other_client = client_for(stack, key), client_for(stack, other)
        task = [{"role": "user", "content": "List the files."}]

        async def ask(messages, on=client):
            stack.engine.queue(
                thinking_call(qwen3_tokenizer, "look first", "Bash", '{"command": "ls"}')
            )
            return await on.messages.create(
                model="m", max_tokens=64, messages=messages, tools=[BASH]
            )

        first = await ask(task)
        foreign = (await ask(task, on=other_client)).content[0].signature
        thinking, use = (b.model_dump() for b in first.content)

        def replayed(thought: dict) -> list[dict]:
            return [*task, {"role": "assistant", "content": [thought, use]}, result(use["id"], "a")]

        cases = {
            "made up": {**thinking, "signature": "plies-turn-" + "A" * 24},
            "altered": {**thinking, "signature": thinking["signature"][:-2] + "xx"},
            "another session's": {**thinking, "signature": foreign},
            "thinking edited": {**thinking, "thinking": "look second"},
            "genuine": thinking,
        }
        replies = {}
        for name, thought in cases.items():
            replies[name] = await ask(replayed(thought))
            assert replies[name].stop_reason == "tool_use"  # served, never an error
        # The agent goes on along its made-up branch: that branch is extended as usual (the
        # forged block is now history the gateway rendered from text, not a turn it sampled).
        made_up = replies["made up"]
        reply = {"role": "assistant", "content": [b.model_dump() for b in made_up.content]}
        await ask([*replayed(cases["made up"]), reply, result(made_up.content[1].id, "b")])
        trajectory = await stack.gateway.finish_session(key)

    turns = trajectory.turns
    reasons = ["unknown_handle"] * 3 + ["handle_mismatch"]
    assert [t.fallback for t in turns[1:5]] == reasons
    assert not any(t.extends for t in turns[1:5])
    assert turns[5].fallback is None and turns[5].extends and turns[5].parent == 0
    assert turns[6].fallback is None and turns[6].extends and turns[6].parent == 1
    assert trajectory.metrics["fallback.unknown_handle"] == 3
    assert trajectory.metrics["fallback.handle_mismatch"] == 1
    engine = stack.engine
    answered = (0, 2, 3, 4, 5, 6, 7)  # answer 1 went to the other session
    assert [t.completion_ids for t in turns] == [engine.sampled(n)[0] for n in answered]
    for k, n in enumerate(answered):
        assert trajectory.prompt_ids(k) == engine.requests[n]["prompt"]
    # What an untrusted branch rendered is what the agent sent, thinking as written.
    assert "look second" in qwen3_tokenizer.decode(trajectory.prompt_ids(4))


async def test_dropped_thinking_is_a_branch_with_a_reason(policy_server, qwen3_tokenizer):
    async with gateway_stack(policy_server, qwen3_tokenizer, max_tokens=64) as stack:
        key = await stack.gateway.create_session("dropped")
        client = client_for(stack, key)

        async def ask(messages):
            return await client.messages.create(
                model="m", max_tokens=64, messages=messages, tools=[BASH]
            )

        messages = [{"role": "user", "content": "List the files."}]
        stack.engine.queue(
            thinking_call(qwen3_tokenizer, "look first", "Bash", '{"command": "ls"}')
        )
        first = await ask(messages)
        messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]}]
        messages += [result(first.content[1].id, "a.txt")]
        stack.engine.queue(think_ids(qwen3_tokenizer, "one file", "a.txt"))
        second = await ask(messages)
        messages += [{"role": "assistant", "content": [b.model_dump() for b in second.content]}]
        # Claude Code keeps the thinking of the turns since the last user message and drops
        # it from older ones once the user speaks again.
        for m in messages:
            if m["role"] == "assistant":
                m["content"] = [b for b in m["content"] if b["type"] != "thinking"]
        messages += [{"role": "user", "content": "Thanks."}]
        stack.engine.queue(think_ids(qwen3_tokenizer, "bye", "Bye."))
        await ask(messages)
        trajectory = await stack.gateway.finish_session(key)

    assert [t.fallback for t in trajectory.turns] == [None, None, "thinking_dropped"]
    assert [t.extends for t in trajectory.turns] == [False, True, False]
    assert trajectory.metrics["fallback.thinking_dropped"] == 1
    assert_recorded_exactly(trajectory, stack.engine)
    last = qwen3_tokenizer.decode(trajectory.prompt_ids(2))
    assert "look first" not in last and "one file" not in last  # what the model saw


async def test_reasoning_items_restore_by_encrypted_content_or_id(policy_server, qwen3_tokenizer):
    async with gateway_stack(policy_server, qwen3_tokenizer, max_tokens=64) as stack:
        key = await stack.gateway.create_session("codex")
        client = stack.client(key)
        items: list[dict] = [
            {"type": "message", "role": "developer", "content": "You are Codex."},
            {"role": "user", "content": "Write a file."},
        ]

        async def run(input_items):
            return await client.responses.create(
                model="codex", input=input_items, tools=TOOLS, **CODEX
            )

        stack.engine.queue(
            thinking_call(qwen3_tokenizer, "use the shell", "exec_command", '{"cmd": "touch a"}')
        )
        first = await run(items)
        reasoning, call = (o.model_dump(exclude_none=True) for o in first.output)
        assert reasoning["id"] == "rs_" + reasoning["encrypted_content"]

        def then(thought: dict | None, output: str) -> list[dict]:
            echoed = [thought, call] if thought is not None else [call]
            return [
                *items,
                *echoed,
                {"type": "function_call_output", "call_id": call["call_id"], "output": output},
            ]

        without_sealed = {k: v for k, v in reasoning.items() if k != "encrypted_content"}
        forged = {**reasoning, "encrypted_content": "plies-turn-forged", "id": "rs_forged"}
        for thought, output in [
            (reasoning, "ok"),  # extends the live tip
            (without_sealed, "retry"),  # the id alone names turn 0: restored, a sibling
            (forged, "forged"),
            (None, "dropped"),  # the reasoning item left out
        ]:
            stack.engine.queue(think_ids(qwen3_tokenizer, "done", f"Wrote {output}."))
            reply = await run(then(thought, output))
            assert reply.output_text == f"Wrote {output}."
        trajectory = await stack.gateway.finish_session(key)

    turns = trajectory.turns
    assert [t.fallback for t in turns] == [None, None, None, "unknown_handle", "thinking_dropped"]
    assert [t.parent for t in turns[1:3]] == [0, 0] and turns[1].extends and turns[2].extends
    first_prompt, sampled = stack.engine.requests[0]["prompt"], stack.engine.sampled(0)[0]
    assert contains(stack.engine.requests[2]["prompt"], sampled)
    assert stack.engine.requests[2]["prompt"][: len(first_prompt)] == first_prompt
    assert not contains(stack.engine.requests[4]["prompt"], sampled)
    assert_recorded_exactly(trajectory, stack.engine)
