"""`ToolCallingHarness`: the built-in agent loop between a policy and an `Env` with tools.

One episode: reset the env, then repeat render -> sample -> parse -> call tools -> append
the tool results, until a tool result says done or a limit ends it. Every turn is recorded
as the sampler produced it (`Turn`: the prompt as a delta or a full render, completion ids,
logprobs, finish reason, policy, parsed message, fallback reason), so the trajectory is
ready for training without re-tokenizing anything.

How an episode ends, and what `Trajectory.status` / `info["stop_reason"]` say:

- the env said done: `completed`, `StopReason.DONE`;
- a budget ran out (turns, context tokens, a completion cut at `max_tokens`, wall clock):
  `truncated`, with the budget's `StopReason`;
- the model's output was unusable (no parse, no tool call, an unknown tool) and no
  correction message is configured: `completed`, `StopReason.ILL_FORMED`, the reason in
  `info["stop_detail"]`. With `correction` set the model is told what was wrong and the
  episode goes on.

What each ending is worth is the harness's `RewardPolicy` (`plies.harness.rewards`): the
tools' total when the env said done, and explicit, documented rewards for an ill-formed,
truncated or unpaid episode, so every trajectory it settles has a finite reward.

Errors of the parts (the policy server, the env) propagate: the caller (usually the
`RolloutDriver`) settles the episode as failed, cancelled or quarantined. Turns recorded
before that stay on the trajectory the caller passed in.

Remote calls (env reset, each tool call, each sample) run inside `lease.operation(...)` when
a lease is given, so cancelling an episode waits (bounded) for them to settle and
quarantines the env when they do not. They share one `SettleWatch`: the loop enters them one
after another in one scope, and a watcher per call would cost more than the call's shield.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import KW_ONLY, dataclass, field
from enum import StrEnum
from typing import Any

import anyio

from plies import ConfigError
from plies.environments import Env, Task, ToolResult
from plies.policy import Completion, PolicyClient, SamplingParams
from plies.runtime import EpisodeContext, Lease, Pool, SettleWatch
from plies.tokens import ChatRenderer, Conversation, ParsedResponse
from plies.trajectory import PolicyRef, Status, Trajectory, Turn

from .rewards import DEFAULT_REWARDS, RewardPolicy

__all__ = ["EpisodeLimits", "StopReason", "ToolCallingHarness"]


class StopReason(StrEnum):
    """Why the harness stopped an episode (`Trajectory.info["stop_reason"]`)."""

    DONE = "done"
    """A tool result said the episode is over (status `completed`)."""
    MAX_TURNS = "max_turns"
    """`EpisodeLimits.max_turns` turns were sampled (status `truncated`)."""
    MAX_TOTAL_TOKENS = "max_total_tokens"
    """The context (prompt + room for a completion) would exceed the token budget."""
    MAX_NEW_TOKENS = "max_new_tokens"
    """A completion hit `SamplingParams.max_tokens` before its stop token (`truncated`)."""
    WALL_CLOCK = "wall_clock"
    """`EpisodeLimits.wall_s` seconds passed (status `truncated`)."""
    ILL_FORMED = "ill_formed"
    """The model's output was unusable and no correction is configured (status `completed`,
    scored by `RewardPolicy.ill_formed`)."""


@dataclass(frozen=True, slots=True)
class EpisodeLimits:
    """Budgets of one episode. An exhausted budget ends it as `truncated`, never raises.

    Attributes:
        max_turns: most sampled turns.
        max_total_tokens: most tokens in the context: a turn is not sampled when its prompt
            leaves no room, and each completion is capped to the room left. None: no bound.
        wall_s: seconds from reset to the end of the episode. None: no bound.
        min_new_tokens: the least room for a completion worth sampling; less ends the
            episode with `max_total_tokens`.
    """

    max_turns: int = 16
    max_total_tokens: int | None = None
    wall_s: float | None = None
    min_new_tokens: int = 1

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ConfigError(f"max_turns must be at least 1, got {self.max_turns}")
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            raise ConfigError(f"max_total_tokens must be at least 2, got {self.max_total_tokens}")
        if self.wall_s is not None and not self.wall_s > 0:
            raise ConfigError(f"wall_s must be positive, got {self.wall_s}")
        if self.min_new_tokens < 1:
            raise ConfigError(f"min_new_tokens must be at least 1, got {self.min_new_tokens}")


class _Ended(Exception):
    """Internal: the loop stops with this status and reason."""

    def __init__(self, status: Status, reason: StopReason, detail: str | None = None):
        super().__init__(reason.value)
        self.status = status
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class ToolCallingHarness:
    """Plays episodes of tool-calling envs with one policy client and one renderer.

    A harness holds no per-episode state, so one instance serves any number of concurrent
    episodes.

    Args:
        renderer: the `ChatRenderer` of the policy's tokenizer (one per model).
        sampler: the policy client that samples completions.
        sampling: sampling parameters; `max_tokens` is the per-turn cap on new tokens.
        limits: the episode budgets.
        system_prompt: a system message put before the env's opening messages (the chat
            template renders the tool schemas into the system turn either way).
        correction: when set, an ill-formed turn does not end the episode: this text is sent
            as a user message (or, for an unknown tool, the env's error as the tool result)
            and the model tries again, within `max_turns`.
        rewards: what an ill-formed, truncated or unpaid episode is worth; the defaults
            (`DEFAULT_REWARDS`) keep every reward finite, so a group trains.

    Example::

        harness = ToolCallingHarness(renderer, client, SamplingParams(max_tokens=64))
        async with BlackjackEnv() as env:
            traj = await harness.run(env, Task(id="hand", seed=7))
        traj.status, traj.reward, traj.turns[0].completion_ids
    """

    renderer: ChatRenderer
    sampler: PolicyClient
    sampling: SamplingParams
    _: KW_ONLY
    limits: EpisodeLimits = EpisodeLimits()
    system_prompt: str | None = None
    correction: str | None = None
    rewards: RewardPolicy = DEFAULT_REWARDS

    def __post_init__(self) -> None:
        if not isinstance(self.rewards, RewardPolicy):
            raise ConfigError(
                f"rewards must be a RewardPolicy, got {self.rewards!r}; "
                "e.g. rewards=RewardPolicy(ill_formed=IllFormedReward(reward=-1.0))"
            )

    async def play(self, ctx: EpisodeContext, *, pool: Pool[Any] | str = "env") -> Trajectory:
        """A `RolloutDriver` episode: borrow an env from `pool` (a pool of the resources
        scope, or its name), play `ctx.task` on it.

        Turns are recorded on `ctx.trajectory` as they happen, so an episode cancelled
        midway settles with the turns it took. Sampling uses the group's policy.

        Raises:
            ConfigError: `ctx.task` is not an `plies.environments.Task`.
        """
        if not isinstance(ctx.task, Task):
            raise ConfigError(
                f"ToolCallingHarness.play needs GroupSpec.task to be a Task, got "
                f"{type(ctx.task).__name__}"
            )
        async with ctx.borrow(pool) as lease:
            return await self.run(
                lease.resource,
                ctx.task,
                lease=lease,
                policy=ctx.policy,
                trajectory=ctx.trajectory,
                add_turn=ctx.add_turn,
            )

    async def run(
        self,
        env: Env,
        task: Task,
        *,
        lease: Lease[Any] | None = None,
        policy: PolicyRef | str | None = None,
        trajectory: Trajectory | None = None,
        add_turn: Callable[[Turn], None] | None = None,
    ) -> Trajectory:
        """Play one episode of `task` on `env` (fresh, not yet reset) and return it settled.

        The env is not closed here: whoever made it (a pool, an `async with`) closes it.

        Args:
            env: a new env instance.
            task: what to play; its id becomes the trajectory's task id.
            lease: the lease `env` was borrowed under; remote calls run in its operations.
            policy: which policy samples (a group's `PolicyRef`); None: the client's default.
            trajectory: record into this trajectory (e.g. a driver's `ctx.trajectory`).
            add_turn: how to append a turn (e.g. `ctx.add_turn`); default: append to
                `trajectory.turns`.

        Returns:
            The trajectory with status, reward (scored by `rewards`), `info["stop_reason"]`,
            `info["tool_reward"]` (what the tools paid, None when nothing) and metrics set.

        Raises:
            PolicyError, EnvError, LeaseError: a remote part failed; turns so far stay on
                `trajectory`.
        """
        traj = trajectory if trajectory is not None else Trajectory(task_id=task.id)
        record = add_turn if add_turn is not None else traj.turns.append
        episode = _Episode(self, env, traj, record, lease, policy)
        return await episode.play(task)


_INLINE_PARSE_TOKENS = 512
"""Completions up to this long are parsed on the event loop: a thread hand-off costs more than
parsing them (bench/rollout_bench.py); longer ones are parsed in a worker thread."""


async def _parse(conv: Conversation, completion: Completion) -> ParsedResponse:
    if len(completion.ids) <= _INLINE_PARSE_TOKENS:
        return conv.add_completion(completion.ids, completion.finish_reason)
    return await anyio.to_thread.run_sync(
        conv.add_completion, completion.ids, completion.finish_reason
    )


def _operation(
    lease: Lease[Any] | None, name: str, watch: SettleWatch | None
) -> AbstractAsyncContextManager[Any]:
    return lease.operation(name, watch=watch) if lease is not None else nullcontext()


@dataclass(slots=True)
class _Episode:
    """The state of one episode; the loop's bookkeeping is O(new tokens) per turn."""

    h: ToolCallingHarness
    env: Env
    traj: Trajectory
    record: Callable[[Turn], None]
    lease: Lease[Any] | None
    policy: PolicyRef | str | None
    reward: float | None = None
    tool_calls: int = 0
    tool_errors: int = 0
    ill_formed: list[dict[str, Any]] = field(default_factory=list)
    conv: Conversation | None = None
    watch: SettleWatch | None = None
    sample_s: float = 0.0
    tokens_sampled: int = 0

    async def play(self, task: Task) -> Trajectory:
        started = time.monotonic()
        limits = self.h.limits
        ended: _Ended | None = None
        with anyio.move_on_after(limits.wall_s if limits.wall_s is not None else float("inf")):
            try:
                await self._loop(task)
            except _Ended as e:
                ended = e
        if ended is None:  # only the wall clock leaves the loop without a verdict
            ended = _Ended(Status.TRUNCATED, StopReason.WALL_CLOCK)
        self._settle(ended, time.monotonic() - started)
        return self.traj

    async def _loop(self, task: Task) -> None:
        if self.lease is None:
            await self._turns(task)
            return
        async with SettleWatch() as self.watch:  # every block below is entered in this scope
            await self._turns(task)

    async def _turns(self, task: Task) -> None:
        async with _operation(self.lease, "reset", self.watch):
            obs = await self.env.reset(task)
        opening = list(obs.messages)
        if self.h.system_prompt is not None:
            opening.insert(0, {"role": "system", "content": self.h.system_prompt})
        self.conv = conv = self.h.renderer.start(opening, tools=obs.tools or None)
        # With the messages, the tool schemas make the trajectory re-renderable on its own.
        self.traj.info["tools"] = list(obs.tools)
        offered = {t["function"]["name"] for t in obs.tools if "function" in t}
        while True:
            if len(self.traj.turns) >= self.h.limits.max_turns:
                raise _Ended(Status.TRUNCATED, StopReason.MAX_TURNS)
            prompt = await conv.arender()
            delta = conv.delta
            params = self._params(len(prompt))
            sent = time.time()
            t0 = time.monotonic()
            async with _operation(self.lease, "sample", self.watch):
                completion: Completion = await self.h.sampler.sample(
                    prompt, params, policy=self.policy, session=self.traj.id
                )
            latency = time.monotonic() - t0
            self.sample_s += latency
            self.tokens_sampled += len(completion.ids)
            parsed = await _parse(conv, completion)
            problem = self._problem(parsed, completion, offered)
            self.record(
                Turn.from_completion(
                    delta,
                    completion,
                    message=conv.messages[-1],
                    ill_formed=problem is not None,
                    fallback=delta.fallback.reason.value if delta.fallback else None,
                    started_at=sent,
                    latency_s=latency,
                )
            )
            if completion.finish_reason != "stop":
                raise _Ended(Status.TRUNCATED, StopReason.MAX_NEW_TOKENS)
            if problem is not None:
                await self._ill_formed(conv, parsed, problem)
                continue
            await self._call_tools(conv, parsed.tool_calls)

    def _params(self, prompt_len: int) -> SamplingParams:
        params = self.h.sampling
        budget = self.h.limits.max_total_tokens
        if budget is None:
            return params
        room = budget - prompt_len
        if room < self.h.limits.min_new_tokens:
            raise _Ended(
                Status.TRUNCATED,
                StopReason.MAX_TOTAL_TOKENS,
                f"prompt of {prompt_len} tokens leaves {room} of {budget}",
            )
        if room >= params.max_tokens:
            return params
        return params.model_copy(update={"max_tokens": room})

    @staticmethod
    def _problem(parsed: ParsedResponse, completion: Completion, offered: set[str]) -> str | None:
        """Why the turn's output is unusable, or None. A cut completion is a budget matter."""
        if completion.finish_reason != "stop":
            return None
        if parsed.ill_formed:
            return f"unparsable: {parsed.error}"
        if not parsed.tool_calls:
            return "no tool call"
        unknown = [c["function"]["name"] for c in parsed.tool_calls]
        unknown = [n for n in unknown if n not in offered]
        if unknown:
            return f"unknown tool {unknown[0]!r}"
        return None

    async def _ill_formed(self, conv: Conversation, parsed: ParsedResponse, problem: str) -> None:
        self.ill_formed.append({"turn": len(self.traj.turns) - 1, "reason": problem})
        if self.h.correction is None:
            # Garbage is an outcome the policy produced: training should see it scored.
            raise _Ended(Status.COMPLETED, StopReason.ILL_FORMED, problem)
        if parsed.tool_calls and not parsed.ill_formed:
            # Unknown tools: the env's own error message answers each call.
            await self._call_tools(conv, parsed.tool_calls)
            return
        conv.add_messages([{"role": "user", "content": self.h.correction}])

    async def _call_tools(self, conv: Conversation, calls: Sequence[dict[str, Any]]) -> None:
        results: list[dict[str, Any]] = []
        done = False
        for call in calls:
            name = call["function"]["name"]
            async with _operation(self.lease, f"tool:{name}", self.watch):
                result: ToolResult = await self.env.call_tool(name, call["function"]["arguments"])
            self.tool_calls += 1
            self.tool_errors += result.error
            if not result.error:
                self.reward = (self.reward or 0.0) + result.reward
            results.append({"role": "tool", "name": name, "content": result.content})
            if result.done:
                done = True
                self.traj.info["env"] = result.info
                break
        conv.add_messages(results)
        if done:
            raise _Ended(Status.COMPLETED, StopReason.DONE)

    def _settle(self, ended: _Ended, wall_s: float) -> None:
        traj = self.traj
        traj.info["stop_reason"] = ended.reason.value
        traj.info["tool_reward"] = self.reward
        if ended.detail is not None:
            traj.info["stop_detail"] = ended.detail
        reward = self.h.rewards.score(
            self.reward,
            truncated=ended.status is Status.TRUNCATED,
            ill_formed=ended.reason is StopReason.ILL_FORMED,
        )
        if self.ill_formed:
            traj.info["ill_formed"] = self.ill_formed
        if self.conv is not None:
            traj.messages = list(self.conv.messages)
            traj.metrics["fallbacks"] = float(len(self.conv.fallbacks))
        traj.metrics.update(
            turns=float(len(traj.turns)),
            tool_calls=float(self.tool_calls),
            tool_errors=float(self.tool_errors),
            tokens_sampled=float(self.tokens_sampled),
            sample_s=self.sample_s,
            wall_s=wall_s,
        )
        traj.settle(ended.status, reward=reward)  # last: a settled record is final
