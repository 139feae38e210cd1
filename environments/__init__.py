"""Environments: the `Env` base class and its tools, and Blackjack three ways.

- `Env`, `tool`, `Task`, `Observation`, `ToolResult`, `Tool`, `ToolError`, `RemoteRef`: write
  your own env (`ToolError` and `RemoteRef` are re-exported from `plies` and `plies.runtime`).
- `BlackjackEnv`: Blackjack in process.
- `OpenEnvEnv` and `OpenEnvEndpoint`: drive any OpenEnv server through OpenEnv's own client;
  `python -m plies.environments.openenv_server` serves Blackjack as one.
- `SandboxedBlackjackEnv`: the trusted game script run in one sandbox per episode, through a
  `SandboxBackend`: `LocalProcessBackend` or `E2BBackend`; `reap_sandbox` kills one by id and
  `sandbox_reapers()` hands `plies reap` a reaper per sandbox kind.

- `HarborTask`, `HarborEnv`: a Harbor task directory as an env, each episode in a
  `BubblewrapBackend` sandbox that gives the task its absolute paths and no network.
- `McpHost`, `McpServer`, `McpEnv`: an MCP server's tools as an env, one session (and, for a
  stateful stdio server, one process) per episode; `marked_processes` finds any left.
- `EnvMcpServer`: the reverse: an env's tools served over MCP for one episode.

The `openenv`, `e2b` and `mcp` packages are imported only when an env first needs them.
"""

from plies import ToolError as ToolError
from plies.runtime import RemoteRef as RemoteRef

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
from .mcp_client import marked_processes as marked_processes
from .mcp_server import EnvMcpServer as EnvMcpServer
from .openenv_client import OpenEnvEndpoint as OpenEnvEndpoint
from .openenv_client import OpenEnvEnv as OpenEnvEnv
from .reapers import reap_sandbox as reap_sandbox
from .reapers import sandbox_reapers as sandbox_reapers
from .sandbox import CommandResult as CommandResult
from .sandbox import LocalProcessBackend as LocalProcessBackend
from .sandbox import Sandbox as Sandbox
from .sandbox import SandboxBackend as SandboxBackend
from .sandboxed import SandboxedBlackjackEnv as SandboxedBlackjackEnv

__all__ = [
    "BlackjackEnv",
    "BubblewrapBackend",
    "CommandResult",
    "E2BBackend",
    "Env",
    "EnvMcpServer",
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
    "RemoteRef",
    "Sandbox",
    "SandboxBackend",
    "SandboxedBlackjackEnv",
    "Task",
    "Tool",
    "ToolError",
    "ToolResult",
    "marked_processes",
    "reap_sandbox",
    "sandbox_reapers",
    "tool",
]

for _name in __all__:  # show `plies.environments.Task`, not the private module, in reprs
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("plies.environments._"):
        _obj.__module__ = __name__
del _name, _obj
