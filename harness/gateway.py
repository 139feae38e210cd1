"""`GatewayHarness`: play an episode with an external agent program behind a gateway session.

The agent is any program written against the OpenAI client: it gets `OPENAI_BASE_URL` and
`OPENAI_API_KEY` naming a gateway session, so every completion it asks for is sampled from
the policy and recorded exactly. The environment stays with the harness. The agent reaches
it through a line protocol on its stdin and stdout (JSON, one object a line), which needs
no network and works the same for a subprocess or a command in a sandbox:

- harness -> agent, first line: `{"type": "task", "task_id", "messages", "tools"}`;
- agent -> harness: `{"type": "tool", "name", "arguments"}` for each tool call, answered by
  harness -> agent `{"type": "result", "content", "done", "error"}`;
- agent -> harness: `{"type": "done"}` (or simply exiting) ends the episode.

The reward is the sum of the env's tool rewards, scored by the harness's `RewardPolicy`: an
episode past `wall_s` gets `RewardPolicy.truncated`, one in which no tool paid gets
`RewardPolicy.unpaid` (what the tools paid stays in `info["tool_reward"]`). A `failed`
episode (the agent crashed or broke the protocol) keeps no reward: that is the system, not
the model, and training refuses its group. With a lease, the env's reset and every tool call
run inside `lease.operation(...)`, so a cancelled episode waits (bounded) for them to settle
and the env is quarantined when they do not. The agent runs in its own process group,
killed (TERM, then KILL) on every path: done, crash, timeout, cancellation.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from plies import ConfigError, EnvError
from plies.environments import Env, Task
from plies.gateway import GatewayServer
from plies.runtime import EpisodeContext, Lease, Pool
from plies.trajectory import Trajectory

from ._agent_ending import AgentEnding
from .protocol import gateway_session, operation, play_task
from .rewards import DEFAULT_REWARDS, RewardPolicy

__all__ = ["DEFAULT_KILL_TIMEOUT", "DEFAULT_WALL_S", "GatewayHarness"]

log = logging.getLogger("plies.harness")

DEFAULT_WALL_S = 300.0
"""Seconds an agent may run before the episode is cut off as truncated."""
DEFAULT_KILL_TIMEOUT = 5.0
"""Seconds between SIGTERM and SIGKILL for the agent's process group."""
_MAX_LINE = 1 << 20
_EPISODE_ERRORS = (EnvError, OSError, ValueError, KeyError, TypeError)
"""What an agent or env can do wrong that fails the episode rather than the run."""
_STDERR_TAIL = 4000


class GatewayHarness:
    """Runs an agent program per episode against a gateway session and an env.

    Args:
        server: a running `GatewayServer` (its gateway holds the sessions).
        command: the agent program, e.g. `[sys.executable, "examples/gateway_agent.py"]`.
        env: extra environment variables for the agent.
        wall_s: wall-clock budget per episode; past it the trajectory is `truncated`.
        kill_timeout: grace between SIGTERM and SIGKILL when the agent is stopped.
        rewards: what a truncated or unpaid episode is worth (default `DEFAULT_REWARDS`).

    Example::

        harness = GatewayHarness(server, [sys.executable, "agent.py"])
        async with BlackjackEnv() as env:
            trajectory = await harness.run(env, Task(id="hand-1", seed=1))
    """

    def __init__(
        self,
        server: GatewayServer,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        wall_s: float = DEFAULT_WALL_S,
        kill_timeout: float = DEFAULT_KILL_TIMEOUT,
        rewards: RewardPolicy = DEFAULT_REWARDS,
    ):
        if not command:
            raise ConfigError("GatewayHarness needs the agent's command")
        if not isinstance(rewards, RewardPolicy):
            raise ConfigError(f"rewards must be a RewardPolicy, got {rewards!r}")
        self.server = server
        self.command = list(command)
        self.env = dict(env or {})
        self.wall_s = wall_s
        self.kill_timeout = kill_timeout
        self.rewards = rewards

    @property
    def sampler(self) -> Any:
        """The gateway's sampler: every turn of the agent is sampled by it."""
        return self.server.gateway.sampler

    async def play(self, ctx: EpisodeContext, *, pool: Pool[Any] | str = "env") -> Trajectory:
        """A `RolloutDriver` episode: borrow an env from `pool`, play `ctx.task` on it.

        Raises:
            ConfigError: `ctx.task` is not a `Task`.
        """
        return await play_task(self, ctx, pool)

    async def run(
        self, env: Env, task: Task, *, group_id: str = "", lease: Lease[Any] | None = None
    ) -> Trajectory:
        """Play one episode; returns the settled trajectory with its reward.

        A failing agent gives a `failed` trajectory (its stderr tail in `error`), an agent
        past `wall_s` a `truncated` one; the session is finished either way. If the caller
        is cancelled, the agent is killed and the session dropped. `lease` is the lease
        `env` was borrowed under: the env's remote calls run in its operations.
        """
        gateway = self.server.gateway
        async with operation(lease, "reset"):
            observation = await env.reset(task)
        episode = _Episode(env, lease)
        ending = AgentEnding()
        async with gateway_session(
            gateway, task.id, group_id=group_id, info={"seed": task.seed}
        ) as key:
            try:
                with anyio.move_on_after(self.wall_s) as budget:
                    code, stderr = await self._play(key, task, observation, episode)
                if budget.cancelled_caught:
                    ending.truncated(f"wall_s={self.wall_s:g}")
                else:
                    ending.exited(code, stderr)
            except _EPISODE_ERRORS as exc:
                ending.failed(exc)
            details = {
                "env_done": env.done,
                "tool_calls": episode.calls,
                "tool_reward": episode.reward,
            }
            return await ending.finish(gateway, key, self.rewards, episode.reward, details)

    async def _play(
        self, key: str, task: Task, observation: Any, episode: _Episode
    ) -> tuple[int | None, str]:
        agent_env = {
            **os.environ,
            **self.env,
            "OPENAI_BASE_URL": self.server.url,
            "OPENAI_API_KEY": key,
            "PLIES_TASK_ID": task.id,
        }
        process = await anyio.open_process(
            self.command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=agent_env,
            start_new_session=True,
        )
        stderr = bytearray()
        failure: Exception | None = None
        code: int | None = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_drain, process, stderr)
                opening = {
                    "type": "task",
                    "task_id": task.id,
                    "messages": observation.messages,
                    "tools": observation.tools,
                }
                try:
                    await _send(process, opening)
                    await episode.serve(process)
                    code = await process.wait()
                except _EPISODE_ERRORS as exc:  # re-raised below, outside the task group
                    failure = exc
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._kill(process)
        if failure is not None:
            raise failure
        return code, stderr.decode(errors="replace")

    async def _kill(self, process: Process) -> None:
        """Stop the agent's whole process group, politely first."""
        for sig, wait in ((signal.SIGTERM, self.kill_timeout), (signal.SIGKILL, self.kill_timeout)):
            if process.returncode is not None:
                break
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            with anyio.move_on_after(wait):
                await process.wait()
        if process.returncode is None:
            log.error("agent process group %d survived SIGKILL", process.pid)
        await process.aclose()


class _Episode:
    """The env side of the line protocol: runs the agent's tool calls, sums the rewards."""

    def __init__(self, env: Env, lease: Lease[Any] | None):
        self.env = env
        self.lease = lease
        self.reward: float | None = None
        self.calls = 0

    async def serve(self, process: Process) -> None:
        assert process.stdout is not None
        lines = BufferedByteReceiveStream(process.stdout)
        while True:
            try:
                line = await lines.receive_until(b"\n", _MAX_LINE)
            except (anyio.EndOfStream, anyio.IncompleteRead):
                return
            if not line.strip():
                continue
            request = json.loads(line)
            kind = request.get("type")
            if kind == "done":
                return
            if kind != "tool":
                raise ValueError(f"agent sent an unknown message type {kind!r}")
            if self.env.done:
                answer = {"type": "result", "content": "the episode is over", "done": True}
            else:
                name = request["name"]
                async with operation(self.lease, f"tool:{name}"):
                    result = await self.env.call_tool(name, request.get("arguments"))
                self.calls += 1
                self.reward = (self.reward or 0.0) + result.reward
                answer = {
                    "type": "result",
                    "content": result.content,
                    "done": result.done,
                    "error": result.error,
                }
            await _send(process, answer)


async def _send(process: Process, message: dict[str, Any]) -> None:
    """Write one line to the agent; an agent that already left simply does not read it."""
    assert process.stdin is not None
    try:
        await process.stdin.send(json.dumps(message).encode() + b"\n")
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        log.debug("agent closed its stdin before reading %s", message.get("type"))


async def _drain(process: Process, sink: bytearray) -> None:
    """Keep the agent's stderr flowing, keeping only its tail for error reports."""
    assert process.stderr is not None
    async for chunk in process.stderr:
        sink += chunk
        del sink[:-_STDERR_TAIL]
