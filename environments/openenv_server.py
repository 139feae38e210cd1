"""Blackjack served as an OpenEnv environment, on 127.0.0.1 by default.

    python -m plies.environments.openenv_server --port 0 --max-sessions 8

prints one JSON line, `{"url": "http://127.0.0.1:PORT", "max_sessions": 8}`, on stdout once it
accepts connections; logs go to stderr. Each WebSocket session (`/ws`) gets its own
`BlackjackEnvironment`; OpenEnv refuses sessions beyond `--max-sessions` rather than
queueing them (see `OpenEnvEndpoint` for the client-side limit). The app comes from OpenEnv's
own factory with its web UI off. Any OpenEnv client can play it:

    async with GenericEnvClient(base_url=url) as client:
        result = await client.reset(seed=7)
        result = await client.step({"action": "stand"})
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
from typing import Any, Literal

import anyio
import uvicorn
from fastapi import FastAPI
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from .._net import SERVER_HTTP, SERVER_KEEPALIVE_S
from ._blackjack_game import BlackjackGame, IllegalMove
from .blackjack import new_seed

__all__ = [
    "BlackjackAction",
    "BlackjackEnvironment",
    "BlackjackObservation",
    "create_blackjack_app",
    "main",
]


class BlackjackAction(Action):
    """One move."""

    action: Literal["hit", "stand"] = Field(
        description="hit: take another card (over 21 loses at once); stand: end your turn."
    )


class BlackjackObservation(Observation):
    """What the player sees: the text for the model and the facts behind it."""

    text: str = Field(description="The situation in words, for the model.")
    seed: int = Field(description="The deal's seed.")
    player_cards: list[int] = Field(description="The player's cards, ace as 1.")
    player_total: int = Field(description="The player's best total.")
    usable_ace: bool = Field(description="Whether an ace counts 11 in that total.")
    dealer_up: int = Field(description="The dealer's face-up card, ace as 1.")
    dealer_cards: list[int] | None = Field(default=None, description="Shown when the hand ends.")
    dealer_total: int | None = Field(default=None, description="Shown when the hand ends.")


class BlackjackEnvironment(Environment[BlackjackAction, BlackjackObservation, State]):
    """One hand per reset; the same rules object as the in-process `BlackjackEnv`."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each session owns its instance; nothing is shared

    def __init__(self) -> None:
        super().__init__()
        self._game: BlackjackGame | None = None
        self._state = State()

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> BlackjackObservation:
        self._game = BlackjackGame.deal(new_seed() if seed is None else seed)
        self._state = State(episode_id=episode_id, step_count=0)
        return self._observe(self._game.opening())

    def step(
        self, action: BlackjackAction, timeout_s: float | None = None, **kwargs: Any
    ) -> BlackjackObservation:
        if self._game is None:
            raise IllegalMove("reset before stepping")
        text = self._game.hit() if action.action == "hit" else self._game.stand()
        self._state.step_count += 1
        return self._observe(text)

    @property
    def state(self) -> State:
        return self._state

    def _observe(self, text: str) -> BlackjackObservation:
        game = self._game
        assert game is not None
        return BlackjackObservation(text=text, done=game.done, reward=game.reward, **game.info())


def create_blackjack_app(max_sessions: int) -> FastAPI:
    """The OpenEnv app for Blackjack, allowing `max_sessions` concurrent WebSocket sessions.

    `create_fastapi_app` is the factory OpenEnv's `create_app` delegates to when the web UI
    is off; calling it directly keeps the UI off whatever the environment says.
    """
    if max_sessions < 1:
        raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
    return create_fastapi_app(
        BlackjackEnvironment,
        BlackjackAction,
        BlackjackObservation,
        max_concurrent_envs=max_sessions,
        env_name="blackjack",
    )


async def serve(host: str, port: int, max_sessions: int) -> None:
    """Serve until cancelled or signalled; print the ready line once accepting connections."""
    app = create_blackjack_app(max_sessions)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it: without it each kept-alive response waits out a
    # delayed ACK (about 40 ms on Linux loopback).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    config = uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        timeout_keep_alive=SERVER_KEEPALIVE_S,
        http=SERVER_HTTP,
    )
    server = uvicorn.Server(config)
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, [sock])
        while not server.started:
            if server.should_exit:
                return
            await anyio.sleep(0.01)
        bound_port = sock.getsockname()[1]
        ready = {"url": f"http://{host}:{bound_port}", "max_sessions": max_sessions}
        print(json.dumps(ready), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve Blackjack as an OpenEnv environment.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--max-sessions", type=int, default=8)
    args = parser.parse_args(argv)
    if args.max_sessions < 1:
        parser.error("--max-sessions must be at least 1")
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    anyio.run(serve, args.host, args.port, args.max_sessions)


if __name__ == "__main__":
    main()
