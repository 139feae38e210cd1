"""The sampler's draws against the sampling convention, one row at a time."""

from __future__ import annotations

import math

import torch

from plies.server._sampling import RowParams, certain_tokens, processed_logprobs, sample_rows
from plies.testing._models import VOCAB_SIZE


def peaked(heads: list[float], seed: int) -> torch.Tensor:
    """Logits whose first tokens hold `heads` of the probability and the rest a thin tail."""
    x = torch.randn(VOCAB_SIZE, generator=torch.Generator().manual_seed(seed)) * 0.5
    x += math.log(1.0 - sum(heads)) - float(torch.logsumexp(x[len(heads) :], dim=0))
    for i, p in enumerate(heads):
        x[i] = math.log(p)
    return x[torch.randperm(VOCAB_SIZE, generator=torch.Generator().manual_seed(seed))]


def by_definition(x: torch.Tensor, row: RowParams, u: torch.Tensor) -> tuple[int, float]:
    """Inverse CDF of `processed_logprobs` at the uniform draw `u`."""
    logp = processed_logprobs(x, row.temperature, row.top_k, row.top_p)
    cdf = torch.exp(logp).cumsum(dim=-1)
    token = int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=VOCAB_SIZE - 1))
    return token, float(logp[token])


def test_certain_and_open_rows_draw_what_the_convention_draws_seeded_or_shared():
    """Rows whose most likely token alone holds top_p skip the cut's passes, yet every row
    still takes one uniform from its stream: seeded or shared, each token and logprob is the
    one the row alone would get, and a certain token has logprob exactly 0."""
    logits = torch.stack(
        [peaked([0.997], s) for s in range(6)] + [peaked([0.6, 0.397], s) for s in range(6, 12)]
    )[torch.tensor([0, 6, 1, 7, 8, 2, 3, 9, 10, 4, 11, 5])]
    params = [(1.0, -1, 0.9), (1.0, -1, 1.0), (0.7, -1, 0.9), (1.0, 40, 0.95)]

    def rows(seeded: bool) -> list[RowParams]:
        return [
            RowParams(*params[i % 4], torch.Generator().manual_seed(100 + i) if seeded else None)
            for i in range(len(logits))
        ]

    certain = {
        i
        for i, row in enumerate(rows(False))
        if int(certain_tokens(logits[i : i + 1], row.temperature, row.top_k, row.top_p)[0]) >= 0
    }
    assert 0 < len(certain) < len(logits)
    for seeded in (True, False):
        shared = torch.Generator().manual_seed(7)
        ids, lps = sample_rows(logits, rows(seeded), shared)
        reference = torch.Generator().manual_seed(7)
        for i, row in enumerate(rows(seeded)):
            u = torch.rand((), generator=row.generator or reference)
            assert (ids[i], lps[i]) == by_definition(logits[i], row, u), i
            if i in certain:
                assert (ids[i], lps[i]) == (int(logits[i].argmax()), 0.0)
