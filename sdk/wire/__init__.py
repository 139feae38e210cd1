"""Wire schemas shared by plies' clients and its reference server.

- `plies.wire.training`: what `TrainingClient` sends and a trainer answers (`Datum`,
  `TrainingBatch`, `AdamParams`, the requests, results, `OpRecord`, `ErrorCode`).
- `plies.wire.sampling`: the vLLM-shaped (and SGLang-shaped) sampling subset the reference
  server speaks, and `served_name`, the rule that names a served policy.

Both sides import these modules and neither imports the other: the server is a separate
process, and the clients must also work against servers that are not plies. This package
depends only on `plies.trajectory`, the error tree and pydantic.
"""

from .sampling import CompletionRequest as CompletionRequest
from .sampling import GenerateRequest as GenerateRequest
from .sampling import LoadPolicyRequest as LoadPolicyRequest
from .sampling import ModelCard as ModelCard
from .sampling import SGLangSampling as SGLangSampling
from .sampling import UnloadPolicyRequest as UnloadPolicyRequest
from .sampling import served_name as served_name
from .training import OP_ID_PATTERN as OP_ID_PATTERN
from .training import AdamParams as AdamParams
from .training import Datum as Datum
from .training import ErrorCode as ErrorCode
from .training import ForwardBackwardRequest as ForwardBackwardRequest
from .training import ForwardBackwardResult as ForwardBackwardResult
from .training import LossName as LossName
from .training import OpKind as OpKind
from .training import OpRecord as OpRecord
from .training import OpStatus as OpStatus
from .training import OptimStepRequest as OptimStepRequest
from .training import OptimStepResult as OptimStepResult
from .training import SavePolicyRequest as SavePolicyRequest
from .training import SavePolicyResult as SavePolicyResult
from .training import TrainerState as TrainerState
from .training import TrainingBatch as TrainingBatch
from .training import check_op_id as check_op_id

__all__ = [
    "OP_ID_PATTERN",
    "AdamParams",
    "CompletionRequest",
    "Datum",
    "ErrorCode",
    "ForwardBackwardRequest",
    "ForwardBackwardResult",
    "GenerateRequest",
    "LoadPolicyRequest",
    "LossName",
    "ModelCard",
    "OpKind",
    "OpRecord",
    "OpStatus",
    "OptimStepRequest",
    "OptimStepResult",
    "SGLangSampling",
    "SavePolicyRequest",
    "SavePolicyResult",
    "TrainerState",
    "TrainingBatch",
    "UnloadPolicyRequest",
    "check_op_id",
    "served_name",
]
