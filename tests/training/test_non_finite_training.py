"""Numbers that would overflow float32 never reach the weights.

A masked sampler logprob of -200 or -1e39, or an advantage of 1e38, is finite in float64 and
overflowed `exp(logprob - sampler_logprob)` or the loss sum in float32; one such datum used
to turn every weight NaN for good. Here: the wire refuses them, the loss clamps the log-ratio,
the trainer refuses a non-finite loss per op and never steps on a non-finite gradient norm.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from pydantic import ValidationError
from test_trainer_journal import fb, grads, step, weights
from training_batches import random_batch

from plies import TrainingGradientsLost
from plies.server import PolicyStore
from plies.server._losses import batch_loss
from plies.server._trainer import NonFiniteLoss, Trainer
from plies.training import Datum, TrainingBatch
from plies.wire.training import ForwardBackwardRequest, ForwardBackwardResult, OptimStepResult


def poisoned(*, logprob: float | None = None, advantage: float | None = None) -> TrainingBatch:
    """A random batch with one masked value replaced, built without validation (as a server
    older than the checks, or a client bypassing them, would have let it through)."""
    good = random_batch(3, (12,), prompt=5)
    d = good.data[0]
    logprobs, advantages = list(d.logprobs), list(d.advantages)
    if logprob is not None:
        logprobs[7] = logprob
    if advantage is not None:
        advantages[7] = advantage
    datum = Datum.model_construct(
        tokens=d.tokens, mask=d.mask, logprobs=logprobs, advantages=advantages
    )
    return TrainingBatch.model_construct(data=[datum], temperature=1.0, top_k=-1, top_p=1.0)


@pytest.fixture
def trainer(tmp_path, tiny_model_dir) -> Trainer:
    return Trainer.open(tmp_path, PolicyStore.open(tmp_path, tiny_model_dir))


@pytest.mark.parametrize("lp", [-200.0, -1e39])
@pytest.mark.parametrize("loss", ["importance_sampling", "ppo"])
def test_the_ratio_comes_from_a_clamped_log_ratio(trainer, lp, loss):
    metrics = batch_loss(trainer.model, poisoned(logprob=lp), loss)
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["ratio_max"])
    assert all(torch.isfinite(g).all() for g in grads(trainer))


def test_a_non_finite_loss_is_refused_and_the_other_ops_gradients_are_kept(trainer):
    trainer.forward_backward(fb("good"))
    before = grads(trainer)
    bad = ForwardBackwardRequest.model_construct(
        op_id="bad", batch=poisoned(advantage=1e38), loss="importance_sampling",
        clip_low=0.2, clip_high=0.2,
    )  # fmt: skip
    with pytest.raises(NonFiniteLoss, match="not finite"):
        trainer.forward_backward(bad)
    assert trainer.state().pending == ["good"] and trainer.op("bad") is None
    for g0, g1 in zip(before, grads(trainer), strict=True):
        assert torch.equal(g0, g1)
    trainer.optim_step(step("s1", ["good"]))
    assert all(torch.isfinite(w).all() for w in weights(trainer).values())


def test_optim_step_never_steps_on_a_non_finite_gradient_norm(trainer):
    trainer.forward_backward(fb("a"))
    kept = weights(trainer)
    next(p for p in trainer.model.parameters() if p.grad is not None).grad[0] = math.inf
    with pytest.raises(TrainingGradientsLost, match="gradient norm") as refused:
        trainer.optim_step(step("s1", ["a"]))
    assert refused.value.op_ids == ["a"] and trainer.step == 0
    assert trainer.state().pending == [] and trainer.op("s1") is None
    for name, w in weights(trainer).items():
        assert torch.equal(w, kept[name]), name


@pytest.mark.parametrize(
    "logprob,advantage,match",
    [
        (-200.0, None, "below -100"),
        (-1e39, None, "below -100"),
        (None, 1e38, "exceeds"),
        (math.nan, None, "non-finite"),
    ],
)
def test_the_wire_refuses_values_that_overflow_float32(logprob, advantage, match):
    d = poisoned(logprob=logprob, advantage=advantage).data[0]
    with pytest.raises(ValidationError, match=match):
        Datum(tokens=d.tokens, mask=d.mask, logprobs=d.logprobs, advantages=d.advantages)


def test_the_wire_refuses_sampling_and_loss_settings_that_give_nan_gradients():
    data = random_batch(1, (8,), prompt=3).data
    for temperature in (1e-45, math.nan, math.inf):
        with pytest.raises(ValidationError):
            TrainingBatch(data=data, temperature=temperature)
    with pytest.raises(ValidationError):
        ForwardBackwardRequest(op_id="x", batch=TrainingBatch(data=data), clip_high=1e308)


def test_undefined_metrics_never_go_out_as_null():
    fb_result = ForwardBackwardResult(
        op_id="x", generation=1, step=0, metrics={"loss": 1.0, "kl": math.nan}
    )
    step_result = OptimStepResult(op_id="y", step=1, metrics={"grad_norm": math.inf, "lr": 0.1})
    assert json.loads(fb_result.model_dump_json())["metrics"] == {"loss": 1.0}
    assert json.loads(step_result.model_dump_json())["metrics"] == {"lr": 0.1}
