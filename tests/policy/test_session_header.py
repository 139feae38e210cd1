"""Router affinity: every sampling request of an episode carries `X-Session-ID: <episode id>`.

A loopback engine here records the headers of every request it answers (vLLM's
`/v1/completions` and SGLang's `/generate`), so the tests see what a router in front of a
fleet would see.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import anyio
import pytest
from anyio.abc import SocketStream
from engine_wire import requests, response
from pydantic import Field

from plies import ConfigError, PolicyRef
from plies.environments import Env, Observation, Task, ToolResult, tool
from plies.harness import EpisodeLimits, ToolCallingHarness
from plies.policy import SESSION_HEADER, SamplingParams, SGLangClient, VLLMClient
from plies.runtime import EnvPool, GroupSpec, RolloutDriver, RolloutResources
from plies.tokens import ChatRenderer

pytestmark = pytest.mark.anyio

REF = PolicyRef(uri="plies://test/policies/0", version=0)
PROMPT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]


class RecordingEngine:
    """Answers every request with `ids`; records (path, headers, body) of each one."""

    def __init__(self, ids: list[int]):
        self.ids = ids
        self.requests: list[tuple[str, dict[str, str], dict[str, Any]]] = []

    def _answer(self, path: str) -> bytes:
        lps = [-0.25] * len(self.ids)
        if path == "/generate":
            body: dict[str, Any] = {
                "meta_info": {
                    "output_token_logprobs": [
                        [lp, i, None] for lp, i in zip(lps, self.ids, strict=True)
                    ],
                    "finish_reason": {"type": "stop"},
                    "weight_version": "default",
                }
            }
        else:
            body = {
                "choices": [
                    {
                        "token_ids": self.ids,
                        "logprobs": {"token_logprobs": lps},
                        "finish_reason": "stop",
                    }
                ],
                "plies_policy": REF.model_dump(mode="json"),
            }
        return response(200, json.dumps(body).encode())

    async def handle(self, stream: SocketStream) -> None:
        try:
            async for request in requests(stream):
                self.requests.append((request.path, request.headers, request.json()))
                await stream.send(self._answer(request.path))
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
        finally:
            await stream.aclose()


async def serve(engine: RecordingEngine, tg) -> str:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    tg.start_soon(listener.serve, engine.handle)
    return f"http://127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}"


async def test_vllm_and_sglang_send_the_session_as_a_header():
    engine = RecordingEngine([7, 8])
    params = SamplingParams(max_tokens=2)
    async with anyio.create_task_group() as tg:
        url = await serve(engine, tg)
        async with (
            VLLMClient(url, "policy-0", policy=REF) as vllm,
            SGLangClient(url, policy=REF) as sglang,
            VLLMClient(url, "policy-0", policy=REF, session_header=None) as silent,
            SGLangClient(url, policy=REF, session_header="X-Episode") as renamed,
        ):
            await vllm.sample(PROMPT, params, session="episode-a")
            await vllm.sample(PROMPT, params)
            await sglang.sample(PROMPT, params, session="episode-b")
            await silent.sample(PROMPT, params, session="episode-c")
            await renamed.sample(PROMPT, params, session="episode-d")
            with pytest.raises(ConfigError, match="visible ASCII"):
                await vllm.sample(PROMPT, params, session="two\r\nlines")
            with pytest.raises(ConfigError, match="visible ASCII"):
                await vllm.sample(PROMPT, params, session="")
        tg.cancel_scope.cancel()
    key = SESSION_HEADER.lower()
    seen = [(path, h.get(key), h.get("x-episode")) for path, h, _ in engine.requests]
    assert seen == [
        ("/v1/completions", "episode-a", None),
        ("/v1/completions", None, None),
        ("/generate", "episode-b", None),
        ("/v1/completions", None, None),
        ("/generate", None, "episode-d"),
    ]


class CounterEnv(Env):
    """One tool; done after `goal` calls."""

    def __init__(self, goal: int):
        super().__init__()
        self.goal, self.count = goal, 0

    async def setup(self, task: Task) -> Observation:
        return Observation(messages=[{"role": "user", "content": f"Count to {self.goal}."}])

    @tool
    async def advance(self, steps: Annotated[int, Field(ge=1, le=4)]) -> ToolResult:
        """Move the counter forward."""
        self.count += steps
        return ToolResult(content=f"at {self.count}", reward=1.0, done=self.count >= self.goal)


def tool_call_ids(renderer: ChatRenderer, tools: list[dict[str, Any]]) -> list[int]:
    """The template's own ids for one `advance` call after a tool round, close included."""
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "advance", "arguments": {"steps": 1}}}
        ],
    }
    head = [
        {"role": "user", "content": "Count to 3."},
        call,
        {"role": "tool", "name": "advance", "content": "at 1"},
    ]
    tok = renderer.tokenizer
    kw = {"tools": tools, "chat_template": renderer.chat_template, "tokenize": True}
    prompt = tok.apply_chat_template(head, add_generation_prompt=True, return_dict=False, **kw)
    ids = tok.apply_chat_template([*head, call], return_dict=False, **kw)
    close = tok.convert_tokens_to_ids("<|im_end|>")
    return ids[len(prompt) : ids.index(close, len(prompt)) + 1]


async def test_every_request_of_a_harness_episode_carries_its_episode_id(qwen3_tokenizer):
    renderer = ChatRenderer(qwen3_tokenizer)
    tools = [t.schema() for t in CounterEnv(1).tools()]
    engine = RecordingEngine(tool_call_ids(renderer, tools))
    goal, episodes = 3, 6
    async with anyio.create_task_group() as tg:
        url = await serve(engine, tg)
        async with VLLMClient(url, "policy-0", policy=REF) as client:
            harness = ToolCallingHarness(
                renderer, client, SamplingParams(max_tokens=32), limits=EpisodeLimits(max_turns=5)
            )

            async def make_env() -> CounterEnv:
                return CounterEnv(goal)

            async with (
                RolloutResources(sampler=client, pools=[EnvPool(make_env)]) as res,
                RolloutDriver(res, harness.play, policy=REF) as driver,
            ):
                await driver.admit(GroupSpec("count", size=episodes, task=Task(id="count")))
                driver.close_admission()
                groups = [g async for g in driver.groups()]
        tg.cancel_scope.cancel()
    trajectories = groups[0].trajectories
    assert [t.status.value for t in trajectories] == ["completed"] * episodes
    by_session: dict[str | None, list[list[int]]] = {}
    for _, headers, body in engine.requests:
        by_session.setdefault(headers.get(SESSION_HEADER.lower()), []).append(body["prompt"])
    assert set(by_session) == {t.id for t in trajectories}
    for traj in trajectories:
        # The k-th request that names the episode sent exactly that episode's k-th prompt.
        sent = by_session[traj.id]
        assert sent == [traj.prompt_ids(k) for k in range(len(traj.turns))]
        assert len(sent) == goal
