"""What a training step of `plies serve`'s trainer costs, as it is against as it was.

Two changes sit between the trainer as it was and as it is, each measured here on the
Blackjack warm start's steps (the recipe's threshold-player transcripts and batches,
`cross_entropy`, AdamW) on the server's `Trainer`:

- durability: a checkpoint of model and optimizer (three copies of the model) at every
  `optim_step` (`checkpoint_seconds` 0; the batches are journaled here too, which the old
  trainer did not do, so "as it was" pays a few hundred kilobytes a step more), against the
  journaled batches and a checkpoint every `TrainerConfig.checkpoint_seconds` (30 s), with
  the steps since redone on reopen;
- memory: glibc mapping every large tensor afresh from the kernel, against the server's
  `reuse_freed_memory`, which serves them from memory already freed.

Each setting runs in a process of its own (the malloc setting is process-wide), the settings
in turn for `--rounds` rounds, so all of them see the same disk and cores. Printed per step:
wall seconds, the kernel's CPU seconds, page faults; then the ratio to the trainer as it was,
and what a reopen of the last round's state costs (its redo) and whether it lands on the
same weights.

    python bench/trainer_bench.py [--steps 30] [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = {
    "as it was: checkpoint every step": (0.0, False),
    "checkpoint every 30 s": (30.0, False),
    "as it is: + freed memory reused": (30.0, True),
}
WARMUP = 5
"""Steps run before timing: the heap grows to the size of a step's tensors."""


def child(setting: str, steps: int, threads: int) -> dict[str, float]:
    """Run `steps` warm-start steps under `setting` in this process; what each cost."""
    import anyio
    import torch
    from transformers import AutoTokenizer

    from plies import PolicyRef, testing
    from plies.recipes.blackjack.config import BUDGETS, TEMPLATE_KWARGS
    from plies.recipes.blackjack.warm_start import transcripts
    from plies.server import PolicyStore, TrainerConfig
    from plies.server._serve import reuse_freed_memory
    from plies.server._trainer import Trainer
    from plies.tokens import ChatRenderer
    from plies.training import AdamParams, Datum, TrainingBatch
    from plies.wire.training import ForwardBackwardRequest, OptimStepRequest

    seconds, reuse = SETTINGS[setting]
    if reuse and not reuse_freed_memory():
        raise SystemExit("no glibc here: nothing to compare")
    torch.set_num_threads(threads)
    budget = BUDGETS["default"]
    tokenizer = AutoTokenizer.from_pretrained(testing.qwen3_tokenizer_dir())
    renderer = ChatRenderer(tokenizer, template_kwargs=dict(TEMPLATE_KWARGS))
    base = PolicyRef(uri="file:///base", version=0)
    data = anyio.run(
        lambda: transcripts(
            renderer, tokenizer, budget.warm_hands, policy=base, players=budget.warm_players
        )
    )
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        store = PolicyStore.open(Path(tmp), testing.tiny_model_dir())
        config = TrainerConfig(checkpoint_seconds=seconds)
        trainer = Trainer.open(Path(tmp), store, config)
        usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        for step in range(WARMUP + steps):
            if step == WARMUP:
                usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            first = (step * budget.warm_batch) % len(data)
            hands = [data[(first + j) % len(data)] for j in range(budget.warm_batch)]
            batch = TrainingBatch(
                data=[Datum.from_segment(s, 1.0) for t in hands for s in t.segments()]
            )
            trainer.forward_backward(
                ForwardBackwardRequest(op_id=f"fb-{step}", batch=batch, loss="cross_entropy")
            )
            trainer.optim_step(
                OptimStepRequest(
                    op_id=f"opt-{step}",
                    adam=AdamParams(lr=budget.warm_lr, grad_clip=1.0),
                    forward_backward_ops=[f"fb-{step}"],
                )
            )
        wall, before = usage
        after = resource.getrusage(resource.RUSAGE_SELF)
        out = {
            "wall": (time.perf_counter() - wall) / steps,
            "system": (after.ru_stime - before.ru_stime) / steps,
            "faults": (after.ru_minflt - before.ru_minflt) / steps,
        }
        last = trainer.checkpoints.current()
        out["since_checkpoint"] = trainer.step - (int(last.name) if last is not None else 0)
        start = time.perf_counter()
        reopened = Trainer.open(Path(tmp), store, config)
        out["reopen"] = time.perf_counter() - start
        out["same_weights"] = all(
            torch.equal(a, b)
            for a, b in zip(trainer.model.parameters(), reopened.model.parameters(), strict=True)
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per process")
    parser.add_argument("--rounds", type=int, default=2, help="processes per setting")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.steps, args.threads)))
        return
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name in SETTINGS:
            argv = [sys.executable, __file__, "--child", name, "--steps", str(args.steps)]
            argv += ["--threads", str(args.threads)]
            done = subprocess.run(argv, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{args.steps} warm-start steps per process, {args.rounds} processes per setting")
    print(f"{'setting':<34} {'s/step':>7} {'kernel s':>9} {'faults':>8} {'x as it was':>12}")
    was = statistics.median(r["wall"] for r in runs[next(iter(SETTINGS))])
    for name, rows in runs.items():
        wall = statistics.median(r["wall"] for r in rows)
        system = statistics.median(r["system"] for r in rows)
        faults = statistics.median(r["faults"] for r in rows)
        print(f"{name:<34} {wall:>7.3f} {system:>9.3f} {faults:>8.0f} {wall / was:>12.2f}")
    last = runs[list(SETTINGS)[-1]][-1]
    print(
        f"reopen with {last['since_checkpoint']} steps since the checkpoint: "
        f"{last['reopen']:.1f} s (their redo and the model load), "
        f"weights {'bitwise equal' if last['same_weights'] else 'DIFFERENT'}"
    )


if __name__ == "__main__":
    main()
