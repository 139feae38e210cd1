"""Agent loops that play episodes between a policy and an environment.

- `ToolCallingHarness`: the built-in loop (render, sample, parse, call tools, append) with
  `EpisodeLimits` and a `StopReason` on every trajectory it settles.
- `GatewayHarness`: an external agent program (OpenAI client) behind a gateway session.
- `RewardPolicy` (`IllFormedReward`, `TruncationReward`, `UnpaidReward`): what an episode
  that did not end on the env's terms is worth, so every reward a harness settles is finite.
- `EnvGroup` and `play_groups`: one GRPO group's envs, group rewards and shared cleanup, and
  the short way to play a few groups and get them back ready for `training_groups`.
"""

from .gateway import GatewayHarness as GatewayHarness
from .groups import DEFAULT_GROUP_SIZE as DEFAULT_GROUP_SIZE
from .groups import EnvGroup as EnvGroup
from .groups import play_groups as play_groups
from .rewards import DEFAULT_ILL_FORMED_REWARD as DEFAULT_ILL_FORMED_REWARD
from .rewards import DEFAULT_REWARDS as DEFAULT_REWARDS
from .rewards import DEFAULT_UNPAID_REWARD as DEFAULT_UNPAID_REWARD
from .rewards import IllFormedReward as IllFormedReward
from .rewards import RewardPolicy as RewardPolicy
from .rewards import TruncationReward as TruncationReward
from .rewards import UnpaidReward as UnpaidReward
from .tool_calling import EpisodeLimits as EpisodeLimits
from .tool_calling import StopReason as StopReason
from .tool_calling import ToolCallingHarness as ToolCallingHarness

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "DEFAULT_ILL_FORMED_REWARD",
    "DEFAULT_REWARDS",
    "DEFAULT_UNPAID_REWARD",
    "EnvGroup",
    "EpisodeLimits",
    "GatewayHarness",
    "IllFormedReward",
    "RewardPolicy",
    "StopReason",
    "ToolCallingHarness",
    "TruncationReward",
    "UnpaidReward",
    "play_groups",
]
