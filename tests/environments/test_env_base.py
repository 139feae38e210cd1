"""`Env`: tools from signatures, errors as tool messages, single use, and bounded teardown."""

from __future__ import annotations

import threading
from typing import Annotated, Literal

import anyio
import pytest
from pydantic import Field

from plies import EnvError, ToolError, UsageError
from plies._lifecycle import OpenState
from plies.environments import BlackjackEnv, Env, Observation, Task, ToolResult, tool
from plies.environments.blackjack import BlackjackGame, total
from plies.runtime import HoldsRemote

pytestmark = pytest.mark.anyio


class Counter(Env):
    close_timeout_s = 0.5

    def __init__(self, teardown_delay: float = 0.0):
        super().__init__()
        self.total = 0
        self.teardowns = 0
        self.teardown_delay = teardown_delay
        self.sync_thread: int | None = None

    async def setup(self, task: Task) -> Observation:
        self.total = int(task.data.get("start", 0))
        return Observation(messages=[{"role": "user", "content": f"at {self.total}"}])

    async def teardown(self) -> None:
        self.teardowns += 1
        await anyio.sleep(self.teardown_delay)

    @tool
    async def add(
        self,
        n: Annotated[int, Field(ge=1, description="How much to add.")],
        unit: Literal["one", "ten"] = "one",
    ) -> ToolResult:
        """Add n units to the counter.

        This second paragraph is for humans, not the model.
        """
        self.total += n * (10 if unit == "ten" else 1)
        return ToolResult(content=str(self.total), reward=float(n), done=self.total >= 20)

    @tool(name="peek")
    def look(self) -> str:
        """Say the total; runs in a worker thread because it is sync."""
        self.sync_thread = threading.get_ident()
        return f"total {self.total}"

    @tool
    async def refuse(self) -> str:
        """Always refuses."""
        raise ToolError("not today")


async def test_schema_comes_from_the_signature():
    env = Counter()
    obs = await env.reset(Task(id="t"))
    by_name = {t["function"]["name"]: t for t in obs.tools}
    assert sorted(by_name) == ["add", "peek", "refuse"]
    add = by_name["add"]
    assert add["type"] == "function"
    assert add["function"]["description"] == "Add n units to the counter."
    params = add["function"]["parameters"]
    assert params["type"] == "object"
    assert params["required"] == ["n"]
    assert params["additionalProperties"] is False
    assert params["properties"]["n"] == {
        "type": "integer",
        "minimum": 1,
        "description": "How much to add.",
    }
    assert params["properties"]["unit"]["enum"] == ["one", "ten"]
    assert "title" not in params
    assert by_name["peek"]["function"]["parameters"]["properties"] == {}


async def test_bad_calls_become_tool_errors_and_change_nothing():
    env = Counter()
    await env.reset(Task(id="t", data={"start": 3}))
    cases = [
        ("nope", "{}", "unknown tool 'nope'; available tools: add, peek, refuse"),
        ("add", "{}", "n: Field required"),
        ("add", {"n": 0}, "n: Input should be greater than or equal to 1"),
        ("add", {"n": 1, "unit": "hundred"}, "unit: Input should be 'one' or 'ten'"),
        ("add", {"n": 1, "extra": True}, "extra: Extra inputs are not permitted"),
        ("add", "{not json", "arguments are not valid JSON"),
        ("add", "[1]", "arguments must be a JSON object, got list"),
        ("refuse", None, "not today"),
    ]
    for name, args, expected in cases:
        result = await env.call_tool(name, args)
        assert result.error and not result.done and result.reward == 0.0, (name, args)
        assert expected in result.content, (result.content, expected)
    assert env.total == 3
    ok = await env.call_tool("add", '{"n": 2, "unit": "ten"}')
    assert (ok.content, ok.reward, ok.error) == ("23", 2.0, False)


async def test_sync_tools_run_off_the_event_loop():
    env = Counter()
    await env.reset(Task(id="t"))
    result = await env.call_tool("peek", {})
    assert result.content == "total 0"
    assert env.sync_thread is not None and env.sync_thread != threading.get_ident()


async def test_single_use_and_done_are_enforced():
    env = Counter()
    with pytest.raises(UsageError, match="after reset"):
        await env.call_tool("add", {"n": 1})
    await env.reset(Task(id="t"))
    with pytest.raises(UsageError, match="single-use"):
        await env.reset(Task(id="t"))
    result = await env.call_tool("add", {"n": 25})
    assert result.done and env.done
    with pytest.raises(UsageError, match="done"):
        await env.call_tool("add", {"n": 1})
    await env.close()
    await env.close()
    assert env.teardowns == 1
    with pytest.raises(UsageError, match="closed"):
        await env.call_tool("add", {"n": 1})


async def test_close_is_shielded_and_bounded_and_can_be_retried():
    env = Counter(teardown_delay=5.0)
    await env.reset(Task(id="t"))
    with anyio.move_on_after(0.05):  # cancellation does not cut teardown short ...
        with pytest.raises(EnvError, match=r"did not finish in 0\.5s"):  # ... the bound does
            await env.close()
    env.teardown_delay = 0.0
    await env.close()
    assert env.teardowns == 2
    await env.close()
    assert env.teardowns == 2


async def test_a_failing_teardown_is_reported_as_env_error():
    class Leaky(Counter):
        async def teardown(self) -> None:
            self.teardowns += 1
            raise OSError("disk on fire")

    env = Leaky()
    await env.reset(Task(id="t"))
    with pytest.raises(EnvError, match="teardown failed: OSError: disk on fire") as err:
        await env.close()
    assert isinstance(err.value.__cause__, OSError)
    with pytest.raises(EnvError):  # not marked closed: a second close retries
        await env.close()
    assert env.teardowns == 2


async def test_async_with_closes_and_sync_with_points_to_async():
    async with Counter() as env:
        await env.reset(Task(id="t"))
    assert env.teardowns == 1
    with pytest.raises(TypeError, match="async with"), Counter():
        pass


def test_tool_needs_a_description_and_typed_parameters():
    with pytest.raises(UsageError, match="docstring"):

        class NoDoc(Env):
            @tool
            async def x(self) -> str:
                return ""

    with pytest.raises(UsageError, match="type hint"):

        class NoHint(Env):
            @tool
            async def x(self, n) -> str:  # type: ignore[no-untyped-def]
                "X."
                return ""


def test_task_validates():
    with pytest.raises(ValueError):
        Task(id="t", seed=-1)
    with pytest.raises(ValueError):
        Task(id="t", extra=1)  # type: ignore[call-arg]


async def test_blackjack_env_plays_the_same_hands_as_the_rules():
    for seed in range(200):
        game = BlackjackGame.deal(seed)
        async with BlackjackEnv() as env:
            obs = await env.reset(Task(id=f"hand-{seed}", seed=seed))
            assert [t["function"]["name"] for t in obs.tools] == ["hit", "stand"]
            info = obs.info
            assert (info["player_total"], info["dealer_up"]) == (total(game.player), game.dealer[0])
            assert (
                f"The dealer shows {'A' if game.dealer[0] == 1 else game.dealer[0]}."
                in (obs.messages[0]["content"])
            )
            result = None
            while result is None or not result.done:
                move = "hit" if info["player_total"] < 17 else "stand"
                result = await env.call_tool(move, {})
                expected_text = game.hit() if move == "hit" else game.stand()
                assert result.content == expected_text
                assert result.info == game.info()
                info = result.info
                assert {"player_total", "usable_ace", "dealer_up"} <= set(info)
            assert result.reward == game.reward


async def test_blackjack_without_seed_records_a_fresh_one():
    async with BlackjackEnv() as env:
        obs = await env.reset(Task(id="t"))
    game = BlackjackGame.deal(obs.info["seed"])
    assert obs.info["player_cards"] == game.player


async def test_an_env_holds_remote_state_as_the_runtime_names_it():
    env = Counter()
    assert isinstance(env, HoldsRemote) and env.remote_refs() == []
    assert env.lifecycle is OpenState.UNOPENED
    await env.reset(Task(id="t"))
    assert env.lifecycle is OpenState.OPEN
    await env.close()
    assert env.lifecycle is OpenState.CLOSED
    with pytest.raises(UsageError, match="single-use and was already closed"):
        await env.reset(Task(id="t"))
