"""Timeouts and retry bounds of policy clients, as objects with named defaults."""

from __future__ import annotations

from dataclasses import dataclass

from .._exceptions import ConfigError

__all__ = ["DEFAULT_RETRY", "DEFAULT_TIMEOUT", "RetryPolicy", "Timeout"]


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


@dataclass(frozen=True)
class RetryPolicy:
    """How often a request that provably never reached an engine is tried again.

    Only refused connections, connect timeouts and 503 (overloaded) answers are retried,
    with jittered exponential waits; a request that may have run is never repeated.
    """

    attempts: int = 4
    initial_wait: float = 0.1
    max_wait: float = 2.0
    down_for: float = 2.0
    """Seconds an engine that refused a connection is skipped before a health probe."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ConfigError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.initial_wait < 0 or self.max_wait < self.initial_wait or self.down_for < 0:
            raise ConfigError(f"inconsistent retry waits: {self}")


DEFAULT_TIMEOUT = Timeout()
DEFAULT_RETRY = RetryPolicy()
