"""`GatewayServer(uds=...)`: the same app on a Unix socket, for agents in sandboxes with no network.

A sandbox's forwarded port leads to this socket (`plies.environments.Forward`); the agents
tier drives Codex and Claude Code through it. Here: the socket answers what TCP answers,
only its owner may open it, a stale socket is replaced, any other file there is refused,
and the socket goes with the server.
"""

from __future__ import annotations

import socket
import stat
import tempfile
from pathlib import Path

import httpx
import pytest

from plies import GatewayError
from plies.gateway import Gateway, GatewayServer
from plies.testing import ScriptedPolicy
from plies.tokens import ChatRenderer

pytestmark = pytest.mark.anyio


async def test_the_gateway_answers_on_its_unix_socket(qwen3_tokenizer):
    gateway = Gateway(ScriptedPolicy(qwen3_tokenizer, ["hi"]), ChatRenderer(qwen3_tokenizer))
    with tempfile.TemporaryDirectory(prefix="plies-uds-") as short:
        path = Path(short) / "gw.sock"
        path.touch()
        async with gateway:
            with pytest.raises(GatewayError, match=r"gw\.sock"):  # not a socket: left alone
                async with GatewayServer(gateway, uds=path):
                    pass
            assert path.is_file()
            path.unlink()
            with socket.socket(socket.AF_UNIX) as stale:  # an earlier run's, never removed
                stale.bind(str(path))
            for _ in range(2):  # the first replaces the stale socket; the second finds none
                async with GatewayServer(gateway, uds=path) as server:
                    assert stat.S_IMODE(path.stat().st_mode) == 0o600
                    transport = httpx.AsyncHTTPTransport(uds=str(path))
                    async with httpx.AsyncClient(transport=transport) as over_uds:
                        got = await over_uds.get(f"http://127.0.0.1:{server.port}/health")
                    async with httpx.AsyncClient() as over_tcp:
                        want = await over_tcp.get(f"http://127.0.0.1:{server.port}/health")
                    assert got.status_code == want.status_code == 200
                    assert got.json() == want.json()
                assert not path.exists()
