"""The supervised warm start: random-play transcripts, and training steps taken exactly once."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from plies import PolicyRef, Trajectory, Turn
from plies.environments import BlackjackEnv, Task
from plies.policy import Completion
from plies.rl import train_step
from plies.tokens import ChatRenderer
from plies.training import Datum, Trainer, TrainingBatch

from .config import SEED_STRIDE, SYSTEM_PROMPT, WARM_SEEDS, Budget, WarmPlayers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["applied_steps", "tool_call_ids", "transcripts", "warm_start"]


def tool_call_ids(tokenizer: PreTrainedTokenizerBase, name: str) -> list[int]:
    """The ids of a bare Qwen3 call of tool `name` with no arguments, close token included."""
    text = f'<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call>'
    return [*tokenizer.encode(text), tokenizer.convert_tokens_to_ids("<|im_end|>")]


async def transcripts(
    renderer: ChatRenderer,
    tokenizer: PreTrainedTokenizerBase,
    hands: int,
    *,
    policy: PolicyRef,
    players: WarmPlayers = "random",
    seed: int = 0,
) -> list[Trajectory]:
    """Hands played by `players`, rendered exactly as the harness would.

    `random`: every call is a coin flip, so the warm start teaches the format and no
    strategy, and nothing in its labels depends on the cards. `thresholds`: each hand is
    played by its own threshold player (hit while the total is below a threshold drawn
    uniformly from 12 to 21), so the labels depend on the total but favour no threshold
    and ignore the dealer's card (see docs/research.md for what each did).
    Completions are the canonical tool-call ids; logprobs are 0 (the loss ignores them).
    `seed`: the run's seed (`config.RUN_SEEDS`): which deals are played, and the players'
    draws.
    """
    rng = random.Random(seed)
    calls = {name: _canonical(tool_call_ids(tokenizer, name), policy) for name in ("hit", "stand")}
    out = []
    for i in range(hands):
        task = Task(id=f"warm-{i}", seed=WARM_SEEDS + seed * SEED_STRIDE + i)
        async with BlackjackEnv() as env:
            obs = await env.reset(task)
            opening = [{"role": "system", "content": SYSTEM_PROMPT}, *obs.messages]
            conv = renderer.start(opening, tools=obs.tools)
            traj = Trajectory(task_id=task.id)
            threshold = rng.randint(12, 21) if players == "thresholds" else None
            info, done = obs.info, False
            while not done:
                conv.render()
                delta = conv.delta
                if threshold is not None:
                    name = "hit" if info["player_total"] < threshold else "stand"
                else:
                    name = rng.choice(("hit", "stand"))
                completion = calls[name]
                call = {"type": "function", "function": {"name": name, "arguments": {}}}
                message = {"role": "assistant", "content": "", "tool_calls": [call]}
                conv.add_completion(completion.ids, "stop", message=message)
                traj.turns.append(Turn.from_completion(delta, completion))
                result = await env.call_tool(name, {})
                conv.add_messages([{"role": "tool", "name": name, "content": result.content}])
                info, done = result.info, result.done
            out.append(traj)
    return out


def _canonical(ids: list[int], policy: PolicyRef) -> Completion:
    """A completion as if sampled: `ids` verbatim, zero logprobs (cross-entropy ignores them)."""
    return Completion(ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop", policy=policy)


async def applied_steps(trainer: Trainer) -> int:
    """Optimizer steps the trainer's weights already hold: where a cut-off warm start resumes.

    `plies serve` journals every `optim_step` with its batches and reopens from its last
    checkpoint with the steps since redone, so after a Ctrl-C or a crash the count is every
    step it applied. A Tinker training run is created anew unless it resumes from a saved
    policy, so there it is the steps behind that policy (0 before the warm start saved one).
    """
    return (await trainer.state()).step


async def warm_start(
    trainer: Trainer,
    data: Sequence[Trajectory],
    budget: Budget,
    *,
    start: int = 0,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> PolicyRef:
    """Supervised steps (`cross_entropy`) over `data` from step `start` to the budget's
    `warm_steps`, at `warm_lr`, then `save_policy`.

    Each step's op ids name the step, so running it again after a crash repeats nothing.
    `start` is the number of steps the trainer already applied (`applied_steps`): a warm
    start cut off by Ctrl-C continues from its last applied step rather than from step 0.
    """
    for step in range(start, budget.warm_steps):
        first = (step * budget.warm_batch) % len(data)
        hands = [data[(first + j) % len(data)] for j in range(budget.warm_batch)]
        batch = TrainingBatch(
            data=[Datum.from_segment(seg, 1.0) for t in hands for seg in t.segments()]
        )
        fb, _ = await train_step(
            trainer, f"warm-{step}", batch, loss="cross_entropy", lr=budget.warm_lr
        )
        if on_step is not None:
            on_step(step, fb)
    return await trainer.save_policy(op_id="warm-save")
