"""What the servers share about where they listen.

Root-private, like `_durable`: both `plies serve` and `plies gateway` refuse to bind beyond
loopback without a token, and must agree on what loopback is.
"""

from __future__ import annotations

import ipaddress

__all__ = ["is_loopback"]


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
