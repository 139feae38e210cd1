"""plies: exact multi-turn rollouts for agentic reinforcement learning.

The core records and errors live here; subsystems are subpackages: `plies.tokens`
(prompts and parsing), `plies.policy` (sampling clients), `plies.runtime` (resources,
driver, signals, sinks), `plies.training`, `plies.gateway`, `plies.server`,
`plies.environments` and `plies.harness`.
"""

from ._exceptions import AdmissionClosed as AdmissionClosed
from ._exceptions import ConfigError as ConfigError
from ._exceptions import EnvCapacityError as EnvCapacityError
from ._exceptions import EnvError as EnvError
from ._exceptions import GatewayError as GatewayError
from ._exceptions import GatewayRequestError as GatewayRequestError
from ._exceptions import GatewaySessionError as GatewaySessionError
from ._exceptions import LeaseError as LeaseError
from ._exceptions import OperationUnsettled as OperationUnsettled
from ._exceptions import PliesError as PliesError
from ._exceptions import PolicyError as PolicyError
from ._exceptions import PolicyOutcomeUnknown as PolicyOutcomeUnknown
from ._exceptions import PolicyResponseError as PolicyResponseError
from ._exceptions import PolicyUnavailable as PolicyUnavailable
from ._exceptions import PoolExhausted as PoolExhausted
from ._exceptions import SandboxError as SandboxError
from ._exceptions import TokenizationError as TokenizationError
from ._exceptions import ToolError as ToolError
from ._exceptions import TrainingError as TrainingError
from ._exceptions import TrainingGradientsLost as TrainingGradientsLost
from ._exceptions import TrainingQuarantined as TrainingQuarantined
from ._exceptions import TrajectoryError as TrajectoryError
from ._exceptions import UsageError as UsageError
from ._exports import name_after as _name_after
from ._retry import RetryPolicy as RetryPolicy
from .trajectory import Group as Group
from .trajectory import PolicyRef as PolicyRef
from .trajectory import Segment as Segment
from .trajectory import Status as Status
from .trajectory import Trajectory as Trajectory
from .trajectory import Turn as Turn

__all__ = [
    "AdmissionClosed",
    "ConfigError",
    "EnvCapacityError",
    "EnvError",
    "GatewayError",
    "GatewayRequestError",
    "GatewaySessionError",
    "Group",
    "LeaseError",
    "OperationUnsettled",
    "PliesError",
    "PolicyError",
    "PolicyOutcomeUnknown",
    "PolicyRef",
    "PolicyResponseError",
    "PolicyUnavailable",
    "PoolExhausted",
    "RetryPolicy",
    "SandboxError",
    "Segment",
    "Status",
    "TokenizationError",
    "ToolError",
    "TrainingError",
    "TrainingGradientsLost",
    "TrainingQuarantined",
    "Trajectory",
    "TrajectoryError",
    "Turn",
    "UsageError",
]

_name_after(__name__, globals())
