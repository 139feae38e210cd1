"""The server's door: the bearer token and the body size cap, checked before any route runs.

It is plain ASGI middleware so that it holds for every route alike (sampling, training,
loading, the Tinker API, the test fault routes): a route added later cannot forget it.

- Token: when the server has one, every request but the health checks must carry it, as
  `Authorization: Bearer <token>` or `X-API-Key: <token>` (the header the tinker SDK sends its
  api key in). Compared in constant time, so timing does not leak how much of a guess matched.
- Size: a body larger than its route's cap is refused with 413 before it is buffered whole;
  a `Content-Length` over the cap is refused before a byte is read. The training routes
  carry batches and get their own, larger cap.

The body is buffered here (bounded) and replayed to the app; after that, `receive` passes
through, so a route can still see the client disconnect.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["OPEN_PATHS", "TRAINING_PATHS", "Guard"]

OPEN_PATHS = frozenset({"/health", "/api/v1/healthz"})
"""Answered without the token: liveness only, they reveal nothing and change nothing."""
TRAINING_PATHS = frozenset({"/v1/training/forward_backward", "/api/v1/forward_backward"})
"""Routes whose bodies are training batches, under the larger cap."""


class Guard:
    """ASGI middleware: refuse unauthenticated (401) and oversized (413) requests.

    Args:
        app: the app behind the door.
        token: the secret every request must present; None admits all (loopback only, see
            `serve`).
        max_body_bytes: the cap on every other body.
        max_training_body_bytes: the cap on `TRAINING_PATHS` bodies.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        token: str | None,
        max_body_bytes: int,
        max_training_body_bytes: int,
    ) -> None:
        self.app = app
        self._token = token.encode() if token else None
        self._max = max_body_bytes
        self._max_training = max_training_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        headers = dict(scope["headers"])
        if self._token is not None and path not in OPEN_PATHS and not self._authorized(headers):
            await _refuse(send, 401, "AuthenticationError", _AUTH_MESSAGE)
            return
        limit = self._max_training if path in TRAINING_PATHS else self._max
        declared = headers.get(b"content-length", b"").strip()
        if declared.isdigit() and int(declared) > limit:
            await _refuse(send, 413, "RequestTooLarge", _too_large(path, int(declared), limit))
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before the body ended
                return
            body += message.get("body", b"")
            if len(body) > limit:
                await _refuse(send, 413, "RequestTooLarge", _too_large(path, len(body), limit))
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        assert self._token is not None
        scheme, _, bearer = headers.get(b"authorization", b"").partition(b" ")
        offered = [bearer.strip()] if scheme.lower() == b"bearer" else []
        offered.append(headers.get(b"x-api-key", b"").strip())
        # Both are compared whatever the first gives, so timing does not say which was sent.
        results = [hmac.compare_digest(o, self._token) for o in offered]
        return any(results)


_AUTH_MESSAGE = (
    "this server needs its token: send Authorization: Bearer <token> (or X-API-Key: <token>)"
)


def _too_large(path: str, size: int, limit: int) -> str:
    return f"request body of {size} bytes or more exceeds the {limit}-byte limit of {path}"


async def _refuse(send: Send, status: int, kind: str, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
