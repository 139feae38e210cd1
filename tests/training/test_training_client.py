"""TrainingClient against a real server subprocess: replay, crashes mid-request, quarantine.

Crashes are placed by holding the trainer at a fault point (the servers run with
`--test-faults`) and killing the server while the op waits there.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import httpx
import pytest
from training_batches import random_batch

from plies import (
    ConfigError,
    PolicyError,
    PolicyRef,
    TrainingGradientsLost,
    TrainingQuarantined,
    UsageError,
)
from plies.policy import SamplingParams, VLLMClient, publish
from plies.training import AdamParams, TrainingBatch, TrainingClient
from plies.wire.training import ForwardBackwardResult, OpStatus

pytestmark = pytest.mark.anyio

ADAM = AdamParams(lr=1e-2)


def batch(seed: int = 0) -> TrainingBatch:
    return random_batch(seed, (10, 14), prompt=4)


def journal(state_dir) -> list[dict]:
    lines = (state_dir / "trainer" / "journal.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


async def hold(url: str, point: str) -> None:
    """Make the next op that reaches `point` ("before_apply", "before_answer") wait there."""
    async with httpx.AsyncClient(base_url=url) as http:
        (await http.post("/plies/test/hold", json={"point": point})).raise_for_status()


async def wait_in_flight(url: str, op_id: str, *, applied: bool = False) -> None:
    """Return once the server is inside the op, unanswered (and, if `applied`, past applying
    its gradients)."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        with anyio.fail_after(60):
            while True:
                state = (await http.get("/v1/training/state")).json()
                if state["in_flight"] == op_id and (not applied or op_id in state["pending"]):
                    return
                await anyio.sleep(0.05)


@dataclass
class Sent:
    """Op "s1-fb" as `in_flight` sent it: what it returned, or what it raised."""

    result: ForwardBackwardResult | None = None
    error: Exception | None = None

    def outcome(self) -> ForwardBackwardResult:
        """The result, or the op's error raised again (for `pytest.raises`)."""
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


@asynccontextmanager
async def in_flight(
    trainer: TrainingClient, url: str, *, applied: bool = False
) -> AsyncIterator[Sent]:
    """Send op "s1-fb" (a `forward_backward`) in the background; enter once the server holds
    it (see `wait_in_flight`). Leaving waits for the op to end, however it ends."""
    sent = Sent()

    async def send() -> None:
        try:
            sent.result = await trainer.forward_backward(batch(), op_id="s1-fb")
        except Exception as err:  # the test checks it once the block is over
            sent.error = err

    async with anyio.create_task_group() as tg:
        tg.start_soon(send)
        await wait_in_flight(url, "s1-fb", applied=applied)
        yield sent


@pytest.fixture
def restart(tmp_path, start_server, port) -> Callable[[], Any]:
    """Start the trainer on the test's state dir and port; called again after a kill, it is
    the same trainer restarted: same journal, same URL, so the client can ask it again."""
    return partial(start_server, tmp_path, port=port)


async def test_replayed_op_ids_return_the_original_result_and_publish_serves(
    tmp_path, start_server
):
    server = start_server(tmp_path)
    async with TrainingClient(server.url) as trainer:
        first = await trainer.forward_backward(batch(), op_id="s1-fb")
        async with TrainingClient(server.url) as other:  # e.g. a resumed script
            again = await other.forward_backward(batch(), op_id="s1-fb")
            assert again == first
            with pytest.raises(ConfigError, match="already used"):
                await other.forward_backward(batch(seed=1), op_id="s1-fb")
        assert (await trainer.state()).pending == ["s1-fb"]
        step = await trainer.optim_step(ADAM, op_id="s1-step")
        assert step.step == 1
        assert step.metrics["forward_backward_calls"] == 1
        assert step.metrics["tokens"] == batch().loss_tokens
        async with TrainingClient(server.url) as other:
            assert await other.optim_step(ADAM, op_id="s1-step") == step  # no second step
        assert (await trainer.state()).step == 1
        assert (await trainer.op("s1-fb")).status is OpStatus.APPLIED
        assert await trainer.op("never-sent") is None

        policy = await trainer.save_policy(op_id="s1-save")
        assert await trainer.save_policy(op_id="s1-save") == policy
        assert policy.version == 1 and policy.uri.startswith("file://")
        async with VLLMClient(server.url, "policy-0") as sampler:
            await publish(policy, [sampler])
            await publish(policy, [sampler])  # publishing again is harmless
        async with httpx.AsyncClient(base_url=server.url) as http:
            resp = await http.post(
                "/v1/completions",
                json={"model": "policy-1", "prompt": [1, 2, 3], "max_tokens": 2, "logprobs": 0},
            )
            assert resp.status_code == 200, resp.text
            assert resp.json()["plies_policy"] == policy.model_dump()

        # Through a VLLMClient, the policy package's publish cycle keeps its name map in step.
        await trainer.forward_backward(batch(seed=2), op_id="s2-fb")
        await trainer.optim_step(ADAM, op_id="s2-step")
        policy2 = await trainer.save_policy(op_id="s2-save")
        assert policy2.version == 2 and policy2.digest != policy.digest
        async with VLLMClient(server.url, "policy-0") as sampler:
            await publish(policy, [sampler])  # already served: learnt, not reloaded
            await publish(policy2, [sampler])
            params = SamplingParams(max_tokens=2)
            assert (await sampler.sample([1, 2, 3], params, policy=policy2)).policy == policy2
            assert (await sampler.sample([1, 2, 3], params, policy=policy)).policy == policy
            # The reference server reports what it loaded: other weights are refused.
            forged = PolicyRef(uri=policy2.uri, version=3, digest="sha256:" + "0" * 64)
            with pytest.raises(PolicyError, match="digest"):
                await publish(forged, [sampler])
            with pytest.raises(ConfigError, match="not a PolicyLoader"):
                await publish(policy2, [server.url])
    assert [r["op_id"] for r in journal(tmp_path)] == [
        "s1-fb",
        "s1-step",
        "s1-save",
        "s2-fb",
        "s2-step",
        "s2-save",
    ]


async def test_killed_before_the_gradients_were_applied_the_step_applies_once(tmp_path, restart):
    server = restart()
    await hold(server.url, "before_apply")
    async with TrainingClient(server.url, reconcile_timeout=120) as trainer:
        async with in_flight(trainer, server.url) as sent:
            server.kill()  # the request is in flight and unanswered
            assert not (tmp_path / "trainer" / "journal.jsonl").exists()
            await anyio.to_thread.run_sync(restart)
        # The client asked the restarted server, learnt the op was never applied, and sent
        # it again under the same id: applied once, in the new generation.
        assert sent.outcome().generation == 2
        step = await trainer.optim_step(ADAM)
        assert step.metrics["forward_backward_calls"] == 1
        assert step.metrics["tokens"] == batch().loss_tokens
        state = await trainer.state()
        assert state.step == 1 and state.pending == []
    records = journal(tmp_path)
    assert [r["op_id"] for r in records if r["kind"] == "forward_backward"] == ["s1-fb"]
    assert records[-1]["consumed"] == ["s1-fb"]


async def test_killed_after_applying_but_before_answering_is_reported_lost_not_applied(
    tmp_path, restart
):
    server = restart()
    await hold(server.url, "before_answer")
    async with TrainingClient(server.url, reconcile_timeout=120) as trainer:
        async with in_flight(trainer, server.url, applied=True) as sent:
            # Applied and journaled, but the answer was never sent.
            assert [r["op_id"] for r in journal(tmp_path)] == ["s1-fb"]
            server.kill()
            await anyio.to_thread.run_sync(restart)
        with pytest.raises(TrainingGradientsLost, match="lost its gradients") as err:
            sent.outcome()
        assert err.value.op_ids == ["s1-fb"]
        assert trainer.pending_ops == []
        assert (await trainer.op("s1-fb")).status is OpStatus.LOST
        # The client redoes the step's forward_backward under a new id; the step applies once.
        await trainer.forward_backward(batch(), op_id="s1-fb-redo")
        step = await trainer.optim_step(ADAM)
        assert step.metrics["forward_backward_calls"] == 1
        assert step.metrics["tokens"] == batch().loss_tokens
        assert (await trainer.op("s1-fb")).status is OpStatus.LOST
    assert journal(tmp_path)[-1]["consumed"] == ["s1-fb-redo"]


async def test_unreachable_trainer_quarantines_the_session_until_reconciled(tmp_path, restart):
    server = restart()
    await hold(server.url, "before_apply")
    async with TrainingClient(server.url, reconcile_timeout=2) as trainer:
        async with in_flight(trainer, server.url) as sent:
            server.kill()
        with pytest.raises(TrainingQuarantined, match="could not be asked"):
            sent.outcome()
        assert "s1-fb" in trainer.quarantined
        with pytest.raises(TrainingQuarantined, match="call reconcile"):
            await trainer.forward_backward(batch(), op_id="s2-fb")
        with pytest.raises(TrainingQuarantined):
            await trainer.optim_step(ADAM)
        with pytest.raises(TrainingQuarantined, match="asking again failed"):
            await trainer.reconcile()
        await anyio.to_thread.run_sync(restart)
        assert await trainer.reconcile() is None  # never applied; the caller decides
        assert trainer.quarantined is None
        await trainer.forward_backward(batch(), op_id="s1-fb")
        assert (await trainer.optim_step(ADAM)).step == 1


async def test_a_held_op_goes_on_when_released_and_the_client_checks_its_lifetime(
    tmp_path, start_server
):
    server = start_server(tmp_path)
    trainer = TrainingClient(server.url)
    with pytest.raises(UsageError, match="never opened"):
        await trainer.state()
    with pytest.raises(TypeError, match="async with"), trainer:
        pass
    await hold(server.url, "before_answer")
    async with trainer:
        async with (
            in_flight(trainer, server.url, applied=True) as sent,
            httpx.AsyncClient(base_url=server.url) as http,
        ):
            (await http.post("/plies/test/release")).raise_for_status()
        assert sent.outcome().op_id == "s1-fb" and trainer.pending_ops == ["s1-fb"]
    with pytest.raises(UsageError, match="is closed"):
        await trainer.optim_step(ADAM)


async def test_an_op_id_the_client_completed_is_answered_without_the_server(tmp_path, start_server):
    # The client's op ledger (the one the Tinker client keeps too) answers a repeated op id
    # itself: a script re-running the step it was on needs no reachable trainer for the
    # ops it already saw answered, and a reused id naming another request is refused.
    server = start_server(tmp_path)
    async with TrainingClient(server.url, reconcile_timeout=1) as trainer:
        fb = await trainer.forward_backward(batch(), op_id="s1-fb")
        step = await trainer.optim_step(ADAM, op_id="s1-step")
        server.kill()
        assert await trainer.forward_backward(batch(), op_id="s1-fb") == fb
        assert await trainer.optim_step(ADAM, op_id="s1-step") == step
        assert trainer.pending_ops == []  # an answered forward_backward is not pending again
        with pytest.raises(ConfigError, match="already used"):
            await trainer.forward_backward(batch(seed=1), op_id="s1-fb")
