"""Tinker-shaped errors: what the SDK reads from a 4xx, and from a failed future.

The SDK raises `BadRequestError` and friends from any status >= 400, with the parsed JSON body
attached; it retries 408, 409, 429 and 5xx for minutes, and takes an empty 400 for a proxy
rejection. So a permanent refusal is a 400 or 404 that always carries a body saying why.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from .._quote import bounded

__all__ = ["TinkerRequestError", "error_body", "error_response"]


class TinkerRequestError(Exception):
    """A request the Tinker routes refuse; `status` is the HTTP status it is answered with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def error_body(message: str) -> dict[str, Any]:
    """A failed future's result: the SDK raises `RequestFailedError(error)` on it."""
    return {"error": bounded(message), "category": "user"}


def error_response(message: str, status: int = 400) -> JSONResponse:
    """A refused request: `detail` is the message the SDK's exception shows."""
    return JSONResponse({"detail": bounded(message), "category": "user"}, status_code=status)
