"""Random but seeded training batches, shared by the trainer and training-client tests."""

from __future__ import annotations

import random

from plies.training import Datum, TrainingBatch


def random_batch(seed: int, lengths: tuple[int, ...], prompt: int) -> TrainingBatch:
    """Rows of `lengths` random tokens; the first `prompt` of each unmasked, advantages +-1."""
    rng = random.Random(seed)
    data = []
    for n in lengths:
        tokens = [rng.randrange(1, 5000) for _ in range(n)]
        mask = [0] * prompt + [1] * (n - prompt)
        data.append(
            Datum(
                tokens=tokens,
                mask=mask,
                logprobs=[-11.0 * m for m in mask],
                advantages=[rng.choice([-1.0, 1.0]) * m for m in mask],
            )
        )
    return TrainingBatch(data=data)
