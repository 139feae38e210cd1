"""Many agents at once: 32 processes with their own keys, and a synchronous trainer loop."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import anyio
import openai
import pytest
from gateway_kit import gateway_stack

from plies.gateway import ThreadedGatewayServer
from plies.policy import SamplingParams, VLLMClient
from plies.tokens import ChatRenderer

AGENT = """
import os, sys, openai
client = openai.OpenAI()
marker = sys.argv[1]
messages = [{"role": "user", "content": f"I am agent {marker}."}]
for turn in range(2):
    reply = client.chat.completions.create(model="policy", messages=messages)
    messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    messages.append({"role": "user", "content": f"Agent {marker}, turn {turn + 1}."})
"""


@pytest.mark.anyio
async def test_32_agent_processes_stay_isolated(policy_server, qwen3_tokenizer):
    n = 32
    async with gateway_stack(policy_server, qwen3_tokenizer, max_tokens=4) as stack:
        keys = [await stack.gateway.create_session(f"agent-{i}") for i in range(n)]
        procs = []
        for i, key in enumerate(keys):
            env = {**os.environ, "OPENAI_BASE_URL": stack.url, "OPENAI_API_KEY": key}
            procs.append(
                await anyio.open_process(
                    [sys.executable, "-c", AGENT, f"m{i:02d}x"], env=env, stderr=subprocess.PIPE
                )
            )
        codes = []
        for proc in procs:
            async with proc:
                codes.append(await proc.wait())
                errors = await proc.stderr.receive() if codes[-1] else b""
                assert codes[-1] == 0, errors.decode()
        trajectories = [await stack.gateway.finish_session(key) for key in keys]

    answers = [a["choices"][0]["token_ids"] for a in stack.engine.answers]
    assert len(answers) == 2 * n
    recorded = []
    for i, trajectory in enumerate(trajectories):
        assert trajectory.task_id == f"agent-{i}"
        assert len(trajectory.turns) == 2
        text = " ".join(m["content"] or "" for m in trajectory.messages if m["role"] == "user")
        assert f"m{i:02d}x" in text
        assert all(f"m{j:02d}x" not in text for j in range(n) if j != i)
        for k, turn in enumerate(trajectory.turns):
            prompt = qwen3_tokenizer.decode(trajectory.prompt_ids(k))
            assert f"m{i:02d}x" in prompt
            recorded.append(turn.completion_ids)
    assert sorted(recorded) == sorted(answers)


def test_sync_loop_drives_episodes_through_threaded_gateway(policy_server, qwen3_tokenizer):
    renderer = ChatRenderer(qwen3_tokenizer)
    with ThreadedGatewayServer(
        lambda: VLLMClient(policy_server.url, policy_server.model),
        renderer,
        sampling=SamplingParams(max_tokens=4),
    ) as server:
        for episode in range(3):
            key = server.create_session(f"episode-{episode}")
            with openai.OpenAI(base_url=server.url, api_key=key, max_retries=0) as client:
                messages = [{"role": "user", "content": f"episode {episode}"}]
                for _ in range(2):
                    reply = client.chat.completions.create(model="policy", messages=messages)
                    messages += [
                        {"role": "assistant", "content": reply.choices[0].message.content},
                        {"role": "user", "content": "go on"},
                    ]
            trajectory = server.finish_session(key, reward=float(episode))
            assert len(trajectory.turns) == 2 and trajectory.reward == episode

        # The session API from another thread while a request is in flight: no deadlock.
        key = server.create_session("concurrent")
        done = threading.Event()

        def agent() -> None:
            with openai.OpenAI(base_url=server.url, api_key=key, max_retries=0) as client:
                client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "hi"}]
                )
            done.set()

        thread = threading.Thread(target=agent)
        thread.start()
        other = server.create_session("other")
        server.drop_session(other)
        thread.join(60)
        assert done.is_set()
        assert len(server.finish_session(key).turns) == 1
    with pytest.raises(Exception, match="not running"):
        server.create_session("after close")
