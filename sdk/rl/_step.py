"""One optimizer step, taken exactly once however often a crashed run sends it again."""

from __future__ import annotations

from plies import PliesError, TrainingGradientsLost
from plies.training import AdamParams, LossName, Trainer, TrainingBatch

__all__ = ["Metrics", "train_step"]

Metrics = dict[str, float]


async def train_step(
    trainer: Trainer,
    prefix: str,
    batch: TrainingBatch,
    *,
    loss: LossName,
    lr: float,
) -> tuple[Metrics, Metrics]:
    """forward_backward + optim_step with op ids derived from `prefix`, exactly once.

    Re-running a step after a crash sends the same ids: the trainer answers what it already
    applied. When it reports the gradients lost (it restarted between the two calls), the
    forward_backward is redone under a new id and the step is taken once.

    Returns:
        The forward_backward and optim_step metrics.

    Raises:
        PliesError: the gradients were lost three times in a row.
    """
    for attempt in range(3):
        tag = prefix if attempt == 0 else f"{prefix}-redo{attempt}"
        try:
            fb = await trainer.forward_backward(batch, loss=loss, op_id=f"{tag}-fb")
            opt = await trainer.optim_step(AdamParams(lr=lr, grad_clip=1.0), op_id=f"{prefix}-opt")
        except TrainingGradientsLost:
            continue
        return fb.metrics, opt.metrics
    raise PliesError(f"step {prefix}: the trainer lost its gradients three times")
