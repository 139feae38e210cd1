"""Advantages that move the hit rate between states, not everywhere at once.

A policy gradient on the hit/stand token is a sum over decisions of `A * (1[hit] - p_hit)`
times the gradient of the decision's logit. While the model's decision barely depends on the
state, that gradient is nearly the same vector at every decision, and the sum acts as one
shared knob: hits lost at 17 and above turn every state towards stand, totals of 11 and
below included (docs/research.md measured this). `state_contrast` removes that shared share:
it subtracts from each decision token's advantage a multiple of `1[hit] - p_hit`, chosen so
that the sum over the batch is zero. What is left credits a decision only against the others
in the batch, so it can move the hit rate from one state to another but not all together.
It is an action-dependent baseline, so it is not an unbiased policy gradient. All of it is
removed: with nucleus sampling at 0.8 the cut plays the ends of the chart, and a run that
removed half drifted to stand everywhere late in its steps, where removing all kept hitting
low totals (docs/research.md).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from plies.training import TrainingBatch

from .warm_start import tool_call_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["DecisionTokens", "decision_tokens", "state_contrast"]

DecisionTokens = tuple[int, int, int]
"""(the token before the decision, the hit token, the stand token)."""


def decision_tokens(tokenizer: PreTrainedTokenizerBase) -> DecisionTokens:
    """Where a hit call and a stand call first differ: the tool name's first token."""
    hit, stand = tool_call_ids(tokenizer, "hit"), tool_call_ids(tokenizer, "stand")
    k = next(i for i, (a, b) in enumerate(zip(hit, stand, strict=False)) if a != b)
    return hit[k - 1], hit[k], stand[k]


def state_contrast(batch: TrainingBatch, tokens: DecisionTokens) -> TrainingBatch:
    """`batch` with the decision tokens' shared share of the update removed, so the hit rate
    cannot move everywhere at once.

    A decision token is a sampled hit or stand token right after the token that precedes
    the tool's name. Its `1[hit] - p_hit` is taken from the sampler's logprob of the token,
    as if hit and stand held all the probability there (the format around them is nearly
    certain after the warm start). Every other token keeps its advantage.
    """
    before, hit, stand = tokens
    spots: list[tuple[int, int, float]] = []
    for i, datum in enumerate(batch.data):
        for pos in range(1, len(datum.tokens)):
            token = datum.tokens[pos]
            if datum.mask[pos] and token in (hit, stand) and datum.tokens[pos - 1] == before:
                away = 1.0 - math.exp(datum.logprobs[pos])
                spots.append((i, pos, away if token == hit else -away))
    norm = sum(x * x for _, _, x in spots)
    if norm == 0.0:
        return batch
    shared = sum(batch.data[i].advantages[pos] * x for i, pos, x in spots) / norm
    advantages = [list(d.advantages) for d in batch.data]
    for i, pos, x in spots:
        advantages[i][pos] -= shared * x
    data = [
        d.model_copy(update={"advantages": a}) for d, a in zip(batch.data, advantages, strict=True)
    ]
    return batch.model_copy(update={"data": data})
