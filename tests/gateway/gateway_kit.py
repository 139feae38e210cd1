"""Gateway fixtures: a recording engine in front of the reference policy server.

The reference server comes from the `policy_server` fixture of tests/conftest.py. The
recording engine is a real HTTP server speaking the vLLM completions subset. It
forwards each request to the reference server and records the exact answer, unless a test
queued a scripted completion: the tiny model writes random text, so tool-call answers are
scripted with the chat template's own tokens. Either way, tests compare the gateway's
trajectory against exactly what the engine answered.
"""

from __future__ import annotations

import json
import socket
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import openai
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from plies.gateway import Gateway, GatewayServer
from plies.policy import SamplingParams, VLLMClient
from plies.tokens import ChatRenderer

SCRIPTED_POLICY = {"uri": "file:///scripted-engine", "version": 0, "digest": ""}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "hit",
            "description": "Take another card.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "bet",
            "description": "Raise the bet.",
            "parameters": {
                "type": "object",
                "properties": {"amount": {"type": "integer"}},
                "required": ["amount"],
            },
        },
    },
]


@dataclass
class Exchange:
    """One request the engine answered: the prompt, the sampled ids and logprobs, and when
    it arrived and when its answer left (monotonic seconds)."""

    prompt: list[int]
    ids: list[int]
    logprobs: list[float]
    arrived: float
    left: float


@dataclass
class Engine:
    """What the recording engine answered, and the completions queued for it to script."""

    url: str = ""
    script: deque[tuple[list[int], str, float, float]] = field(default_factory=deque)
    requests: list[dict[str, Any]] = field(default_factory=list)
    answers: list[dict[str, Any]] = field(default_factory=list)
    exchanges: list[Exchange] = field(default_factory=list)
    """Each answered request with its answer and when it was served, in answering order
    (`requests` and `answers` are each in their own order, which concurrent requests
    can make differ)."""

    chunks_sent: list[float] = field(default_factory=list)
    """When each streamed chunk left (monotonic seconds), across all streamed answers."""

    def queue(
        self, ids: list[int], finish: str = "stop", delay: float = 0.0, pace: float = 0.0
    ) -> None:
        """Script the next answer: sent after `delay` s; streamed, `pace` s between chunks."""
        self.script.append((ids, finish, delay, pace))

    def sampled(self, k: int) -> tuple[list[int], list[float]]:
        choice = self.answers[k]["choices"][0]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"]


@asynccontextmanager
async def serve_app(app: Any) -> AsyncIterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: server.serve(sockets=[sock]))
        while not server.started:
            await anyio.sleep(0.01)
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            server.should_exit = True


STREAM_RUN = 3
"""Ids per chunk when the recording engine streams an answer (vLLM sends one per step)."""


async def _chunks(answer: dict[str, Any], engine: Engine, pace: float) -> AsyncIterator[bytes]:
    """A whole answer as vLLM streams one: runs of ids with their logprobs, the finish and
    the policy in a last chunk, then `[DONE]`."""
    choice = answer["choices"][0]
    ids, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    for i in range(0, len(ids), STREAM_RUN):
        run = {"token_ids": ids[i : i + STREAM_RUN], "finish_reason": None}
        run["logprobs"] = {"token_logprobs": logprobs[i : i + STREAM_RUN]}
        yield b"data: " + json.dumps({"choices": [run]}).encode() + b"\n\n"
        engine.chunks_sent.append(time.monotonic())
        await anyio.sleep(pace)
    last = {"token_ids": [], "logprobs": None, "finish_reason": choice["finish_reason"]}
    record = {"choices": [last], "plies_policy": answer.get("plies_policy")}
    yield b"data: " + json.dumps(record).encode() + b"\n\ndata: [DONE]\n\n"


@asynccontextmanager
async def recording_engine(upstream: str) -> AsyncIterator[Engine]:
    engine = Engine()
    async with httpx.AsyncClient(base_url=upstream, timeout=120) as client:

        async def completions(request: Request) -> JSONResponse:
            arrived = time.monotonic()
            body = await request.json()
            engine.requests.append(body)
            pace = 0.0
            if engine.script:
                ids, finish, delay, pace = engine.script.popleft()
                await anyio.sleep(delay)
                answer = {
                    "choices": [
                        {
                            "token_ids": ids,
                            "finish_reason": finish,
                            "logprobs": {
                                "token_logprobs": [-0.01 * (i + 1) for i in range(len(ids))]
                            },
                        }
                    ],
                    "plies_policy": SCRIPTED_POLICY,
                }
            else:
                resp = await client.post("/v1/completions", json={**body, "stream": False})
                resp.raise_for_status()
                answer = resp.json()
            engine.answers.append(answer)
            choice = answer["choices"][0]
            engine.exchanges.append(
                Exchange(
                    body["prompt"],
                    choice["token_ids"],
                    choice["logprobs"]["token_logprobs"],
                    arrived,
                    time.monotonic(),
                )
            )
            if body.get("stream"):
                chunks = _chunks(answer, engine, pace)
                return StreamingResponse(chunks, media_type="text/event-stream")
            return JSONResponse(answer)

        app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
        async with serve_app(app) as url:
            engine.url = url
            yield engine


@dataclass
class Stack:
    engine: Engine
    gateway: Gateway
    url: str
    tokenizer: Any
    server: GatewayServer
    clients: list[openai.AsyncOpenAI] = field(default_factory=list)

    def client(self, key: str, **options: Any) -> openai.AsyncOpenAI:
        """An official openai client for `key`, closed with the stack."""
        client = openai.AsyncOpenAI(base_url=self.url, api_key=key, max_retries=0, **options)
        self.clients.append(client)
        return client


@asynccontextmanager
async def gateway_stack(
    policy_server: Any,
    tokenizer: Any,
    *,
    max_tokens: int = 12,
    template_kwargs: dict[str, Any] | None = None,
    policy: Any = None,
    keepalive_s: float = 5.0,
) -> AsyncIterator[Stack]:
    """Recording engine -> VLLMClient -> Gateway -> uvicorn, all on 127.0.0.1."""
    async with (
        recording_engine(policy_server.url) as engine,
        VLLMClient(engine.url, policy_server.model) as client,
        Gateway(
            client,
            # These tests script completions without a think block, which Qwen3's own template
            # keeps as sampled in tool rounds; TRL's training variant (what template="auto"
            # picks) renders an empty one there, so those turns would be full renders.
            ChatRenderer(tokenizer, template_kwargs=template_kwargs, template="model"),
            sampling=SamplingParams(max_tokens=max_tokens, seed=0),
            settle_timeout=5.0,
            policy=policy,
        ) as gateway,
        GatewayServer(gateway, keepalive_s=keepalive_s) as server,
    ):
        stack = Stack(engine, gateway, server.url, tokenizer, server)
        try:
            yield stack
        finally:
            for client in stack.clients:
                await client.close()
