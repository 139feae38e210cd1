"""plies batches as Tinker datums, so that one batch means the same update on both wires.

A plies `Datum` holds the whole sequence: `tokens[i]` is predicted by position `i - 1`, and
`mask[i] == 1` marks a sampled token. A Tinker datum holds the model input and the targets,
shifted by one: `model_input = tokens[:-1]`, `target_tokens = tokens[1:]`, and every
per-token input (`weights`, `logprobs`, `advantages`) is the plies one from index 1.

Normalisation, made explicit: the native wire averages the per-token loss over the masked
tokens of one `forward_backward` call; a Tinker service sums it. Every loss here is linear
in its per-token weight (cross-entropy's `weights`, the advantages of importance sampling
and PPO; PPO's `min` of two terms that share the factor, which is positive), so each
masked token's weight is divided by `N`, the call's masked-token count, and unmasked
tokens get weight 0. The sum the service computes is then the native mean, its gradient
the native gradient, and one learning rate the same step on both.

Tinker takes logprobs at temperature 1 with no top-k or top-p; a batch sampled otherwise is
refused rather than trained under another distribution than it was sampled from.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .._exceptions import ConfigError
from ..wire.training import LossName, TrainingBatch

if TYPE_CHECKING:
    from tinker import types as tinker_types

__all__ = ["forward_backward_metrics", "loss_config", "tinker_datums"]


def _check_distribution(batch: TrainingBatch) -> None:
    if batch.temperature != 1.0 or batch.top_k not in (-1, 0) or batch.top_p != 1.0:
        raise ConfigError(
            f"a Tinker service takes logprobs at temperature 1 without top-k or top-p; this "
            f"batch was sampled at temperature {batch.temperature}, top_k {batch.top_k}, "
            f"top_p {batch.top_p}. Sample at temperature 1 to train through Tinker"
        )


def tinker_datums(batch: TrainingBatch, loss: LossName) -> list[tinker_types.Datum]:
    """The Tinker datums of `batch` under `loss`, each masked token weighted `1 / N`.

    Raises:
        ConfigError: the batch was not sampled at temperature 1 without top-k or top-p.
    """
    from tinker import types

    _check_distribution(batch)
    scale = 1.0 / batch.loss_tokens
    out = []
    for d in batch.data:
        mask = np.asarray(d.mask[1:], dtype=np.float32)
        inputs: dict[str, Any] = {"target_tokens": np.asarray(d.tokens[1:], dtype=np.int64)}
        if loss == "cross_entropy":
            inputs["weights"] = mask * np.float32(scale)
        else:
            inputs["logprobs"] = np.asarray(d.logprobs[1:], dtype=np.float32) * mask
            advantages = np.asarray(d.advantages[1:], dtype=np.float64) * scale
            inputs["advantages"] = (advantages * mask).astype(np.float32)
        model_input = types.ModelInput.from_ints(d.tokens[:-1])
        out.append(types.Datum(model_input=model_input, loss_fn_inputs=inputs))
    return out


def loss_config(loss: LossName, clip_low: float, clip_high: float) -> dict[str, float] | None:
    """Tinker's `loss_fn_config`: PPO takes ratio bounds, plies the epsilons around 1."""
    if loss != "ppo":
        return None
    return {"clip_low_threshold": 1.0 - clip_low, "clip_high_threshold": 1.0 + clip_high}


def forward_backward_metrics(
    batch: TrainingBatch,
    loss: LossName,
    output: tinker_types.ForwardBackwardOutput,
    clip_low: float,
    clip_high: float,
) -> dict[str, float]:
    """The native wire's metrics, from the service's loss and per-token target logprobs.

    `loss` is the service's `loss:sum`, which the `1 / N` weights make the token mean.
    Policy-gradient losses add the ratio statistics the native trainer reports, computed
    here from the logprobs the service returned (`entropy` needs the full distribution, which
    the Tinker API does not return, so it is left out).
    """
    metrics = {"tokens": float(batch.loss_tokens), "sequences": float(len(batch.data))}
    total = output.metrics.get("loss:sum")
    if total is not None and math.isfinite(total):
        metrics["loss"] = float(total)
    if loss == "cross_entropy":
        return metrics
    diffs, advs = [], []
    for d, record in zip(batch.data, output.loss_fn_outputs, strict=True):
        lp = np.asarray(record["logprobs"].to_numpy(), dtype=np.float64)
        keep = np.asarray(d.mask[1:], dtype=bool)
        diffs.append(lp[keep] - np.asarray(d.logprobs[1:], dtype=np.float64)[keep])
        advs.append(np.asarray(d.advantages[1:], dtype=np.float64)[keep])
    diff, adv = np.concatenate(diffs), np.concatenate(advs)
    ratio = np.exp(diff)
    metrics.update(
        ratio_mean=float(ratio.mean()),
        ratio_min=float(ratio.min()),
        ratio_max=float(ratio.max()),
        kl=float((ratio - 1.0 - diff).mean()),
        logprob_diff_max=float(np.abs(diff).max()),
    )
    if loss == "ppo":
        clipped = np.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
        metrics["clip_fraction"] = float((clipped * adv < ratio * adv).mean())
    return {k: v for k, v in metrics.items() if math.isfinite(v)}
