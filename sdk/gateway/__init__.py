"""The capture gateway: an OpenAI-compatible endpoint that records exact trajectories.

Black-box agents written against the OpenAI client call `/v1/chat/completions` with a
session key as their API key. The gateway renders their messages with `plies.tokens`,
samples through a `plies.policy` client, answers with parsed tool calls, and records every
turn's exact tokens and logprobs into the session's trajectory.

- `Gateway`: sessions and turns (`create_session`, `finish_session`, `drop_session`).
- `create_app`: the ASGI app, to mount on your own server.
- `GatewayServer`: the app served by uvicorn on your event loop.
- `ThreadedGatewayServer`: all of it on its own loop in a daemon thread, for sync trainers.

`plies gateway` runs it standalone, until SIGINT or SIGTERM.
"""

from .._exports import name_after as _name_after
from ._app import create_app as create_app
from ._gateway import Gateway as Gateway
from ._server import GatewayServer as GatewayServer
from ._threaded import ThreadedGatewayServer as ThreadedGatewayServer

__all__ = [
    "Gateway",
    "GatewayServer",
    "ThreadedGatewayServer",
    "create_app",
]

_name_after(__name__, globals())
