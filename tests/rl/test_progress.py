"""The run's live display: a bar on a terminal, plain lines with an ETA in a log, and an
error of the sampling block it watches reaching the caller as itself."""

from __future__ import annotations

import io

import anyio
import pytest
from free_env import REF, make, quick
from rich.console import Console

from plies.rl import RunProgress
from plies.runtime import EnvPool, GroupSpec, RolloutDriver, RolloutResources


def test_in_a_log_a_phase_prints_a_line_each_tenth_with_its_eta():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, soft_wrap=True)
    name = "evaluation [final]"  # brackets are text, not markup
    with RunProgress(console) as progress, progress.phase(name, 40, completed=8) as ph:
        for _ in range(32):
            ph.advance(status="loss 0.5")
    lines = out.getvalue().splitlines()
    assert len(lines) == 8  # tenths 3..10: a resumed phase starts where it was
    assert lines[0].startswith(f"  {name} 12/40 (") and lines[0].endswith(") loss 0.5")
    assert "ETA" in lines[0] and "ETA" not in lines[-1]
    assert lines[-1].startswith(f"  {name} 40/40 (")


class Stop(Exception):
    """What `Interrupted` is to the recipe: an error the caller catches by its type."""


@pytest.mark.anyio
async def test_on_a_terminal_the_bar_shows_the_driver_and_an_error_passes_through_as_itself():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system=None, width=160)
    async with (
        RolloutResources(pools=[EnvPool(make)]) as res,
        RolloutDriver(res, quick, policy=REF) as driver,
    ):
        with (
            RunProgress(console) as progress,
            progress.phase("GRPO steps", 3) as phase,
            pytest.raises(Stop),  # not an ExceptionGroup around it
        ):
            async with progress.sampling(phase, driver):
                await driver.admit(GroupSpec("a", size=3))
                await driver.wait_drained()
                phase.advance()
                await anyio.sleep(0.7)  # the bar refreshes, the driver's figures too
                raise Stop
    drawn = out.getvalue()
    assert "GRPO steps" in drawn and "1/3" in drawn and "ETA" in drawn
    assert "0 episodes running" in drawn
