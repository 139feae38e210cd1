"""`AgentHarness`: play an episode with an unmodified agent program, such as Claude Code or Codex.

The agent brings its own loop and tools; plies brings the workspace, the model and the
record. Per episode:

1. the env (a `WorkspaceEnv`, a `HarborEnv`: any `AgentEnv`) makes its sandbox and lays the
   task out in it (under the lease's `reset` operation);
2. the gateway opens a session; the adapter writes the agent's configuration into a fresh
   `HOME` inside the workspace (`.plies-agent/`), pointing it at the gateway with the session
   key as its API key, offline, tools allowed;
3. the agent runs in the workspace until it exits or `wall_s` passes (or the env's own
   `agent_timeout_s`, if smaller). Every model call it makes is sampled from the policy and
   recorded by the gateway exactly;
4. the env's verifier scores the workspace (under the lease's `verify` operation), the
   harness's `RewardPolicy` turns that into the reward, and the session is finished into the
   trajectory.

How an episode ends: the agent exited 0: `completed`; it ran past `wall_s`: `truncated` (its
workspace is still scored, and `RewardPolicy.truncated` decides what that is worth); it
exited non-zero, could not start, or the verifier failed: `failed`, with the agent's output
tail in `error` and no reward (that is the system, not the model, and training refuses the
group). The agent runs in its own process group inside the sandbox, killed on every path
(exit, timeout, cancellation, Ctrl-C, error); what it left running is killed with the
sandbox when the env is closed. The agent's own run is deliberately not a lease operation:
a cancelled episode kills it at once instead of waiting for it to settle.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Mapping
from typing import Any

import anyio

from plies import ConfigError, EnvError
from plies.environments import Env, McpServer, Task
from plies.environments.sandbox import CommandResult
from plies.runtime import EpisodeContext, Lease, Pool
from plies.trajectory import Status, Trajectory

from ._agent_ending import AgentEnding
from .adapters import AgentAdapter, LaunchSpec
from .protocol import gateway_session, operation, play_task
from .rewards import DEFAULT_REWARDS, RewardPolicy
from .workspace import AgentEnv

__all__ = ["AGENT_HOME", "DEFAULT_AGENT_MAX_TURNS", "DEFAULT_AGENT_WALL_S", "AgentHarness"]

log = logging.getLogger("plies.harness")

DEFAULT_AGENT_WALL_S = 600.0
"""Seconds an agent may run before the episode is cut off as truncated."""
DEFAULT_AGENT_MAX_TURNS = 20
"""Model calls an agent is told it may make, where it has such a switch."""
AGENT_HOME = ".plies-agent"
"""The agent's fresh HOME, relative to the workspace: its config files and its own state."""
_OUTPUT_TAIL = 4000
_EPISODE_ERRORS = (EnvError, OSError)
"""What the agent's sandbox or the verifier can do wrong that fails the episode, not the run."""


class AgentHarness:
    """Runs an agent program per episode against a gateway session, in the env's workspace.

    Args:
        server: the running gateway (a `GatewayServer`: its `gateway` holds the sessions and
            its `url` is where agents on this machine reach it).
        adapter: starts the agent (`ClaudeCode`, `Codex`, `OpenCode`, `Pi`, `MiniSweAgent`,
            `AgentsSdk`).
        base_url: the gateway's root URL as the agent sees it, when it runs elsewhere (an E2B
            sandbox needs a reachable address); default: `server.url` without `/v1`.
        model: the model name given to the agent; default: the one the gateway serves.
        wall_s: wall-clock budget per episode; past it the agent is killed and the episode is
            `truncated`.
        max_turns: the most model calls the agent is told to make (where it has a switch).
        env: extra environment variables for the agent.
        rewards: what a truncated episode is worth (default `DEFAULT_REWARDS`).

    Example::

        harness = AgentHarness(server, ClaudeCode(command=".agents/npm/bin/claude"))
        async with WorkspaceEnv(LocalProcessBackend(), run_id="r1") as env:
            trajectory = await harness.run(env, task)

    An agent inside a bubblewrap sandbox (a Harbor task) reaches the gateway through a
    forwarded port: serve it on a Unix socket too, and share the agent's installation::

        async with GatewayServer(gw, uds=sock) as server:
            backend = task.backend(shares=[npm_prefix], forwards=[Forward(server.port, sock)])
            async with HarborEnv(task, backend) as env:
                trajectory = await harness.run(env, Task(id=task.name))
    """

    def __init__(
        self,
        server: Any,
        adapter: AgentAdapter,
        *,
        base_url: str | None = None,
        model: str | None = None,
        wall_s: float = DEFAULT_AGENT_WALL_S,
        max_turns: int = DEFAULT_AGENT_MAX_TURNS,
        env: Mapping[str, str] | None = None,
        rewards: RewardPolicy = DEFAULT_REWARDS,
    ):
        if not isinstance(adapter, AgentAdapter):
            raise ConfigError(
                f"adapter must be an AgentAdapter (e.g. ClaudeCode()), got {adapter!r}"
            )
        if not isinstance(rewards, RewardPolicy):
            raise ConfigError(f"rewards must be a RewardPolicy, got {rewards!r}")
        if not wall_s > 0:
            raise ConfigError(f"wall_s must be positive, got {wall_s}")
        if max_turns < 1:
            raise ConfigError(f"max_turns must be at least 1, got {max_turns}")
        self.server = server
        self.adapter = adapter
        self._base_url = base_url.rstrip("/") if base_url else None
        self.model = model
        self.wall_s = wall_s
        self.max_turns = max_turns
        self.env = dict(env or {})
        self.rewards = rewards

    @property
    def sampler(self) -> Any:
        """The gateway's sampler: every turn of every agent is sampled by it."""
        return self.server.gateway.sampler

    @property
    def base_url(self) -> str:
        """The gateway's root URL as agents see it (no `/v1`)."""
        if self._base_url is not None:
            return self._base_url
        url = str(self.server.url).rstrip("/")
        return url.removesuffix("/v1")

    async def play(self, ctx: EpisodeContext, *, pool: Pool[Any] | str = "env") -> Trajectory:
        """A `RolloutDriver` episode: borrow an `AgentEnv` from `pool`, play `ctx.task`.

        Raises:
            ConfigError: `ctx.task` is not a `Task`, or the pool lent something that is not an
                `AgentEnv`.
        """
        return await play_task(self, ctx, pool)

    async def run(
        self, env: AgentEnv, task: Task, *, group_id: str = "", lease: Lease[Any] | None = None
    ) -> Trajectory:
        """Play one episode of `task` on `env` (fresh, not yet reset); return it settled.

        The env is not closed here: whoever made it (a pool, an `async with`) closes it, and
        with it the sandbox and anything the agent left running.

        Raises:
            ConfigError: `env` is not an `AgentEnv`.
            GatewaySessionError: the gateway is closed.
        """
        if not _is_agent_env(env):
            raise ConfigError(
                "AgentHarness needs an env with a workspace and a verifier (an AgentEnv such as "
                f"WorkspaceEnv or HarborEnv), got {type(env).__name__}"
            )
        gateway = self.server.gateway
        async with operation(lease, "reset"):
            observation = await env.reset(task)
        instruction = str(observation.messages[-1]["content"])
        info = {"agent": self.adapter.name, "agent_version": self.adapter.version}
        async with gateway_session(
            gateway, task.id, group_id=group_id, info={**info, "wire": self.adapter.wire}
        ) as key:
            ending = AgentEnding()
            outcome: CommandResult | None = None
            verified: float | None = None
            try:
                wall_s, limit = self.wall_s, f"wall_s={self.wall_s:g}"
                if env.agent_timeout_s is not None and env.agent_timeout_s < wall_s:
                    wall_s = env.agent_timeout_s
                    limit = f"the env's agent timeout ({wall_s:g}s)"
                with anyio.move_on_after(wall_s) as budget:
                    async with env.serve_tools() as mcp_servers:
                        outcome = await self._run_agent(env, key, instruction, wall_s, mcp_servers)
                if budget.cancelled_caught:
                    ending.truncated(limit)
                elif outcome is not None:
                    ending.exited(outcome.exit_code, outcome.stderr or outcome.stdout)
                if ending.status is not Status.FAILED:
                    async with operation(lease, "verify"):
                        verified = await env.verify()
            except _EPISODE_ERRORS as exc:
                ending.failed(exc)
            output = outcome.stdout[-_OUTPUT_TAIL:] if outcome is not None else ""
            details = {
                "exit_code": None if outcome is None else outcome.exit_code,
                "verified_reward": verified,
                "agent_output": output,
            }
            return await ending.finish(gateway, key, self.rewards, verified, details)

    async def _run_agent(
        self,
        env: AgentEnv,
        key: str,
        instruction: str,
        wall_s: float,
        mcp_servers: Mapping[str, McpServer],
    ) -> CommandResult:
        """Write the agent's configuration, then run it in the workspace until it exits."""
        sandbox = env.workspace
        workdir = await _workdir(sandbox)
        home = posixpath.join(workdir, AGENT_HOME)
        spec = LaunchSpec(
            instruction=instruction,
            base_url=self.base_url,
            api_key=key,
            model=self.model or self.server.gateway.model,
            home=home,
            workdir=workdir,
            max_turns=self.max_turns,
            mcp_servers=mcp_servers,
        )
        launch = self.adapter.launch(spec)
        await sandbox.write_file(posixpath.join(AGENT_HOME, ".keep"), "")
        for path, text in launch.files.items():
            await sandbox.write_file(posixpath.join(AGENT_HOME, path), text)
        # The sandbox runs it in its own process group and kills that group on every way out
        # of this call; the margin lets `wall_s` (the caller's scope) fire first.
        return await sandbox.run(
            launch.argv, timeout_s=wall_s + 60.0, env={**self.env, **launch.env}
        )


def _is_agent_env(env: object) -> bool:
    """Whether `env` is an `Env` with what `AgentEnv` names, looked up on its class so that a
    `workspace` that refuses before reset is not called."""
    kind = type(env)
    return isinstance(env, Env) and all(
        hasattr(kind, name) for name in ("workspace", "agent_timeout_s", "serve_tools", "verify")
    )


async def _workdir(sandbox: Any) -> str:
    """The sandbox's working directory as an absolute path inside it."""
    known = getattr(sandbox, "workdir", None)
    if known is not None:
        return str(known)
    result = await sandbox.run(["pwd"], timeout_s=30)
    return result.stdout.strip()
