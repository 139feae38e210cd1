"""Blackjack on a real OpenEnv server (a subprocess on 127.0.0.1), through OpenEnv's client."""

from __future__ import annotations

import signal

import anyio
import pytest
from openenv.core import GenericEnvClient

from plies import EnvCapacityError, EnvError, ToolError, UsageError
from plies.environments import BlackjackEnv, Task, ToolResult
from plies.environments.blackjack import BlackjackGame
from plies.environments.openenv_client import OpenEnvEndpoint, OpenEnvEnv, action_tools

pytestmark = pytest.mark.anyio


async def test_openenvs_own_client_plays_the_plies_server(blackjack_server):
    for seed in range(12):
        game = BlackjackGame.deal(seed)
        async with GenericEnvClient(base_url=blackjack_server["url"]) as client:
            result = await client.reset(seed=seed, episode_id=f"hand-{seed}")
            assert result.observation["text"] == game.opening()
            assert result.done is False
            while not result.done:
                move = "hit" if result.observation["player_total"] < 17 else "stand"
                result = await client.step({"action": move})
                assert result.observation["text"] == (game.hit() if move == "hit" else game.stand())
                assert result.observation["player_cards"] == game.player
            assert result.reward == game.reward
            state = await client.state()
            assert state["episode_id"] == f"hand-{seed}"


async def test_openenv_env_plays_the_same_hands_as_in_process(blackjack_server):
    endpoint = OpenEnvEndpoint(blackjack_server["url"], max_sessions=2)
    for seed in range(12):
        task = Task(id=f"hand-{seed}", seed=seed)
        async with (
            OpenEnvEnv(endpoint, system_prompt="Play well.") as remote,
            BlackjackEnv() as local,
        ):
            obs, expected = await remote.reset(task), await local.reset(task)
            assert obs.messages == [{"role": "system", "content": "Play well."}, *expected.messages]
            assert [t["function"]["name"] for t in obs.tools] == ["hit", "stand"]
            assert obs.tools[0]["function"]["parameters"] == {
                "type": "object", "properties": {}, "additionalProperties": False,
            }  # fmt: skip
            for key in ("player_total", "usable_ace", "dealer_up", "player_cards", "seed"):
                assert obs.info[key] == expected.info[key]
            done = False
            while not done:
                move = "hit" if obs.info["player_total"] < 17 else "stand"
                got, want = await remote.call_tool(move, {}), await local.call_tool(move, {})
                assert (got.content, got.reward, got.done) == (want.content, want.reward, want.done)
                assert {k: got.info[k] for k in want.info} == want.info
                done, obs = got.done, got
        assert endpoint.statistics().sessions_open == 0


async def test_four_times_the_server_capacity_and_no_episode_fails(blackjack_server):
    """The server allows 2 sessions; 8 concurrent episodes share a 2-slot endpoint."""
    endpoint = OpenEnvEndpoint(blackjack_server["url"], max_sessions=2)
    rewards: dict[int, float] = {}

    async def episode(seed: int) -> None:
        async with OpenEnvEnv(endpoint) as env:
            obs = await env.reset(Task(id=f"cap-{seed}", seed=seed))
            info, result = obs.info, None
            while result is None or not result.done:
                await anyio.sleep(0.02)  # hold the session a while
                result = await env.call_tool("hit" if info["player_total"] < 17 else "stand", {})
                info = result.info
            rewards[seed] = result.reward

    async with anyio.create_task_group() as tg:
        for seed in range(8):
            tg.start_soon(episode, seed)
    stats = endpoint.statistics()
    assert sorted(rewards) == list(range(8))
    assert stats.capacity_refusals == 0
    assert stats.peak_sessions == 2
    assert stats.sessions_open == 0


async def test_without_the_limit_the_server_refuses_and_plies_says_so(blackjack_server):
    """Control: an endpoint that overstates capacity sees OpenEnv's refusal as EnvCapacityError."""
    endpoint = OpenEnvEndpoint(blackjack_server["url"], max_sessions=4, capacity_retries=0)
    outcomes: list[str] = []
    opened = anyio.Event()
    attempts = 0

    async def episode(seed: int) -> None:
        nonlocal attempts
        async with OpenEnvEnv(endpoint) as env:
            try:
                await env.reset(Task(id=f"over-{seed}", seed=seed))
                outcomes.append("opened")
            except EnvCapacityError as err:
                assert "refused a session" in str(err) and "2/2" in str(err)
                outcomes.append("refused")
            finally:
                attempts += 1
                if attempts == 4:
                    opened.set()
            await opened.wait()  # hold every open session until all four have tried

    async with anyio.create_task_group() as tg:
        for seed in range(4):
            tg.start_soon(episode, seed)
    assert sorted(outcomes) == ["opened", "opened", "refused", "refused"]
    stats = endpoint.statistics()
    assert (stats.capacity_refusals, stats.sessions_open) == (2, 0)


async def test_a_refusal_caused_by_another_client_is_retried(blackjack_server):
    """Someone outside plies fills the server; plies backs off and gets in once a slot frees."""
    url = blackjack_server["url"]
    endpoint = OpenEnvEndpoint(url, max_sessions=2, capacity_retries=6, capacity_backoff_s=0.1)
    async with GenericEnvClient(base_url=url) as other:
        await other.reset(seed=1)
        squatter = GenericEnvClient(base_url=url)
        await squatter.connect()
        await squatter.reset(seed=2)

        async def leave_once_refused() -> None:
            # The slot frees only after plies was turned away, however slow the machine.
            with anyio.fail_after(60):
                while not endpoint.statistics().capacity_refusals:
                    await anyio.sleep(0.02)
            await squatter.close()

        async with anyio.create_task_group() as tg, OpenEnvEnv(endpoint) as env:
            tg.start_soon(leave_once_refused)
            obs = await env.reset(Task(id="patient", seed=5))
            assert obs.info["seed"] == 5
    assert endpoint.statistics().capacity_refusals >= 1


async def test_bad_calls_are_tool_errors_and_the_session_goes_on(blackjack_server):
    endpoint = OpenEnvEndpoint(blackjack_server["url"], max_sessions=2)
    async with OpenEnvEnv(endpoint) as env:
        await env.reset(Task(id="bad", seed=3))
        unknown = await env.call_tool("double_down", {})
        assert unknown.error and "available tools: hit, stand" in unknown.content
        extra = await env.call_tool("hit", {"cards": 2})
        assert extra.error and "hit takes no arguments" in extra.content
        result = await env.call_tool("stand", "{}")
        assert result.done and not result.error
        with pytest.raises(UsageError):
            await env.call_tool("hit", {})


async def test_unreachable_servers_are_env_errors_and_release_their_slot(start_blackjack_server):
    with pytest.raises(EnvError, match="could not read the OpenEnv schema"):
        await OpenEnvEndpoint("http://127.0.0.1:9", max_sessions=1).schema()
    with start_blackjack_server(max_sessions=1) as server:
        endpoint = OpenEnvEndpoint(server["url"], max_sessions=1, message_timeout_s=5)
        env = OpenEnvEnv(endpoint)
        await env.reset(Task(id="lost", seed=1))
        assert [r.kind for r in env.remote_refs()] == ["openenv-session"]
        server["process"].send_signal(signal.SIGKILL)
        server["process"].wait()
        with pytest.raises(EnvError, match="OpenEnv server"):
            await env.call_tool("hit", {})
        with pytest.raises(EnvError, match="connection to the OpenEnv session was lost"):
            await env.call_tool("hit", {})
        await env.close()
        assert endpoint.statistics().sessions_open == 0
        async with OpenEnvEnv(endpoint) as fresh:  # the schema is cached; the socket is not
            with pytest.raises(EnvError, match=r"lost the connection .* open a session"):
                await fresh.reset(Task(id="dead", seed=1))
        assert endpoint.statistics().sessions_open == 0


async def test_actions_that_are_not_one_enum_become_one_validated_step_tool():
    schema = {
        "type": "object",
        "title": "MoveAction",
        "description": "Move a piece.",
        "additionalProperties": False,
        "properties": {
            "metadata": {"type": "object", "title": "Metadata"},
            "piece": {"type": "string", "title": "Piece"},
            "to": {"type": "integer", "minimum": 0, "maximum": 63, "title": "To"},
        },
        "required": ["piece", "to"],
    }
    sent: list[dict] = []

    async def send(action: dict) -> ToolResult:
        sent.append(action)
        return ToolResult(content="moved")

    (step,) = action_tools(schema, send, step_tool_name="move")
    assert step.schema()["function"] == {
        "name": "move",
        "description": "Move a piece.",
        "parameters": {
            "type": "object",
            "description": "Move a piece.",
            "additionalProperties": False,
            "properties": {
                "piece": {"type": "string"},
                "to": {"type": "integer", "minimum": 0, "maximum": 63},
            },
            "required": ["piece", "to"],
        },
    }
    assert (await step.run({"piece": "knight", "to": 18})).content == "moved"
    for bad, message in [
        ({"piece": "knight"}, "'to' is a required property"),
        ({"piece": "knight", "to": 64}, "to: 64 is greater than the maximum of 63"),
        ({"piece": "knight", "to": 1, "metadata": {}}, "Additional properties are not allowed"),
    ]:
        with pytest.raises(ToolError, match=message):
            await step.run(bad)
    assert sent == [{"piece": "knight", "to": 18}]


async def test_enums_behind_a_ref_become_one_tool_per_value():
    schema = {
        "$defs": {"Dir": {"enum": ["left", "right"], "type": "string", "title": "Dir"}},
        "properties": {"dir": {"$ref": "#/$defs/Dir", "description": "Where to go."}},
        "required": ["dir"],
        "type": "object",
    }

    async def send(action: dict) -> ToolResult:
        return ToolResult(content=str(action))

    tools = action_tools(schema, send)
    assert [t.name for t in tools] == ["left", "right"]
    assert tools[1].description == "Play 'right'. Where to go."
    assert (await tools[1].run({})).content == "{'dir': 'right'}"
