"""Agent loops that play episodes between a policy and an environment.

- `ToolCallingHarness`: the built-in loop (render, sample, parse, call tools, append) with
  `EpisodeLimits` and a `StopReason` on every trajectory it settles.
- `GatewayHarness`: an external agent program (OpenAI client) behind a gateway session.
- `AgentHarness`: an unmodified agent CLI (Claude Code, Codex, OpenCode, pi, mini-swe-agent,
  an OpenAI Agents SDK script) in a `WorkspaceEnv`'s sandbox, through a gateway session; an
  `AgentAdapter` per agent writes its command line, environment and config files.
- `VerifiersHarness`: a verifiers environment (`load_environment()`, its own loop and
  rubric) in a sidecar process of the interpreter that has verifiers, its model calls
  through a gateway session.
- `Harness`: the protocol all of them implement (`play(ctx)`), so any harness feeds any driver.
- `RewardPolicy` (`IllFormedReward`, `TruncationReward`, `UnpaidReward`): what an episode
  that did not end on the env's terms is worth, so every reward a harness settles is finite.
- `EnvGroup` and `play_groups`: one GRPO group's envs, group rewards and shared cleanup, and
  the short way to play a few groups and get them back ready for `training_groups`.
"""

from .adapters import AgentAdapter as AgentAdapter
from .adapters import AgentLaunch as AgentLaunch
from .adapters import AgentsSdk as AgentsSdk
from .adapters import ClaudeCode as ClaudeCode
from .adapters import Codex as Codex
from .adapters import LaunchSpec as LaunchSpec
from .adapters import MiniSweAgent as MiniSweAgent
from .adapters import OpenCode as OpenCode
from .adapters import Pi as Pi
from .agent import AgentHarness as AgentHarness
from .gateway import GatewayHarness as GatewayHarness
from .groups import EnvGroup as EnvGroup
from .groups import play_groups as play_groups
from .protocol import Harness as Harness
from .rewards import IllFormedReward as IllFormedReward
from .rewards import RewardPolicy as RewardPolicy
from .rewards import TruncationReward as TruncationReward
from .rewards import UnpaidReward as UnpaidReward
from .tool_calling import EpisodeLimits as EpisodeLimits
from .tool_calling import StopReason as StopReason
from .tool_calling import ToolCallingHarness as ToolCallingHarness
from .verifiers import VerifiersHarness as VerifiersHarness
from .workspace import McpWorkspaceEnv as McpWorkspaceEnv
from .workspace import WorkspaceEnv as WorkspaceEnv

__all__ = [
    "AgentAdapter",
    "AgentHarness",
    "AgentLaunch",
    "AgentsSdk",
    "ClaudeCode",
    "Codex",
    "EnvGroup",
    "EpisodeLimits",
    "GatewayHarness",
    "Harness",
    "IllFormedReward",
    "LaunchSpec",
    "McpWorkspaceEnv",
    "MiniSweAgent",
    "OpenCode",
    "Pi",
    "RewardPolicy",
    "StopReason",
    "ToolCallingHarness",
    "TruncationReward",
    "UnpaidReward",
    "VerifiersHarness",
    "WorkspaceEnv",
    "play_groups",
]
