"""Training: check groups, build batches, and drive a remote trainer exactly once.

- `training_groups` refuses groups that must not be trained on, each with a typed reason.
- `grpo_advantages` (of a group's rewards) and `training_batch` turn groups into a
  `TrainingBatch` (segments with per-token advantages).
- `TrainingClient` sends `forward_backward`, `optim_step` and `save_policy` with operation
  ids and reconciles unknown outcomes with the server.
- `TinkerTrainingClient` offers the same calls on any Tinker-API service (the `tinker` SDK,
  `plies[tinker]`); `Trainer` is the protocol both implement, what training loops take.

The schemas are defined in `plies.wire.training`, shared with the server; the ones a training
script builds (`Datum`, `TrainingBatch`, `AdamParams`, `LossName`) are re-exported here, the
results it reads are not. Publishing a saved policy
to samplers is `plies.policy.publish`. The loop and its guarantees are in docs/training.md.
"""

from .._exports import name_after as _name_after
from ..wire.training import AdamParams as AdamParams
from ..wire.training import Datum as Datum
from ..wire.training import LossName as LossName
from ..wire.training import TrainingBatch as TrainingBatch
from ._advantages import grpo_advantages as grpo_advantages
from ._advantages import training_batch as training_batch
from ._client import TrainingClient as TrainingClient
from ._groups import RefusalReason as RefusalReason
from ._groups import Truncated as Truncated
from ._groups import training_groups as training_groups
from ._tinker import TinkerTrainingClient as TinkerTrainingClient
from ._trainer import Trainer as Trainer

__all__ = [
    "AdamParams",
    "Datum",
    "LossName",
    "RefusalReason",
    "TinkerTrainingClient",
    "Trainer",
    "TrainingBatch",
    "TrainingClient",
    "Truncated",
    "grpo_advantages",
    "training_batch",
    "training_groups",
]

_name_after(__name__, globals())
