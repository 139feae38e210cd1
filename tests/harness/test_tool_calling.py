"""ToolCallingHarness against the real reference server and real Blackjack envs.

Every test samples from `plies serve` (the tiny model, warm-started by the demo's supervised
step where complete episodes are needed) and checks each recorded turn against what the
policy client returned and each prompt against an independent full chat-template render.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from transformers import AutoTokenizer

from plies import ConfigError, Status, Trajectory
from plies.environments import (
    BlackjackEnv,
    LocalProcessBackend,
    OpenEnvEndpoint,
    OpenEnvEnv,
    SandboxedBlackjackEnv,
    Task,
    ToolResult,
    tool,
)
from plies.harness import (
    EpisodeLimits,
    IllFormedReward,
    RewardPolicy,
    StopReason,
    ToolCallingHarness,
    TruncationReward,
    UnpaidReward,
)
from plies.harness.rewards import DEFAULT_ILL_FORMED_REWARD, DEFAULT_UNPAID_REWARD
from plies.policy import Completion, SamplingParams, SeededPolicy, VLLMClient
from plies.recipes.blackjack.config import SYSTEM_PROMPT, TEMPLATE_KWARGS
from plies.recipes.blackjack.run import openenv_server
from plies.runtime import EnvPool, GroupSpec, RolloutDriver, RolloutResources
from plies.tokens import ChatRenderer

pytestmark = pytest.mark.anyio


class RecordingClient:
    """The real client, plus a log of every prompt sent and completion returned per session."""

    def __init__(self, inner: VLLMClient):
        self.inner = inner
        self.calls: dict[str, list[tuple[list[int], Completion]]] = defaultdict(list)

    async def sample(self, prompt_ids, params, *, policy=None, session=None) -> Completion:
        sent = list(prompt_ids)
        completion = await self.inner.sample(sent, params, policy=policy, session=session)
        self.calls[session].append((sent, completion))
        return completion

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def renderer(tokenizer) -> ChatRenderer:
    return ChatRenderer(tokenizer, template_kwargs=dict(TEMPLATE_KWARGS))


def full_render(renderer: ChatRenderer, messages: Sequence[dict[str, Any]], tools) -> list[int]:
    """transformers' own full render, with the chat template the renderer uses."""
    ids = renderer.tokenizer.apply_chat_template(
        list(messages), tools=tools, add_generation_prompt=True, tokenize=True,
        return_dict=False, chat_template=renderer.chat_template, **TEMPLATE_KWARGS,
    )  # fmt: skip
    return list(ids)


def check_exact(traj: Trajectory, client: RecordingClient, renderer: ChatRenderer, tools) -> None:
    """Each turn is what the client returned; each prompt is what was sent and a full render."""
    calls = client.calls[traj.id]
    assert len(calls) == len(traj.turns) > 0
    assistant_at = [i for i, m in enumerate(traj.messages) if m["role"] == "assistant"]
    assert len(assistant_at) == len(traj.turns)
    for k, (turn, (sent, completion)) in enumerate(zip(traj.turns, calls, strict=True)):
        assert turn.completion_ids == completion.ids
        assert turn.logprobs == completion.logprobs
        assert turn.finish_reason == completion.finish_reason
        assert turn.policy == completion.policy
        assert traj.prompt_ids(k) == sent
        assert sent == full_render(renderer, traj.messages[: assistant_at[k]], tools)
        # A turn extends exactly when its prompt starts with the previous prompt and completion,
        # whichever way it was rendered; the incremental path always extends.
        before = [*calls[k - 1][0], *calls[k - 1][1].ids] if k > 0 else None
        assert turn.extends == (before is not None and sent[: len(before)] == before)
        assert turn.extends or turn.fallback is not None or k == 0
        assert turn.message == traj.messages[assistant_at[k]]
    assert sum(len(s.tokens) for s in traj.segments()) >= sum(
        len(t.completion_ids) for t in traj.turns
    )


@pytest.fixture
async def client(warm_server):
    async with VLLMClient(warm_server.url, warm_server.model) as inner:
        yield RecordingClient(inner)


async def test_complete_episodes_in_process_openenv_and_sandbox_concurrently(
    warm_server, client, renderer, tmp_path
):
    """12 hands, 4 per variant, all at once; every env, session and sandbox is released."""
    harness = ToolCallingHarness(
        renderer, client, SamplingParams(max_tokens=32, temperature=0.0),
        system_prompt=SYSTEM_PROMPT, limits=EpisodeLimits(max_turns=10),
    )  # fmt: skip
    sandboxes = tmp_path / "sandboxes"
    async with openenv_server(2, tmp_path / "openenv.log") as env_server:
        endpoint = OpenEnvEndpoint(env_server.url, max_sessions=2)

        async def local() -> BlackjackEnv:
            return BlackjackEnv()

        async def remote() -> OpenEnvEnv:
            return OpenEnvEnv(endpoint)

        async def sandboxed() -> SandboxedBlackjackEnv:
            return SandboxedBlackjackEnv(LocalProcessBackend(sandboxes), run_id="harness-test")

        pools = [EnvPool(f, name=n) for n, f in
                 (("local", local), ("openenv", remote), ("sandbox", sandboxed))]  # fmt: skip
        async with RolloutResources(sampler=client, pools=pools) as resources:

            async def episode(ctx) -> Trajectory:
                return await harness.play(ctx, pool=ctx.task.data["pool"])

            groups = []
            async with RolloutDriver(
                resources, episode, policy=warm_server.warm, max_groups_in_flight=None
            ) as driver:
                for pool in ("local", "openenv", "sandbox"):
                    for seed in range(4):
                        task = Task(id=f"{pool}-{seed}", seed=seed, data={"pool": pool})
                        await driver.admit(GroupSpec(task_id=task.id, task=task))
                driver.close_admission()
                groups = [g async for g in driver.groups()]
            stats = resources.statistics()
    assert len(groups) == 12
    for group in groups:
        traj = group.trajectories[0]
        assert traj.status is Status.COMPLETED, (traj.error, traj.info)
        assert traj.info["stop_reason"] == StopReason.DONE
        assert traj.reward in (-1.0, 0.0, 1.0)
        assert traj.policies == {warm_server.warm}
        # Each variant offers its own schemas (OpenEnv's come from the server's /schema).
        check_exact(traj, client, renderer, traj.info["tools"])
    assert stats.borrowed == stats.released == 12
    assert stats.quarantined == stats.live == 0
    assert endpoint.statistics().sessions_open == 0
    assert not any(sandboxes.iterdir()), "every sandbox directory was removed"


async def test_sampled_turns_are_recorded_exactly(warm_server, client, renderer):
    """At temperature 1 some hands may go wrong; every turn is recorded as sampled anyway.

    Seeded per turn (from the episode id, named here rather than drawn) and played one hand
    at a time (hands played at once share the server's batches, and a row's float results
    depend on which rows share its batch), so a run repeats on one machine. How many hands
    go wrong differs between machines (the same code, warm start included: 3 of the first 16
    on one, 6 on another), so hands are played until 12 have finished, and every turn of
    every hand played is checked.
    """
    harness = ToolCallingHarness(
        renderer, SeededPolicy(client), SamplingParams(max_tokens=32), system_prompt=SYSTEM_PROMPT
    )
    trajs: list[Trajectory] = []
    done: list[Trajectory] = []
    for seed in range(48):
        async with BlackjackEnv() as env:
            task = Task(id=f"t{seed}", seed=seed)
            named = Trajectory(id=f"hand-{seed}", task_id=task.id)
            traj = await harness.run(env, task, policy=warm_server.warm, trajectory=named)
        trajs.append(traj)
        if traj.info["stop_reason"] == StopReason.DONE:
            done.append(traj)
            if len(done) == 12:
                break
    schemas = [t.schema() for t in BlackjackEnv().tools()]
    for traj in trajs:
        check_exact(traj, client, renderer, schemas)
        assert traj.error is None
        if traj.info["stop_reason"] == StopReason.DONE:
            assert traj.status is Status.COMPLETED
            assert traj.reward == traj.info["tool_reward"] and traj.reward in (-1.0, 0.0, 1.0)
            assert not any(t.ill_formed for t in traj.turns)
        elif traj.info["stop_reason"] == StopReason.MAX_NEW_TOKENS:  # cut off mid-reply
            assert traj.status is Status.TRUNCATED and traj.turns[-1].finish_reason == "length"
            paid = traj.info["tool_reward"]
            assert traj.reward == (DEFAULT_UNPAID_REWARD if paid is None else paid)
        else:  # scored by the default policy, so training sees the format error
            assert traj.status is Status.COMPLETED
            assert traj.info["stop_reason"] == StopReason.ILL_FORMED
            assert traj.turns[-1].ill_formed and traj.info["stop_detail"]
            assert traj.reward == DEFAULT_ILL_FORMED_REWARD
    print(f"{len(done)} of {len(trajs)} hands done")
    assert len(done) == 12, [t.info.get("stop_detail") for t in trajs]


ONE_WORD = SamplingParams(max_tokens=1, stop_token_ids=tuple(range(151936)))
"""Every id of the vocabulary is a stop token, so the one sampled token (often `<tool_call>`
for the warm start) is a finished completion with no whole tool call: ill-formed output."""


async def test_random_model_output_ends_the_episode_as_ill_formed_and_scored(
    warm_server, client, renderer
):
    harness = ToolCallingHarness(renderer, client, ONE_WORD)
    async with BlackjackEnv() as env:
        traj = await harness.run(env, Task(id="r", seed=5), policy=warm_server.base)
    check_exact(traj, client, renderer, [t.schema() for t in BlackjackEnv().tools()])
    assert (traj.status, traj.info["stop_reason"]) == (Status.COMPLETED, StopReason.ILL_FORMED)
    assert len(traj.turns) == 1 and traj.turns[0].ill_formed
    assert traj.reward == DEFAULT_ILL_FORMED_REWARD and traj.info["tool_reward"] is None
    assert traj.turns[0].finish_reason == "stop" and traj.error is None
    assert traj.info["ill_formed"][0]["turn"] == 0
    assert traj.info["stop_detail"] == traj.info["ill_formed"][0]["reason"]


async def test_a_configured_reward_scores_ill_formed_output_for_training(
    warm_server, client, renderer
):
    rewards = RewardPolicy(ill_formed=IllFormedReward(reward=-0.5))
    harness = ToolCallingHarness(renderer, client, ONE_WORD, rewards=rewards)
    async with BlackjackEnv() as env:
        traj = await harness.run(env, Task(id="r", seed=5), policy=warm_server.base)
    assert (traj.status, traj.info["stop_reason"]) == (Status.COMPLETED, StopReason.ILL_FORMED)
    assert traj.reward == -0.5 and traj.error is None
    assert traj.turns[0].ill_formed


def test_rewards_must_be_a_policy(renderer):
    with pytest.raises(ConfigError, match="rewards must be a RewardPolicy"):
        ToolCallingHarness(renderer, None, ONE_WORD, rewards=-1.0)  # type: ignore[arg-type]


async def test_correction_message_keeps_the_episode_going(warm_server, client, renderer):
    correction = "Reply with exactly one tool call."
    harness = ToolCallingHarness(
        renderer, client, ONE_WORD, limits=EpisodeLimits(max_turns=3), correction=correction
    )
    async with BlackjackEnv() as env:
        traj = await harness.run(env, Task(id="c", seed=6), policy=warm_server.base)
    check_exact(traj, client, renderer, [t.schema() for t in BlackjackEnv().tools()])
    assert (traj.status, traj.info["stop_reason"]) == (Status.TRUNCATED, StopReason.MAX_TURNS)
    assert [e["turn"] for e in traj.info["ill_formed"]] == [0, 1, 2]
    for entry in traj.info["ill_formed"]:
        following = traj.messages[[i for i, m in enumerate(traj.messages)
                                   if m["role"] == "assistant"][entry["turn"]] + 1]  # fmt: skip
        assert following == {"role": "user", "content": correction}


class StandOnly(BlackjackEnv):
    """Offers only `stand`: a model trained on hit and stand will name an unknown tool."""

    def tools(self):
        return [t for t in super().tools() if t.name == "stand"]


async def test_unknown_tool_is_ill_formed(warm_server, client, renderer):
    harness = ToolCallingHarness(
        renderer, client, SamplingParams(max_tokens=32), system_prompt=SYSTEM_PROMPT
    )
    trajs = []
    for seed in range(16):
        async with StandOnly() as env:
            trajs.append(
                await harness.run(env, Task(id=f"s{seed}", seed=seed), policy=warm_server.warm)
            )
    schemas = [t.schema() for t in StandOnly().tools()]
    unknown = 0
    for traj in trajs:
        check_exact(traj, client, renderer, schemas)
        names = [c["function"]["name"] for c in traj.turns[0].message.get("tool_calls", [])]
        if names and names[0] == "hit":
            unknown += 1
            assert (traj.status, traj.info["stop_reason"]) == (
                Status.COMPLETED, StopReason.ILL_FORMED,
            )  # fmt: skip
            assert traj.info["stop_detail"] == "unknown tool 'hit'"
            assert traj.reward == DEFAULT_ILL_FORMED_REWARD
    assert unknown >= 1


STUCK = "You drew 2. Your cards: 10, 2 (total 12). The dealer shows 7."


class Endless(BlackjackEnv):
    """Never says done: every move is answered with the same hand.

    The answer reads like a real hit's, so the warm policy (trained on Blackjack transcripts)
    stays on familiar ground and keeps calling tools until a limit ends the episode.
    """

    @tool
    def hit(self) -> ToolResult:
        """Take another card."""
        return ToolResult(content=STUCK)

    @tool
    def stand(self) -> ToolResult:
        """End your turn."""
        return ToolResult(content=STUCK)


class Slow(BlackjackEnv):
    """Every move takes `delay` seconds (a stalled remote env); `moving` is set when one starts."""

    def __init__(self) -> None:
        super().__init__()
        self.delay = 5.0
        self.moving = anyio.Event()

    @tool
    async def hit(self) -> ToolResult:
        """Take another card."""
        self.moving.set()
        await anyio.sleep(self.delay)
        return ToolResult(content="late")

    @tool
    async def stand(self) -> ToolResult:
        """End your turn."""
        self.moving.set()
        await anyio.sleep(self.delay)
        return ToolResult(content="late", done=True)


async def play(harness, env, policy, seed) -> Trajectory:
    async with env:
        return await harness.run(env, Task(id="limits", seed=seed), policy=policy)


DEALS = range(1, 17)


async def well_formed_deal(client, renderer, policy) -> int:
    """The first of `DEALS` whose greedy first call under `policy` parses.

    Tests of what ends an episode after its first call need one. Which deals the warm policy
    answers well-formed depends on the machine (its float reductions), not on plies: on one
    machine deal 1 was, on another only 5 of the first 12 were.
    """
    greedy = SamplingParams(max_tokens=32, temperature=0.0)
    h = ToolCallingHarness(renderer, client, greedy, system_prompt=SYSTEM_PROMPT,
                           limits=EpisodeLimits(max_turns=1))  # fmt: skip
    for seed in DEALS:
        if (await play(h, Endless(), policy, seed)).status is Status.TRUNCATED:
            return seed
    raise AssertionError(f"the warm policy's greedy first call is ill-formed on deals {DEALS}")


async def test_limits_end_episodes_as_truncated(warm_server, client, renderer):
    greedy = SamplingParams(max_tokens=32, temperature=0.0)
    schemas = [t.schema() for t in Endless().tools()]

    # Every deal's episode stops at the third turn, or before it on an ill-formed call; at
    # least one of them lasts that long.
    h = ToolCallingHarness(renderer, client, greedy, system_prompt=SYSTEM_PROMPT,
                           limits=EpisodeLimits(max_turns=3))  # fmt: skip
    reached = []
    for seed in DEALS:
        traj = await play(h, Endless(), warm_server.warm, seed)
        check_exact(traj, client, renderer, schemas)
        if traj.status is Status.TRUNCATED:
            assert (traj.info["stop_reason"], len(traj.turns)) == (StopReason.MAX_TURNS, 3)
            reached.append(seed)
        else:
            assert traj.info["stop_reason"] == StopReason.ILL_FORMED and len(traj.turns) <= 3
    assert reached, f"no deal of {DEALS} kept well-formed for three greedy calls"
    seed = reached[0]

    h = ToolCallingHarness(renderer, client, greedy.model_copy(update={"max_tokens": 4}),
                           system_prompt=SYSTEM_PROMPT)  # fmt: skip
    traj = await play(h, Endless(), warm_server.warm, seed)
    assert (traj.status, traj.info["stop_reason"]) == (Status.TRUNCATED, StopReason.MAX_NEW_TOKENS)
    assert [t.finish_reason for t in traj.turns] == ["length"] and len(traj.turns[0].logprobs) == 4

    first = len(traj.turns[0].prompt_ids)
    h = ToolCallingHarness(renderer, client, greedy, system_prompt=SYSTEM_PROMPT,
                           limits=EpisodeLimits(max_total_tokens=first + 20))  # fmt: skip
    traj = await play(h, Endless(), warm_server.warm, seed)
    check_exact(traj, client, renderer, schemas)
    assert (traj.status, traj.info["stop_reason"]) == (
        Status.TRUNCATED, StopReason.MAX_TOTAL_TOKENS,
    )  # fmt: skip
    assert len(traj.turns) == 1 and len(traj.prompt_ids(0)) + 20 >= first + len(
        traj.turns[0].completion_ids
    )

    h = ToolCallingHarness(renderer, client, greedy, system_prompt=SYSTEM_PROMPT,
                           limits=EpisodeLimits(wall_s=1.0))  # fmt: skip
    with anyio.fail_after(4):
        traj = await play(h, Slow(), warm_server.warm, seed)
    assert (traj.status, traj.info["stop_reason"]) == (Status.TRUNCATED, StopReason.WALL_CLOCK)
    assert len(traj.turns) == 1


class Paying(Endless):
    """Never says done, and pays 0.5 for every move."""

    @tool
    def hit(self) -> ToolResult:
        """Take another card."""
        return ToolResult(content="Nothing happens. Your cards: 10, 2 (total 12).", reward=0.5)

    @tool
    def stand(self) -> ToolResult:
        """End your turn."""
        return ToolResult(content="Nothing happens. Your cards: 10, 2 (total 12).", reward=0.5)


async def test_truncated_episodes_are_scored_by_the_reward_policy(warm_server, client, renderer):
    """Greedy sampling plays the same episode under each policy: only the score differs.
    One turn, on a deal whose greedy first call parses (`well_formed_deal`)."""
    greedy = SamplingParams(max_tokens=32, temperature=0.0)
    seed = await well_formed_deal(client, renderer, warm_server.warm)
    outcomes = {}
    for name, truncated in (
        ("kept", TruncationReward()),
        ("capped", TruncationReward(at_most=0.25)),
        ("flat", TruncationReward(reward=-1.0)),
    ):
        h = ToolCallingHarness(renderer, client, greedy, system_prompt=SYSTEM_PROMPT,
                               limits=EpisodeLimits(max_turns=1),
                               rewards=RewardPolicy(truncated=truncated))  # fmt: skip
        traj = await play(h, Paying(), warm_server.warm, seed)
        assert (traj.status, traj.info["stop_reason"]) == (Status.TRUNCATED, StopReason.MAX_TURNS)
        assert traj.metrics["tool_calls"] == 1
        outcomes[name] = (traj.info["tool_reward"], traj.reward)
    assert outcomes == {"kept": (0.5, 0.5), "capped": (0.5, 0.25), "flat": (0.5, -1.0)}

    # Cut off in the first completion: no tool paid, so the unpaid policy decides.
    h = ToolCallingHarness(renderer, client, greedy.model_copy(update={"max_tokens": 4}),
                           system_prompt=SYSTEM_PROMPT,
                           rewards=RewardPolicy(unpaid=UnpaidReward(reward=-0.25)))  # fmt: skip
    traj = await play(h, Paying(), warm_server.warm, seed)
    assert (traj.status, traj.info["stop_reason"]) == (Status.TRUNCATED, StopReason.MAX_NEW_TOKENS)
    assert (traj.info["tool_reward"], traj.reward) == (None, -0.25)


@pytest.mark.parametrize(
    "delay,settle,expected", [(0.5, 5.0, "released"), (30.0, 0.3, "quarantined")]
)
async def test_cancelled_tool_call_settles_or_is_quarantined(
    warm_server, client, renderer, delay, settle, expected
):
    """Cancel while a tool call is in flight: it settles within the bound, or the env is
    quarantined; the turn sampled before stays on the trajectory either way."""

    made: list[Slow] = []

    async def make() -> Slow:
        env = Slow()
        env.delay = delay
        made.append(env)
        return env

    harness = ToolCallingHarness(
        renderer, client, SamplingParams(max_tokens=32, temperature=0.0),
        system_prompt=SYSTEM_PROMPT,
    )  # fmt: skip
    seed = await well_formed_deal(client, renderer, warm_server.warm)  # a tool call starts
    pool = EnvPool(make, settle_timeout=settle, teardown_retries=0)
    async with RolloutResources(sampler=client, pools=[pool]) as resources:
        async with RolloutDriver(resources, harness.play, policy=warm_server.warm) as driver:
            await driver.admit(GroupSpec(task_id="stall", task=Task(id="stall", seed=seed)))
            with anyio.fail_after(60):
                while not made or not made[0].moving.is_set():
                    await anyio.sleep(0.05)
            driver.cancel()
            [group] = [g async for g in driver.groups()]
        stats = resources.statistics()
    traj = group.trajectories[0]
    assert len(traj.turns) == 1
    if expected == "released":
        assert traj.status is Status.CANCELLED
        assert (stats.released, stats.quarantined) == (1, 0)
    else:
        assert traj.status is Status.QUARANTINED
        assert (stats.released, stats.quarantined) == (0, 1)
        [entry] = traj.info["quarantined_leases"]
        assert "tool:" in entry["reason"] and "did not settle" in entry["reason"]
    assert stats.live == 0 and stats.borrowed == 1
