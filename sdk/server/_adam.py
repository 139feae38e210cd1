"""AdamW on both training wires: the settings accepted, and a step that is undone when it
would leave a number that is not finite.

Finite settings can still write NaN into float32 weights: `eps=1e-300` is 0 in float32, so a
coordinate whose gradient is 0 divides 0 by 0; `lr * weight_decay` past float32's range
scales every weight by minus infinity; `lr=1e39` is infinite in float32. So the settings are
bounded (`check_adam`), and since extreme but finite gradients can still overflow a moment
(`g * g` past 3.4e38) or an update, every step is checked after it is taken
(`step_or_roll_back`): weights and Adam moments all finite, or the step is undone.

`adam_step` is the whole step both wires take (the native trainer's `optim_step` and a
Tinker tenant's): gradient norm, refusal of a norm that is not finite, the settings, the
clip, the checked step. Each wire only words the refusal (`StepRefused`) its own way.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "MAX_BETA",
    "MAX_EPS",
    "MAX_LR",
    "MIN_EPS",
    "AdamSettings",
    "StepRefused",
    "adam_step",
    "check_adam",
    "step_or_roll_back",
]

MAX_LR = 10.0
"""The largest learning rate: an Adam update moves each weight by about `lr`, so past this a
single step overwrites what the model knew."""
MIN_EPS = 1e-20
"""The smallest `eps`: a float32 normal number, and large enough that a moment which
underflowed to 0 cannot turn a tiny first moment into an update past float32's range."""
MAX_EPS = 1.0
"""The largest `eps` (it bounds the update by `lr * |m| / eps`; past 1 it only stalls)."""
MAX_BETA = 1 - 1e-7
"""The largest beta: above it, beta rounds to 1 in float32 and the moment never decays."""


@dataclass(frozen=True)
class AdamSettings:
    """One step's AdamW settings, as both wires take them (`check_adam` bounds them first).

    `grad_clip`: the gradient norm to clip to, or None for no clipping.
    """

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip: float | None = None


def check_adam(settings: AdamSettings) -> None:
    """Refuse AdamW settings that cannot be applied to float32 weights (the clip is checked
    by each wire's own schema: nothing about float32 bounds it).

    Raises:
        ValueError: which setting is out of which range.
    """
    lr, beta1, beta2 = settings.lr, settings.beta1, settings.beta2
    eps, weight_decay = settings.eps, settings.weight_decay
    values = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}
    bad = [name for name, v in values.items() if not math.isfinite(v)]
    if bad:
        raise ValueError(f"AdamW settings {bad} are not finite")
    if not 0 <= lr <= MAX_LR:
        raise ValueError(f"learning rate {lr:g} is outside [0, {MAX_LR:g}]")
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0 <= beta <= MAX_BETA:
            raise ValueError(f"{name} {beta!r} is outside [0, 1 - 1e-7]")
    if not MIN_EPS <= eps <= MAX_EPS:
        raise ValueError(f"eps {eps:g} is outside [{MIN_EPS:g}, {MAX_EPS:g}]")
    if weight_decay < 0 or lr * weight_decay > 1:
        raise ValueError(
            f"weight_decay {weight_decay:g} must be at least 0 with lr * weight_decay at most 1 "
            f"(AdamW scales each weight by 1 - lr * weight_decay; here {lr * weight_decay:g})"
        )


def _finite(tensors: list[torch.Tensor]) -> bool:
    flags = [torch.isfinite(t).all() for t in tensors if t.is_floating_point()]
    return bool(torch.stack(flags).all()) if flags else True


def step_or_roll_back(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> bool:
    """`optimizer.step()`, undone unless every weight in `params` and every tensor of the
    optimizer's state is finite after it; whether the step stands.

    The weights and the optimizer state are copied before the step (held until it is
    checked): the price of an exact undo.
    """
    weights = [q.detach().clone() for q in params]
    state = copy.deepcopy(optimizer.state_dict())
    optimizer.step()
    moments = [
        t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    ]
    if _finite([q.detach() for q in params] + moments):
        return True
    with torch.no_grad():
        for q, w in zip(params, weights, strict=True):
            q.copy_(w)
    optimizer.load_state_dict(state)
    return False


class StepRefused(ArithmeticError):
    """An AdamW step that was not taken, for a number that is not finite: the weights and the
    optimizer state are as they were. `reason` says which number; `norm` is the gradient norm
    (before clipping)."""

    def __init__(self, reason: str, norm: float):
        super().__init__(reason)
        self.reason = reason
        self.norm = norm


def _grad_norm(params: Sequence[torch.Tensor]) -> float:
    """The 2-norm of every gradient of `params` together; 0 when none has one (every
    trained token was certain under a top-p cut, or no loss term reached them)."""
    norms = [torch.linalg.vector_norm(q.grad) for q in params if q.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def adam_step(
    optimizer: torch.optim.AdamW | None, params: Sequence[torch.Tensor], settings: AdamSettings
) -> tuple[torch.optim.AdamW, float]:
    """One AdamW step with `settings` on the gradients of `params`; the optimizer (made here
    at the first step, so a refused first step leaves none) and the gradient norm before
    clipping. The gradients are left for the caller to clear.

    Raises:
        StepRefused: the gradient norm is not finite (nothing stepped), or the step would
            leave a weight or moment that is not finite (undone, `step_or_roll_back`).
    """
    norm = _grad_norm(params)
    if not math.isfinite(norm):
        raise StepRefused(f"the gradient norm is not finite ({norm})", norm)
    opt = optimizer if optimizer is not None else torch.optim.AdamW(params)
    for group in opt.param_groups:
        group.update(
            lr=settings.lr,
            betas=(settings.beta1, settings.beta2),
            eps=settings.eps,
            weight_decay=settings.weight_decay,
        )
    if settings.grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
    if not step_or_roll_back(opt, params):
        raise StepRefused(
            "the step would have left a weight or an Adam moment that is not finite", norm
        )
    return opt, norm
