"""One run's state: what every phase of the job works with, opened once by `run.main`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from plies import PolicyRef
from plies.policy import VLLMClient, publish
from plies.runtime import Interrupts, RolloutResources
from plies.tokens import ChatRenderer
from plies.training import TrainingClient

from .config import BUDGETS, Budget, DemoConfig
from .rewards import Forfeiting
from .runlog import RunLog

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Interrupted", "RunState"]


class Interrupted(Exception):
    """Ctrl-C arrived; the run stops after what it was doing settled (it resumes later)."""


@dataclass(frozen=True, slots=True)
class RunState:
    """The open resources of one run and the options it runs with.

    Everything here is opened by `run.main` inside one exit stack and closed with it; phases
    receive this one object rather than each resource separately.
    """

    config: DemoConfig
    log: RunLog
    trainer: TrainingClient
    """The reference server's trainer: it trains and saves the policies."""
    client: VLLMClient
    """The same server's sampler: episodes sample from it and new policies load into it."""
    resources: RolloutResources
    harness: Forfeiting
    renderer: ChatRenderer
    tokenizer: PreTrainedTokenizerBase
    base: PolicyRef
    """The policy the server started with (the random tiny model)."""
    console: Console
    interrupts: Interrupts

    @property
    def budget(self) -> Budget:
        return BUDGETS[self.config.budget]

    @property
    def out(self) -> Path:
        return self.config.out

    def stop_if_interrupted(self) -> None:
        """Raise `Interrupted` once Ctrl-C arrived, between units of work."""
        if self.interrupts.count:
            raise Interrupted

    async def publish(self, policy: PolicyRef) -> None:
        """Serve `policy` for sampling; harmless when it is already served."""
        await publish(policy, [self.client])
