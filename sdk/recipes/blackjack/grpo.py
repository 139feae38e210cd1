"""Blackjack's GRPO phase: `plies.rl.grpo` on seeded deals, with the learning curve between steps.

Each group is `group_size` hands of one seeded deal, so rewards differ only by the actions,
and a hand whose every token was drawn with certainty is its deal and its calls: a group
plays it once and its other members repeat it (`deterministic`, `plies.rl.repeat_certain`).
`retrain` recomputes a logged step for `plies replay --train-only`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plies import ConfigError, Group, PolicyRef, rl
from plies.environments import Task
from plies.policy._paths import policy_path
from plies.rl import train_on
from plies.training import Trainer, TrainingBatch

from .config import SEED_STRIDE, TRAIN_SEEDS, Budget
from .contrast import DecisionTokens, decision_tokens, state_contrast
from .evaluation import evaluate
from .state import RunState

__all__ = ["grpo", "retrain"]


def train_tasks(seed: int) -> Callable[[int], Task]:
    """Group `i` of training for the run's `seed`: the deal seeded `TRAIN_SEEDS + seed *
    SEED_STRIDE + i` (seed 0's ids are the ones runs before `--seed` recorded)."""
    name = "train" if seed == 0 else f"train-s{seed}"
    return lambda i: Task(id=f"{name}-{i}", seed=TRAIN_SEEDS + seed * SEED_STRIDE + i)


def contrast(
    decisions: DecisionTokens,
) -> Callable[[TrainingBatch, list[Group]], TrainingBatch]:
    """GRPO's batch rewrite: the decision tokens' shared share removed (`state_contrast`)."""
    return lambda batch, _groups: state_contrast(batch, decisions)


async def retrain(
    trainer: Trainer, step: int, groups: list[Group], policy: PolicyRef, run: dict[str, Any]
) -> dict[str, Any]:
    """`train_on` as the run whose `run.json` is `run` took step `step`: the fields its step
    record holds, recomputed (`plies replay --train-only`, with a trainer restored at it).

    Raises:
        ConfigError: `run` is not a native-trainer Blackjack run (no budget recorded, or the
            steps went through the Tinker API, whose losses are summed, not averaged).
    """
    config = run.get("config") if isinstance(run.get("config"), dict) else {}
    if config.get("trainer", "native") != "native":
        raise ConfigError(
            f"the run was trained through the Tinker API (--trainer {config['trainer']}); "
            "--train-only re-feeds steps of the native trainer"
        )
    try:
        budget = Budget(**run["budget"])
    except (KeyError, TypeError) as exc:
        raise ConfigError(
            f"run.json records no Blackjack budget ({exc!r}); --train-only re-feeds steps of "
            "plies demo blackjack"
        ) from None
    from transformers import AutoTokenizer  # the policy directory carries its tokenizer

    shape = contrast(decision_tokens(AutoTokenizer.from_pretrained(policy_path(policy))))
    _, info = await train_on(trainer, step, groups, policy, budget.grpo, shape=shape)
    return info


async def grpo(run: RunState, policy: PolicyRef) -> PolicyRef:
    """Train from `policy` until the budget's steps are logged; resumable at any point.

    Raises:
        Interrupted: Ctrl-C arrived; in-flight groups drained to disk for the next run.
    """
    budget = run.budget

    async def curve(step: int, policy: PolicyRef) -> None:
        """A learning-curve point after every `curve_every`-th step but the last."""
        if budget.curve_every and step % budget.curve_every == 0:
            await evaluate(run, policy, budget.curve_hands, "curve", step)

    shape = contrast(decision_tokens(run.tokenizer))
    return await rl.grpo(
        run.loop,
        policy,
        budget.grpo,
        train_tasks(run.config.seed),
        deterministic=True,
        shape=shape,
        after_step=curve,
    )
