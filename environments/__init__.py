"""Environments: the `Env` base class and its tools, and Blackjack three ways.

- `Env`, `tool`, `Task`, `Observation`, `ToolResult`, `Tool`: write your own env (with
  `plies.ToolError` to refuse a call and `plies.runtime.RemoteRef` to name remote state).
- `BlackjackEnv`: Blackjack in process; `plies.environments.blackjack_exact` has the game's
  exact values (the optimal strategy, any policy's expected return, a run's decisions priced).
- `OpenEnvEnv` and `OpenEnvEndpoint`: drive any OpenEnv server through OpenEnv's own client;
  `python -m plies.environments.openenv_server` serves Blackjack as one.
- `SandboxedBlackjackEnv`: the trusted game script run in one sandbox per episode, through a
  `SandboxBackend`: `LocalProcessBackend` or `E2BBackend` (a backend of your own makes the
  `Sandbox`es of `plies.environments.sandbox`); `sandbox_reapers()` hands `plies reap` a
  reaper per sandbox kind.

- `HarborTask`, `HarborEnv`: a Harbor task directory as an env, each episode in a
  `BubblewrapBackend` sandbox that gives the task its absolute paths and no network.
- `McpHost`, `McpServer`, `McpEnv`: an MCP server's tools as an env, one session (and, for a
  stateful stdio server, one process) per episode.

The `openenv`, `e2b` and `mcp` packages are imported only when an env first needs them.
"""

from plies._exports import name_after as _name_after

from ._env import Env as Env
from ._env import Observation as Observation
from ._env import Task as Task
from ._env import Tool as Tool
from ._env import ToolResult as ToolResult
from ._env import tool as tool
from .blackjack import BlackjackEnv as BlackjackEnv
from .bubblewrap import BubblewrapBackend as BubblewrapBackend
from .bubblewrap import Forward as Forward
from .e2b_backend import E2BBackend as E2BBackend
from .harbor import HarborEnv as HarborEnv
from .harbor import HarborTask as HarborTask
from .mcp_client import McpEnv as McpEnv
from .mcp_client import McpHost as McpHost
from .mcp_client import McpServer as McpServer
from .openenv_client import OpenEnvEndpoint as OpenEnvEndpoint
from .openenv_client import OpenEnvEnv as OpenEnvEnv
from .reapers import sandbox_reapers as sandbox_reapers
from .sandbox import LocalProcessBackend as LocalProcessBackend
from .sandbox import SandboxBackend as SandboxBackend
from .sandboxed import SandboxedBlackjackEnv as SandboxedBlackjackEnv

__all__ = [
    "BlackjackEnv",
    "BubblewrapBackend",
    "E2BBackend",
    "Env",
    "Forward",
    "HarborEnv",
    "HarborTask",
    "LocalProcessBackend",
    "McpEnv",
    "McpHost",
    "McpServer",
    "Observation",
    "OpenEnvEndpoint",
    "OpenEnvEnv",
    "SandboxBackend",
    "SandboxedBlackjackEnv",
    "Task",
    "Tool",
    "ToolResult",
    "sandbox_reapers",
    "tool",
]

_name_after(__name__, globals())
