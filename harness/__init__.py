"""Agent loops that play episodes between a policy and an environment.

- `ToolCallingHarness`: the built-in loop (render, sample, parse, call tools, append) with
  `EpisodeLimits` and a `StopReason` on every trajectory it settles.
- `GatewayHarness`: an external agent program (OpenAI client) behind a gateway session.
"""

from .gateway import GatewayHarness as GatewayHarness
from .tool_calling import EpisodeLimits as EpisodeLimits
from .tool_calling import StopReason as StopReason
from .tool_calling import ToolCallingHarness as ToolCallingHarness

__all__ = [
    "EpisodeLimits",
    "GatewayHarness",
    "StopReason",
    "ToolCallingHarness",
]
