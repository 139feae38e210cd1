"""The trainer's op journal on the tiny model: replay, lost gradients, restarts, snapshots.

A "restart" here mostly reopens `Trainer` from the same state dir in process, which is what a
new server process does; the last test SIGKILLs a real `plies serve` instead (the client's
crash tests are in test_training_client.py).
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from training_batches import random_batch

from plies import ConfigError, TrainingError, TrainingGradientsLost
from plies.server import PolicyStore, TrainerConfig
from plies.server._policies import weights_digest
from plies.server._trainer import OpConflict, Trainer
from plies.training import AdamParams, TrainingBatch
from plies.wire.training import (
    ForwardBackwardRequest,
    OpStatus,
    OptimStepRequest,
    SavePolicyRequest,
)

ADAM = AdamParams(lr=1e-2)


def batch(seed: int) -> TrainingBatch:
    return random_batch(seed, (12, 17), prompt=5)


def fb(op_id: str, seed: int = 0) -> ForwardBackwardRequest:
    return ForwardBackwardRequest(op_id=op_id, batch=batch(seed))


def step(op_id: str, ops: list[str]) -> OptimStepRequest:
    return OptimStepRequest(op_id=op_id, adam=ADAM, forward_backward_ops=ops)


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def grads(trainer: Trainer) -> list[torch.Tensor]:
    return [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]


@pytest.fixture
def state(tmp_path, tiny_model_dir):
    store = PolicyStore.open(tmp_path, tiny_model_dir)
    return tmp_path, store


def test_a_repeated_op_id_returns_the_original_result_and_applies_nothing(state):
    state_dir, store = state
    trainer = Trainer.open(state_dir, store)
    first = trainer.forward_backward(fb("a"))
    before = grads(trainer)
    again = trainer.forward_backward(fb("a"))
    assert again == first
    for g0, g1 in zip(before, grads(trainer), strict=True):
        assert torch.equal(g0, g1)
    assert trainer.state().pending == ["a"]
    assert trainer.op("a").status is OpStatus.PENDING
    with pytest.raises(OpConflict, match="op id a was already used"):
        trainer.forward_backward(fb("a", seed=1))
    done = trainer.optim_step(step("s1", ["a"]))
    assert done.metrics["forward_backward_calls"] == 1
    assert done.metrics["tokens"] == batch(0).loss_tokens
    after = weights(trainer)
    assert trainer.optim_step(step("s1", ["a"])) == done
    assert all(torch.equal(after[k], v) for k, v in weights(trainer).items())
    assert trainer.op("a").status is OpStatus.APPLIED
    assert trainer.op("never-sent") is None


def test_optim_step_refuses_partial_gradients_and_discards_them(state):
    state_dir, store = state
    trainer = Trainer.open(state_dir, store)
    trainer.forward_backward(fb("a"))
    before = weights(trainer)
    with pytest.raises(TrainingGradientsLost, match="missing \\['b'\\]") as err:
        trainer.optim_step(step("s1", ["a", "b"]))
    assert err.value.op_ids == ["a", "b"]
    assert all(torch.equal(before[k], v) for k, v in weights(trainer).items())
    assert trainer.state().pending == [] and trainer.step == 0
    assert trainer.op("a").status is OpStatus.LOST
    with pytest.raises(ConfigError, match="no accumulated gradients"):
        trainer.optim_step(step("s2", []))


def test_restart_loses_gradients_loudly_and_keeps_every_applied_step(state):
    state_dir, store = state
    trainer = Trainer.open(state_dir, store)
    trainer.forward_backward(fb("a"))
    trainer.optim_step(step("s1", ["a"]))
    trainer.forward_backward(fb("b", seed=1))  # its gradients die with the "process"
    stepped = weights(trainer)
    opt_state = trainer.optimizer.state_dict()["state"]

    reopened = Trainer.open(state_dir, store)
    assert reopened.generation == trainer.generation + 1
    assert reopened.step == 1
    assert all(torch.equal(stepped[k], v) for k, v in weights(reopened).items())
    for k, v in reopened.optimizer.state_dict()["state"].items():
        assert torch.equal(v["exp_avg"], opt_state[k]["exp_avg"])
    assert reopened.op("a").status is OpStatus.APPLIED
    assert reopened.op("s1").status is OpStatus.APPLIED
    assert reopened.op("b").status is OpStatus.LOST
    with pytest.raises(TrainingGradientsLost, match="redo this step"):
        reopened.forward_backward(fb("b", seed=1))
    with pytest.raises(TrainingGradientsLost):
        reopened.optim_step(step("s2", ["b"]))
    # Redoing the step with a new op id works and steps exactly once on it.
    reopened.forward_backward(fb("b2", seed=1))
    result = reopened.optim_step(step("s2", ["b2"]))
    assert result.step == 2 and result.metrics["forward_backward_calls"] == 1


def test_reopen_repairs_a_crash_between_checkpoint_and_journal(state):
    state_dir, store = state
    trainer = Trainer.open(state_dir, store, TrainerConfig(checkpoint_seconds=0))
    trainer.forward_backward(fb("a"))
    done = trainer.optim_step(step("s1", ["a"]))
    journal = state_dir / "trainer" / "journal.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    assert json.loads(lines[-1])["op_id"] == "s1"
    # Lose the step's journal line and tear the file, as a crash mid-append would.
    journal.write_text("".join(lines[:-1]) + '{"op_id":"torn')

    reopened = Trainer.open(state_dir, store)
    record = reopened.op("s1")
    assert record.status is OpStatus.APPLIED and record.result == done.model_dump(mode="json")
    assert reopened.op("a").status is OpStatus.APPLIED
    assert [json.loads(x)["op_id"] for x in journal.read_text().splitlines()] == ["a", "s1"]


def test_reopen_redoes_the_steps_since_its_checkpoint_from_their_batches(state):
    state_dir, store = state
    trainer = Trainer.open(state_dir, store)  # the default: no checkpoint within 30 s
    trainer.forward_backward(fb("a"))
    trainer.forward_backward(fb("b", seed=1))
    first = trainer.optim_step(step("s1", ["a", "b"]))
    published = trainer.save_policy(SavePolicyRequest(op_id="save-1")).policy
    trainer.forward_backward(fb("c", seed=2))
    second = trainer.optim_step(step("s2", ["c"]))
    trainer.forward_backward(fb("d", seed=3))  # pending: lost with the "process"
    stepped = weights(trainer)
    moments = trainer.optimizer.state_dict()["state"]
    assert trainer.checkpoints.current() is None
    assert len(list((state_dir / "trainer" / "batches").iterdir())) == 4

    # Redone on the weights it started from (version 0), not on the version it published.
    reopened = Trainer.open(state_dir, store)
    assert reopened.step == 2
    assert all(torch.equal(stepped[k], v) for k, v in weights(reopened).items())
    for k, v in reopened.optimizer.state_dict()["state"].items():
        assert torch.equal(v["exp_avg"], moments[k]["exp_avg"])
        assert torch.equal(v["exp_avg_sq"], moments[k]["exp_avg_sq"])
    assert reopened.op("s1").result == first.model_dump(mode="json")
    assert reopened.op("s2").result == second.model_dump(mode="json")
    assert reopened.op("d").status is OpStatus.LOST
    assert reopened.state().policy == published
    # The redo ends in a checkpoint, which covers every batch but none is pending.
    assert reopened.checkpoints.current().name == "2"
    assert list((state_dir / "trainer" / "batches").iterdir()) == []
    again = Trainer.open(state_dir, store)
    assert all(torch.equal(stepped[k], v) for k, v in weights(again).items())


def test_a_step_whose_batch_is_missing_is_refused_at_reopen_not_skipped(state):
    state_dir, store = state
    trainer = Trainer.open(state_dir, store)
    trainer.forward_backward(fb("a"))
    trainer.optim_step(step("s1", ["a"]))
    for held in (state_dir / "trainer" / "batches").iterdir():
        held.unlink()
    with pytest.raises(TrainingError, match="missing: a journaled step cannot be redone"):
        Trainer.open(state_dir, store)


def test_save_policy_publishes_immutable_versions_exactly_once(state):
    state_dir, store = state
    trainer = Trainer.open(state_dir, store)
    trainer.forward_backward(fb("a"))
    trainer.optim_step(step("s1", ["a"]))
    saved = trainer.save_policy(SavePolicyRequest(op_id="save-1"))
    ref = saved.policy
    assert ref.version == 1 and ref.uri.startswith("file://")
    path = store.path(1)
    assert ref.digest == weights_digest(path)
    assert ref.digest != store.get(0).digest
    assert trainer.save_policy(SavePolicyRequest(op_id="save-1")) == saved
    assert store.versions() == [0, 1]
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    second = trainer.save_policy(SavePolicyRequest(op_id="save-2")).policy
    assert second.version == 2 and second.digest == ref.digest
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert Trainer.open(state_dir, store).state().policy == second


def test_kill_9_answers_every_op_id_answered_before_it_the_same_and_applies_none_twice(
    tmp_path, start_server, port
):
    """An `optim_step` answered, then `kill -9` of `plies serve` and a restart: each op id
    sent again gets the answer it got before (from the journal, not a second application),
    and the trainer's step is where the answered ops left it. Plain HTTP, so the server
    answers and not the client's own op ledger."""

    def post(url: str, route: str, req) -> dict:
        body = req.model_dump(mode="json")
        resp = httpx.post(f"{url}/v1/training/{route}", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        return resp.json()

    server = start_server(tmp_path, port=port)
    ops = [("forward_backward", fb("s1-fb")), ("optim_step", step("s1-step", ["s1-fb"]))]
    answered = [post(server.url, route, req) for route, req in ops]
    answered.append(post(server.url, "save_policy", SavePolicyRequest(op_id="s1-save")))
    ops.append(("save_policy", SavePolicyRequest(op_id="s1-save")))
    server.kill()
    server = start_server(tmp_path, port=port)
    assert [post(server.url, route, req) for route, req in ops] == answered
    state = httpx.get(f"{server.url}/v1/training/state", timeout=60).json()
    assert (state["generation"], state["step"], state["pending"]) == (2, 1, [])
    assert httpx.get(f"{server.url}/v1/training/ops/s1-fb").json()["status"] == "applied"
    lines = (tmp_path / "trainer" / "journal.jsonl").read_text().splitlines()
    assert [json.loads(x)["op_id"] for x in lines] == ["s1-fb", "s1-step", "s1-save"]
