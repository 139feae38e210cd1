"""What a top-p cut costs the sampler and the trainer, side by side with no cut.

The Blackjack recipe samples at a `top_p` below 1, so every token of every episode goes
through the cut and every trained token's logprob is taken under it. Rows are shaped like
the recipe's after its warm start: a format token (the right token holds 0.997, the rest a
thin tail over the 151,936-token vocabulary) and a decision token (hit and stand share
0.997).

1. The cut alone (`processed_logprobs`, one row): the server's path (the most likely token
   alone, else the 64 most likely) against sorting the whole row, and no cut at all.
2. The sampler (`sample_rows`, the call the engine makes per decoded chunk of 8 rows): at
   `top_p` against no cut. A format token alone in its nucleus is drawn without the cut's
   vocabulary-wide passes.
3. With `--run DIR` (a `plies demo blackjack` run), the trainer (`batch_loss`, the call a
   training step makes) on the groups one GRPO step of that run trained, by the policy that
   sampled them: at the run's `top_p` against no cut. Rows alone in their nucleus stay out of
   the gradient pass.

    python bench/nucleus_bench.py [--repeats 200] [--threads 1] [--run DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from plies.server._losses import batch_loss
from plies.server._sampling import RowParams, _sorted_nucleus, processed_logprobs, sample_rows
from plies.testing._models import VOCAB_SIZE

TOP_P = 0.9


def row(heads: list[float], tail: float) -> torch.Tensor:
    """Logits whose first tokens hold `heads` of the probability and the rest `tail`."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(VOCAB_SIZE, generator=generator) * 0.5
    x += math.log(tail) - float(torch.logsumexp(x[len(heads) :], dim=0))
    for i, p in enumerate(heads):
        x[i] = math.log(p)
    return x


def per_call_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def sampler_ms(x: torch.Tensor, top_p: float, repeats: int) -> float:
    """ms per token of `sample_rows` on a chunk of 8 copies of row `x`."""
    chunk = torch.stack([x] * 8)
    rows = [RowParams(1.0, -1, top_p, None) for _ in range(8)]
    generator = torch.Generator().manual_seed(0)
    return per_call_ms(lambda: sample_rows(chunk, rows, generator), repeats) / 8


def trainer(run: Path, repeats: int) -> None:
    """`batch_loss` on the groups of `run`'s last GRPO step whose policies are still on
    disk (a step's batch, as the run trained it), by the newest of those policies."""
    from transformers import AutoModelForCausalLM

    from plies.training import training_batch
    from plies.trajectory import Group

    top_p = json.loads((run / "run.json").read_text())["budget"]["top_p"]
    groups = {g.id: g for g in map(Group.model_validate_json, (run / "groups.jsonl").open())}
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").open()) if r["kind"] == "step"]
    policies = run / "server" / "policies"
    kept = {int(p.name) for p in policies.iterdir() if p.name.isdigit()}
    batches = [[groups[i] for i in s["groups"]] for s in reversed(steps)]
    by = next(
        (
            b
            for b in batches
            if {p.version for g in b for t in g.trajectories for p in t.policies} <= kept
        ),
        None,
    )
    if by is None:
        raise SystemExit(f"{run}: no GRPO step whose groups' policies are still on disk")
    version = max(p.version for g in by for t in g.trajectories for p in t.policies)
    model = AutoModelForCausalLM.from_pretrained(policies / str(version))
    signs = [[(-1.0) ** (i + j) for j in range(len(g.trajectories))] for i, g in enumerate(by)]
    print(f"\ntrainer: batch_loss on a GRPO step of {run} (policy v{version}), ms per batch")
    times = {}
    for p in (top_p, 1.0):
        batch = training_batch(by, signs, temperature=1.0, top_p=p)

        def step(batch=batch) -> None:
            model.zero_grad()
            batch_loss(model, batch, "ppo")

        times[p] = per_call_ms(step, repeats)
    tokens = training_batch(by, signs, temperature=1.0).loss_tokens
    cut, plain = times[top_p], times[1.0]
    print(f"{tokens} trained tokens: top_p {top_p} {cut:.0f} ms, no cut {plain:.0f} ms")
    print(f"cut / no cut: {cut / plain:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--run", type=Path, help="a `plies demo blackjack` run directory")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = {
        "format token (0.997 alone)": row([0.997], 0.003),
        "decision token (0.60 + 0.397)": row([0.6, 0.397], 0.003),
    }
    print(f"top_p {TOP_P}, the cut of one row of {VOCAB_SIZE} logits, ms per row")
    print(f"{'row':<32} {'no cut':>8} {'server':>8} {'sorting':>8} {'sorting / server':>17}")
    for name, x in rows.items():
        fast = processed_logprobs(x, top_p=TOP_P)
        slow = torch.log_softmax(_sorted_nucleus(x, TOP_P), dim=-1)
        assert torch.equal(torch.isfinite(fast), torch.isfinite(slow)), "the two cuts differ"
        plain = per_call_ms(lambda x=x: torch.log_softmax(x, dim=-1), args.repeats)
        server = per_call_ms(lambda x=x: processed_logprobs(x, top_p=TOP_P), args.repeats)
        sorting = per_call_ms(
            lambda x=x: torch.log_softmax(_sorted_nucleus(x, TOP_P), dim=-1), args.repeats // 10
        )
        print(f"{name:<32} {plain:>8.3f} {server:>8.3f} {sorting:>8.2f} {sorting / server:>16.0f}x")
    print("\nsampler: sample_rows on chunks of 8 rows, ms per sampled token")
    print(f"{'row':<32} {'no cut':>8} {f'top_p {TOP_P}':>10} {'cut / no cut':>13}")
    for name, x in rows.items():
        plain = sampler_ms(x, 1.0, args.repeats // 4)
        cut = sampler_ms(x, TOP_P, args.repeats // 4)
        print(f"{name:<32} {plain:>8.3f} {cut:>10.3f} {cut / plain:>13.2f}")
    if args.run is not None:
        trainer(args.run, max(1, args.repeats // 100))


if __name__ == "__main__":
    main()
