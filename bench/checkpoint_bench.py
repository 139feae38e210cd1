"""What durability costs a training step: a checkpoint at every step against one every 30 s.

`plies serve`'s trainer journals every op and writes each forward_backward's batch before
answering; a checkpoint of model and optimizer (three copies of the model) is written at an
`optim_step` only once `TrainerConfig.checkpoint_seconds` have passed, and a reopen redoes the
steps since from their batches. This times the Blackjack warm start's steps (the recipe's own
threshold-player transcripts and batches, `cross_entropy`, AdamW) on the server's `Trainer`
in process, with `checkpoint_seconds` 0 (a checkpoint every step, the trainer's old way) and
at its default, in alternating blocks of steps so that both see the same disk and cores, then
reopens the default's state to time the redo.

    python bench/checkpoint_bench.py [--steps 40] [--blocks 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import anyio
import torch

from plies import PolicyRef, testing
from plies.recipes.blackjack import TEMPLATE_KWARGS, transcripts
from plies.recipes.blackjack.config import BUDGETS
from plies.server import PolicyStore, TrainerConfig
from plies.server._trainer import Trainer
from plies.tokens import ChatRenderer
from plies.training import AdamParams, Datum, TrainingBatch
from plies.wire import ForwardBackwardRequest, OptimStepRequest

BUDGET = BUDGETS["default"]


def batches(count: int) -> list[TrainingBatch]:
    """The default warm start's first `count` batches, built as `warm_start` builds them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(testing.qwen3_tokenizer_dir())
    renderer = ChatRenderer(tokenizer, template_kwargs=dict(TEMPLATE_KWARGS))
    base = PolicyRef(uri="file:///base", version=0)
    data = anyio.run(
        lambda: transcripts(
            renderer, tokenizer, BUDGET.warm_hands, policy=base, players=BUDGET.warm_players
        )
    )
    out = []
    for step in range(count):
        first = (step * BUDGET.warm_batch) % len(data)
        hands = [data[(first + j) % len(data)] for j in range(BUDGET.warm_batch)]
        out.append(
            TrainingBatch(data=[Datum.from_segment(s, 1.0) for t in hands for s in t.segments()])
        )
    return out


def train(trainer: Trainer, work: list[TrainingBatch], first: int) -> float:
    """Seconds per step over `work`, steps numbered from `first`."""
    start = time.perf_counter()
    for k, batch in enumerate(work, start=first):
        trainer.forward_backward(
            ForwardBackwardRequest(op_id=f"fb-{k}", batch=batch, loss="cross_entropy")
        )
        trainer.optim_step(
            OptimStepRequest(
                op_id=f"opt-{k}",
                adam=AdamParams(lr=BUDGET.warm_lr, grad_clip=1.0),
                forward_backward_ops=[f"fb-{k}"],
            )
        )
    return (time.perf_counter() - start) / len(work)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="steps per block")
    parser.add_argument("--blocks", type=int, default=3, help="blocks of each setting")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = batches(args.steps * args.blocks)
    settings = {"checkpoint every step": 0.0, "checkpoint every 30 s": 30.0}
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        trainers = {}
        for name, seconds in settings.items():
            root = Path(tmp) / str(seconds)
            store = PolicyStore.open(root, testing.tiny_model_dir())
            config = TrainerConfig(checkpoint_seconds=seconds)
            trainers[name] = (Trainer.open(root, store, config), root, store, config)
        times: dict[str, list[float]] = {name: [] for name in settings}
        for block in range(args.blocks):
            part = work[block * args.steps : (block + 1) * args.steps]
            for name, (trainer, *_) in trainers.items():
                times[name].append(train(trainer, part, block * args.steps))
        print(
            f"{args.steps * args.blocks} warm-start steps each ({args.blocks} alternating blocks)"
        )
        for name, per_block in times.items():
            blocks = ", ".join(f"{t:.3f}" for t in per_block)
            print(f"  {name:<22} {sum(per_block) / len(per_block):.3f} s/step  ({blocks})")
        every, timed = (sum(t) / len(t) for t in times.values())
        print(f"  ratio (every 30 s / every step): {timed / every:.2f}")
        trainer, root, store, config = trainers["checkpoint every 30 s"]
        last = trainer.checkpoints.current()
        held = trainer.step - (int(last.name) if last is not None else 0)
        start = time.perf_counter()
        reopened = Trainer.open(root, store, config)
        redo = time.perf_counter() - start
        same = all(
            torch.equal(a, b)
            for a, b in zip(trainer.model.parameters(), reopened.model.parameters(), strict=True)
        )
        print(
            f"  reopen after {trainer.step} steps, {held} since the last checkpoint: "
            f"{redo:.1f} s, weights {'bitwise equal' if same else 'DIFFERENT'}"
        )


if __name__ == "__main__":
    main()
