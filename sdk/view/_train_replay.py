"""`plies replay --train-only`: a recorded training step re-fed to a trainer restored at it.

What a Blackjack run keeps of a GRPO step, and where:

- `metrics.jsonl`, its `step` record: the groups it trained on (`groups`), how many were
  trainable and why the others were refused, and every metric the trainer reported
  (`loss`, `tokens`, `sequences`, `entropy`, `ratio_mean/min/max`, `kl`,
  `logprob_diff_max`) plus the optimizer step's `grad_norm`;
- `groups.jsonl`: those groups' trajectories, every token with its mask and sampler logprob;
- `server/policies/V/`: the policy the step began from, which is the trainer's weights at
  that moment (the previous step's `policy`, the warm start's for step 0: each step ends by
  publishing what it trained, and a step that trained nothing leaves the weights alone).

The loss, its ratios and the gradient norm depend on the weights and the batch only, not on
the optimizer's moments, so a fresh `plies serve` on that policy is the trainer restored at
the step. The step itself is the recipe's (`train`: for Blackjack, `grpo.retrain`, the same
group checks, advantages, batch and loss as `train_on`), sent over the same wire, so nothing
here re-implements what a step is; the command line passes it in, as `plies.view` and the
recipes are independent layers.

On CPU the trainer is deterministic for one machine and thread count: every metric comes
back bit for bit (docs/viewer.md: a smoke run's steps). A difference is reported with its size.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from plies import ConfigError, Group, PolicyRef
from plies.policy._paths import policy_path
from plies.training import Trainer, TrainingClient

from ._files import JSONL_CAP, first_error, iter_lines
from ._replay import local_policy, read_run_groups, replay_server, run_record

__all__ = ["MetricReplay", "StepFn", "StepReplay", "replay_step"]

_NOT_COMPARED = frozenset({"kind", "time", "step", "seconds", "policy", "groups"})
"""Step-record fields that are not outcomes of the step's batch."""


@dataclass(frozen=True, slots=True)
class MetricReplay:
    """One recorded field of a step against its value when the step is re-fed."""

    name: str
    recorded: Any
    replayed: Any

    @property
    def exact(self) -> bool:
        if isinstance(self.recorded, float) and isinstance(self.replayed, float):
            both_nan = math.isnan(self.recorded) and math.isnan(self.replayed)
            return both_nan or self.recorded == self.replayed
        return self.recorded == self.replayed

    @property
    def difference(self) -> float | None:
        """|recorded - replayed| for numbers (None for other fields)."""
        numbers = (int, float)
        if isinstance(self.recorded, numbers) and isinstance(self.replayed, numbers):
            return abs(float(self.recorded) - float(self.replayed))
        return None


@dataclass(frozen=True, slots=True)
class StepReplay:
    step: int
    policy: PolicyRef
    """The policy the step began from: the restored trainer's weights."""
    groups: list[str]
    metrics: list[MetricReplay]

    @property
    def exact(self) -> bool:
        return all(m.exact for m in self.metrics)

    def lines(self) -> list[str]:
        """The report `plies replay --train-only` prints: a head, a line per field, a tally."""
        out = [
            f"step {self.step} from policy v{self.policy.version}, groups {', '.join(self.groups)}"
        ]
        for m in self.metrics:
            diff = m.difference
            verdict = "exact" if m.exact else f"DIFFERENT by {diff:.3g}" if diff else "DIFFERENT"
            out.append(f"{m.name}: recorded {m.recorded!r}, replayed {m.replayed!r}: {verdict}")
        exact = sum(m.exact for m in self.metrics)
        out.append(f"{exact} of {len(self.metrics)} recorded fields of step {self.step} reproduced")
        return out


def _records(run_dir: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """The run log's records, and the numbers of the lines that are none (torn by a crash).

    Raises:
        ConfigError: the log is missing, not a regular file, or over its caps.
    """
    path = run_dir / "metrics.jsonl"
    out, torn = [], []
    try:
        for number, line in iter_lines(path, JSONL_CAP):
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                record = None
            if isinstance(record, dict):
                out.append(record)
            elif line.strip():
                torn.append(number)
    except FileNotFoundError:
        raise ConfigError(f"{path} is missing") from None
    return out, torn


def _whole(record: dict[str, Any]) -> bool:
    step = record.get("step")
    return isinstance(step, int) and not isinstance(step, bool)


def _last(records: list[dict[str, Any]], kind: str, **match: Any) -> dict[str, Any] | None:
    found = [
        r for r in records if r.get("kind") == kind and all(r.get(k) == v for k, v in match.items())
    ]
    return found[-1] if found else None


def _start_policy(records: list[dict[str, Any]], step: int, path: Path) -> PolicyRef:
    """The policy step `step` trained from: step - 1's, or the warm start's for step 0."""
    before = _last(records, "step", step=step - 1) if step else _last(records, "warm_start")
    if before is None or "policy" not in before:
        what = f"step {step - 1}" if step else "the warm start"
        raise ConfigError(
            f"{path} records no {what}, so the policy step {step} began from is unknown"
        )
    try:
        return PolicyRef.model_validate(before["policy"])
    except ValidationError as exc:
        what = f"step {step - 1}" if step else "the warm start"
        raise ConfigError(
            f"{path}: the policy of {what} is not a policy record: {first_error(exc)}"
        ) from None


def _groups(run_dir: Path, ids: list[str], step: int) -> list[Group]:
    wanted = set(ids)
    by_id = {g.id: g for _, g in read_run_groups(run_dir) if g is not None and g.id in wanted}
    missing = [g for g in ids if g not in by_id]
    if missing:
        raise ConfigError(
            f"{run_dir / 'groups.jsonl'} lacks group(s) {', '.join(missing)} that step {step} "
            "trained on"
        )
    return [by_id[g] for g in ids]


StepFn = Callable[[Trainer, int, list[Group], PolicyRef, dict[str, Any]], Awaitable[dict[str, Any]]]
"""A recipe's training step: (trainer, step, its groups, the policy it began from, the run's
`run.json`) -> the fields the run recorded for it, recomputed."""


async def replay_step(
    run_dir: Path, step: int, *, train: StepFn, log: Path | None = None
) -> StepReplay:
    """Re-feed step `step` of the run in `run_dir` to a fresh trainer on CPU; compare.

    Raises:
        ConfigError: the run lacks `run.json`, the step's record, its groups or the policy it
            began from (each named), or `train` refuses the run.
        PliesError: the server did not start or refused the step.
    """
    run_dir = Path(run_dir)
    run = run_record(run_dir, "")
    log_path = run_dir / "metrics.jsonl"
    records, torn = _records(run_dir)
    record = _last(records, "step", step=step)
    if record is None:
        known = sorted({r["step"] for r in records if r.get("kind") == "step" and _whole(r)})
        shown = f"{known[0]}..{known[-1]}" if known else "none"
        unread = f"; line(s) {', '.join(map(str, torn))} do not read" if torn else ""
        raise ConfigError(f"{log_path} records no step {step} (steps recorded: {shown}{unread})")
    start = _start_policy(records, step, log_path)
    ids = record.get("groups", [])
    if not isinstance(ids, list) or not all(isinstance(g, str) for g in ids):
        raise ConfigError(f"{log_path}: step {step}'s groups are not a list of group ids")
    groups = _groups(run_dir, ids, step)
    try:
        weights = policy_path(local_policy(run_dir, start))
    except ConfigError as exc:  # most often a retention policy pruned it
        raise ConfigError(f"step {step} needs the policy it began from, and {exc}") from None
    async with (
        replay_server(weights, log=log) as server,
        TrainingClient(server.url) as trainer,
    ):
        info = await train(trainer, step, groups, start, run)
    # What the run recorded is what can be compared (an older run recorded fewer metrics).
    names = [k for k in record if k not in _NOT_COMPARED]
    metrics = [MetricReplay(k, record[k], info.get(k)) for k in names]
    return StepReplay(step, start, [g.id for g in groups], metrics)
