"""Leak checks: which processes still belong to a sandbox, read from /proc."""

from __future__ import annotations

from pathlib import Path


def sandbox_processes(root: Path) -> list[int]:
    """Live processes whose `PLIES_SANDBOX_ID` names a sandbox under `root`.

    Local sandboxes label every process they start with that variable, and children inherit
    it, so after an episode or a Ctrl-C this list must be empty: a test's leak check.
    """
    needle = f"PLIES_SANDBOX_ID={root}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if any(v.startswith(needle) for v in environ.split(b"\0")):
                found.append(int(entry.name))
    return found
