"""`Trainer`: the surface a training loop is written against, whichever trainer runs it.

Two clients implement it: `TrainingClient` (plies' own wire, `plies serve`'s `/v1/training/`)
and `TinkerTrainingClient` (any Tinker-API service, through the official `tinker` SDK). A
batch means the same update on both: the loss is the mean over the batch's masked tokens,
and logprobs are taken as the batch says it was sampled (docs/training.md compares what each
backend guarantees).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..trajectory import PolicyRef
from ..wire.training import (
    AdamParams,
    ForwardBackwardResult,
    LossName,
    OptimStepResult,
    TrainingBatch,
)

__all__ = ["Trainer"]


@runtime_checkable
class Trainer(Protocol):
    """What a training script calls: gradients, a step, a saved policy; nothing else.

    Example:
        async def step(trainer: Trainer, batch: TrainingBatch) -> PolicyRef:
            await trainer.forward_backward(batch, loss="importance_sampling")
            await trainer.optim_step(AdamParams(lr=1e-4))
            return await trainer.save_policy()

        async with TrainingClient(url) as native, TinkerTrainingClient(url, ...) as tinker:
            await step(native, batch)  # the same update on both
            await step(tinker, batch)
    """

    async def forward_backward(
        self,
        batch: TrainingBatch,
        *,
        loss: LossName = "importance_sampling",
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        op_id: str | None = None,
    ) -> ForwardBackwardResult:
        """Add the gradients of `batch` (mean loss over its masked tokens) to the step."""
        ...

    async def optim_step(self, adam: AdamParams, *, op_id: str | None = None) -> OptimStepResult:
        """Apply the gradients accumulated since the last step with AdamW."""
        ...

    async def save_policy(self, *, op_id: str | None = None) -> PolicyRef:
        """Save the current weights as a new immutable policy samplers can load."""
        ...

    @property
    def quarantined(self) -> str | None:
        """Why the trainer refuses further steps (an outcome it could not learn), or None."""
        ...

    async def aclose(self) -> None: ...
