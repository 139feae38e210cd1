"""What the server's routes share, set on the app when it starts.

It sits in its own module so that the app factory imports the routers and the routers import
only this, never the factory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Request

from ._config import ServerConfig
from ._engine import Engine
from ._policies import PolicyStore

__all__ = ["ServerState", "server_state"]


@dataclass
class ServerState:
    """What routes share: set on `app.state.plies` when the app starts."""

    config: ServerConfig
    store: PolicyStore
    engine: Engine
    tokenizer: Any


def server_state(request: Request) -> ServerState:
    """The running server's state, for route handlers."""
    return request.app.state.plies
