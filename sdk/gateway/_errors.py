"""Which HTTP status and error type each failure gets, whatever dialect writes it.

Each dialect wraps the same classification in its own envelope (OpenAI's `{"error": {...}}`,
Anthropic's `{"type": "error", "error": {...}}`), so the official clients raise their typed
exceptions and every dialect refuses the same things with the same status.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from .._exceptions import (
    GatewayRequestError,
    GatewaySessionError,
    PliesError,
    PolicyError,
    PolicyOutcomeUnknown,
    PolicyResponseError,
    PolicyUnavailable,
    TokenizationError,
)
from ._schemas import ErrorType

__all__ = [
    "Failure",
    "HTTPError",
    "classify",
    "forced_tool_choice",
    "validated",
    "validation_error",
]

log = logging.getLogger("plies.gateway")


class HTTPError(PliesError):
    """An HTTP-only refusal (admin routes, body size) with its status and error type."""

    def __init__(self, status: int, type_: ErrorType, message: str):
        super().__init__(message)
        self.status = status
        self.type_ = type_


@dataclass(frozen=True)
class Failure:
    """A failure as the wire states it."""

    status: int
    type_: ErrorType
    message: str
    param: str | None = None


_CLIENT_FAULTS = frozenset({400, 413, 422})
"""Sampler statuses that blame the request (a context too long, a bad seed): passed on as a
400, since the same request would fail again; any other sampler error is the gateway's."""

_STATUS: list[tuple[type[Exception], int, ErrorType]] = [
    (GatewaySessionError, 401, "authentication_error"),
    (GatewayRequestError, 400, "invalid_request_error"),
    (TokenizationError, 400, "invalid_request_error"),
    (PolicyUnavailable, 503, "service_unavailable"),
    (PolicyOutcomeUnknown, 504, "server_error"),
    (PolicyError, 502, "server_error"),
]


def classify(exc: Exception) -> Failure:
    """The status, type and message for any exception; unexpected ones are 500 and logged."""
    if isinstance(exc, HTTPError):
        return Failure(exc.status, exc.type_, str(exc))
    if isinstance(exc, PolicyResponseError) and exc.status in _CLIENT_FAULTS:
        message = f"the policy server refused the request: {exc}"
        return Failure(400, "invalid_request_error", message)
    for cls, status, type_ in _STATUS:
        if isinstance(exc, cls):
            return Failure(status, type_, str(exc), getattr(exc, "param", None))
    log.error("gateway error: %r", exc, exc_info=exc)
    return Failure(500, "server_error", str(exc))


def validation_error(exc: ValidationError) -> GatewayRequestError:
    """A 400 naming the first offending field of a request."""
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    where = f" at {param}" if param else ""
    return GatewayRequestError(f"invalid request{where}: {first['msg']}", param=param)


def forced_tool_choice(choice: object, param: str) -> GatewayRequestError:
    """A 400 for a `tool_choice` other than 'auto' or 'none', worded alike on every wire: the
    gateway samples the policy as it is, so it cannot make the policy call a tool."""
    return GatewayRequestError(
        f"tool_choice {choice!r} is not supported: the gateway samples the policy as it is and "
        "cannot force a tool call; use 'auto' or 'none'",
        param=param,
    )


M = TypeVar("M", bound=BaseModel)


def validated(model: type[M], body: Any) -> M:
    """`body` read as `model`; one that does not fit is the client's 400 (`validation_error`)."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from exc
