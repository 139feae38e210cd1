"""Timeouts and retry bounds of policy clients, as objects with named defaults (the retry
bounds are plies' one `RetryPolicy`)."""

from __future__ import annotations

from dataclasses import dataclass

from .._exceptions import ConfigError
from .._retry import RetryPolicy

__all__ = ["DEFAULT_RETRY", "DEFAULT_TIMEOUT", "Timeout"]


@dataclass(frozen=True)
class Timeout:
    """Seconds allowed per phase of one HTTP request to an engine.

    `read` bounds the wait for the answer, so it must cover a whole generation (completions
    are not streamed). None disables a phase's limit.

    Example:
        Timeout()                      # the defaults below
        Timeout(read=30.0)             # short generations
        Timeout(connect=1.0, read=5.0)
    """

    connect: float | None = 5.0
    read: float | None = 600.0
    write: float | None = 30.0
    pool: float | None = 30.0

    def __post_init__(self) -> None:
        for name in ("connect", "read", "write", "pool"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"Timeout.{name} must be positive or None, got {value}")


DEFAULT_TIMEOUT = Timeout()
DEFAULT_RETRY = RetryPolicy()
