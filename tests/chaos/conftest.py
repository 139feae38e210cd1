"""The chaos suite's table, printed at the end of the session whether the trials passed or not."""

from __future__ import annotations

import pytest

TABLES = pytest.StashKey[list[str]]()


@pytest.fixture
def chaos_tables(request: pytest.FixtureRequest) -> list[str]:
    """Where a chaos test leaves its table for the terminal summary."""
    return request.config.stash.setdefault(TABLES, [])


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    for table in config.stash.get(TABLES, []):
        terminalreporter.write_sep("=", "chaos trials")
        terminalreporter.write_line(table)
