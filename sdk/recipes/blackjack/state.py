"""One run's state: what every phase of the job works with, opened once by `run.main`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from plies import PolicyRef
from plies.harness import ToolCallingHarness
from plies.policy import TinkerPolicyClient, VLLMClient, publish
from plies.rl import Interrupted, Run, RunLog, RunProgress, retain
from plies.runtime import Interrupts, RolloutResources
from plies.tokens import ChatRenderer
from plies.training import Trainer

from .config import MAX_STALENESS, Budget, DemoConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["RunState"]


@dataclass(frozen=True, slots=True)
class RunState:
    """The open resources of one run and the options it runs with.

    Everything here is opened by `run.main` inside one exit stack and closed with it; phases
    receive this one object rather than each resource separately.
    """

    config: DemoConfig
    log: RunLog
    trainer: Trainer
    """It trains and saves the policies: native or Tinker, as `config.trainer` says."""
    client: VLLMClient | TinkerPolicyClient
    """The sampler on the same service: episodes sample from it, new policies load into it."""
    resources: RolloutResources
    harness: ToolCallingHarness
    """Plays every hand, scored by `FORFEIT_REWARDS`."""
    renderer: ChatRenderer
    tokenizer: PreTrainedTokenizerBase
    base: PolicyRef
    """The policy the server started with (the random tiny model)."""
    console: Console
    interrupts: Interrupts
    progress: RunProgress
    """The one live display of the run's phases (on a terminal; lines in a log)."""

    @property
    def budget(self) -> Budget:
        return self.config.plan

    @property
    def out(self) -> Path:
        return self.config.out

    @property
    def loop(self) -> Run:
        """What `plies.rl`'s GRPO and evaluations work with, from the same resources."""
        return Run(
            out=self.out, log=self.log, trainer=self.trainer, sampler=self.client,
            resources=self.resources, play=self.harness.play, publish=self.publish,
            console=self.console, interrupts=self.interrupts, progress=self.progress,
        )  # fmt: skip

    def stop_if_interrupted(self) -> None:
        """Raise `Interrupted` once Ctrl-C arrived, between units of work."""
        if self.interrupts.count:
            raise Interrupted

    async def publish(self, policy: PolicyRef) -> None:
        """Serve `policy` for sampling, then remove the published policies the run no longer
        keeps (`prune`); harmless when it is already served."""
        await publish(policy, [self.client])
        await self.prune(sampling=True, newest=policy)

    async def prune(self, *, sampling: bool, newest: PolicyRef | None = None) -> None:
        """Apply `--keep-policies` to the published policies; `sampling`: groups may still
        be sampled from the newest `MAX_STALENESS + 1` versions, so those stay too.
        `newest`: a policy just published, not yet in the log."""
        warm = self.log.last("warm_start")
        logged = [r["policy"] for kind in ("warm_start", "step") for r in self.log.all(kind)]
        published = [PolicyRef.model_validate(p) for p in logged] + ([newest] if newest else [])
        _, failures = await retain(
            self.out, published, trainer=self.trainer,
            warm=None if warm is None else warm["policy"]["version"],
            keep=self.config.keep_policies, max_staleness=MAX_STALENESS if sampling else None,
        )  # fmt: skip
        for why in failures:
            self.console.print(f"[yellow]retention[/]: {why}; it is tried again later")
