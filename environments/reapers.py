"""Killing a sandbox a quarantine report names, whatever backend made it.

Its own module, above every backend: the backends import `sandbox` for what they share, so a
reaper there that imported them back would close an import cycle.
"""

from __future__ import annotations

from functools import partial

from plies import ConfigError
from plies.runtime import Reaper

from .bubblewrap import BubblewrapBackend
from .e2b_backend import E2BBackend
from .sandbox import LocalProcessBackend

__all__ = ["SANDBOX_KINDS", "reap_sandbox", "sandbox_reapers"]

SANDBOX_KINDS = (LocalProcessBackend.kind, BubblewrapBackend.kind, E2BBackend.kind)
"""Every sandbox kind `reap_sandbox` can kill."""


async def reap_sandbox(kind: str, sandbox_id: str) -> bool:
    """Kill a sandbox recorded in a report, by its backend's kind and its id.

    A local or bubblewrap sandbox is a marked directory with its processes; E2B sandboxes are
    killed with the API key and domain from the environment (`E2B_API_KEY`, `E2B_DOMAIN`).
    Returns False if it was already gone.

    Raises:
        ConfigError: `kind` is none of `SANDBOX_KINDS`.
    """
    if kind in (LocalProcessBackend.kind, BubblewrapBackend.kind):
        return await LocalProcessBackend().kill(sandbox_id)
    if kind == E2BBackend.kind:
        return await E2BBackend().kill(sandbox_id)
    raise ConfigError(f"unknown sandbox kind {kind!r}; known: {', '.join(SANDBOX_KINDS)}")


def sandbox_reapers() -> dict[str, Reaper]:
    """A reaper per sandbox kind, to merge with the runtime's own.

    The runtime cannot know the sandbox kinds (it sits below the environments), so whoever
    reaps, `plies reap` for one, composes `{**builtin_reapers(), **sandbox_reapers()}`.
    """
    return {kind: partial(reap_sandbox, kind) for kind in SANDBOX_KINDS}
