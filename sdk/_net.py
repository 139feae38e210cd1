"""What plies' servers and clients share about connections.

Root-private, like `_durable`: both `plies serve` and `plies gateway` refuse to bind beyond
loopback without a token, and must agree on what loopback is; every client and server
must agree on who closes an idle connection first; and every HTTP client takes its base URL
the same way.
"""

from __future__ import annotations

import ipaddress

from ._exceptions import ConfigError

__all__ = [
    "CLIENT_KEEPALIVE_S",
    "SERVER_HTTP",
    "SERVER_KEEPALIVE_S",
    "http_base_url",
    "is_loopback",
]

SERVER_HTTP = "h11"
"""The HTTP/1.1 parser every plies server runs under uvicorn, named so that uvicorn's "auto"
never picks httptools (installed for the policy clients' transport): h11 drops a connection
whose unfinished request head passes 16 KiB, where uvicorn's httptools protocol keeps every
header line a client sends (`tests/security/test_hostile_requests.py` sends 64 MiB of them)."""

CLIENT_KEEPALIVE_S = 2.0
"""How long plies' HTTP clients keep an idle connection for the next request.

Below the idle timeout of the servers they talk to (uvicorn's default, so vLLM's, is 5 s): a
request sent on a connection in the instant its server closes it fails mid-flight, with an
outcome nobody can know, and a sample is never retried on that. httpx's default expiry is
also 5 s, and loses that race now and then.
"""

SERVER_KEEPALIVE_S = 15
"""How long `plies serve`, `plies gateway` and the OpenEnv server keep an idle connection:
above httpx's 5 s default (the tinker SDK, most Python clients), so that a client reuses a
connection only while the server still wants it."""


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a server reachable from this machine only.

    "localhost" counts; every other name is refused, since a name may resolve anywhere.
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def http_base_url(url: str) -> str:
    """`url` as a client's base, without a trailing slash: the client appends its paths.

    Raises:
        ConfigError: `url` is not http(s), checked here so the mistake is reported where it
            was made rather than at the first request.
    """
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"base URL {url!r} must start with http:// or https://")
    return url.rstrip("/")
