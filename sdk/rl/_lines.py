"""What the loop prints about each batch: what trained, what was refused and why, what tied."""

from __future__ import annotations

from collections import Counter
from types import MappingProxyType
from typing import Any

from plies import PolicyRef

__all__ = ["REFUSALS", "step_line", "stopped_line"]

REFUSALS = MappingProxyType(
    {
        "duplicate": "seen twice",
        "foreign_member": "a member of another task",
        "incomplete": "members missing",
        "failed_member": "a member failed or was cancelled",
        "truncated": "a member was cut off by a budget",
        "non_finite_reward": "a member has no reward",
        "mixed_policy": "sampled by more than one policy",
        "stale": "sampled by a policy older than the staleness bound",
        "misaligned": "tokens, masks and logprobs disagree",
        "empty": "a member sampled no token",
    }
)
"""What each `RefusalReason` means, in the words a step line uses."""


def step_line(
    step: int, info: dict[str, Any], policy: PolicyRef | None, set_aside: dict[str, int]
) -> str:
    """One GRPO batch for the terminal: what trained, what was refused and why, what tied.

    A refused group failed the checks `training_groups` runs before any training (its
    rewards or tokens cannot be trusted); a tied group passed them, but its members all
    scored alike, so every advantage is 0 and it teaches nothing. `set_aside` counts, by
    reason, the groups judged so as they arrived while the batch filled (`set_aside_counts`).
    `policy` None: the batch trained nothing and is not counted as a step.
    """
    groups = len(info["groups"])
    useful = info["trainable"] - info.get("tied", 0)
    ret = info["train_return"]
    parts = [f"trained on {useful} of {groups} groups"]
    if ret is not None:
        parts[0] += f" (train return {ret:+.3f})"
    reasons = Counter(r.split(": ", 1)[-1] for r in info["refused"])
    if reasons:
        why = ", ".join(f"{n} {REFUSALS.get(k, k)}" for k, n in reasons.most_common())
        parts.append(f"{len(info['refused'])} refused by the checks before training ({why})")
    if info.get("tied"):
        parts.append(f"{info['tied']} tied (members all scored alike: nothing to learn)")
    if set_aside:
        why = ", ".join(f"{n} {REFUSALS.get(k, k)}" for k, n in Counter(set_aside).most_common())
        parts.append(f"{sum(set_aside.values())} set aside while the batch filled ({why})")
    if policy is None:
        return f"step {step}: {'; '.join(parts)}; not a step, sampling another batch"
    return f"step {step} -> policy v{policy.version}: {'; '.join(parts)}"


def stopped_line(step: int, episodes: int) -> str:
    """Why GRPO ended before its steps were taken."""
    return (
        f"GRPO stopped at step {step}: {episodes} episodes in a row trained nothing (their "
        "groups all tied, certain or refused), so the policy has stopped exploring"
    )
