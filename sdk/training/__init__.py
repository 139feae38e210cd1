"""Training: check groups, build batches, and drive a remote trainer exactly once.

- `training_groups` refuses groups that must not be trained on, each with a typed reason.
- `grpo_advantages` / `group_advantages` and `training_batch` turn groups into a
  `TrainingBatch` (segments with per-token advantages).
- `TrainingClient` sends `forward_backward`, `optim_step` and `save_policy` with operation
  ids, reconciles unknown outcomes with the server, and publishes policies to samplers.

The loop and its guarantees are described in docs/training.md.
"""

from ._advantages import group_advantages as group_advantages
from ._advantages import grpo_advantages as grpo_advantages
from ._advantages import training_batch as training_batch
from ._client import PolicyLoader as PolicyLoader
from ._client import TrainingClient as TrainingClient
from ._groups import GroupSelection as GroupSelection
from ._groups import Refusal as Refusal
from ._groups import RefusalReason as RefusalReason
from ._groups import Truncated as Truncated
from ._groups import training_groups as training_groups
from ._wire import AdamParams as AdamParams
from ._wire import Datum as Datum
from ._wire import ForwardBackwardResult as ForwardBackwardResult
from ._wire import LossName as LossName
from ._wire import OpRecord as OpRecord
from ._wire import OpStatus as OpStatus
from ._wire import OptimStepResult as OptimStepResult
from ._wire import SavePolicyResult as SavePolicyResult
from ._wire import TrainerState as TrainerState
from ._wire import TrainingBatch as TrainingBatch

__all__ = [
    "AdamParams",
    "Datum",
    "ForwardBackwardResult",
    "GroupSelection",
    "LossName",
    "OpRecord",
    "OpStatus",
    "OptimStepResult",
    "PolicyLoader",
    "Refusal",
    "RefusalReason",
    "SavePolicyResult",
    "TrainerState",
    "TrainingBatch",
    "TrainingClient",
    "Truncated",
    "group_advantages",
    "grpo_advantages",
    "training_batch",
    "training_groups",
]

for _name in __all__:
    if _name != "LossName":
        globals()[_name].__module__ = "plies.training"
del _name
