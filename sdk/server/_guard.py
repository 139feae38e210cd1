"""The server's door: the bearer token and the body size cap, checked before any route runs.

It is plain ASGI middleware so that it holds for every route alike (sampling, training,
loading, the Tinker API, the test fault routes): a route added later cannot forget it.

- Token: when the server has one, every request but the health checks must carry it, as
  `Authorization: Bearer <token>` or `X-API-Key: <token>` (the header the tinker SDK sends its
  api key in). Compared in constant time, so timing does not leak how much of a guess matched.
- Size: a body larger than its route's cap is refused with 413 before it is buffered whole;
  a `Content-Length` over the cap is refused before a byte is read. The training routes
  carry batches and get their own, larger cap.
- Encoding: a `Content-Encoding: zstd` body (the tinker SDK's, when enabled) is decompressed
  here, in a worker thread, under the same cap, whatever size its frames declare: a 32 KB
  frame can declare a gigabyte. The input is fed a few hundred bytes at a time, so no single
  step can produce more than a few megabytes past the cap before it is refused (413). Any
  other encoding is refused (415): the routes read bodies as sent.

The body is buffered here (bounded) and replayed to the app; after that, `receive` passes
through, so a route can still see the client disconnect.
"""

from __future__ import annotations

import hmac
import json

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._exceptions import PliesError

__all__ = ["OPEN_PATHS", "TRAINING_PATHS", "Guard"]

OPEN_PATHS = frozenset({"/health", "/api/v1/healthz"})
"""Answered without the token: liveness only, they reveal nothing and change nothing."""
TRAINING_PATHS = frozenset({"/v1/training/forward_backward", "/api/v1/forward_backward"})
"""Routes whose bodies are training batches, under the larger cap."""

_ZSTD_STEP = 256
"""Compressed bytes fed per decompression step: zstd's densest block turns 4 bytes into
128 KiB, so one step yields at most 8 MiB before the cap is checked again."""


class _TooLarge(PliesError):
    """A decompressed body went past its cap."""


def _unzstd(body: bytes, limit: int) -> bytes:
    """The decompressed `body` (one or more zstd frames), refused once it passes `limit`.

    Blocking: call it in a worker thread.

    Raises:
        ValueError: not zstd, or cut off inside a frame.
        _TooLarge: the output passed `limit` bytes.
    """
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    out = bytearray()
    view = memoryview(body)
    pos = 0
    try:
        while pos < len(body):  # one frame at a time
            frame = dctx.decompressobj()
            while not frame.eof:
                if pos >= len(body):
                    raise ValueError("the zstd body ends inside a frame")
                step = view[pos : pos + _ZSTD_STEP]
                pos += len(step)
                out += frame.decompress(step)
                if len(out) > limit:
                    raise _TooLarge
            pos -= len(frame.unused_data)
    except zstandard.ZstdError as exc:
        raise ValueError(f"malformed zstd body: {exc}") from None
    return bytes(out)


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
        encoding = headers.get(b"content-encoding", b"").strip().lower() or b"identity"
        if encoding != b"identity":
            decoded = await self._decode(send, path, encoding, bytes(body), limit)
            if decoded is None:
                return
            body = bytearray(decoded)
            kept = [(k, v) for k, v in scope["headers"] if k not in _ENCODED_HEADERS]
            kept.append((b"content-length", b"%d" % len(body)))
            scope = {**scope, "headers": kept}
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _decode(
        self, send: Send, path: str, encoding: bytes, body: bytes, limit: int
    ) -> bytes | None:
        """The decoded body, or None once a refusal was sent."""
        if encoding != b"zstd":
            shown = encoding[:40].decode("latin-1")
            message = f"Content-Encoding {shown!r} is not supported; send zstd or none"
            await _refuse(send, 415, "UnsupportedMediaType", message)
            return None
        try:
            return await anyio.to_thread.run_sync(_unzstd, body, limit)
        except _TooLarge:
            message = f"the decompressed request body exceeds the {limit}-byte limit of {path}"
            await _refuse(send, 413, "RequestTooLarge", message)
        except ValueError as exc:
            await _refuse(send, 400, "BadRequestError", str(exc)[:200])
        except ImportError:
            message = "zstd bodies need the zstandard package (pip install 'plies[tinker]')"
            await _refuse(send, 415, "UnsupportedMediaType", message)
        return None

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        assert self._token is not None
        scheme, _, bearer = headers.get(b"authorization", b"").partition(b" ")
        offered = [bearer.strip()] if scheme.lower() == b"bearer" else []
        offered.append(headers.get(b"x-api-key", b"").strip())
        # Both are compared whatever the first gives, so timing does not say which was sent.
        results = [hmac.compare_digest(o, self._token) for o in offered]
        return any(results)


_ENCODED_HEADERS = frozenset({b"content-encoding", b"content-length"})

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
