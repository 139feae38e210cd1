"""Real agent CLIs against the real gateway: what `.ci/agents-tier` installs, and the stack.

The agents come from the registries, pinned: the npm ones under `.agents/npm`, the PyPI ones in
`.venv-agents` (see `.ci/agents-tier`). Without them every test here is skipped, so the main
test run passes on a machine that never installed them.

The stack: a policy (the scripted one, or the tiny model behind `plies serve`) -> `Gateway` ->
its ASGI app in uvicorn on 127.0.0.1, with a thin ASGI wrapper that counts every response the
agents got by status, so a test can say "0 client errors" from what went over the wire.
"""

from __future__ import annotations

import socket
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
import uvicorn

from plies.environments import Task
from plies.gateway import Gateway, create_app
from plies.harness import (
    AgentAdapter,
    AgentsSdk,
    ClaudeCode,
    Codex,
    MiniSweAgent,
    OpenCode,
    Pi,
)
from plies.policy import SamplingParams
from plies.tokens import ChatRenderer

ROOT = Path(__file__).parents[2]
NPM_BIN = ROOT / ".agents" / "npm" / "node_modules" / ".bin"
AGENTS_VENV = ROOT / ".venv-agents" / "bin"

AGENTS: dict[str, Callable[[], AgentAdapter]] = {
    "mini-swe-agent": lambda: MiniSweAgent(command=str(AGENTS_VENV / "mini")),
    "openai-agents-chat": lambda: AgentsSdk(python=str(AGENTS_VENV / "python"), wire="chat"),
    "opencode": lambda: OpenCode(command=str(NPM_BIN / "opencode")),
    "pi": lambda: Pi(command=str(NPM_BIN / "pi")),
    "openai-agents-responses": lambda: AgentsSdk(
        python=str(AGENTS_VENV / "python"), wire="responses"
    ),
    "claude-code": lambda: ClaudeCode(command=str(NPM_BIN / "claude")),
    "codex": lambda: Codex(command=str(NPM_BIN / "codex")),
}
"""Every agent the tier tests, by the id tests are parametrised with."""

_EXECUTABLES = {
    "mini-swe-agent": AGENTS_VENV / "mini",
    "openai-agents-chat": AGENTS_VENV / "python",
    "openai-agents-responses": AGENTS_VENV / "python",
    "opencode": NPM_BIN / "opencode",
    "pi": NPM_BIN / "pi",
    "claude-code": NPM_BIN / "claude",
    "codex": NPM_BIN / "codex",
}

TASK = Task(
    id="hello-file",
    data={
        "instruction": "Create hello.txt containing the line hello, show it with cat, then "
        "say that you are done.",
        "verify": ["grep", "-qx", "hello", "hello.txt"],
    },
)
"""The three-step task: write a file, run a command, answer. The verifier pays 1.0."""


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"tool_calls": [{"name": name, "arguments": arguments}]}


def _claude_write(prompt: str) -> dict[str, Any]:
    """Claude Code's Write takes an absolute path: the working directory from its prompt."""
    marker = "Primary working directory: "
    if marker not in prompt:
        marker = "Working directory: "
    workdir = prompt.split(marker, 1)[1].split("\n", 1)[0].strip()
    return _call("Write", file_path=f"{workdir}/hello.txt", content="hello\n")


DONE = "Done: hello.txt contains hello."

SCRIPTS: dict[str, list[Any]] = {
    # mini-swe-agent has one tool, bash, and ends on its submit command.
    "mini-swe-agent": [
        _call("bash", command="printf 'hello\\n' > hello.txt"),
        _call("bash", command="cat hello.txt"),
        _call("bash", command="echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"),
    ],
    "openai-agents-chat": [
        _call("write_file", path="hello.txt", content="hello\n"),
        _call("run_command", command="cat hello.txt"),
        DONE,
    ],
    "opencode": [
        _call("write", filePath="hello.txt", content="hello\n"),
        _call("bash", command="cat hello.txt", description="Show hello.txt"),
        DONE,
    ],
    "pi": [
        _call("write", path="hello.txt", content="hello\n"),
        _call("bash", command="cat hello.txt"),
        DONE,
    ],
    "claude-code": [
        _claude_write,
        _call("Bash", command="cat hello.txt", description="Show hello.txt"),
        DONE,
    ],
    # Codex has no file-writing tool of its own in this version: its shell writes the file.
    "codex": [
        _call("exec_command", cmd="printf 'hello\\n' > hello.txt"),
        _call("exec_command", cmd="cat hello.txt"),
        DONE,
    ],
}
SCRIPTS["openai-agents-responses"] = SCRIPTS["openai-agents-chat"]


_INSTALLED = {agent: path.exists() for agent, path in _EXECUTABLES.items()}
"""Looked at once, as the tests are collected: `.ci/run` installs the agents while the main
tests run, and tests collected as skipped must not start running agents halfway through that
run (the agents tier runs them, after)."""


def agent_installed(agent: str) -> bool:
    return _INSTALLED[agent]


def require_agent(agent: str) -> AgentAdapter:
    """The agent's adapter, or a skip when `.ci/agents-tier` has not installed it."""
    if not agent_installed(agent):
        pytest.skip(f"{agent} is not installed (run .ci/agents-tier)")
    return AGENTS[agent]()


@dataclass
class CountingServer:
    """The gateway's app in uvicorn, with every response status the agents got counted."""

    gateway: Gateway
    url: str = ""
    port: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    paths: Counter[str] = field(default_factory=Counter)

    @property
    def client_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 400)


@asynccontextmanager
async def serve_gateway(gateway: Gateway, uds: Path | None = None) -> AsyncIterator[CountingServer]:
    """The counting server on 127.0.0.1, and on the Unix socket `uds` too when given."""
    server = CountingServer(gateway)
    app = create_app(gateway)

    async def counting(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        server.paths[f"{scope['method']} {scope['path']}"] += 1

        async def send_counted(message: Any) -> None:
            if message["type"] == "http.response.start":
                server.statuses[message["status"]] += 1
            await send(message)

        await app(scope, receive, send_counted)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sockets = [sock]
    if uds is not None:
        sockets.append(socket.socket(socket.AF_UNIX))
        sockets[-1].bind(str(uds))
    config = uvicorn.Config(counting, log_level="warning", lifespan="off", access_log=False)
    http = uvicorn.Server(config)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: http.serve(sockets=sockets))
        while not http.started:
            await anyio.sleep(0.01)
        server.port = sock.getsockname()[1]
        server.url = f"http://127.0.0.1:{server.port}/v1"
        try:
            yield server
        finally:
            http.should_exit = True


@asynccontextmanager
async def agent_gateway(
    sampler: Any, tokenizer: Any, *, max_tokens: int = 512, uds: Path | None = None
) -> AsyncIterator[CountingServer]:
    """`sampler` -> `Gateway` -> a counting server on 127.0.0.1 (and `uds`)."""
    # Scripted answers carry no think block, as Qwen3's own template keeps them in history;
    # TRL's training variant would render an empty one there.
    renderer = ChatRenderer(tokenizer, template="model")
    sampling = SamplingParams(max_tokens=max_tokens, seed=0)
    gateway = Gateway(sampler, renderer, sampling=sampling, settle_timeout=5.0)
    async with gateway, serve_gateway(gateway, uds) as server:
        yield server
