"""The HTTP/1.1 of the loopback engines in the policy tests, read and written by hand.

Those tests count connections, hold requests, misbehave on the wire and record the headers
each request carried, which a real server framework hides or does not allow; so each engine
serves raw sockets, and the request framing they all need lives here once.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from anyio.abc import SocketStream


@dataclass
class Request:
    """One request as it arrived: its path, its headers (names lower-cased), its body."""

    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def requests(stream: SocketStream) -> AsyncIterator[Request]:
    """Each request on a kept-alive connection, in order; `anyio.EndOfStream` (or
    `BrokenResourceError`) when the client closes it, for the engine to catch."""
    buf = b""
    while True:
        while b"\r\n\r\n" not in buf:
            buf += await stream.receive()
        head, _, rest = buf.partition(b"\r\n\r\n")
        first, *lines = head.decode().split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)}
        length = int(headers.get("content-length", 0))
        while len(rest) < length:
            rest += await stream.receive()
        body, buf = rest[:length], rest[length:]
        yield Request(first.split(" ")[1], headers, body)


def response(status: int, body: bytes) -> bytes:
    """A whole JSON response with its length, so the connection stays open for the next."""
    return (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body
