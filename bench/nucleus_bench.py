"""What a top-p cut costs per sampled token, the server's cut against sorting, side by side.

The Blackjack recipe samples at `top_p` 0.9, so every token of every episode goes through
the cut (`plies.server._sampling.processed_logprobs`). Rows are shaped like the recipe's
after its warm start: a format token (the right token holds 0.997, the rest a thin tail over
the 151,936-token vocabulary) and a decision token (hit and stand share 0.997). Each is cut
by the server's path (the most likely token alone, else the 64 most likely) and by sorting
the whole row, and timed beside no cut at all (a plain log-softmax).

    python bench/nucleus_bench.py [--repeats 200] [--threads 1]
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch

from plies.server._sampling import _sorted_nucleus, processed_logprobs
from plies.testing import VOCAB_SIZE

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = {
        "format token (0.997 alone)": row([0.997], 0.003),
        "decision token (0.60 + 0.397)": row([0.6, 0.397], 0.003),
    }
    print(f"top_p {TOP_P}, one row of {VOCAB_SIZE} logits, ms per sampled token")
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


if __name__ == "__main__":
    main()
