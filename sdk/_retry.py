"""The one retry policy of plies' own clients (the policy clients, the native training
client): which failures are tried again is each client's to say (only those that provably
never reached the server); how often and how long to wait between tries is `RetryPolicy`'s.

Tenacity runs the loop; it sleeps with anyio, since tenacity's own async sleep is asyncio's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import anyio
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    stop_never,
    wait_random_exponential,
)

from ._exceptions import ConfigError

__all__ = ["RetryPolicy"]


@dataclass(frozen=True)
class RetryPolicy:
    """How often a request that provably never reached its server is tried again.

    Waits are jittered and grow exponentially from `initial_wait` to at most `max_wait`.
    `attempts` bounds the tries (None: until the caller's deadline). A request that may have
    run is never repeated blind: the client learns its outcome first, or reports it unknown.
    """

    attempts: int | None = 4
    initial_wait: float = 0.1
    max_wait: float = 2.0
    down_for: float = 2.0
    """Seconds a policy engine that refused a connection is skipped before a health probe."""

    def __post_init__(self) -> None:
        if self.attempts is not None and self.attempts < 1:
            raise ConfigError(f"RetryPolicy.attempts must be >= 1 or None, got {self.attempts}")
        if self.initial_wait < 0 or self.max_wait < self.initial_wait or self.down_for < 0:
            raise ConfigError(f"inconsistent retry waits: {self}")

    def retrying(
        self,
        retry_on: type[Exception] | tuple[type[Exception], ...],
        *,
        deadline: float | None = None,
    ) -> AsyncRetrying:
        """A tenacity loop that retries `retry_on` until the attempts are spent or
        `deadline` (`time.monotonic()`) has passed, then re-raises the last failure.

        Raises:
            ConfigError: neither bound is set, so the loop could retry forever.
        """
        if self.attempts is None and deadline is None:
            raise ConfigError("RetryPolicy(attempts=None) needs a deadline to stop at")
        stop = stop_never if self.attempts is None else stop_after_attempt(self.attempts)
        if deadline is not None:
            stop = stop | stop_after_delay(max(0.0, deadline - time.monotonic()))
        return AsyncRetrying(
            stop=stop,
            wait=wait_random_exponential(multiplier=self.initial_wait, max=self.max_wait),
            retry=retry_if_exception_type(retry_on),
            sleep=anyio.sleep,
            reraise=True,
        )
