"""One lifetime for the things plies opens: opened once, closed once, never reopened.

Clients, pools, scopes, sinks, gateways and envs all follow the same three states, so they
share one enum and one base instead of each spelling its own. The base only keeps the state
and words the misuse errors; what opening and closing *do* stays with each class.
`AsyncCloseable` is the base of those closed by one `aclose()`, so that leaving `async with`
and closing by hand are the same call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import StrEnum
from typing import ClassVar

from ._exceptions import UsageError

__all__ = ["AsyncCloseable", "AsyncLifecycle", "Lifecycle", "OpenState"]


class OpenState(StrEnum):
    """Where an object is in its one lifetime."""

    UNOPENED = "unopened"
    """Built; nothing acquired yet."""
    OPEN = "open"
    """Entered: usable."""
    CLOSED = "closed"
    """Closed for good: a new object is needed to start again."""


class Lifecycle:
    """Opens once, closes once. Subclasses call `_open()`, `_close()` and `_check_open()`."""

    _lifecycle_noun: ClassVar[str] = ""
    """How errors name the object (defaults to the class name)."""

    lifecycle: OpenState = OpenState.UNOPENED
    """Where this object is in its lifetime. Not `state`: subclasses (an env's game, a
    trainer's step) want that name for their own."""

    def _noun(self) -> str:
        return self._lifecycle_noun or type(self).__name__

    def _open(self) -> None:
        """Mark the object open. Raises `UsageError` on a second open or a reopen."""
        if self.lifecycle is OpenState.OPEN:
            raise UsageError(f"this {self._noun()} is already open")
        if self.lifecycle is OpenState.CLOSED:
            raise UsageError(f"this {self._noun()} is closed; create a new one")
        self.lifecycle = OpenState.OPEN

    def _close(self) -> bool:
        """Mark the object closed; True only for the call that closed it (close is idempotent)."""
        if self.lifecycle is OpenState.CLOSED:
            return False
        self.lifecycle = OpenState.CLOSED
        return True

    def _check_open(self, action: str = "use it") -> None:
        """Raise `UsageError` unless the object is open, naming what was attempted."""
        if self.lifecycle is OpenState.UNOPENED:
            raise UsageError(f"cannot {action}: this {self._noun()} was never opened")
        if self.lifecycle is OpenState.CLOSED:
            raise UsageError(f"cannot {action}: this {self._noun()} is closed")


class AsyncLifecycle(Lifecycle):
    """A `Lifecycle` entered with `async with`; a plain `with` says so instead of half-working."""

    def __enter__(self) -> None:
        name = type(self).__name__
        raise TypeError(f"use 'async with {name}(...)'; {name} is an async context manager")

    def __exit__(self, *exc_info: object) -> None:  # pragma: no cover - __enter__ raises
        return None


class AsyncCloseable(AsyncLifecycle, ABC):
    """An `AsyncLifecycle` that `aclose()` closes: leaving `async with`, however the block
    ended, is that same call (as with anyio's `AsyncResource`)."""

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @abstractmethod
    async def aclose(self) -> None:
        """Close for good and release what the object holds. Idempotent."""
