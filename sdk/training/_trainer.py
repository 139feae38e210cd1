"""`Trainer`: the surface a training loop is written against, whichever trainer runs it.

Two clients implement it: `TrainingClient` (plies' own wire, `plies serve`'s `/v1/training/`)
and `TinkerTrainingClient` (any Tinker-API service, through the official `tinker` SDK). A
batch means the same update on both: the loss is the mean over the batch's masked tokens,
and logprobs are taken as the batch says it was sampled (docs/training.md compares what each
backend guarantees).

The protocol is the whole of what a loop needs, so no caller asks which client it holds:
the updates, a saved policy, where the trainer stands (`state()`: its step is where a cut-off
script resumes), and the op ledger both keep (`pending_ops`, `quarantined`, `reconcile()`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..trajectory import PolicyRef
from ..wire.training import (
    AdamParams,
    ForwardBackwardResult,
    LossName,
    OptimStepResult,
    TrainerState,
    TrainingBatch,
)

__all__ = ["Trainer"]


@runtime_checkable
class Trainer(Protocol):
    """What a training script calls: gradients, a step, a saved policy, where it stands.

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

    async def state(self) -> TrainerState:
        """Where the trainer stands: `step` counts the optimizer steps its weights hold,
        which is where a script cut off mid-run resumes."""
        ...

    @property
    def pending_ops(self) -> list[str]:
        """forward_backward ops whose gradients the next `optim_step` will apply."""
        ...

    @property
    def quarantined(self) -> str | None:
        """Why the trainer refuses further steps (an outcome it could not learn), or None."""
        ...

    async def reconcile(self) -> object:
        """Learn the outcome of the op that quarantined the trainer; lift the quarantine
        once it is known, and return what the trainer has of it."""
        ...

    async def aclose(self) -> None: ...
