"""The Tinker losses' values AND gradients against an independent torch computation.

The SDK tests (test_training.py) check each loss's value and `loss_fn_outputs` through the
server; a loss's value cannot tell a stop-gradient (cispo's clipped ratio) or a penalty's
gradient (dro's) from a wrong one, so here the server's loss code runs on the tiny model and
its `.grad`s are compared with autograd over the documented formula on full logits.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from plies.server._losses import tinker_loss
from plies.server._tinker._proto import TinkerDatum

SEQS = [
    [9707, 11, 1879, 0, 151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30, 151645],
    [1879, 0, 151644, 872, 198, 3838, 374, 220],
]
CLIP = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}


def _reference(loss_fn: str, lp, q, adv, weights, config) -> torch.Tensor:
    ratio = torch.exp(lp - q)
    if loss_fn == "cross_entropy":
        return -(lp * weights).sum()
    if loss_fn == "importance_sampling":
        return -(ratio * adv).sum()
    low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    if loss_fn == "ppo":
        return -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv).sum()
    if loss_fn == "cispo":
        return -(ratio.clamp(low, high).detach() * lp * adv).sum()
    assert loss_fn == "dro"
    return -(lp * adv - 0.5 * config["beta"] * (lp - q) ** 2).sum()


@pytest.mark.parametrize(
    ("loss_fn", "config"),
    [
        ("cross_entropy", {}),
        ("importance_sampling", {}),
        ("ppo", CLIP),
        ("cispo", CLIP),
        ("cispo", {}),
        ("dro", {"beta": 0.7}),
    ],
)
def test_loss_and_gradients_match_autograd_on_the_formula(base_model, loss_fn, config):
    served, ref = copy.deepcopy(base_model), copy.deepcopy(base_model)
    rng = np.random.default_rng(5)
    data, total = [], torch.zeros((), dtype=torch.float64)
    for tokens in SEQS:
        t = len(tokens) - 1
        with torch.no_grad():
            lp0 = torch.log_softmax(base_model(torch.tensor([tokens[:-1]])).logits[0], -1)
        target = torch.tensor(tokens[1:])
        q = lp0.gather(1, target[:, None])[:, 0] + torch.tensor(rng.normal(0, 0.2, t)).float()
        adv = torch.tensor(rng.normal(0, 1, t) * (rng.random(t) > 0.3)).float()
        weights = torch.tensor(rng.normal(0, 1, t) * (rng.random(t) > 0.3)).float()
        inputs = {"target_tokens": target.numpy().astype(np.int64)}
        if loss_fn == "cross_entropy":
            inputs["weights"] = weights.numpy()
        else:
            inputs |= {"logprobs": q.numpy(), "advantages": adv.numpy()}
        data.append(TinkerDatum(np.array(tokens[:-1], np.int64), inputs))
        logits = ref(torch.tensor([tokens[:-1]])).logits[0].double()
        lp = torch.log_softmax(logits, -1).gather(1, target[:, None])[:, 0]
        total = total + _reference(loss_fn, lp, q.double(), adv.double(), weights.double(), config)
    total.backward()
    # Small head chunks, so the no-gradient rows and the micro-batching are exercised too.
    got = tinker_loss(served, data, loss_fn, config, backward=True, max_head_rows=4)
    assert got.loss == pytest.approx(float(total.detach()), rel=1e-4, abs=1e-4)
    checked = 0
    for p_got, p_ref in zip(served.parameters(), ref.parameters(), strict=True):
        if p_ref.grad is None or not p_ref.grad.abs().sum():
            continue
        scale = float(p_ref.grad.abs().max())
        torch.testing.assert_close(p_got.grad, p_ref.grad.float(), atol=1e-4 * scale, rtol=1e-3)
        checked += 1
    assert checked >= 10, checked  # every layer's weights, not just the head
