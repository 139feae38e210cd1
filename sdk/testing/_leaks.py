"""Leak checks: whether a process still runs, which still belong to a sandbox, read from /proc."""

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


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie.

    A killed child stays in the process table as a zombie until its parent reaps it, so
    `os.kill(pid, 0)` still succeeds on it; a leak check must count it as gone.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # the state follows the command name
