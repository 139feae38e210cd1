"""The main job: Blackjack GRPO on the tiny Qwen3 model, start to finish on a laptop CPU.

`plies demo blackjack --out DIR` runs `main`, which does:

1. the offline kit: the Qwen3 tokenizer and the tiny random Qwen3 model (`plies.testing`);
2. the reference server (`plies serve`) on 127.0.0.1, in its own session so that Ctrl-C
   reaches only this process, which decides what to stop;
3. a supervised warm start (`warm_start`: `cross_entropy` through the `TrainingClient`) on
   `transcripts`: in the default budget each hand is played by a threshold player (hit
   while the total is below a threshold of its own), so the model learns the call's format
   and to read the total, but no threshold and nothing about the dealer's card, which are
   left to RL (the quick and smoke budgets flip coins: the format only);
4. GRPO (`grpo`, on `plies.rl.grpo`, the loop every trainer script shares): each group is
   G episodes of one seeded deal, advantages are each reward minus the group mean, less the
   share that moves every state alike (`contrast`), `training_groups` checks every group,
   then `forward_backward`
   (PPO's clipped ratio) + `optim_step` + `save_policy` + publish; every episode samples at
   the budget's `top_p` and the batches say so; new groups are admitted
   under the new policy while the driver's bound on groups in flight keeps sampling at most
   `MAX_STALENESS` steps ahead (staleness by pacing);
5. evaluation on held-out deals (`evaluate`: the same seeds before and after, so the
   comparison is paired); metrics in `DIR/metrics.jsonl` (`RunLog`), then `DIR/summary.json`
   (the headline: each policy's decision shares priced exactly by
   `plies.environments.blackjack_exact`; the sampled
   returns beside the references on the same deals; 95% intervals, the paired improvement,
   the strategy table), `DIR/learning_curve.png` and `DIR/strategy.png` (`write_summary`).
   `DIR` follows `plies.rl`'s run-directory schema (docs/rl.md), with the recipe's own
   records added.

Modules: `config` (budgets, seeds, prompt), `warm_start`,
`rewards`, `state` (the `RunState` every phase receives), `evaluation`, `grpo`, `contrast`
(the `state_contrast` advantages), `report`,
`run` (servers, clients, pools, and the phases in order), `trainers` (`--trainer native` or
`tinker`: plies' own wire, or the Tinker API's training and sampling clients). The run log,
the live display, the GRPO loop and which published policies stay on disk (`--keep-policies`,
`retain`) are `plies.rl`'s.

Resuming: everything that matters is in DIR. Completed groups are fsynced to
`groups.jsonl` before training sees them; each step is announced in `metrics.jsonl`
(`step_begin`, with its groups) before it is sent, and its op ids are derived from the step
number, so a step cut off midway is replayed with the same ids and the trainer answers what
it already applied (or says the gradients are gone, and they are recomputed). Running the
same command again continues from the last published policy, and groups that completed
but were not trained on yet are trained first.

`examples/blackjack_grpo.py` is the same job written out compactly on `plies.rl.train`.
"""

from ..._exports import name_after as _name_after
from .config import BUDGETS as BUDGETS
from .config import Budget as Budget
from .run import main as main

__all__ = [
    "BUDGETS",
    "Budget",
    "main",
]

_name_after(__name__, globals())
